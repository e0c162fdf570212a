"""Soak, load and faults: hundreds of launches in one process leave nothing behind, a run on a machine whose
cores are all busy still ends correctly, and how long each fault takes to surface (docs/faults.md, the fault matrix).

1. Soak: ``--launches`` runs (default 200), two at a time, cycling through all seven schedules; every fifth
   fails on purpose (its loss raises in the run), every seventh is stopped mid-step. Prints the parent's
   threads, open file descriptors, child processes, pipeviz temp files and RSS at the start, every 50 runs and
   at the end, and the largest growth.
2. Load: a run while ``stress`` processes (one per core) spin, checked against the unsplit model.
3. Faults: for each fault, what the run reports and how long it took.

    python benchmarks/speed/soak.py [--launches 200]
"""

from __future__ import annotations

import _thread
import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from glob import glob

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.schedule.traits import ALL, SINGLE
from pipeviz.zoo import MyNetwork

X, Y = torch.randn(8, 8), torch.randint(0, 10, (8,))


def boom(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if out.requires_grad:
        raise ValueError("failing on purpose")
    return F.cross_entropy(out, target)


def nan_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target) * (float("nan") if out.requires_grad else 1.0)


def sleepy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if out.requires_grad:
        time.sleep(3600)
    return F.cross_entropy(out, target)


def children() -> int:
    """Live (not zombie) child processes of this process."""
    import psutil

    n = 0
    for p in psutil.Process().children():
        try:
            n += p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # it ended since the listing
            pass
    return n


def resources() -> dict[str, float]:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "children": children(), "temp files": len(glob(os.path.join(tempfile.gettempdir(), "pipeviz-*"))),
            "RSS MiB": rss / 2**20}


def soak(launches: int) -> None:
    plans = {3: pv.trace(MyNetwork(8, [8, 8, 8]), (X,)).split(["layer0", "layer1"]),
             4: pv.trace(MyNetwork(8, [8, 8, 8, 8]), (X,)).split(["layer0", "layer1", "layer2"])}

    def start(i: int) -> tuple[pv.Run, str]:
        schedule = ALL[i % len(ALL)]
        plan = plans[3 if schedule in SINGLE else 4]
        kind = "fail" if i % 5 == 4 else "stop" if i % 7 == 6 else "ok"
        steps = 10**6 if kind == "stop" else 2
        run = pv.launch(plan, schedule, 4, steps=steps, inputs=(X,), target=Y, loss_fn=boom if kind == "fail" else
                        F.cross_entropy)
        return run, kind

    print(f"{'runs':>6}" + "".join(f"{k:>12}" for k in resources()))
    rows = [(0, resources())]
    print(f"{0:>6}" + "".join(f"{v:>12.1f}" for v in rows[0][1].values()))
    outcomes: dict[str, int] = {}
    i = 0
    t0 = time.time()
    while i < launches:
        pair = [start(i + k) for k in range(min(2, launches - i))]
        for run, kind in pair:
            if kind == "stop":
                while run.step < 1 and not run.done:
                    time.sleep(0.02)
                run.stop()
            status = run.wait(120)
            expected = {"ok": "done", "fail": "failed", "stop": "stopped"}[kind]
            key = f"{kind} -> {status}" + ("" if status == expected else " (UNEXPECTED)")
            outcomes[key] = outcomes.get(key, 0) + 1
        i += len(pair)
        if i % 50 == 0 or i == launches:
            rows.append((i, resources()))
            print(f"{i:>6}" + "".join(f"{v:>12.1f}" for v in rows[-1][1].values()), flush=True)
    print(f"{launches} launches in {time.time() - t0:.0f} s; outcomes: {outcomes}")
    # Growth from after the first 50 (the fork server and torch's lazily created threads are there by then).
    base = rows[1][1] if len(rows) > 2 else rows[0][1]
    print("growth after the first 50 runs: " + ", ".join(f"{k} {rows[-1][1][k] - base[k]:+.1f}" for k in base))


def _spin(stop: mp.Event) -> None:  # type: ignore[valid-type]
    a = torch.randn(256, 256)
    torch.set_num_threads(1)
    while not stop.is_set():  # type: ignore[attr-defined]
        a @ a


def load() -> None:
    cores = os.cpu_count() or 1
    stop = mp.get_context("spawn").Event()
    spinners = [mp.get_context("spawn").Process(target=_spin, args=(stop,), daemon=True) for _ in range(cores)]
    for p in spinners:
        p.start()
    time.sleep(1.0)
    try:
        torch.manual_seed(0)
        model = MyNetwork(64, [64, 64, 64])
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        plan = pv.trace(model, (x,)).split(["layer0", "layer1"])
        t = time.time()
        run = pv.launch(plan, "1F1B", 4, steps=20, inputs=(x,), target=y, loss_fn=F.cross_entropy)
        status = run.wait(600)
        check = pv.check_numerics(run) if status == "done" else None
        print(f"with {cores} busy processes beside it: {status} in {time.time() - t:.1f} s; {check}")
    finally:
        stop.set()
        for p in spinners:
            p.join(5)


def faults() -> None:
    plan = pv.trace(MyNetwork(8, [8, 8, 8]), (X,)).split(["layer0", "layer1"])
    args = {"inputs": (X,), "target": Y, "loss_fn": F.cross_entropy}

    def report(name: str, seconds: float, text: str) -> None:
        print(f"  {name:<34}{seconds:>8.2f} s   {text.splitlines()[0][:110]}")

    print("fault                               time     what the user sees")
    t = time.time()
    try:
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(torch.randn(8, 100),), target=Y, loss_fn=F.cross_entropy)
    except pv.LaunchError as exc:
        report("bad input (shape)", time.time() - t, str(exc))

    def running(**kw: object) -> pv.Run:
        run = pv.launch(plan, "1F1B", 4, steps=10**6, **(args | kw))  # type: ignore[arg-type]
        while run.step < 1 and not run.done:
            time.sleep(0.02)
        return run

    run = running()
    os.kill(run.pids[1], signal.SIGKILL)
    t = time.time()
    run.wait(60)
    report("rank killed (SIGKILL)", time.time() - t, run.error or run.status)
    run = pv.launch(plan, "1F1B", 4, steps=2, **(args | {"loss_fn": sleepy, "timeout": 5}))
    t = time.time()
    run.wait(120)
    report("hung rank (timeout=5)", time.time() - t, run.error or run.status)
    run = running()
    t = time.time()
    run.stop()
    report("stop()", time.time() - t, run.status)
    run = running()
    threading.Timer(0.1, _thread.interrupt_main).start()
    t = time.time() + 0.1
    try:
        run.wait(60)
    except KeyboardInterrupt:
        report("Ctrl-C in wait()", time.time() - t, f"KeyboardInterrupt; run {run.status}")
    run = pv.launch(plan, "1F1B", 4, steps=5, **(args | {"loss_fn": nan_loss}))
    t = time.time()
    run.wait(60)
    report("NaN loss (from launch)", time.time() - t, run.error or run.status)
    script = textwrap.dedent("""
        import time, torch, torch.nn.functional as F, pipeviz as pv
        from pipeviz.zoo import MyNetwork
        plan = pv.trace(MyNetwork(8, [8, 8]), example_args=(torch.randn(8, 8),)).split(["layer0"])
        run = pv.launch(plan, "GPipe", 2, 10**6, inputs=(torch.randn(8, 8),), target=torch.randint(0, 10, (8,)),
                        loss_fn=F.cross_entropy)
        while run.step < 1:
            time.sleep(0.05)
        print(*run.pids, flush=True)
        time.sleep(3600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
    proc.kill()
    proc.wait()
    t = time.time()
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z"
              for p in pids) and time.time() - t < 30:
        time.sleep(0.05)
    report("parent killed (kernel restart)", time.time() - t, "every rank exited")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=200)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    print("== soak")
    soak(a.launches)
    print("\n== load")
    load()
    print("\n== faults")
    faults()


if __name__ == "__main__":
    main()
