"""How long ``pv.plan_cluster`` takes for Llama-3-8B (meta device, no weights) on 8 and 1,024 GPUs.

Goal (issue 19): 8 GPUs in about a second, 1,024 GPUs under a minute on a 2-core machine. The trace is timed
apart (it is done once per model and sequence length: two blocks traced and the last repeated,
``pipeviz.zoo.planning_graph``; ``--full-trace`` traces every block); each plan is timed cold (a fresh process's
caches) and warm (torch's multi-stage schedule orders already built).

    python benchmarks/speed/planner_speed.py [--model llama-3-8b] [--hardware h100] [--seq-len 8192] [--full-trace]
"""

from __future__ import annotations

import argparse
import time
import warnings

import pipeviz as pv
from pipeviz import zoo

CASES = ((8, 64), (1024, 1536))  # (gpus, global batch in sequences)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--full-trace", action="store_true")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    t = time.perf_counter()
    graph, seq = zoo.planning_graph(a.model, a.seq_len, blocks=None if a.full_trace else 2)
    how = "every block traced" if a.full_trace else "2 blocks traced, the last repeated"
    print(f"{a.model}: {graph.total_params / 1e9:.2f} B parameters, {len(graph.layers)} layers, "
          f"{len(graph.capture.ops)} ops; on meta at {seq} tokens ({how}): {time.perf_counter() - t:.1f} s")
    for gpus, batch in CASES:
        times = []
        for _ in range(2):
            t = time.perf_counter()
            cp = pv.plan_cluster(graph, gpus, a.hardware, global_batch=batch)
            times.append(time.perf_counter() - t)
        best = cp.best
        print(f"{gpus:>5} GPUs, global batch {batch}: plan {times[0]:.2f} s cold, {times[1]:.2f} s warm "
              f"({cp.considered} layouts considered, {cp.simulated} simulated, {cp.pruned} pruned by a bound); "
              f"best {best.label()}: {best.step_time:.3f} s/step, MFU {best.mfu:.1%}")


if __name__ == "__main__":
    main()
