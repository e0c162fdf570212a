"""``StageExchanges``: the exchanges one action of a stage issues inside it, per stage — what context parallelism's
key/value exchanges (``pipeviz.sim.collectives.CpExchanges``) and expert parallelism's all-to-alls
(``pipeviz.sim.experts.EpExchanges``) have in common: the simulator places them inside the forward or backward that
issues them (``cp_actions``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageExchanges"]


@dataclass(frozen=True)
class StageExchanges:
    """Per stage, the seconds of each exchange in one forward (``forward``) and in one backward (``backward``: ``B``,
    or ``I`` under a split backward, never ``W``), in the order the action issues them."""

    forward: tuple[tuple[float, ...], ...]
    backward: tuple[tuple[float, ...], ...]

    def each(self, stage: int, kind: str) -> tuple[float, ...]:
        """The exchanges an action of ``kind`` (``F``, ``B``, ``I``, ``W``) of ``stage`` issues, in order."""
        if kind == "F":
            return self.forward[stage]
        return self.backward[stage] if kind in ("B", "I") else ()

    def seconds(self, kind: str) -> tuple[float, ...]:
        """Per stage, the exchanges' seconds in one action of ``kind``."""
        return tuple(sum(self.each(s, kind)) for s in range(len(self.forward)))
