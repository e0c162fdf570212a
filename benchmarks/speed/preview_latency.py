"""Click -> preview latency against torch's pipeline(), on a GPT-2 small config (random weights).

A click in the Explorer toggles one split and recomputes every stage's stats from the traced graph.
The alternative without pipeviz is to re-run torch's ``pipeline()`` on a deep copy of the model for
every change. Both are timed here, side by side, in one run.

Goal: ratio >= 100 and preview < 30 ms on a 2-core machine.

    python benchmarks/speed/preview_latency.py [--layers 12] [--width 768] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch.distributed.pipelining import pipeline

import pipeviz as pv
from pipeviz import zoo


def click_latencies(plan: pv.SplitPlan, candidates: list[str], clicks: int, stride: int) -> list[float]:
    """Seconds per click -> preview: toggle a split, then read every stage's stats (what the preview shows)."""
    out = []
    for i in range(clicks):
        t = time.perf_counter()
        plan = plan.toggle(candidates[(i * stride) % len(candidates)])
        _ = [(s.layers, s.params, s.flops, s.send_bytes, s.memory_bytes) for s in plan.stages]
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="pipeline() calls to time")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = zoo.gpt2(args.layers, args.width, max(1, args.width // 64), 50257, 1024)
    ids = torch.randint(0, 50257, (1, args.seq))
    t0 = time.perf_counter()
    graph = pv.trace(model, example_args=(ids,))
    trace_s = time.perf_counter() - t0
    cands = graph.split_candidates
    plan = graph.split([cands[len(cands) // 2]])

    # What a user clicks: the drawn layers (split_candidates also holds every nested module name).
    previews = click_latencies(plan, list(graph.layer_names[:-1]), 200, 5)

    spec = graph.split([cands[len(cands) // 3], cands[2 * len(cands) // 3]]).split_spec
    retrace = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        m = copy.deepcopy(model)
        m.config.use_cache = False
        pipeline(m, mb_args=(ids,), split_spec=spec)
        retrace.append(time.perf_counter() - t)

    p, r = statistics.median(previews), statistics.median(retrace)
    print(f"model: GPT-2 config, {args.layers} layers x {args.width}, {graph.total_params / 1e6:.1f} M params, "
          f"{len(graph.layers)} layers in the graph, seq {args.seq}")
    print(f"pv.trace once:                    {trace_s * 1000:9.1f} ms")
    print(f"pipeviz click -> preview (median): {p * 1000:9.3f} ms   (goal < 30 ms)")
    print(f"torch pipeline() on a deep copy:   {r * 1000:9.1f} ms   (median of {args.repeats})")
    print(f"ratio:                             {r / p:9.0f} x   (goal >= 100)")


if __name__ == "__main__":
    main()
