"""Tensor parallelism's step on CPU (gloo), measured against ``pv.simulate`` as the Explorer overlays it.

The Explorer's tiny GPT-2 (``pipeviz.zoo.gpt2(4, 128, 4, 512)``, 16 x 32 tokens: the README's) and a tiny Llama
(``pipeviz.zoo.llama()``: 4 layers, width 128, grouped-query attention) balanced into 2 stages run under 1F1B with 4
microbatches, as a user launches them from the Explorer, in two layouts of 4 processes each: pp 2 x dp 2 (the
layout whose accuracy ``simulator_accuracy.py`` bounds: 4 processes on 2 cores measured 12-24 % longer than
simulated) and pp 2 x tp 2. Each is simulated with the Explorer's costs (``pv.CostOptions()``) two ways: "a core
per rank" (``pv.simulate(plan, cfg)``, the chart's default overlay) and "as run here" (``cores=`` this machine's:
what "Simulate as run here" overlays). The table puts each beside the run's median step (steps 1 on), then where a
tp run's time goes: the ``F`` and ``B`` spans per stage and the ``TP`` actions (per process and step, median),
measured and simulated side by side. The rounds alternate the cases, so a busy minute on a shared machine lands on
both layouts.

    PYTHONPATH=. python benchmarks/accuracy/tp_step.py [--rounds 2] [--steps 4] [--models gpt2,llama]

What the pricing is (``pipeviz.sim.tensor_parallel``): each collective the launch's layout issues a ``TP`` action
on gloo's link, plus ``cpu_tp_collective_wait`` where the processes outnumber the cores; each op of a shard's stage
``cpu_tp_op_overhead`` (forward) and ``cpu_tp_backward_op_overhead`` (backward) for DTensor's dispatch; all three
measured by ``benchmarks/calibration/cpu_constants.py --only tp_op,tp_wait``.

Measured 2026-12-06 on the 2-core development machine (x86_64) with other jobs running (load 7-13 throughout: no
quiet minute that day), three runs of 2 rounds, measured / simulated as run here:

- before this pricing (the collectives at gloo's link time only, no dispatch, no wait; issue 50): GPT-2 pp 2 x tp 2
  measured 490-690 ms against 105 ms as run here (5-6x) and 69 ms with a core per rank (the issue: 614 vs 60 ms;
  Llama 1,117 vs 63 ms); a forward of the first stage 45 ms measured against 5 ms priced, of which the run's 5 TP
  actions took 17 ms (3.5 ms each against 0.47 ms priced) and DTensor's dispatch of its 129 ops most of the rest;
- run C, the pricing committed (dispatch 61 / 73 us an op, wait 3.9 ms, the wait off the core), load 7-11: pp 2 x
  dp 2 2.94 (GPT-2) and 4.58 (Llama); pp 2 x tp 2 2.14 and 2.14 (GPT-2 1,087 and 536 ms against 379 priced; Llama
  1,212 and 560 against 414: each first round at the higher load); per stage F 52 / 32, 48 / 34 ms, B 46 / 32,
  49 / 34 ms (GPT-2); TP actions per process and step 36 / 36 and 44 / 44 (GPT-2), 36 / 36 and 52 / 44 (Llama:
  its later stage also all-reduces the rotary cos / sin gradients it receives, 2 a microbatch, not priced), median
  each 3.8 and 3.1 ms against 4.35 ms priced;
- run B (the wait holding the core), load 10: pp x dp 2.54 and 3.12, pp x tp 0.67 and 0.77;
- run A (dispatch measured at load 11: 198 / 243 us an op, wait 3.0 ms), load 11-13: pp x dp 2.48 and 3.37,
  pp x tp 0.90 and 1.12.

So at the same load a tp run now sits within the ratio the pp x dp runs beside it show (0.67-2.14 against
2.48-4.58), where it was 5-6x against their about 2-3x before; the 1.25x bound pp x dp keeps on a quiet machine
(``simulator_accuracy.py``) is not shown here, for either layout: the load moves both by 2-4x. The dispatch per op
moved with the load by 3x (61-198 us): the constants are the machine's at the time they were measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

import pipeviz as pv
from pipeviz.zoo import gpt2, llama


@dataclass
class Case:
    model: str
    layout: str  # "dp" or "tp"
    plan: pv.SplitPlan
    ids: torch.Tensor
    measured: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    runs: list[pv.Run] = field(default_factory=list)

    @property
    def config(self) -> pv.LaunchConfig:
        return pv.LaunchConfig(schedule="1F1B", microbatches=4, loss_fn=pv.cross_entropy,
                               **{self.layout: 2})  # type: ignore[arg-type]


def build(name: str) -> tuple[pv.SplitPlan, torch.Tensor]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = gpt2(4, 128, 4, 512) if name == "gpt2" else llama()
        ids = torch.randint(0, 512, (16, 32))
        return pv.balance(pv.trace(model, example_args=(ids,)), 2), ids


def median_of(events: list[pv.Event], kind: str, stage: int | None = None) -> float:
    xs = [e.duration for e in events if e.kind == kind and (stage is None or e.stage == stage)]
    return statistics.median(xs) if xs else float("nan")


def where_tp_goes(case: Case, here: pv.Timeline, steps: int) -> None:
    """The last run's F / B per stage and its TP actions, each beside what the simulation as run here prices."""
    run = case.runs[-1]
    measured = [e for e in run.timeline().events if e.step > 0]
    sim = [e for e in here.events if e.step == 0]
    for kind in ("F", "B"):
        print(f"    {kind} per stage, measured / simulated ms: " + ", ".join(
            f"{median_of(measured, kind, s) * 1e3:.1f} / {median_of(sim, kind, s) * 1e3:.1f}" for s in range(2)))
    seen = Counter(run.mesh.coords(e.rank).pp for e in measured if e.kind == "TP")
    priced = Counter(e.rank for e in sim if e.kind == "TP")
    per = [seen[s] / (2 * (steps - 1)) for s in range(2)]  # 2 processes (shards) per pipeline rank
    print("    TP per process and step, measured / simulated: " + ", ".join(
        f"{m:.0f} / {priced[s]}" for s, m in enumerate(per)) + f"; median each measured "
          f"{median_of(measured, 'TP') * 1e3:.2f} ms, simulated {median_of(sim, 'TP') * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--models", default="gpt2,llama")
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    cases = []
    for name in a.models.split(","):
        plan, ids = build(name)
        cases += [Case(name, layout, plan, ids) for layout in ("dp", "tp")]
    for r in range(a.rounds):
        for case in cases[r % 2:] + cases[:r % 2]:  # the order rotated each round
            case.loads.append(os.getloadavg()[0])
            run = pv.launch(case.plan, config=case.config, steps=a.steps, inputs=(case.ids,), target=case.ids)
            if run.wait(900) != "done":
                raise SystemExit(f"{case.model} {case.layout}: {run.error}")
            case.measured.append(statistics.median(run.timeline().step_times[1:]))
            case.runs.append(run)
    print(f"{'case':<16}{'measured ms':>13}{'here ms':>10}{'ratio':>7}{'core/rank ms':>14}{'ratio':>7}  load")
    for case in cases:
        here = pv.simulate(case.plan, case.config, cores=cores)
        alone = pv.simulate(case.plan, case.config)
        m = statistics.median(case.measured)
        print(f"{case.model + ' pp2 x ' + case.layout + '2':<16}{m * 1e3:>13.1f}{here.step_time * 1e3:>10.1f}"
              f"{m / here.step_time:>7.2f}{alone.step_time * 1e3:>14.1f}{m / alone.step_time:>7.2f}  "
              f"{', '.join(f'{x:.1f}' for x in case.loads)}  "
              f"(runs {', '.join(f'{x * 1e3:.0f}' for x in case.measured)})")
        if case.layout == "tp":
            where_tp_goes(case, here, a.steps)
    print(f"{cores} cores, load now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
