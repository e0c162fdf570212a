"""How long ``pv.plan_cluster`` takes for Llama-3 models (meta device, no weights) on 8 and 1,024 H100s.

Goals: 8 GPUs in about a second, 1,024 GPUs under a minute on a 2-core machine (issue 19); Llama-3.1-405B on 1,024
H100s under 60 s and Llama-3-70B under 30 s, with the rows of the exhaustive search (issue 49). The trace is timed
apart (once per model and sequence length: two blocks traced and the last repeated, ``pipeviz.zoo.planning_graph``;
``--full-trace`` traces every block). Each plan runs in a fresh process (cold caches: torch's multi-stage schedule
orders are built again), and the load average is printed beside each time: on a shared machine a time means little
without it.

``--baseline DIR`` plans the same in another checkout (say the commit before a change: ``git worktree add DIR
REV``), one process after the other so that both see the same load, and says whether its rows are the same.

    python benchmarks/speed/planner_speed.py [--models llama-3-8b llama-3-70b llama-3.1-405b] [--cases 8:64 1024:1536]
        [--hardware h100] [--baseline /tmp/pipeviz-before] [--full-trace]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def one(model: str, gpus: int, batch: int, hardware: str, full_trace: bool) -> None:
    """Trace and plan once in this process; print the measurement as one JSON line."""
    warnings.filterwarnings("ignore")
    import pipeviz as pv
    from pipeviz import zoo

    t = time.perf_counter()
    graph, _ = zoo.planning_graph(model, None, blocks=None if full_trace else 2)
    traced = time.perf_counter() - t
    t = time.perf_counter()
    cp = pv.plan_cluster(graph, gpus, hardware, global_batch=batch)
    planned = time.perf_counter() - t
    rows = [[r.label(), r.dp_reduce, r.step_time, r.peak_memory] for r in cp.rows]
    print(json.dumps({"trace": traced, "plan": planned, "considered": cp.considered, "simulated": cp.simulated,
                      "pruned": cp.pruned, "too_big": cp.too_big, "too_long": cp.too_long, "rows": rows,
                      "best": cp.best.label() if cp.rows else "-", "mfu": cp.best.mfu if cp.rows else 0.0}))


def measure(root: Path, model: str, gpus: int, batch: int, hardware: str, full_trace: bool) -> dict[str, object]:
    """One fresh process planning with the pipeviz at ``root``; its figures and the load before it started."""
    load = os.getloadavg()[0]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", model, str(gpus), str(batch), "--hardware", hardware,
           *(["--full-trace"] if full_trace else [])]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, check=True,
                         timeout=1800)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["load"] = load
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "llama-3-70b", "llama-3.1-405b"])
    ap.add_argument("--cases", nargs="+", default=["8:64", "1024:1536"], help="gpus:global batch")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout, planned in turn with this one")
    ap.add_argument("--full-trace", action="store_true")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "GPUS", "BATCH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one(a.one[0], int(a.one[1]), int(a.one[2]), a.hardware, a.full_trace)
        return
    print(f"{os.cpu_count()} cores; load average at the start {os.getloadavg()[0]:.2f}", flush=True)
    for model in a.models:
        for case in a.cases:
            gpus, batch = map(int, case.split(":"))
            runs = {"this": measure(HERE, model, gpus, batch, a.hardware, a.full_trace)}
            if a.baseline is not None:
                runs["baseline"] = measure(a.baseline, model, gpus, batch, a.hardware, a.full_trace)
            for name, r in runs.items():
                print(f"{model:>15} {gpus:>5} GPUs, batch {batch:>5} [{name:>8}]: plan {r['plan']:6.1f} s (load "
                      f"{r['load']:.1f}; trace {r['trace']:.1f} s); {r['considered']} considered, {r['simulated']} "
                      f"simulated, {r['pruned']} pruned, {r['too_big']} too big, {r['too_long']} too long; best "
                      f"{r['best']}, MFU {r['mfu']:.1%}", flush=True)
            if "baseline" in runs:
                same = runs["this"]["rows"] == runs["baseline"]["rows"]
                print(f"{'':>15} rows {'the same as' if same else 'DIFFERENT from'} the baseline's", flush=True)


if __name__ == "__main__":
    main()
