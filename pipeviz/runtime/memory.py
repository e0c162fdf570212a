"""A rank's memory, measured while it runs: what ``run.memory`` holds and the timeline's memory track draws.

On the CPU nothing counts allocations, so the meter counts what training keeps alive by construction:

- **activations**: every tensor autograd saves for a backward (``torch.autograd.graph.saved_tensors_hooks``),
  counted from when a forward saves it until autograd lets it go (the backward that used it, or the graph
  freed) — each distinct tensor once (views of one buffer with the same start and size are one), parameters
  and their views never (they are counted below);
- **static**: the rank's parameters, their gradients and the optimizer's state tensors (this process's shards
  under tensor parallelism or FSDP).

On a GPU the meter reads ``torch.cuda.memory_allocated`` instead (everything the caching allocator hands out:
activations, parameters, gradients, optimizer state, workspaces), and its activation part is the same saved-
tensor count. Samples are taken when each forward, backward, input-grad and weight-grad action starts and ends.

Example:
    >>> run = pv.launch(plan, "1F1B", 8, 2, inputs=(x,), target=y, loss_fn=pv.cross_entropy)
    >>> run.wait(); max(b for _, b in run.activation_memory[0])      # rank 0's peak of saved activations
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["MemoryMeter"]


class _Saved:
    """What autograd keeps for one saved tensor while the meter counts it; uncounted when autograd drops it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: MemoryMeter, key: tuple[int, int], tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class MemoryMeter:
    """Counts one rank's saved activations and static bytes; ``sample()`` gives (activation bytes, total)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device if device is not None and device.type == "cuda" else None
        self.live: dict[tuple[int, int], list[int]] = {}  # (data_ptr, nbytes) -> [references, nbytes]
        self.activations = 0
        self.static = 0
        self.params: set[int] = set()  # storages of parameters: saved weights are not activations

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        """The rank's parameters (their storages are never counted as activations)."""
        self.params = {_local(p).untyped_storage().data_ptr() for p in params}

    def count_static(self, params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None) -> None:
        """Parameters, gradients and optimizer state held now (call after a step: Adam's state exists then)."""
        total = 0
        for p in params:
            t = _local(p)
            total += t.numel() * t.element_size()
            if p.grad is not None:
                g = _local(p.grad)
                total += g.numel() * g.element_size()
        if optimizer is not None:
            for state in optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:  # Adam's step counter is a scalar
                        v = _local(v)
                        total += v.numel() * v.element_size()
        self.static = total

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Inside the block, count every tensor autograd saves for backward until it is released."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def sample(self) -> tuple[int, int]:
        """(saved activation bytes, total bytes) now: on a GPU the total is ``torch.cuda.memory_allocated``."""
        if self.cuda is not None:
            return self.activations, int(torch.cuda.memory_allocated(self.cuda))
        return self.activations, self.activations + self.static

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Saved:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return t
        local = _local(t)
        try:
            ptr = local.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a fake or a functional one)
            return t
        if ptr in self.params or ptr == 0:
            return t
        key = (local.data_ptr(), local.numel() * local.element_size())
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, key[1]]
            self.activations += key[1]
        else:
            entry[0] += 1
        # Keep the data, not the tensor: a saved output's grad_fn holds this object, and holding the tensor back
        # (its grad_fn) would close a reference cycle that only the garbage collector breaks. A backward with
        # retain_graph=True (zero-bubble's input- and weight-grad passes) never releases the saved tensors
        # itself, so with the cycle they, and the memory, lived on until a collection.
        return _Saved(self, key, t.detach())

    def _release(self, key: tuple[int, int]) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.activations -= entry[1]


def _unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
