"""The replicas' gradient average, overlapped with the rest of the step (``LaunchConfig.dp_reduce="overlap"``).

torch's DDP reduces a stage's gradients inside that stage's last backward and waits for them there, so every
stage's reduction lands on the pipeline's drain and, with several stages on a rank (interleaved, V-shaped), each
one holds up the backwards still to run on that rank. Large runs do it the way Megatron-Core's
``--overlap-grad-reduce`` does per model chunk: a stage's buckets are launched as soon as the stage's gradients are
final (its last backward, or its last weight-grad pass under a split backward) and run while the rank goes on with
its other stages; the step waits for them once, before the optimizer (``wait``).

``OverlappedReduction`` does that with asynchronous all-reduces (``dist.all_reduce(..., async_op=True)``) of
DDP-sized buckets (25 MiB) per stage; each bucket is a ``DP`` event on the timeline from its launch to its
completion. It is exact: the average of the replicas' sums, as DDP's (each replica's gradients summed over its
microbatches, then averaged over the replicas), only placed elsewhere in time.

Example:
    >>> reduction = OverlappedReduction(dp_group, replicas=2, on_done=record)
    >>> reduction.add_stage(0, stage_params)
    >>> reduction.launch(0)      # stage 0's gradients are final: its buckets start, the rank goes on
    >>> reduction.wait()         # before the optimizer step: every bucket averaged into the gradients
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["BUCKET_BYTES", "OverlappedReduction"]

BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


@dataclass
class _Pending:
    work: dist.Work
    flat: torch.Tensor
    grads: list[torch.Tensor]
    divisor: int


@dataclass
class _Part:
    """Parameters of a stage reduced over ``group`` (None: the reduction's), their sum divided by ``divisor``."""

    params: list[torch.nn.Parameter]
    group: dist.ProcessGroup | None
    divisor: int


class OverlappedReduction:
    """One rank's asynchronous gradient averages across its replicas, stage by stage (see the module docstring).

    ``on_done(stage, start, end)`` is called (on a communication thread) when a bucket's all-reduce completes, with
    ``time.time()`` stamps."""

    def __init__(self, group: dist.ProcessGroup | None, replicas: int,
                 on_done: Callable[[int, float, float], None] | None = None, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group, self.replicas, self.on_done, self.bucket_bytes = group, replicas, on_done, bucket_bytes
        self.params: dict[int, list[_Part]] = {}
        self.pending: list[_Pending] = []
        self.launched: set[int] = set()

    def add_stage(self, stage: int, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None = None,
                  divisor: int | None = None) -> None:
        """Parameters of ``stage`` this rank holds (each reduced with the stage's buckets): averaged over the
        replicas, or (expert parallelism's experts) summed over ``group`` and divided by ``divisor``. A stage may be
        given several such parts."""
        part = _Part([p for p in params if p.requires_grad], group if group is not None else self.group,
                     divisor if divisor is not None else self.replicas)
        self.params.setdefault(stage, []).append(part)

    def launch(self, stage: int) -> None:
        """Start averaging ``stage``'s gradients (they are final: its last backward of the step has run)."""
        if stage in self.launched:
            return
        self.launched.add(stage)
        for part in self.params.get(stage, ()):
            grads = [p.grad for p in part.params if p.grad is not None]
            for bucket in _buckets(grads, self.bucket_bytes):
                flat = torch._utils._flatten_dense_tensors(bucket)
                start = time.time()
                work = dist.all_reduce(flat, group=part.group, async_op=True)
                assert work is not None
                if self.on_done is not None:
                    work.get_future().then(lambda _f, s=stage, t=start, done=self.on_done: done(s, t, time.time()))
                self.pending.append(_Pending(work, flat, bucket, part.divisor))

    def wait(self) -> None:
        """Wait for every launched bucket and put the replicas' average into the gradients."""
        with torch.no_grad():
            for p in self.pending:
                p.work.wait()
                p.flat /= p.divisor
                for g, reduced in zip(p.grads, torch._utils._unflatten_dense_tensors(p.flat, p.grads), strict=True):
                    g.copy_(reduced)
        self.pending.clear()
        self.launched.clear()


def _buckets(grads: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients in buckets of at most ``cap`` bytes (one larger gradient alone), in reverse order (the
    last layers' first, as their gradients are ready first), one dtype per bucket."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in reversed(grads):
        n = g.numel() * g.element_size()
        if not out or size + n > cap or out[-1][0].dtype != g.dtype:
            out.append([])
            size = 0
        out[-1].append(g)
        size += n
    return out
