"""Simulated vs measured step time on CPU, each case measured several times to separate model error from noise.

Cases: two models (an MLP and a small transformer) under GPipe, 1F1B and Interleaved1F1B on 2 ranks, and
pipeline x data parallel (2 stages x 2 replicas = 4 processes, ``pv.launch(..., dp=2)``), plus one diagnostic
case with the ranks left unpinned (``pin_cpus=False``). The cases run round-robin for ``--rounds`` rounds (the
order rotated each round), so a slow minute on a shared machine spreads over all cases instead of landing on
one. For each case the table gives the prediction next to the median of the rounds' measured step times, their
min-max, the share of CPU time the hypervisor stole during the runs (``steal`` in /proc/stat: on a virtual
machine, time the cores were taken away, which no model of this program can predict) and the error of the
prediction against the median. Beside them, what the operating system did: the CPU each process used per step
(/proc) next to the compute the model gives a rank, and the involuntary context switches a process took per
step (4 processes on 2 cores are preempted twice as often). The summary counts the predictions that fall outside
the rounds' measured min-max, and by how much: the error that the machine's own spread does not explain.

Two columns tell the model's error from the machine's speed. ``speed``: in each pinned run, the time the ranks
spent in their forward and backward spans (one process a core: their own CPU) over the time the replay gave
the same ops a few seconds earlier; the same ops moved by 0.96-1.44 from one run to the next here, so a
prediction taken at one speed and checked at another is off by that much whatever the model. ``err at run
speed``: the cpu preset with its op times scaled by that run's speed, against that run: what is left is the
schedule's model (overheads, hand-offs, bubbles). ``used``: all the processes' CPU over the cores' time in
the same window; for PP x DP below 100 % means the operating system left cores idle while four processes
waited on each other (not modelled: the simulator keeps a shared core busy while any rank can run).

Predictions:

- ``profiled``: ``pv.profile`` measures every layer on this machine at the run's microbatch size and thread
  count, then ``pv.simulate`` places the actions. The profile is a measurement too, so it is retaken at the start
  of every round (the table gives the median prediction); the split is the first round's throughout. For
  PP x DP the profile is taken at the replicas' microbatch (``microbatches x dp`` pieces of the batch) with one
  thread per process, and the simulation is told the machine's cores (``cores=``): 4 processes share 2 cores.
- ``hardware="cpu"``: every op of the trace replayed alone at its shapes (``pipeviz.kernels``; no layer of the
  model runs, no profile), retaken each round too.

Run on an idle machine when possible: the script records ``os.getloadavg()`` before every round, because
other processes on the cores move the measured step more than the model's error does.

    python benchmarks/accuracy/simulator_accuracy.py [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.schedule.timeline import COMPUTE
from pipeviz.schedule.training import cross_entropy
from pipeviz.zoo import MyNetwork, TinyTransformer

lm_loss = cross_entropy  # the one language-model loss: pv.cross_entropy over the last dim


@dataclass
class Model:
    name: str
    module: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Case:
    model: Model
    schedule: str
    stages: int
    spr: int | None = None
    dp: int = 1
    pin: bool = True
    plan: Any = None
    predicted: dict[str, list[float]] = field(default_factory=dict)  # per round
    measured: list[float] = field(default_factory=list)  # one median step time per round
    steps: list[float] = field(default_factory=list)  # every step after warm-up, all rounds pooled
    stolen: list[float] = field(default_factory=list)  # per round: share of the run's CPU time the hypervisor took
    cpu: list[float] = field(default_factory=list)  # per round: CPU seconds a process used per step (mean)
    switches: list[float] = field(default_factory=list)  # per round: involuntary context switches per process-step
    busy: list[float] = field(default_factory=list)  # per round: the cpu preset's compute seconds per rank-step
    compute: list[float] = field(default_factory=list)  # per round: the cpu preset's op time (no overhead), a step
    speed: list[float] = field(default_factory=list)  # per round: measured op time / predicted op time
    used: list[float] = field(default_factory=list)  # per round: share of the cores' time the processes used

    @property
    def label(self) -> str:
        extra = f" dp={self.dp}" if self.dp > 1 else ""
        return f"{self.schedule}{extra}{'' if self.pin else ' unpinned'}"

    @property
    def processes(self) -> int:
        ranks = self.stages // (self.spr or 1)
        return ranks * self.dp


def models() -> list[Model]:
    torch.manual_seed(0)
    mlp = MyNetwork(1024, [2048, 1024, 2048, 1024, 512])
    tr = TinyTransformer(vocab=1024, dim=256, heads=4, depth=4, seq=64)
    return [
        Model("MLP 1024-2048 x5", mlp, torch.randn(64, 1024), torch.randint(0, 10, (64,)), F.cross_entropy),
        Model("transformer d256 x4", tr, torch.randint(0, 1024, (16, 64)), torch.randint(0, 1024, (16, 64)),
              lm_loss),
    ]


def cases(ms: list[Model]) -> list[Case]:
    out = []
    for m in ms:
        out += [Case(m, "GPipe", 2), Case(m, "1F1B", 2), Case(m, "Interleaved1F1B", 4, 2), Case(m, "1F1B", 2, dp=2)]
    out.append(Case(ms[1], "1F1B", 2, pin=False))  # the OS diagnostic: same run, ranks not pinned to cores
    return out


def predict(all_cases: list[Case], m: int, graphs: dict[str, Any]) -> None:
    """Append each case's predictions for this round (a fresh profile per model and setting: the profile is a
    measurement too, so it is taken in the same conditions as the round's runs)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    profiled: dict[tuple[str, int], Any] = {}
    hw = pv.hardware("cpu") if hasattr(pv, "hardware") else None
    if hw is not None:
        from pipeviz.hardware import forget_kernel_times

        forget_kernel_times()  # the replay is a measurement too: retaken each round, like the profile
    for c in all_cases:
        name = c.model.name
        if name not in graphs:
            graphs[name] = pv.trace(c.model.module, example_args=(c.model.x,))
        graph = graphs[name]
        # A process gets cpus // processes threads (pv.launch's rule); profile with what the run's ranks get,
        # at the microbatch each replica really computes.
        threads = max(1, cpus // c.processes)
        key = (name, c.dp)
        if key not in profiled:
            prof = pv.profile(graph, microbatches=m * c.dp, repeats=15, threads=threads)
            profiled[key] = graph.with_profile(prof)
        g = profiled[key]
        if c.plan is None:  # one split for all rounds (the launch traces it), balanced on the first profile
            c.plan = pv.balance(g, c.stages, by="time")
        plan = pv.SplitPlan(g, c.plan.splits)
        cores = cpus if c.processes > cpus else None
        c.predicted.setdefault("profiled", []).append(
            pv.simulate(plan, c.schedule, m, stages_per_rank=c.spr, dp=c.dp, cores=cores).step_time)
        if hw is not None:
            try:
                flop_plan = pv.SplitPlan(graph, c.plan.splits)  # the same split, without the profile
                sim = pv.simulate(flop_plan, c.schedule, m, stages_per_rank=c.spr, dp=c.dp, cores=cores,
                                  hardware="cpu")
                t = sim.step_time
                # What the model says each rank computes (its all-reduce included): the CPU a process should use.
                c.busy.append(sum(e.duration for e in sim.events) / sim.num_ranks)
                # The ops alone (no per-action overhead): what the run's F/B spans time, summed over ranks.
                bare = pv.simulate(flop_plan, c.schedule, m, stages_per_rank=c.spr, dp=c.dp, cores=cores,
                                   hardware=replace(pv.hardware("cpu"), action_overhead=0.0))
                c.compute.append(sum(e.duration for e in bare.events if e.kind in COMPUTE))
            except (TypeError, ValueError) as exc:  # an API that differs from what this script expects
                t = float("nan")
                print(f"hardware='cpu' prediction skipped for {name} {c.label}: {exc}")
            c.predicted.setdefault("cpu preset", []).append(t)


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies over all CPUs from /proc/stat; (0, 0) off Linux. Steal is time a virtual CPU was
    ready to run while the hypervisor ran something else: what this machine's noise is made of."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def process_times(pids: list[int]) -> dict[int, tuple[float, int]]:
    """Per process: (CPU seconds used so far, involuntary context switches), from /proc; empty off Linux."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        involuntary = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[pid] = ((int(fields[11]) + int(fields[12])) / tick, involuntary)  # utime + stime
    return out


def measure(c: Case, m: int, steps: int) -> float:
    before = cpu_times()
    run = pv.launch(c.plan, schedule=c.schedule, microbatches=m, steps=steps,
                    inputs=(c.model.x,), target=c.model.y, loss_fn=c.model.loss, stages_per_rank=c.spr,
                    dp=c.dp, pin_cpus=c.pin, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    # Each process's CPU time between the end of step 2 and of step steps-1: what the ranks really computed
    # (and spent around it), against the model's compute per rank.
    marks: list[tuple[int, dict[int, tuple[float, int]], float]] = []
    deadline = time.time() + 600
    while not run.done and time.time() < deadline:
        done = len(run.step_walltimes) + 1 if run.step_walltimes else 0
        if (not marks and done >= 2) or (len(marks) == 1 and done >= steps - 1):
            marks.append((done, process_times(run.pids), time.perf_counter()))
        run.wait(0.02)
    if run.wait(1) != "done":
        raise RuntimeError(f"{c.model.name} {c.label}: {run.error}")
    if len(marks) == 2 and marks[1][0] > marks[0][0]:
        (n0, a, t0), (n1, b, t1) = marks
        common = [p for p in a if p in b]
        if common:
            c.cpu.append(sum(b[p][0] - a[p][0] for p in common) / len(common) / (n1 - n0))
            c.switches.append(sum(b[p][1] - a[p][1] for p in common) / len(common) / (n1 - n0))
            if len(common) == c.processes:
                # All the processes' CPU over the cores' time in the same window: below 1, cores sat idle.
                cores = min(c.processes, os.cpu_count() or 1)
                c.used.append(sum(b[p][0] - a[p][0] for p in common) / ((t1 - t0) * cores))
    after = cpu_times()
    c.stolen.append((after[0] - before[0]) / max(1, after[1] - before[1]))
    tl = run.timeline()
    c.steps += tl.step_times[1:]
    if c.compute and c.processes <= (os.cpu_count() or 1):
        # The machine's speed during this run against the replay's: the ops' measured time (F/B spans of the
        # steps after warm-up, all ranks) over the time the replay gave the same ops. Pinned, one process a
        # core, a span is the rank's own CPU time; time-sliced (PP x DP) it is not, so no ratio there.
        steps = tl.steps[1:]
        spent = sum(e.duration for st in steps for e in tl.step_events(st) if e.kind in COMPUTE) / len(steps)
        c.speed.append(spent / c.compute[-1])
    return tl.step_time


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    m = a.microbatches
    t0 = time.perf_counter()
    print(f"load before profiling: {os.getloadavg()[0]:.2f} (1-min), cores {os.cpu_count()}")
    all_cases = cases(models())
    graphs: dict[str, Any] = {}
    loads = []
    for r in range(a.rounds):
        loads.append(os.getloadavg()[0])
        predict(all_cases, m, graphs)
        order = all_cases[r % len(all_cases):] + all_cases[:r % len(all_cases)]  # rotate: no fixed position
        for c in order:
            c.measured.append(measure(c, m, a.steps))
        print(f"round {r + 1}/{a.rounds} done, load at its start {loads[-1]:.2f}, {time.perf_counter() - t0:.0f} s")

    keys = list(all_cases[0].predicted)
    head = f"{'model':<21}{'case':<22}{'procs':>6}" + "".join(f"{k:>12}" for k in keys)
    head += f"{'measured':>10}{'min-max':>15}{'step IQR':>15}{'stolen':>8}{'cpu/step':>10}{'model':>8}{'csw':>6}"
    head += f"{'used':>6}"
    head += "".join(f"{'err ' + k:>16}" for k in keys) + f"{'speed':>7}{'err at run speed':>18}"
    print("\nstep times in ms; predicted and measured: medians over rounds (measured: of each run's median step);"
          " min-max: over rounds; step IQR: all steps after warm-up pooled; stolen: hypervisor steal; cpu/step:"
          " CPU ms a process used per step (/proc), model: the cpu preset's compute ms per rank-step; csw:"
          " involuntary context switches per process-step; used: the processes' CPU over the cores' time while"
          " they ran (PP x DP: 4 processes on 2 cores; below 100 % the cores sat idle); speed: the ops' measured"
          " time in the run over the replay's for them (median over rounds; 1.20 = the machine ran the same ops"
          " 20 % slower than when it replayed them); err at run speed: the cpu preset with its op times scaled by"
          " that round's speed")
    print(head)
    errors: dict[str, dict[str, list[float]]] = {k: {"fit": [], "over": []} for k in keys}
    at_speed: list[float] = []
    outside: dict[str, dict[str, list[float]]] = {k: {"fit": [], "over": []} for k in keys}
    for c in all_cases:
        med = statistics.median(c.measured)
        q = statistics.quantiles(c.steps, n=4) if len(c.steps) >= 4 else [min(c.steps), 0, max(c.steps)]
        line = f"{c.model.name:<21}{c.label:<22}{c.processes:>6}"
        line += "".join(f"{fmt_ms(statistics.median(c.predicted[k])):>12}" for k in keys)
        line += f"{fmt_ms(med):>10}{fmt_ms(min(c.measured)) + '-' + fmt_ms(max(c.measured)):>15}"
        line += f"{fmt_ms(q[0]) + '-' + fmt_ms(q[2]):>15}{statistics.median(c.stolen):>8.1%}"
        line += (f"{fmt_ms(statistics.median(c.cpu)):>10}" if c.cpu else f"{'-':>10}")
        line += (f"{fmt_ms(statistics.median(c.busy)):>8}" if c.busy else f"{'-':>8}")
        line += (f"{statistics.median(c.switches):>6.0f}" if c.switches else f"{'-':>6}")
        line += (f"{statistics.median(c.used):>6.0%}" if c.used else f"{'-':>6}")
        for k in keys:
            err = statistics.median(c.predicted[k]) / med - 1
            line += f"{err:>+16.1%}"
            if c.pin and err == err:
                group = "fit" if c.processes <= (os.cpu_count() or 1) else "over"
                errors[k][group].append(abs(err))
                # How far the prediction lies outside what the rounds measured (0 inside): the part of the error
                # the machine's own spread cannot account for.
                p = statistics.median(c.predicted[k])
                lo, hi = min(c.measured), max(c.measured)
                outside[k][group].append(0.0 if lo <= p <= hi else (lo - p) / lo if p < lo else (p - hi) / hi)
        if c.speed and "cpu preset" in c.predicted:
            # Per round, the prediction at the speed the machine ran the ops in that run (the step scaled whole:
            # the per-action overhead, ~5 % of it, is scaled too), against that run's median step.
            scaled = [p * r / mm - 1 for p, r, mm in zip(c.predicted["cpu preset"], c.speed, c.measured, strict=True)]
            err = statistics.median(scaled)
            line += f"{statistics.median(c.speed):>7.2f}{err:>+18.1%}"
            if c.pin:
                at_speed.append(abs(err))
        else:
            line += f"{'-':>7}{'-':>18}"
        print(line)
    print()
    for k in keys:
        for group, what in (("fit", "processes <= cores, pinned"), ("over", "processes > cores (PP x DP)")):
            e = errors[k][group]
            if e:
                o = outside[k][group]
                print(f"{k:<12} {what:<30} max |error| {max(e):6.1%}  mean {sum(e) / len(e):6.1%}  ({len(e)} cases);"
                      f" outside the measured min-max: {sum(x > 0 for x in o)} cases, by at most {max(o):.1%}")
    if at_speed:
        speeds = [r for c in all_cases for r in c.speed]
        print(f"cpu preset   at each run's own op speed (pinned)  max |error| {max(at_speed):6.1%}  mean "
              f"{sum(at_speed) / len(at_speed):6.1%}; the machine's op speed in the runs against the replay's: "
              f"{min(speeds):.2f}-{max(speeds):.2f} (median {statistics.median(speeds):.2f})")
    spreads = [(max(c.measured) - min(c.measured)) / statistics.median(c.measured) for c in all_cases]
    stolen = [s for c in all_cases for s in c.stolen]
    print("CPU time stolen by the hypervisor during the runs (/proc/stat steal): "
          f"median {statistics.median(stolen):.1%}, max {max(stolen):.1%} of a run")
    print(f"measured, run-to-run spread (max-min)/median: median {statistics.median(spreads):.1%}, "
          f"max {max(spreads):.1%}")
    p_spreads = [(max(v) - min(v)) / statistics.median(v) for c in all_cases for v in [c.predicted["profiled"]]]
    print(f"profiled prediction, round-to-round spread: median {statistics.median(p_spreads):.1%}, "
          f"max {max(p_spreads):.1%}")
    at = ", ".join(f"{x:.2f}" for x in loads)
    print(f"load (1-min) at round starts: {at}; total {time.perf_counter() - t0:.0f} s   (goal: |error| <= 10 %)")


if __name__ == "__main__":
    main()
