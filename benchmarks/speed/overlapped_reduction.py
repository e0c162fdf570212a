"""The replicas' gradient average on this machine: torch's DDP, one all-reduce after the step, pipeviz's
overlapped all-reduce and ZeRO-1's overlapped reduce-scatter (``LaunchConfig.dp_reduce``: ``"ddp"``,
``"after_flush"``, ``"overlap"``, ``"zero1"``), side by side. (gloo's reduce-scatter has no completion future: a
ZeRO-1 event ends when the step waits for it, an upper bound.)

Each case is a pipeline of 2 ranks x 2 replicas (4 processes) training an MLP of 8 layers of 1024 (8.4 M parameters,
34 MB of gradients: two DDP buckets per rank) on 64 samples, 4 microbatches; the modes of a case run round-robin for
``--rounds`` rounds (a slow minute on a shared machine spreads over all of them). Per mode: the median step, the
replicas' all-reduce seconds per step and process, and the share of them that ran while the same process computed
(hidden: what overlapping buys; DDP's waits inside the stage's last backward count as computing there, so its
share reads high while its backward is stretched), next to ``pv.simulate``'s step for the same config on the
``"cpu"`` preset (each op replayed here) on this machine's cores (``cores=``). On 2 cores the 4 processes and
gloo's reduction threads share the cores: what a reduction hides, it also slows.

    python benchmarks/speed/overlapped_reduction.py [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.schedule.timeline import COMPUTE, Timeline
from pipeviz.zoo import MyNetwork

CASES = (("1F1B", 2, None, ("ddp", "after_flush", "overlap", "zero1")),
         ("Interleaved1F1B", 4, 2, ("ddp", "after_flush", "overlap", "zero1")),
         ("ZBVZeroBubble", 4, 2, ("after_flush", "overlap", "zero1")))  # (DDP cannot follow a split backward)


def hidden_share(tl: Timeline) -> tuple[float, float]:
    """(all-reduce seconds per step and process, the share of them the process computed through)."""
    total = hidden = 0.0
    for e in (e for e in tl.events if e.kind == "DP" and e.step >= 1):
        total += e.duration
        for c in (c for c in tl.events if c.rank == e.rank and c.kind in COMPUTE):
            hidden += max(0.0, min(e.end, c.end) - max(e.start, c.start))
    steps = max(1, len(tl.steps) - 1) * tl.num_ranks
    return total / steps, hidden / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = MyNetwork(512, [1024] * 8)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    graph = pv.trace(model, example_args=(x,))
    cpu = pv.hardware("cpu")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    print(f"{'schedule':<17}{'dp_reduce':<13}{'step (median)':>15}{'simulated':>12}{'all-reduce/step':>17}"
          f"{'hidden':>8}")
    for schedule, stages, spr, modes in CASES:
        plan = pv.balance(graph, stages)
        cfg = pv.LaunchConfig(schedule=schedule, microbatches=4, steps=a.steps, loss_fn=F.cross_entropy, dp=2,
                              stages_per_rank=spr, optimizer=pv.sgd(lr=1e-3))
        steps: dict[str, list[float]] = {m: [] for m in modes}
        dp: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for r in range(a.rounds):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                run = pv.launch(plan, config=cfg.replace(dp_reduce=mode), inputs=(x,), target=y)
                if run.wait(600) != "done":
                    raise RuntimeError(f"{schedule} {mode}: {run.error}")
                tl = run.timeline()
                steps[mode].append(tl.step_time)
                dp[mode].append(hidden_share(tl))
        for mode in modes:
            sim = pv.simulate(plan, cfg.replace(dp_reduce=mode), hardware=cpu, cores=cores).step_time
            seconds = statistics.median(s for s, _ in dp[mode])
            share = statistics.median(h for _, h in dp[mode])
            print(f"{schedule:<17}{mode:<13}{statistics.median(steps[mode]) * 1e3:>12.1f} ms{sim * 1e3:>9.1f} ms"
                  f"{seconds * 1e3:>14.1f} ms{share:>8.0%}", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
