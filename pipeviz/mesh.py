"""``Mesh``: how a run's processes are laid out, pipeline × data parallel × tensor parallel.

A process is known by its coordinates, never by a bare rank: ``pp`` (its place in the pipeline: which stages
it runs), ``dp`` (its replica: which share of every batch it trains on) and ``tp`` (its shard of each stage's
tensors). Ranks are numbered with ``pp`` outermost and ``tp`` innermost (torchtitan's order: tensor-parallel
peers, which talk most, are neighbours), and torch's ``DeviceMesh`` gets the same named dims.

Example:
    >>> mesh = pv.Mesh(pp=2, dp=2)
    >>> mesh.world, mesh.coords(3)
    (4, Coords(pp=1, dp=1, tp=0))
    >>> mesh.pipeline(dp=1)          # the ranks of replica 1's pipeline, stage rank by stage rank
    (1, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["Coords", "Mesh", "MeshError"]


class MeshError(ValueError):
    """A layout that cannot work: the message names each degree and what would fit."""


class Coords(NamedTuple):
    """A process's place: pipeline rank, replica, shard."""

    pp: int
    dp: int
    tp: int

    def label(self) -> str:
        """``"pp1 dp0"`` (a dimension of degree one left out by ``Mesh.label``)."""
        return f"pp{self.pp} dp{self.dp} tp{self.tp}"


@dataclass(frozen=True)
class Mesh:
    """Degrees of pipeline (``pp``: pipeline ranks, each holding one or more stages), data (``dp``: replicas)
    and tensor (``tp``: shards per stage) parallelism; ``world = pp * dp * tp`` processes.

    Raises:
        MeshError: a degree that is not a positive int.
    """

    pp: int
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshError(f"{name} must be a positive int (the number of {_WHAT[name]}), got {value!r}.")

    @property
    def world(self) -> int:
        """Processes in all."""
        return self.pp * self.dp * self.tp

    @property
    def dims(self) -> tuple[str, ...]:
        """The named dims of degree > 1, outermost first (``("pp", "dp")``); always at least ``("pp",)``."""
        return tuple(d for d in ("pp", "dp", "tp") if d == "pp" or getattr(self, d) > 1)

    def check(self, world: int) -> None:
        """Raise ``MeshError`` unless the degrees multiply to ``world`` (naming each degree and what fits)."""
        if self.world == world:
            return
        fits = [f"dp={world // (self.pp * self.tp)}"] if world % (self.pp * self.tp) == 0 else []
        raise MeshError(
            f"pp={self.pp} × dp={self.dp} × tp={self.tp} = {self.world} processes, but the world has {world}. "
            f"Fix: degrees whose product is {world}{' (' + ', '.join(fits) + ')' if fits else ''}."
        )

    def rank(self, pp: int, dp: int = 0, tp: int = 0) -> int:
        """The process rank at these coordinates."""
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        """The coordinates of process ``rank``."""
        if not 0 <= rank < self.world:
            raise MeshError(f"rank {rank} is outside the mesh's {self.world} processes (0 to {self.world - 1}).")
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return Coords(pp, dp, tp)

    def pipeline(self, dp: int = 0, tp: int = 0) -> tuple[int, ...]:
        """The ranks of one pipeline (replica ``dp``, shard ``tp``), in pipeline order."""
        return tuple(self.rank(p, dp, tp) for p in range(self.pp))

    def replicas(self, pp: int, tp: int = 0) -> tuple[int, ...]:
        """The ranks holding the same stages and shard in every replica (a data-parallel group)."""
        return tuple(self.rank(pp, d, tp) for d in range(self.dp))

    def shards(self, pp: int, dp: int = 0) -> tuple[int, ...]:
        """The ranks sharing one stage's tensors (a tensor-parallel group)."""
        return tuple(self.rank(pp, dp, t) for t in range(self.tp))

    def label(self, rank: int) -> str:
        """A process's coordinates in words, dims of degree one left out: ``"pp1 dp0"`` (``"pp1"`` for a pure
        pipeline)."""
        c = self.coords(rank)
        return " ".join(f"{d}{getattr(c, d)}" for d in self.dims)

    def device_mesh(self, device_type: str) -> Any:
        """torch's ``DeviceMesh`` over the whole world with dims named ``pp``, ``dp``, ``tp`` (call it on every
        rank once the default process group is up); ``mesh.get_group("dp")`` is this process's replica group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))


_WHAT = {"pp": "pipeline ranks", "dp": "data-parallel replicas", "tp": "tensor-parallel shards per stage"}
