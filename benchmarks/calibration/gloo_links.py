"""Gloo between two processes on this machine: a send against an all-reduce of the same bytes, side by side.

What the ``"cpu"`` preset's links come from: ``pipeviz.cost.machine.LINKS["gloo"]`` (1 GB/s, 0.2 ms: what a pipeline's
hand-off moves) and ``Hardware.allreduce_efficiency`` (the all-reduce's bus bandwidth as a share of the send's:
0.55 here, the reduction and the extra copies run on the same cores). Each figure is the median of 10 calls after
2 warm-up calls, one thread per process.

    python benchmarks/calibration/gloo_links.py   (cpu_constants.py --only gloo measures and records the ratio)
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (2**16, 2**20, 2**22, 13 * 2**20, 32 * 2**20)


def _work(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 0:
            print(f"{'bytes':>10}{'send':>12}{'send GB/s':>11}{'all-reduce':>13}{'bus GB/s':>10}{'ratio':>8}")
        for nbytes in SIZES:
            t = torch.ones(nbytes // 4)
            sends, reduces = [], []
            for _ in range(12):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:  # a round trip, halved: one hand-off each way
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
            if rank == 0:
                s, r = statistics.median(sends[2:]), statistics.median(reduces[2:])
                # A ring all-reduce over 2 processes moves 2(N-1)/N = 1 x the bytes per process (the bus bandwidth).
                print(f"{nbytes:>10}{s * 1e3:>10.2f}ms{nbytes / s / 1e9:>11.2f}{r * 1e3:>11.2f}ms"
                      f"{nbytes / r / 1e9:>10.2f}{s / r:>8.2f}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_work, args=(port,), nprocs=2)


if __name__ == "__main__":
    main()
