"""Two cores computing at once on this machine: an op's time alone against its time while another core runs the same.

What the ``"cpu"`` preset's ``Hardware.contention`` comes from (1.10 here): pipeline ranks pinned to their own
cores still share the processor's last-level cache and memory bandwidth (on a virtual machine, possibly a
physical core's other half), so an op runs longer while another rank computes. The op is a 64 x 1024 by
1024 x 2048 matmul whose 8 MiB weight is flushed from the caches before each call, as the replay
(``pipeviz.cost.replay``) times a layer whose weights a run streams from memory once a microbatch. One thread runs
it on the first core; a second thread, pinned to the second core, runs the same op (with its own flush) or
sleeps. Each alternation takes the median of 15 calls alone and 15 contended; each repeat prints the median
ratio of 7 alternations, so the machine's drift (10-20 % within a second here) falls on both sides alike.

    python benchmarks/calibration/cpu_contention.py [--repeats 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from pipeviz.adapter.malloc import keep_heap
from pipeviz.cost.calibration import constant


def _op() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(64, 1024), torch.randn(1024, 2048), torch.empty(2**23)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("one core: nothing to contend with (contention 1.0)")
        return
    keep_heap()
    torch.set_num_threads(1)
    go, stop = threading.Event(), threading.Event()

    def other() -> None:
        os.sched_setaffinity(0, {cores[1]})
        x, w, flush = _op()
        while not stop.is_set():
            if go.wait(0.005):
                flush.zero_()
                torch.mm(x, w)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    os.sched_setaffinity(0, {cores[0]})
    x, w, flush = _op()

    def timed(calls: int = 15) -> float:
        times = []
        for _ in range(calls):
            flush.zero_()
            start = time.perf_counter()
            torch.mm(x, w)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    medians = []
    try:
        for _ in range(a.repeats):
            ratios, alone_ms = [], []
            for _ in range(7):
                go.clear()
                time.sleep(0.01)
                alone = timed()
                go.set()
                time.sleep(0.01)
                ratios.append(timed() / alone)
                alone_ms.append(alone * 1e3)
            medians.append(statistics.median(ratios))
            print(f"alone {statistics.median(alone_ms):.2f} ms; contended / alone: median {medians[-1]:.3f} "
                  f"(alternations {min(ratios):.2f}-{max(ratios):.2f})")
    finally:
        stop.set()
        go.set()
        thread.join(1)
    print(f"contention over {a.repeats} repeats: {min(medians):.3f}-{max(medians):.3f} "
          f"(median {statistics.median(medians):.3f}); the cpu preset uses {constant('cpu_contention')} "
          "(pipeviz/cost/calibration.json; cpu_constants.py --only contention --write updates it)")


if __name__ == "__main__":
    main()
