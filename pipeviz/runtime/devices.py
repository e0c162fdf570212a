"""Where a launch's ranks run: each rank's device and the backend between them, and each rank's own cores.

Example:
    >>> resolve_devices("auto", 2)      # on a machine without GPUs
    (['cpu', 'cpu'], 'gloo', [None, None])
    >>> threads, cpus = cpu_sets(2, pin=True)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from pipeviz.errors import LaunchError

__all__ = ["cpu_sets", "resolve_devices"]


def resolve_devices(devices: str | Sequence[str], num_ranks: int) -> tuple[list[str], str, list[str | None]]:
    """Map ranks to devices; returns (stage devices, backend, compute devices).

    ``"auto"``: CPU and gloo without CUDA; one GPU per rank and NCCL with enough GPUs; with fewer GPUs
    than ranks, stages share GPUs and talk over host memory (gloo on CPU tensors; each stage moves its
    inputs to its GPU and its outputs back), because NCCL refuses two ranks on one GPU and gloo cannot
    send CUDA tensors.
    """
    # device_count() does not create a CUDA context in this process (the kernel need not initialise CUDA).
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(devices, str):
        if devices == "auto":
            devices = ["cpu"] * num_ranks if gpus == 0 else [f"cuda:{r % gpus}" for r in range(num_ranks)]
        elif devices in ("cpu", "cuda"):
            devices = [devices if devices == "cpu" else f"cuda:{r % max(gpus, 1)}" for r in range(num_ranks)]
        else:
            devices = [devices] * num_ranks
    devices = [str(d) for d in devices]
    if len(devices) != num_ranks:
        raise LaunchError(
            f"devices lists {len(devices)} entries but the run has {num_ranks} ranks. "
            f"Fix: pass {num_ranks} devices, or devices='auto'."
        )
    for d in devices:
        try:
            dev = torch.device(d)
        except RuntimeError as exc:
            raise LaunchError(f"Unknown device {d!r}; valid: 'cpu', 'cuda', 'cuda:N', or 'auto'.") from exc
        if dev.type not in ("cpu", "cuda"):
            raise LaunchError(f"Device {d!r} is not supported; valid: 'cpu', 'cuda:N', 'auto'.")
        if dev.type == "cuda" and (dev.index or 0) >= gpus:
            raise LaunchError(f"Device {d!r} is not available: this machine has {gpus} CUDA device(s). "
                              "Fix: devices='auto' or 'cpu'.")
    cuda = [d for d in devices if d.startswith("cuda")]
    if cuda and len(cuda) == len(devices) and len(set(devices)) == len(devices):
        return devices, "nccl", [None] * num_ranks
    # CPU, mixed, or a shared GPU: communicate through host memory.
    return ["cpu"] * num_ranks, "gloo", [d if d.startswith("cuda") else None for d in devices]


def cpu_sets(ranks: int, pin: bool) -> tuple[int, list[tuple[int, ...]] | None]:
    """Threads per rank, and with ``pin`` each rank's own cores out of those this process may use.

    Why pin: with every core computing, a gloo thread that a rank needs (to post a send or a receive) can
    be queued behind another rank's compute thread until the next scheduler tick; on its own cores it runs
    as soon as its rank waits. No pinning when ranks outnumber the cores.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    count = len(allowed) or os.cpu_count() or 1
    threads = max(1, count // ranks)
    if not pin or not allowed or ranks > len(allowed):
        return threads, None
    return threads, [tuple(allowed[r * threads:(r + 1) * threads]) for r in range(ranks)]
