"""How long ``pv.synthesize_schedule`` takes, and what it finds, from 4 ranks x 8 microbatches to 16 x 32.

Goal (issue 46): 8 stages on 4 ranks x 8 microbatches in well under 10 s on this 2-core machine; the scaling to 16
ranks x 32 microbatches stated. A transformer traced on the CPU (``TinyTransformer``, 32 blocks) is balanced into
2 stages per rank; each case is synthesized without a limit and with one (the middle of torch's own schedules' peak
memory on those ranks, and 7 % under the least of them, where none of torch's fits), each timed once in this
process (the first case also pays the imports' warm-up; ``--repeat`` times each again). Printed beside the time: the
candidates the search played, the synthesized step against the fastest torch schedule that fits (on the same plan,
microbatches and ranks), and the step with no limit.

    python benchmarks/speed/synthesize.py [--cases 4x8 8x16 16x32] [--repeat 1]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import pipeviz as pv
from pipeviz.planner.synthesize import MemoryLimitError
from pipeviz.zoo import TinyTransformer


def _case(graph: pv.ModelGraph, ranks: int, microbatches: int, repeat: int) -> None:
    t = time.perf_counter()
    plan = pv.balance(graph, 2 * ranks)
    balanced = time.perf_counter() - t
    cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=microbatches, loss_fn=pv.cross_entropy)
    free = pv.synthesize_schedule(plan, cfg)
    peaks = sorted(max(tl.meta["memory_bytes"]) for tl in free.baselines.values())
    print(f"{2 * ranks} stages on {ranks} ranks x {microbatches} microbatches ({2 * ranks * microbatches * 3} actions; "
          f"balance {balanced:.1f} s); torch's peaks {peaks[0] / 2**20:.2f}-{peaks[-1] / 2**20:.2f} MiB per rank")
    for label, limit in (("no limit", None), ("mid torch", (peaks[0] + peaks[-1]) // 2),
                         ("under all", int(peaks[0] * 0.93))):
        times = []
        try:
            for _ in range(repeat):
                t = time.perf_counter()
                syn = pv.synthesize_schedule(plan, cfg, memory_limit=limit)
                times.append(time.perf_counter() - t)
        except MemoryLimitError as exc:
            print(f"  {label:<10} no order fits: smallest feasible {exc.smallest / 2**20:.2f} MiB")
            continue
        fits = syn.fits
        best = min(fits, key=lambda k: fits[k].step_time) if fits else None
        versus = (f"fastest torch that fits {best} {fits[best].step_time * 1e3:.2f} ms "
                  f"({syn.step_time / fits[best].step_time - 1:+.1%})" if best else "no torch schedule fits")
        print(f"  {label:<10} {min(times):6.2f} s, {syn.evaluated:4d} candidates played: synthesized "
              f"{syn.step_time * 1e3:.2f} ms ({syn.placement}, peak {max(syn.memory_bytes) / 2**20:.2f} MiB); "
              f"{versus}; no limit {free.step_time * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["4x8", "8x16", "16x32"], help="RANKSxMICROBATCHES")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    t = time.perf_counter()
    model = TinyTransformer(vocab=512, dim=64, heads=4, depth=32, seq=32)
    graph = pv.trace(model, example_args=(torch.randint(0, 512, (32, 32)),))
    print(f"TinyTransformer, 32 blocks, traced in {time.perf_counter() - t:.1f} s; FLOP-rate costs")
    for case in a.cases:
        ranks, microbatches = map(int, case.split("x"))
        _case(graph, ranks, microbatches, a.repeat)


if __name__ == "__main__":
    main()
