"""fp16's dynamic loss scale across a pipeline's processes (``LaunchConfig.mixed_precision="fp16"``).

float16 keeps 5 exponent bits: small gradients flush to zero. As ``torch.amp.GradScaler`` does on one process, the
last stage multiplies each microbatch's loss by the scale ``S`` (so every gradient is ``S`` times too large and
stays representable), and before the optimizer every process divides its gradients by ``S`` and checks them. The
check is global: one all-reduce (max) of "found an inf or NaN" over every process, so every stage, replica and
shard skips the same step. Then, with GradScaler's defaults: a step with an overflow is skipped and ``S`` halves;
2,000 good steps in a row double it; ``S`` starts at 2**16. Powers of two: scaling and unscaling are exact, so a
run matches the unsplit model trained with ``torch.amp.GradScaler`` (``pv.train_reference(mixed_precision=
torch.float16)``) to the same tolerance as without scaling.

Example:
    >>> scaler = LossScaler()
    >>> loss * scaler.scale                      # the last stage's loss, each microbatch
    >>> if not scaler.unscale(params): optimizer.step()
    >>> scaler.update()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["LossScaler"]


class LossScaler:
    """``torch.amp.GradScaler``'s dynamic scale, with the inf check all-reduced over every process."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.found_inf = False

    def unscale(self, grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """Divide ``grads`` (this process's local gradients) by the scale in place, as GradScaler's ``unscale_``
        does (``torch._amp_foreach_non_finite_check_and_unscale_``), and return whether any process found an inf
        or NaN (one all-reduce over ``group``, default every process)."""
        found = torch.zeros(1, dtype=torch.float32)
        if grads:
            device = grads[0].device
            found = found.to(device)
            inv = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=device)
            for dtype in {g.dtype for g in grads}:
                torch._amp_foreach_non_finite_check_and_unscale_([g for g in grads if g.dtype == dtype], found, inv)
        if dist.is_initialized():
            found = found.cpu()
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        self.found_inf = bool(found.item() > 0)
        return self.found_inf

    def update(self) -> None:
        """After the step: halve the scale after an overflow, double it after ``growth_interval`` good steps."""
        if self.found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
