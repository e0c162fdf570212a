"""``LaunchConfig(ep_overlap=True)`` priced: each overlapped pair of DualPipeV's order (torch's ``OVERLAP_F_B``: a
forward of one microbatch and a full backward of another, run at once by ``pipeviz.adapter.overlap_fb``), or of the
combined 1F1B (``pipeviz.schedule.ep_overlap.combined_1f1b``, what 1F1B runs as under ``ep_overlap``), takes

    max(F, B, F's compute + B's compute)

where ``F`` and ``B`` are the two actions as priced alone (compute plus their expert all-to-alls) and the compute is
that less its all-to-alls: the all-to-alls of one half wait while the other computes, the compute of both still
runs on one device, each half's own chain (its compute, then its waits) still runs in turn. A bound that a fine
interleaving reaches (torchtitan alternates the halves at every dispatch and combine); a coarse one hides less.

Both halves start once both inputs have arrived (the pair waits for both receives before it runs, as torch's
runtime and torchtitan's callback do) and both outputs leave when the pair ends (torch sends them in the actions
after it). The timeline draws the pair as its two actions one after the other, the pair's time shared in
proportion to their priced times.

Example:
    >>> acts, pairs = simulated_pairs(cfg, lay, acts, ep_ex, forward_only=False, repeats=1)
    >>> pairs.seconds(costs, 0, 3)          # a pair of stage 0's forward and stage 3's backward
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeviz.cost.model import Costs
from pipeviz.schedule import traits as sched
from pipeviz.schedule.ep_overlap import combined_1f1b, ep_overlap_refusal
from pipeviz.sim.experts import EpExchanges

__all__ = ["PairOverlap", "simulated_pairs"]


@dataclass(frozen=True)
class PairOverlap:
    """Where a rank's actions pair up and what a pair costs: ``at`` holds ``(rank, position)`` of each pair's
    forward in the rank's action list (its backward is the next action); ``forward_a2a`` and ``backward_a2a`` per
    stage the all-to-all seconds in one forward (count exchanges included) and one backward that the other half
    can compute under (on a CPU with more processes than cores, an ``A2A``'s wait for a core is not among them:
    ``EpExchanges.core_wait``)."""

    at: frozenset[tuple[int, int]]
    forward_a2a: tuple[float, ...]
    backward_a2a: tuple[float, ...]

    @classmethod
    def of(cls, per_rank: Sequence[tuple[int, Sequence[int]]], ex: EpExchanges, repeats: int = 1) -> PairOverlap:
        """The pairs ``per_rank`` gives (per rank: its number of actions, the positions of its pairs' forwards), its
        order played ``repeats`` times in a row (gradient accumulation)."""
        at: set[tuple[int, int]] = set()
        for rank, (length, positions) in enumerate(per_rank):
            at.update((rank, p + b * length) for b in range(repeats) for p in positions)
        # what the other half can compute under: the link's time (and ep_delay's), not a wait for a core
        fwd = tuple(f + c - len(ex.each(s, "F")) * ex.core_wait
                    for s, (f, c) in enumerate(zip(ex.seconds("F"), ex.count_seconds, strict=True)))
        bwd = tuple(b - len(ex.each(s, "B")) * ex.core_wait for s, b in enumerate(ex.seconds("B")))
        return cls(frozenset(at), fwd, bwd)

    def seconds(self, costs: Costs, forward_stage: int, backward_stage: int, slow: float = 1.0) -> float:
        """A pair's seconds: ``max(F, B, F's compute + B's compute)``; ``slow`` stretches the actions (shared
        cores) as the engine does."""
        f, b = costs.duration(forward_stage, "F") * slow, costs.duration(backward_stage, "B") * slow
        fc = max(0.0, f - self.forward_a2a[forward_stage])
        bc = max(0.0, b - self.backward_a2a[backward_stage])
        return max(f, b, fc + bc)


def simulated_pairs(cfg: Any, lay: sched.Layout, acts: sched.Order, ex: EpExchanges | None, forward_only: bool,
                    repeats: int) -> tuple[sched.Order, PairOverlap | None]:
    """What ``pv.simulate`` plays for ``cfg.ep_overlap`` (a ``LaunchConfig``): the order (``acts``, or under 1F1B
    the combined 1F1B's, ``repeats`` times in a row) and its pairs (torch's ``OVERLAP_F_B`` positions in DualPipeV's
    order: ``pipeviz.adapter.schedules.overlap_pairs``), or ``acts`` and None without it (or without expert
    parallelism's exchanges, or forward only); refused as ``pv.launch`` refuses it.

    Raises:
        ValueError: ``ep_overlap`` or ``ep_delay`` where they cannot run (naming the value and the valid choices).
    """
    from pipeviz.adapter.schedules import overlap_pairs

    why = ep_overlap_refusal(cfg)
    if why is not None:
        raise ValueError(why)
    if not cfg.ep_overlap or ex is None or forward_only:
        return acts, None
    if lay.schedule == "1F1B":
        combined, m = combined_1f1b(lay.num_stages, cfg.microbatches), cfg.microbatches
        acts = [[a._replace(mb=a.mb + b * m) for b in range(repeats) for a in order] for order, _ in combined]
        return acts, PairOverlap.of([(len(order), pairs) for order, pairs in combined], ex, repeats)
    per_rank = overlap_pairs(lay.schedule, lay.num_ranks, lay.num_stages, cfg.microbatches)
    return acts, PairOverlap.of(per_rank, ex, repeats)
