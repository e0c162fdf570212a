"""Exact zero-bubble backward splits: every weight gets its gradient from torch's input-grad / weight-grad passes,
and a split backward frees the saved activations when its weight-grad pass is done, as a full backward does."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase


@contextlib.contextmanager
def exact_split_backward() -> Iterator[None]:
    """Inside the block, torch's zero-bubble input-grad / weight-grad split gives every weight its exact
    gradient: weights off the inputs' path get theirs during the input-grad pass (there is nothing to share
    with it), and the weight-grad pass keeps the graph until every weight group is done. The last stage keeps
    its outputs for the step's result detached, so the graph (and every tensor it saved) goes when the weight-grad
    pass is done, not at the step's end."""
    from torch.distributed.pipelining import stage as torch_stage

    original_input, original_weight = torch_stage.stage_backward_input, torch_stage.stage_backward_weight
    stage_cls = torch_stage._PipelineStageBase
    original_forward = stage_cls.forward_one_chunk
    call_forward: Callable[..., object] = original_forward  # what the wrapper passes its arguments on to

    def forward_one_chunk(self: _PipelineStageBase, *args: object, **kwargs: object) -> object:
        output = call_forward(self, *args, **kwargs)
        # The last stage keeps each microbatch's output until the step returns them (output_chunks). torch
        # detaches it in place after the input-grad pass, except a view (a Linear's output on a 3-d input is
        # one), which cannot be: its grad_fn then kept the graph alive, and since both zero-bubble passes run
        # with retain_graph=True, every tensor the stage saved for backward lived until the step's end (measured:
        # a transformer's last stage held all its microbatches' activations through a ZBV step).
        # The loss is computed from the returned output, which stays attached; only the kept copy is detached.
        if self.is_last and self.output_chunks and self.output_chunks[-1] is output:
            self.output_chunks[-1] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), output)
        return output

    def backward_input(outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None, input_values: list[object],
                       weights: Iterable[nn.Parameter],
                       ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, object]]]:
        weights = list(weights)
        _grads_off_the_input_path(outputs, output_grads, input_values, weights)
        dinputs, groups = original_input(outputs, output_grads, input_values, iter(weights))
        # torch sends these to the previous stage as they are; autograd.grad keeps the strides of the op that
        # made them (a transpose's), and gloo refuses a non-contiguous tensor ("input tensor has to be
        # contiguous"). The full backward's accumulated .grad is contiguous already.
        dinputs = tuple(d.contiguous() if isinstance(d, torch.Tensor) else d for d in dinputs)
        return dinputs, groups

    def backward_weight(weights: Iterator[nn.Parameter], param_groups: list[dict[str, object]],
                        retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
        return original_weight(weights, param_groups, retain_graph=True)

    # Patched where PipelineStage looks them up (torch's own module globals), for the block only.
    torch_stage.stage_backward_input = backward_input  # type: ignore[assignment]
    torch_stage.stage_backward_weight = backward_weight
    stage_cls.forward_one_chunk = forward_one_chunk  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch_stage.stage_backward_input, torch_stage.stage_backward_weight = original_input, original_weight
        stage_cls.forward_one_chunk = original_forward  # type: ignore[method-assign]


def _grads_off_the_input_path(outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None,
                              input_values: list[object], weights: list[nn.Parameter]) -> None:
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        reverse_closure,
    )

    valid = [(o, torch.ones_like(o) if output_grads is None else output_grads[i])
             for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and (o.requires_grad or o.grad_fn)]
    input_fns = [f for x in input_values if isinstance(x, torch.Tensor) and (f := _get_grad_fn_or_grad_acc(x))]
    if not valid or not input_fns:  # the first stage: torch runs a full backward in its W pass instead
        return
    roots = {f for o, _ in valid if (f := _get_grad_fn_or_grad_acc(o))}
    reverse = construct_reverse_graph(list(roots))
    inputs_closure, _ = reverse_closure(input_fns, set(), reverse)
    # torch's W pass starts from the nodes where a weight's path meets the inputs' path. A weight whose path
    # never meets it, or also reaches an output around it (T5's position bias, computed in one block and
    # sent on to the next stage), would lose that part: such weights get their whole gradient here, and
    # torch's split never sees them.
    off = []
    for w in weights:
        acc = _get_grad_fn_or_grad_acc(w)
        if acc is None or acc not in reverse:
            continue
        closure, met = reverse_closure([acc], inputs_closure, reverse)
        if not met or (closure & roots):
            off.append(w)
    if off:
        grads = torch.autograd.grad([o for o, _ in valid], off, [g for _, g in valid], retain_graph=True,
                                    allow_unused=True)
        for w, g in zip(off, grads, strict=True):
            if g is not None:
                w.grad = g if w.grad is None else w.grad + g
    kept = [w for w in weights if all(w is not o for o in off)]
    weights[:] = kept
