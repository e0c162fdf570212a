"""Where ``LaunchConfig(ep_overlap=True)`` can run, said once for ``pv.launch`` and ``pv.simulate``: expert
parallelism (``ep`` > 1) under a schedule whose order pairs one microbatch's forward with another's backward
(torch's ``OVERLAP_F_B`` action: DualPipeV), or under 1F1B run as a combined 1F1B (``combined_1f1b``: every
steady-state forward paired with an earlier microbatch's backward, the idea of Megatron-Core's combined 1F1B).
``ep_delay`` (a slowed expert link) needs all-to-alls to slow.

Example:
    >>> ep_overlap_refusal(pv.LaunchConfig(schedule="1F1B", dp=2, ep=2, ep_overlap=True))
    "ep_overlap=True with schedule '1F1B': ..."
"""

from __future__ import annotations

from typing import Any

from pipeviz.schedule import traits as sched

__all__ = ["OVERLAP_SCHEDULES", "combined_1f1b", "ep_overlap_refusal"]

# the schedules ep_overlap runs: torch's with OVERLAP_F_B actions in its order (torch 2.13-2.15: DualPipeV alone),
# and 1F1B as a combined 1F1B (combined_1f1b)
OVERLAP_SCHEDULES = ("DualPipeV", "1F1B")


def combined_1f1b(num_stages: int, microbatches: int) -> list[tuple[list[sched.Action], list[int]]]:
    """Per pipeline rank (one stage each), the combined 1F1B's actions and the positions of its pairs' forwards
    (each pair: a forward, then the backward of an earlier microbatch, run at once under ``ep_overlap``).

    1F1B as torch's ``Schedule1F1B`` runs it (``min(m, p - r)`` warm-up forwards on stage ``r``, then one backward
    and one forward in turn) has on its last stage each backward right after its own microbatch's forward, which it
    needs: nothing to pair. Here stage ``r`` warms up with ``w = min(m, 2(p - 1 - r) + 1)`` forwards, then runs
    ``F(j)`` beside ``B(j - w)``, then drains the backwards: the last stage pairs ``F(j)`` with ``B(j - 1)`` (the idea
    of Megatron-Core's combined 1F1B, a forward merged with another microbatch's backward; these warm-up lengths
    are derived here, not taken from Megatron). A pair waits for both its inputs and sends both outputs when it
    ends, so with 1F1B's warm-up (``p - r`` forwards) stage ``r``'s pair would wait for stage ``r + 1``'s, which
    waits for ``r``'s previous one: the stages' pairs would run in turn. Two more warm-up forwards per stage down
    the pipeline give each pair the slack of one, at a price: up to ``2(p - 1 - r) + 2`` microbatches' activations
    held on stage ``r`` while its first pair runs (1F1B: ``p - r``), which ``pv.simulate`` prices.

    Example:
        >>> [" ".join(str(a) for a in acts) for acts, _ in combined_1f1b(2, 4)]
        ['0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3', '1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3']
        >>> [pairs for _, pairs in combined_1f1b(2, 4)]       # 0F3 & 0B0; 1F1 & 1B0, 1F2 & 1B1, 1F3 & 1B2
        [[3], [1, 3, 5]]
    """
    out = []
    for rank in range(num_stages):
        warm = min(microbatches, 2 * (num_stages - 1 - rank) + 1)
        acts = [sched.Action(rank, sched.Kind.F, i) for i in range(warm)]
        pairs = []
        for j in range(warm, microbatches):
            pairs.append(len(acts))
            acts += [sched.Action(rank, sched.Kind.F, j), sched.Action(rank, sched.Kind.B, j - warm)]
        acts += [sched.Action(rank, sched.Kind.B, b) for b in range(microbatches - warm, microbatches)]
        out.append((acts, pairs))
    return out


def ep_overlap_refusal(cfg: Any) -> str | None:
    """Why ``cfg`` (a ``LaunchConfig``) cannot run its ``ep_overlap`` / ``ep_delay`` (the message names the value,
    the valid choices and the fix), or None where it can."""
    if cfg.ep_overlap:
        if cfg.ep == 1:
            return ("ep_overlap=True with ep=1: the overlap hides expert parallelism's all-to-alls, and ep=1 has "
                    "none. Valid: ep_overlap=False, or ep > 1 (dividing dp). Fix: ep_overlap=False, or set ep.")
        try:
            name = sched.canonical(cfg.schedule)
        except ValueError:
            return None  # (an unknown schedule: refused by its own check, naming the schedules)
        if name not in OVERLAP_SCHEDULES:
            return (f"ep_overlap=True with schedule {cfg.schedule!r}: the overlap runs the forward/backward pairs "
                    "of DualPipeV's order (torch's OVERLAP_F_B actions) or of 1F1B run as a combined 1F1B; "
                    f"{name}'s order pairs none. Valid schedules with ep_overlap: {', '.join(OVERLAP_SCHEDULES)}. "
                    "Fix: schedule='DualPipeV' or '1F1B', or ep_overlap=False.")
        if cfg.order is not None:
            return ("ep_overlap=True with a custom order=: the overlap runs the pairs of DualPipeV's order or of "
                    "the combined 1F1B. Fix: drop order=, or ep_overlap=False.")
    if cfg.ep_delay and cfg.ep == 1:
        return (f"ep_delay={cfg.ep_delay!r} with ep=1: it slows expert parallelism's all-to-alls, and ep=1 has none. "
                "Fix: ep_delay=0.0, or ep > 1.")
    return None
