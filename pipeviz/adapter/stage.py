"""torch's ``PipelineStage`` with every action timed: the three methods pipeviz overrides, with their torch
signatures, in one place (``tests/test_adapter.py`` checks them against the installed torch)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

# The PipelineStage methods a timed stage overrides, with the parameters torch 2.13–2.15 give them.
OVERRIDDEN = {
    "forward_one_chunk": ("self", "fwd_chunk_id", "args", "kwargs"),
    "backward_one_chunk": ("self", "bwd_chunk_id", "loss", "full_backward", "last_backward"),
    "backward_weight_one_chunk": ("self", "bwd_chunk_id", "last_backward"),
    "perform_reduce_grad": ("self", "grad_scale_factor"),
}

Span = Callable[[int, str, int], contextlib.AbstractContextManager[object]]


def check_stage_methods() -> None:
    """Raise ``RuntimeError`` naming the method whose parameters differ from ``OVERRIDDEN`` in this torch."""
    from torch.distributed.pipelining import PipelineStage

    for name, expected in OVERRIDDEN.items():
        method = getattr(PipelineStage, name, None)
        if method is None:
            raise RuntimeError(f"torch's PipelineStage has no {name} any more; pipeviz's timed stage needs updating.")
        got = tuple(list(inspect.signature(method).parameters)[:len(expected)])
        if got != expected:
            raise RuntimeError(f"torch's PipelineStage.{name} takes {got}, pipeviz expects {expected}; pipeviz's "
                               "timed stage needs updating for this torch.")


def _one_recomputation(on: bool) -> contextlib.AbstractContextManager[object]:
    """One ``GraphExecGroup`` (torch 2.13 on) around a weight-grad pass of a recomputing stage; else nothing."""
    import torch.utils.checkpoint

    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None) if on else None
    return group() if group is not None else contextlib.nullcontext()


def timed_stage_class(span: Span) -> type[PipelineStage]:
    """A ``PipelineStage`` subclass that times each action: ``span(stage_index, kind, microbatch)`` is entered
    around every forward (``"F"``), full backward (``"B"``), input-grad (``"I"``) and weight-grad (``"W"``) pass
    of a stage that computes one (a forward-only stage's no-op backward calls are not timed).

    ``stage.recomputes = True`` (a stage with checkpointed layers: ``pipeviz.schedule.recompute``) runs each
    weight-grad pass under one ``torch.utils.checkpoint.GraphExecGroup``: torch's ``stage_backward_weight`` calls
    ``autograd.grad`` once per parameter group, and its non-reentrant checkpoint recomputes a region once per call,
    so a transformer block ran its forward again once per weight (6 times a W on TinyTransformer: W 7.0 ms against
    1.2 ms). Under the group each region is recomputed once per W, with the same gradients bit for bit.

    ``stage.grads_final(stage_index)`` (when set) is called once the stage's gradients of a schedule step are final
    (after its last backward, or its last weight-grad pass), in the step whose ``sync_replicas`` is True:
    ``dp_reduce="overlap"`` starts the replicas' average there (``pipeviz.runtime.overlap``).

    ``stage.sync_replicas = False`` keeps a schedule step's gradients local (gradient accumulation: DDP's
    all-reduce in the last backward and FSDP2's reduce-scatter at the step's end are left to the step whose
    ``sync_replicas`` is True, which reduces the accumulated sum once).

    Example:
        >>> Stage = timed_stage_class(lambda s, kind, mb: clock.span(rank, s, kind, mb, step))
        >>> stage = Stage(module, stage_index, num_stages, device, group=pp_group)
    """
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """torch's PipelineStage, timing every forward, backward, input-grad and weight-grad action."""

        sync_replicas = True
        recomputes = False  # the stage runs checkpointed regions (pipeviz.schedule.recompute)
        grads_final: Callable[[int], None] | None = None  # called with the stage index when its gradients are final

        def forward_one_chunk(self, fwd_chunk_id: int, *a: Any, **k: Any) -> Any:
            with span(self.stage_index, "F", fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *a, **k)

        def backward_one_chunk(self, bwd_chunk_id: int, loss: object = None, full_backward: bool = True,
                               last_backward: bool = False) -> object:
            if not self.has_backward:  # a forward-only run: torch calls it, and it does nothing
                return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                  last_backward=last_backward)
            with span(self.stage_index, "B" if full_backward else "I", bwd_chunk_id):
                out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                 last_backward=last_backward and self.sync_replicas)
            if full_backward and last_backward:
                self._final()
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *a: object, **k: object) -> object:
            if not self.has_backward:
                return super().backward_weight_one_chunk(bwd_chunk_id, *a, **k)
            with span(self.stage_index, "W", bwd_chunk_id), _one_recomputation(self.recomputes):
                out = super().backward_weight_one_chunk(bwd_chunk_id, *a, **k)
            if k.get("last_backward", a[0] if a else False):
                self._final()
            return out

        def _final(self) -> None:
            """The stage's gradients of this schedule step are final: its last backward (or weight-grad pass)."""
            if self.grads_final is not None and self.sync_replicas:
                self.grads_final(self.stage_index)

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            if self.sync_replicas:
                super().perform_reduce_grad(grad_scale_factor)
            elif grad_scale_factor != 1:  # FSDP2 keeps accumulating unsharded gradients, reduced in a later step
                self.scale_grads(grad_scale_factor)

    return TimedStage
