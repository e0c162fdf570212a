"""What a tensor-parallel run's notes say beside the measured and the simulated step (``run_notes_html``): what the
simulation prices beside the shards' compute, and the factor a measured step is off by, named with its cause
(issue 50, point 6; ``pipeviz.sim.tensor_parallel`` prices it, ``benchmarks/accuracy/tp_step.py`` measures it).

Example:
    >>> tp_notes(run.timeline().step_time, pv.simulate(plan, cfg), pv.simulate(plan, cfg, cores=2), tp=2)
"""

from __future__ import annotations

from pipeviz.cost.calibration import constant
from pipeviz.schedule.timeline import Timeline
from pipeviz.widgets.figures import plural

__all__ = ["TP_BOUND", "tp_notes"]

TP_BOUND = 1.25  # pp x dp runs on 4 processes and 2 cores measured 12-24 % longer than simulated as run here
# (benchmarks/accuracy/simulator_accuracy.py); a tp run's ratio beyond it is named with its measured cause


def tp_notes(measured: float, sim: Timeline, here: Timeline | None, tp: int, processes: int = 4,
             cores: int = 2) -> list[str]:
    """What a tensor-parallel run's simulation prices beside its shards' compute (from the simulated ``TP`` actions
    and the measured constants: DTensor's dispatch per op, gloo's collectives and their wait for a core where the
    processes outnumber the cores), and the factor the measured step is off by, with its cause: against the
    simulation as run here where there is one (named only beyond ``TP_BOUND``), else against a core per rank."""
    priced = here if here is not None else sim
    tps = [e for e in priced.events if e.kind == "TP" and e.step == 0]
    out = []
    if tps and priced.meta.get("hardware") in (None, "cpu"):  # (on a GPU preset neither cost is this machine's)
        per = max(sum(1 for e in tps if e.rank == r) for r in {e.rank for e in tps})
        each = sorted(e.duration for e in tps)[len(tps) // 2]
        wait = float(priced.meta.get("tp_wait") or 0.0)
        waits = f", {wait * 1e3:.1f} ms of it waiting for the other shard's process to get a core" if wait else ""
        out.append(f"with tp {tp} each process runs its stage on DTensors ({constant('cpu_tp_op_overhead') * 1e6:.0f} "
                   f"µs forward, {constant('cpu_tp_backward_op_overhead') * 1e6:.0f} µs backward per op, measured) and "
                   f"issues {per} TP all-reduces a step through gloo, priced at {each * 1e3:.1f} ms each{waits}")
    if here is not None:
        ratio = measured / here.step_time if here.step_time > 0 else 0.0
        if ratio > TP_BOUND:
            out.append(f"measured is {ratio:.1f}× the simulation as run here, beyond the {TP_BOUND:.2f}× pp × dp runs "
                       f"keep: not priced, time-slicing {processes} processes on {plural(cores, 'core')} (pp × dp runs "
                       "measured the cores idle 8-18 % of the time and 2-4× the context switches) and the machine's "
                       "other jobs")
    elif sim.step_time > 0 and measured > TP_BOUND * sim.step_time:
        out.append(f"measured is {measured / sim.step_time:.1f}× the simulated step, which gives each process a core "
                   "and each collective its link time only: Simulate as run here prices the shared cores and each "
                   "TP all-reduce's wait for a core (measured)")
    return out
