"""A launch's batches: its inputs checked against the traced example, each ``data=`` and ``eval_data=`` batch
checked against the first, and each replica's share of a batch.

Example:
    >>> args, kwargs = launch_inputs(plan.graph, (x,), None)
    >>> args, kwargs, target = like_first(data_batch((x, y), 1, training=True), spec, 1)
    >>> share(args, replica=1, replicas=2, batch=8)     # replica 1's rows 4..7
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from pipeviz.capture.export import batch_size_of
from pipeviz.errors import LaunchError
from pipeviz.runtime.spec import FedBatch, LaunchSpec

if TYPE_CHECKING:
    from pipeviz.capture.view import GraphView

__all__ = ["data_batch", "eval_batches", "launch_inputs", "like_first", "seq_share", "sequence_length", "share"]

T = TypeVar("T")


def share(tree: T, replica: int, replicas: int, batch: int) -> T:
    """Replica ``replica``'s share of a batch: every tensor whose dim 0 is the batch, cut into ``replicas``
    contiguous parts along it (replica 0 the first part); other values as they are."""
    if replicas == 1:
        return tree
    return pytree.tree_map(lambda t: t.tensor_split(replicas)[replica]
                           if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t, tree)


def seq_share(batch: tuple[Any, ...], share: int, shares: int, seq: int) -> tuple[Any, ...]:
    """Context parallelism: share ``share`` of ``shares``'s tokens of a batch ``(args, kwargs[, target])``, each
    tensor with ``seq`` in dim 1 cut to the share's global positions (``zigzag_positions``: chunks ``share`` and
    ``2·shares−1−share`` of ``2·shares``). Inputs named ``*mask*`` stay whole (the attention mask is built over the
    whole sequence; each share keeps its rows of it)."""
    if shares == 1:
        return batch
    from pipeviz.adapter.context_graph import zigzag_positions

    pos = zigzag_positions(seq, shares, share)

    def cut(t: object) -> object:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == seq:
            return t.index_select(1, pos.to(t.device))
        return t

    args, kwargs, *rest = batch
    kept = {k: v if "mask" in k else pytree.tree_map(cut, v) for k, v in (kwargs or {}).items()}
    return (pytree.tree_map(cut, args), kept if kwargs is not None else kwargs,
            *(pytree.tree_map(cut, r) for r in rest))


def sequence_length(args: object, kwargs: object) -> int | None:
    """The sequence length of a batch: dim 1 of its first input of 2 or more dims (None: no such input)."""
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[1])
    return None


def data_batch(item: object, step: int, training: bool) -> tuple[object, dict[str, object] | None, object]:
    """One item of ``data=`` as (inputs, input_kwargs, target).

    An item is ``(inputs, target)`` (inputs: a tensor, or a tuple or list of the model's positional inputs),
    or a mapping ``{"inputs": ..., "target": ..., <keyword input>: tensor, ...}`` whose other keys are the
    model's keyword inputs (``attention_mask``, ...). A forward-only run (no ``loss_fn``) takes the inputs
    alone (a tensor, tuple or list) or a mapping without ``"target"``.
    """
    if isinstance(item, Mapping):
        rest = {k: v for k, v in item.items() if k not in ("inputs", "target")}
        if "inputs" not in item:
            raise LaunchError(f"data= batch {step} is a mapping without 'inputs' (keys: {sorted(item)}). Fix: "
                              "{'inputs': x, 'target': y, <keyword inputs>...}, or an (inputs, target) tuple.")
        return item["inputs"], rest or None, item.get("target")
    if training:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise LaunchError(f"data= batch {step} is a {type(item).__name__}; a training run takes (inputs, target) "
                              "pairs or {'inputs': ..., 'target': ...} mappings.")
        return item[0], None, item[1]
    return item, None, None


def like_first(batch: tuple[object, Mapping[str, object] | None, object], spec: LaunchSpec, step: int,
               what: str = "data=", same_shapes: bool = True) -> FedBatch:
    """A data= batch as (args, kwargs, target), checked against the first batch: the same inputs, dtypes and number
    of dimensions, and with ``same_shapes`` the same shapes (torch's stages have static shapes). Without it (a
    ``data=`` run: ``pipeviz.runtime.shapes`` traces the stages again for each new shape) the sizes may differ, the
    batch still splitting into the run's microbatches on every replica."""
    inputs, kwargs, target = batch
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs) if isinstance(inputs, tuple | list) \
        else None
    if args is None:
        raise LaunchError(f"{what} batch {step}: inputs is a {type(inputs).__name__}; expected a tensor or a tuple or "
                          "list of tensors, like the first batch.")
    kwargs = dict(kwargs or {})
    pairs = [(f"inputs[{i}]", a, e) for i, (a, e) in enumerate(zip(args, spec.args, strict=False))]
    pairs += [(f"input_kwargs[{k!r}]", kwargs.get(k), v) for k, v in spec.kwargs.items()]
    if spec.target is not None:
        pairs.append(("target", target, spec.target))
    if len(args) != len(spec.args) or set(kwargs) != set(spec.kwargs):
        raise LaunchError(f"{what} batch {step} has other inputs than the first batch ({len(args)} positional, "
                          f"keywords {sorted(kwargs)}; the first: {len(spec.args)}, {sorted(spec.kwargs)}).")
    for label, got, want in pairs:
        if not isinstance(want, torch.Tensor):
            continue
        if not same_shapes and isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.dim() == want.dim():
            continue
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            shown = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise LaunchError(
                f"{what} batch {step}: {label} is {shown}, but the run started with {tuple(want.shape)} {want.dtype}: "
                "a pipeline's shapes are fixed by its first batch (and the batch must split into the "
                f"{spec.microbatches} microbatches). Fix: equal batches, e.g. DataLoader(..., drop_last=True).")
    if not same_shapes:
        size, parts = batch_size_of(args, kwargs), spec.microbatches * spec.dp
        if size is not None and size % parts:
            raise LaunchError(f"{what} batch {step} holds {size} samples, which do not split into the run's "
                              f"{spec.microbatches} microbatches x {spec.dp} replicas ({parts} equal parts). Fix: "
                              f"batches of a multiple of {parts} samples, e.g. DataLoader(..., drop_last=True).")
    return args, {k: kwargs[k] for k in spec.kwargs}, target


def launch_inputs(graph: GraphView, inputs: object, input_kwargs: Mapping[str, object] | None, any_length: bool = False,
            ) -> tuple[tuple[object, ...], dict[str, object]]:
    """The launch's inputs as (args, kwargs) in the traced order, each checked against the traced example."""
    if inputs is None:
        args = tuple(graph.example_args)
    elif isinstance(inputs, torch.Tensor):
        args = (inputs,)
    elif isinstance(inputs, tuple | list):
        args = tuple(inputs)
    else:
        hint = " Fix: pass keyword inputs as input_kwargs={...}." if isinstance(inputs, dict) else \
            " Fix: inputs=(x,)."
        raise LaunchError(f"inputs must be a tensor, or a tuple or list of tensors (the model's positional "
                          f"inputs), got {type(inputs).__name__}.{hint}")
    kwargs = dict(graph.example_kwargs) if input_kwargs is None and inputs is None else dict(input_kwargs or {})
    if not isinstance(kwargs, dict):
        raise LaunchError(f"input_kwargs must be a dict of keyword inputs, got {type(input_kwargs).__name__}.")
    # Keep the traced keyword order: stage 0 maps inputs onto torch's placeholders in that order.
    order = list(graph.example_kwargs)
    unknown = [k for k in kwargs if k not in order]
    if unknown:
        raise LaunchError(f"input_kwargs {unknown} were not in the traced example_kwargs {order}. "
                          "Fix: trace with the same keyword inputs you launch with.")
    kwargs = {k: kwargs[k] for k in order if k in kwargs}
    example = tuple(graph.example_args)
    if len(args) != len(example):
        raise LaunchError(f"The model was traced with {len(example)} positional input(s); launch got {len(args)}. "
                          "Fix: pass inputs like the example, or re-trace with these.")
    pairs = [(f"inputs[{i}]", a, e) for i, (a, e) in enumerate(zip(args, example, strict=True))]
    pairs += [(f"input_kwargs[{k!r}]", kwargs[k], graph.example_kwargs[k]) for k in kwargs]
    for label, got, want in pairs:
        _like_example(label, got, want, any_length)
    return args, kwargs


def _like_example(label: str, got: object, want: object, any_length: bool = False) -> None:
    if not isinstance(want, torch.Tensor):
        return
    retrace = "or re-trace with it: pv.trace(model, example_args=..., example_kwargs=...)."
    if not isinstance(got, torch.Tensor):
        raise LaunchError(f"{label} is a {type(got).__name__}, but the model was traced with a tensor "
                          f"{tuple(want.shape)} {want.dtype}. Fix: pass a tensor like the example, {retrace}")
    if got.dtype != want.dtype:
        raise LaunchError(f"{label} is {got.dtype}, but the model was traced with {want.dtype}. Fix: pass a "
                          f"{want.dtype} tensor (e.g. x.to({want.dtype})), {retrace}")
    if got.dim() != want.dim() or (tuple(got.shape[1:]) != tuple(want.shape[1:]) and not any_length):
        raise LaunchError(f"{label} has shape {tuple(got.shape)}, but the model was traced with "
                          f"{tuple(want.shape)} (every dim after the batch must match). Fix: pass a batch shaped like "
                          f"the example, {retrace}")


def eval_batches(spec: LaunchSpec, eval_data: Iterable[object] | None) -> list[FedBatch]:
    """``eval_data=``'s held-out batches, each like the first training batch (the stages' shapes are static)."""
    every = spec.config.eval_every
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise LaunchError(f"eval_every must be a positive int (steps between evaluations) or None, got {every!r}. "
                          "Fix: eval_every=10, or None to evaluate after the last step only.")
    if eval_data is None:
        if every is not None:
            raise LaunchError(f"eval_every={every} was given without eval_data=: there is nothing to evaluate on. "
                              "Fix: pv.launch(..., eval_data=[(x_val, y_val)]), or drop eval_every.")
        return []
    if isinstance(eval_data, torch.Tensor | str) or not isinstance(eval_data, Iterable):
        raise LaunchError(f"eval_data= must be an iterable of (inputs, target) batches, got "
                          f"{type(eval_data).__name__}. Fix: eval_data=[(x_val, y_val)] (each batch shaped like a "
                          "training batch).")
    batches = [like_first(data_batch(item, i, True), spec, i, "eval_data=") for i, item in enumerate(eval_data)]
    if not batches:
        raise LaunchError("eval_data= gave no batch. Fix: at least one (inputs, target) batch, or drop eval_data.")
    return batches
