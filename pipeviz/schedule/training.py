"""Training recipes every part of pipeviz shares: the default loss, target and optimizer.

They are plain module-level functions and picklable factories, so a launched run sends them to its rank
processes by reference, and the stage processes import only torch to run them.

Example:
    >>> run = pv.launch(plan, "1F1B", 4, 3, inputs=(ids,), target=next_ids, loss_fn=pv.cross_entropy,
    ...                 optimizer=pv.sgd(lr=0.1, momentum=0.9))
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from pipeviz.capture.view import GraphView

__all__ = ["cross_entropy", "default_target", "model_output", "random_classes", "sgd", "warmup_cosine"]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy treating the output's last dim as classes: ``(batch, classes)`` for a classifier,
    ``(batch, seq, vocab)`` for a language model (target ``(batch,)`` or ``(batch, seq)``)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


def sgd(lr: float = 0.1, momentum: float = 0.0) -> functools.partial[torch.optim.SGD]:
    """An optimizer factory for ``pv.launch(optimizer=...)``: ``params -> torch.optim.SGD(params, ...)``
    (built again on every rank for the parameters it holds)."""
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum)


class _WarmupCosine:
    """The factor of step ``n``'s learning rate: linear warm-up, then a cosine decay to ``min_ratio``."""

    def __init__(self, warmup: int, steps: int, min_ratio: float) -> None:
        self.warmup, self.steps, self.min_ratio = warmup, steps, min_ratio

    def __call__(self, n: int) -> float:
        import math

        if n < self.warmup:
            return (n + 1) / self.warmup
        done = min(1.0, (n - self.warmup) / max(1, self.steps - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * done))


def warmup_cosine(warmup: int, steps: int, min_ratio: float = 0.0,
                  ) -> functools.partial[torch.optim.lr_scheduler.LambdaLR]:
    """A learning-rate scheduler factory for ``pv.launch(lr_scheduler=...)``: ``warmup`` steps rising linearly to the
    optimizer's rate, then a cosine decay to ``min_ratio`` of it at ``steps`` (torch's ``LambdaLR``; built on every
    rank around its optimizer).

    Example:
        >>> run = pv.launch(plan, "1F1B", 4, 100, ..., optimizer=pv.sgd(lr=0.1), lr_scheduler=pv.warmup_cosine(10, 100))
    """
    if not (isinstance(warmup, int) and isinstance(steps, int) and 0 <= warmup <= steps and steps > 0):
        raise ValueError(f"warmup_cosine needs 0 <= warmup <= steps and steps > 0, got warmup={warmup!r}, "
                         f"steps={steps!r}. Fix: warmup_cosine(warmup=10, steps=100).")
    return functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=_WarmupCosine(warmup, steps, min_ratio))


def random_classes(output: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Integer targets in ``[0, output.shape[-1])`` shaped like ``output`` without its last dim (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(1, output.shape[-1]), tuple(output.shape[:-1]), generator=gen)


def model_output(out: object) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The output a loss sees: an HF ModelOutput's ``logits``; else the only tensor, or a tuple of tensors."""
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return leaves[0] if len(leaves) == 1 else tuple(leaves)


def default_target(graph: GraphView, seed: int = 0) -> torch.Tensor:
    """``random_classes`` for the model's output on the example batch: sized by the output the trace recorded
    (a meta-device model too: no forward runs), else by one forward of a fresh copy (the manual route).

    Raises:
        ValueError: the model has several outputs, so no single target fits; pass ``target=`` and ``loss_fn=``.
    """
    leaves = graph.capture.loss_outputs  # the logits of an HF output, else every output leaf
    if len(leaves) == 1:
        return random_classes(torch.empty(leaves[0][0], device="meta"), seed)
    if leaves:
        raise ValueError("The model has several outputs, so no single target fits. Fix: pass target=y and "
                         "loss_fn=fn.")
    model = graph.capture.fresh_copy()  # a copy: a forward in train mode would update BatchNorm statistics
    with torch.no_grad():
        out = model_output(model(*graph.example_args, **graph.example_kwargs))
    if not isinstance(out, torch.Tensor):
        raise ValueError("The model has several outputs, so no single target fits. "
                         "Fix: pass target=y and loss_fn=fn.")
    return random_classes(out, seed)
