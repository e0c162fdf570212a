"""Measure the constants the ``"cpu"`` preset cannot probe quickly, and (``--write``) record them, with their
measurement, in ``pipeviz/cost/calibration.json`` (what ``pipeviz.cost.calibration`` reads):

- ``action_overhead``: the gap between one schedule action's end and the next on a CPU rank whose next input is
  already there (1F1B runs of a small MLP on 2 ranks, 8 microbatches);
- ``gloo``: gloo's all-reduce bus bandwidth as a share of a send's, two processes (4-32 MiB, medians of 10);
- ``contention``: an op's time while the other core runs the same, over its time alone (``cpu_contention.py``'s
  method: a weight-streaming matmul, seven alternations per repeat).

    python benchmarks/calibration/cpu_constants.py [--only action_overhead,gloo,contention] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeviz.cost.calibration import PATH, entries

NAMES = {"action_overhead": "cpu_action_overhead", "gloo": "gloo_allreduce_efficiency",
         "contention": "cpu_contention"}


def action_overhead(runs: int = 3) -> tuple[float, str]:
    """The median gap between consecutive actions of a rank whose next action's input had already arrived (its
    dependency, the previous stage's forward or the next stage's backward of the same microbatch, ended before the
    rank's previous action did), over 1F1B runs of a small MLP on 2 ranks, 8 microbatches, steps 1-2."""
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.zoo import MyNetwork

    torch.manual_seed(0)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    plan = pv.trace(MyNetwork(256, [256, 256]), example_args=(x,)).split(["layer0"])
    gaps: list[float] = []
    for _ in range(runs):
        run = pv.launch(plan, "1F1B", 8, steps=3, inputs=(x,), target=y, loss_fn=F.cross_entropy)
        assert run.wait(120) == "done", run.error
        for step in (1, 2):  # past the first step's warm-up
            done = {(e.stage, e.kind, e.mb): e.end for e in run.events if e.step == step and e.kind in "FB"}
            for rank in (0, 1):
                mine = sorted((e for e in run.events if e.rank == rank and e.step == step and e.kind in "FB"),
                              key=lambda e: e.start)
                for prev, nxt in itertools.pairwise(mine):
                    dep = (nxt.stage - 1, "F", nxt.mb) if nxt.kind == "F" else (nxt.stage + 1, "B", nxt.mb)
                    if done.get(dep, -1.0) <= prev.end:  # its input was there: the gap is the runtime's own
                        gaps.append(nxt.start - prev.end)
    value = statistics.median(gaps)
    return value, (f"median gap {value * 1e3:.2f} ms between a rank's actions whose input was there, 1F1B, 2 ranks "
                   f"({len(gaps)} gaps, {min(gaps) * 1e3:.2f}-{max(gaps) * 1e3:.2f} ms)")


def _gloo_work(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ratios = []
    try:
        for nbytes in (4 * 2**20, 13 * 2**20, 32 * 2**20):
            t = torch.ones(nbytes // 4)
            sends, reduces = [], []
            for _ in range(12):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
                sends.append((time.perf_counter() - start) / 2)
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                reduces.append(time.perf_counter() - start)
            ratios.append(statistics.median(sends[2:]) / statistics.median(reduces[2:]))
        if rank == 0:
            Path(out).write_text(json.dumps(ratios))
    finally:
        dist.destroy_process_group()


def gloo() -> tuple[float, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratios.json")
        mp.spawn(_gloo_work, args=(port, out), nprocs=2)
        ratios = json.loads(Path(out).read_text())
    value = statistics.median(ratios)
    return value, f"all-reduce / send bandwidth {', '.join(f'{r:.2f}' for r in ratios)} at 4, 13, 32 MiB"


def contention() -> tuple[float, str]:
    import subprocess

    here = Path(__file__).with_name("cpu_contention.py")
    res = subprocess.run([sys.executable, str(here), "--repeats", "4"], capture_output=True, text=True, check=True)
    medians = [float(line.split("median ")[1].split()[0]) for line in res.stdout.splitlines()
               if line.startswith("alone ")]
    if not medians:
        raise SystemExit("one core: no contention to measure here")
    value = statistics.median(medians)
    return value, f"medians of four repeats of seven alternations {min(medians):.3f}-{max(medians):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(NAMES), help=f"comma-separated among {', '.join(NAMES)}")
    ap.add_argument("--write", action="store_true", help="record the values in pipeviz/cost/calibration.json")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    table = dict(entries())
    machine = f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"
    for name in a.only.split(","):
        value, how = {"action_overhead": action_overhead, "gloo": gloo, "contention": contention}[name]()
        key = NAMES[name]
        old = table[key]["value"]
        print(f"{key}: {value:.4g} (recorded {old:.4g}): {how}")
        table[key] = {**table[key], "value": round(value, 4 if value > 0.01 else 6),
                      "measured": f"{datetime.date.today()}, {machine}: {how}"}
    if a.write:
        PATH.write_text(json.dumps(table, indent=2) + "\n")
        print(f"written: {PATH}")


if __name__ == "__main__":
    main()
