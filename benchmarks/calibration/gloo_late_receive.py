"""What a receive posted after its send costs under gloo: two processes pinned to the two cores, rank 0 sends a
64 KiB tensor (a hand-off of the synthesized-runs benchmark's MLP) and rank 1 times ``irecv().wait()``:

- ``early``: rank 1 posts its receive first, rank 0 sends 5 ms later (the wait includes those 5 ms);
- ``late, sender computing``: rank 0 sends and then computes (a 512 x 512 matmul loop, as a pipeline rank runs its
  next action); rank 1 posts its receive 10 ms after the send, as torch's ``_PipelineScheduleRuntime`` does for a
  ``RECV`` that its lowering put just before its consumer;
- ``late, sender asleep``: the same with rank 0 sleeping instead of computing.

gloo moves a message only once both sides have posted; a late receive is answered by the sender's gloo thread, which
waits for the sender's core. Measured 2026-12-06 at load 7 (docs/synthesis.md, "Runs as simulated"): early 5.33 ms
(the 5 ms of waiting + 0.33), late with the sender computing 2.97 ms (10th-90th percentile 0.35-17.9), late with
the sender asleep 0.40 ms; again at load 6: 5.25, 1.87 (0.19-100), 0.75 (0.18-7.8) ms. The late receive's extra
is not in the cost model (``pipeviz.planner.receives`` charges the link's time only).

    python benchmarks/calibration/gloo_late_receive.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("early", "late, sender computing", "late, sender asleep")


def _busy(seconds: float) -> None:
    a = torch.randn(512, 512)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ a


def _rank(rank: int, port: int, repeats: int, out: mp.SimpleQueue) -> None:  # type: ignore[type-arg]
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(8, 2048)
    waits: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeats):
        for mode in MODES:
            dist.barrier()
            then = _busy if "computing" in mode else time.sleep
            if rank == 0:
                if mode == "early":
                    time.sleep(0.005)  # the receiver posts first
                work = dist.isend(x, 1)
                then(0.03)
                work.wait()
            else:
                y = torch.empty_like(x)
                if mode != "early":
                    time.sleep(0.01)  # the send was posted 10 ms ago
                t = time.perf_counter()
                dist.irecv(y, 0).wait()
                waits[mode].append(time.perf_counter() - t)
                then(0.03)
    if rank == 1:
        out.put(waits)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(port, a.repeats, out), nprocs=2)
    waits = out.get()
    for mode in MODES:
        v = sorted(waits[mode])
        print(f"{mode:<24} irecv().wait(): median {statistics.median(v) * 1e3:.2f} ms "
              f"(10th-90th percentile {v[len(v) // 10] * 1e3:.2f}-{v[9 * len(v) // 10] * 1e3:.2f})")
    print(f"load (1-min): {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
