"""``Mesh``: how a run's processes are laid out, pipeline × data × context × tensor parallel.

A process is known by its coordinates, never by a bare number: ``pp`` (its place in the pipeline: which stages it
runs), ``dp`` (its replica: which share of every batch it trains on), ``cp`` (its share of every sequence: context
parallelism) and ``tp`` (its shard of each stage's tensors). Two kinds of rank, never interchangeable:

- a ``ProcessRank`` numbers the run's processes, ``0 .. world - 1``, with ``pp`` outermost and ``tp`` innermost
  (torchtitan's order: the peers that talk most are neighbours);
- a ``PipelineRank`` is a place in the pipeline, ``0 .. pp - 1`` (``Coords.pp``): what ``Layout.stages_of`` takes.

torch's ``DeviceMesh`` gets the same named dims. Every degree is checked here, once (``check_degree``).

Example:
    >>> mesh = pv.Mesh(pp=2, dp=2)
    >>> mesh.world, mesh.coords(3)
    (4, Coords(pp=1, dp=1, tp=0, cp=0))
    >>> mesh.pipeline(dp=1)          # the process ranks of replica 1's pipeline, in pipeline order
    (1, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, NewType

from pipeviz.errors import LaunchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DIMS", "Coords", "Mesh", "MeshError", "PipelineRank", "ProcessRank", "check_degree"]

ProcessRank = NewType("ProcessRank", int)  # one of the run's processes: 0 .. world - 1
PipelineRank = NewType("PipelineRank", int)  # a place in the pipeline: 0 .. pp - 1 (which stages it runs)

DIMS = ("pp", "dp", "cp", "tp")  # outermost first: the order of ranks and of torch's DeviceMesh dims
_WHAT = {"pp": "pipeline ranks", "dp": "data-parallel replicas of the pipeline",
         "cp": "context-parallel shares of every sequence", "tp": "tensor-parallel shards of every stage",
         "ep": "expert-parallel groups each MoE block's routed experts are sharded over"}
_FIX = {"pp": "a plan with more stages, or fewer stages per rank", "dp": "dp=1 for one pipeline, dp=2 for two "
        "replicas each training on half of every batch", "cp": "cp=1 to keep each sequence whole, cp=2 to split "
        "every sequence in two", "tp": "tp=1 for whole stages, tp=2 to shard each stage's layers in two",
        "ep": "ep=1 for every expert on every rank, ep=2 to shard each MoE block's routed experts over 2 of a stage's "
        "dp x cp ranks"}


class MeshError(LaunchError):
    """A layout that cannot work: the message names each degree and what would fit (a ``LaunchError`` too: a
    launch with such a layout is refused before any process starts)."""


def check_degree(name: str, value: object) -> int:
    """``value`` as the degree of dim ``name`` (``"pp"``, ``"dp"``, ``"cp"``, ``"tp"``): a positive int.

    Raises:
        MeshError: anything else, naming the dim, what it counts and the fix.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MeshError(f"{name} must be a positive int (the number of {_WHAT[name]}), got {value!r}. "
                        f"Fix: {_FIX[name]}.", setting=name)
    return value


class Coords(NamedTuple):
    """A process's place: pipeline rank, replica, tensor-parallel shard, context-parallel share.

    (``cp`` is last only so that ``Coords(pp, dp, tp)`` built before context parallelism still means the same; the
    mesh's order is ``DIMS``.)"""

    pp: int
    dp: int = 0
    tp: int = 0
    cp: int = 0

    @property
    def pipeline_rank(self) -> PipelineRank:
        return PipelineRank(self.pp)

    def label(self, dims: tuple[str, ...] = ("pp", "dp", "tp")) -> str:
        """``"pp1 dp0 tp0"``: the named ``dims`` (``Mesh.label`` leaves out dims of degree one)."""
        return " ".join(f"{d}{getattr(self, d)}" for d in dims)


@dataclass(frozen=True)
class Mesh:
    """Degrees of pipeline (``pp``: pipeline ranks, each holding one or more stages), data (``dp``: replicas),
    tensor (``tp``: shards per stage) and context (``cp``: shares of every sequence) parallelism;
    ``world = pp * dp * cp * tp`` processes. ``ep`` (expert parallelism) adds no processes: each MoE block's routed
    experts are sharded over ``ep`` of a stage's ``dp × cp`` processes (as torchtitan and Megatron carve it), so it
    must divide ``dp * cp``.

    Raises:
        MeshError: a degree that is not a positive int, or an ``ep`` that does not divide ``dp * cp``.
    """

    pp: int
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in (*DIMS, "ep"):
            check_degree(name, getattr(self, name))
        if (self.dp * self.cp) % self.ep:
            fits = [str(e) for e in range(1, self.dp * self.cp + 1) if (self.dp * self.cp) % e == 0]
            raise MeshError(f"ep={self.ep} does not divide dp × cp = {self.dp} × {self.cp} = {self.dp * self.cp}: "
                            "the expert-parallel groups are carved out of a stage's data- and context-parallel "
                            f"processes. Valid ep: {', '.join(fits)}. Fix: one of those, or dp={self.ep * self.cp} "
                            "(more replicas).")

    @property
    def world(self) -> int:
        """Processes in all."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def degrees(self) -> tuple[int, ...]:
        """The degrees in ``DIMS`` order."""
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def dims(self) -> tuple[str, ...]:
        """The named dims of degree > 1, outermost first (``("pp", "dp")``); always at least ``("pp",)``."""
        return tuple(d for d in DIMS if d == "pp" or getattr(self, d) > 1)

    def describe(self) -> str:
        """``"pp=2 × dp=2 × tp=1"`` (``cp`` named when above 1: ``"pp=2 × dp=1 × cp=4 × tp=1"``; ``ep``, which adds
        no processes, after it: ``"pp=2 × dp=4 × tp=1 (ep=2)"``)."""
        dims = " × ".join(f"{d}={getattr(self, d)}" for d in DIMS if d != "cp" or self.cp > 1)
        return dims + (f" (ep={self.ep})" if self.ep > 1 else "")

    def check(self, world: int) -> None:
        """Raise ``MeshError`` unless the degrees multiply to ``world`` (naming each degree and what fits)."""
        if self.world == world:
            return
        rest = self.pp * self.cp * self.tp
        fits = [f"dp={world // rest}"] if world % rest == 0 else []
        raise MeshError(
            f"{self.describe()} = {self.world} processes, but the world has {world}. "
            f"Fix: degrees whose product is {world}{' (' + ', '.join(fits) + ')' if fits else ''}."
        )

    def rank(self, pp: int, *, dp: int = 0, tp: int = 0, cp: int = 0) -> ProcessRank:
        """The process rank at these coordinates."""
        return ProcessRank(((pp * self.dp + dp) * self.cp + cp) * self.tp + tp)

    def rank_of(self, coords: Coords) -> ProcessRank:
        return self.rank(coords.pp, dp=coords.dp, tp=coords.tp, cp=coords.cp)

    def coords(self, rank: int) -> Coords:
        """The coordinates of process ``rank``."""
        if not 0 <= rank < self.world:
            raise MeshError(f"rank {rank} is outside the mesh's {self.world} processes (0 to {self.world - 1}).")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return Coords(pp, dp, tp, cp)

    def pipeline_rank(self, rank: int) -> PipelineRank:
        """The pipeline rank of process ``rank`` (which stages it runs)."""
        return PipelineRank(self.coords(rank).pp)

    def pipeline(self, dp: int = 0, tp: int = 0, cp: int = 0) -> tuple[ProcessRank, ...]:
        """The process ranks of one pipeline (replica ``dp``, share ``cp``, shard ``tp``), in pipeline order."""
        return tuple(self.rank(p, dp=dp, tp=tp, cp=cp) for p in range(self.pp))

    def pipelines(self) -> list[tuple[int, int, int]]:
        """Every pipeline's ``(dp, tp, cp)``, in rank order: the pipelines a process group is made for once each."""
        return [(d, t, c) for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def replicas(self, pp: int, tp: int = 0, cp: int = 0) -> tuple[ProcessRank, ...]:
        """The process ranks holding the same stages and shard in every replica (a data-parallel group)."""
        return tuple(self.rank(pp, dp=d, tp=tp, cp=cp) for d in range(self.dp))

    def shards(self, pp: int, dp: int = 0, cp: int = 0) -> tuple[ProcessRank, ...]:
        """The process ranks sharing one stage's tensors (a tensor-parallel group)."""
        return tuple(self.rank(pp, dp=dp, tp=t, cp=cp) for t in range(self.tp))

    def shares(self, pp: int, dp: int = 0, tp: int = 0) -> tuple[ProcessRank, ...]:
        """The process ranks splitting one sequence (a context-parallel group)."""
        return tuple(self.rank(pp, dp=dp, tp=tp, cp=c) for c in range(self.cp))

    def label(self, rank: int) -> str:
        """A process's coordinates in words, dims of degree one left out: ``"pp1 dp0"`` (``"pp1"`` for a pure
        pipeline)."""
        return self.coords(rank).label(self.dims)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """torch's ``DeviceMesh`` over the whole world with dims named as ``DIMS`` (call it on every rank once the
        default process group is up); ``mesh.get_group("dp")`` is this process's replica group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.degrees, mesh_dim_names=DIMS)
