"""Where ``LaunchConfig(ep_overlap=True)`` can run, said once for ``pv.launch`` and ``pv.simulate``: expert
parallelism (``ep`` > 1) under a schedule whose order pairs one microbatch's forward with another's backward
(torch's ``OVERLAP_F_B`` action: DualPipeV). ``ep_delay`` (a slowed expert link) needs all-to-alls to slow.

Example:
    >>> ep_overlap_refusal(pv.LaunchConfig(schedule="1F1B", dp=2, ep=2, ep_overlap=True))
    "ep_overlap=True with schedule '1F1B': ..."
"""

from __future__ import annotations

from typing import Any

from pipeviz.schedule import traits as sched

__all__ = ["OVERLAP_SCHEDULES", "ep_overlap_refusal"]

# torch's schedules whose order holds OVERLAP_F_B actions (torch 2.13-2.15: DualPipeV alone)
OVERLAP_SCHEDULES = ("DualPipeV",)


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
                    f"of a schedule's order (torch's OVERLAP_F_B actions), which only "
                    f"{', '.join(OVERLAP_SCHEDULES)} has (Megatron's combined 1F1B is not built). Valid schedules "
                    f"with ep_overlap: {', '.join(OVERLAP_SCHEDULES)}. Fix: schedule='DualPipeV', or "
                    "ep_overlap=False.")
        if cfg.order is not None:
            return ("ep_overlap=True with a custom order=: the overlap runs the pairs of torch's DualPipeV order. "
                    "Fix: drop order=, or ep_overlap=False.")
    if cfg.ep_delay and cfg.ep == 1:
        return (f"ep_delay={cfg.ep_delay!r} with ep=1: it slows expert parallelism's all-to-alls, and ep=1 has none. "
                "Fix: ep_delay=0.0, or ep > 1.")
    return None
