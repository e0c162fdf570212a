"""Building the real ``torch.distributed.pipelining`` Pipe for a plan's splits, from a fresh copy of the model.

``SplitPlan.pipe`` and ``SplitPlan.microbatch_inputs`` answer from here. torch's ``pipeline()`` traces one microbatch
of the example inputs (the shape every stage then expects), splits at torch's ``split_spec`` for modules called once
and at pipeviz's per-call markers (``pipeviz.plan.marks``) for the others, with ``no_grad`` / ``autocast`` regions
inlined so their bodies survive the split.

Example:
    >>> pipe = build_pipe(plan.graph, plan.splits, microbatches=4)   # what plan.pipe(4) returns
    >>> pipe.num_stages == plan.num_stages
    True
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.pipelining import SplitPoint
from torch.utils import _pytree as pytree

from pipeviz._compat import deprecated
from pipeviz.adapter import defake, fake_cpu, regions_inlined
from pipeviz.capture.export import TRACE_LOCK
from pipeviz.plan.errors import PlanError
from pipeviz.plan.marks import mark_calls

if TYPE_CHECKING:
    from torch.distributed.pipelining import Pipe

    from pipeviz.capture.view import GraphView as ModelGraph

__all__ = ["build_pipe", "check_batch_split", "check_microbatches", "microbatch_inputs", "torch_splits"]

Splits = Sequence[tuple[str, SplitPoint]]


def check_batch_split(batch_size: int | None, microbatches: object) -> None:
    """Raise ``PlanError`` unless ``microbatches`` is a positive divisor of ``batch_size`` (the schedule's own rule
    on microbatches is ``pipeviz.schedule.traits.check_microbatches``)."""
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive int, got {microbatches!r}.")
    if batch_size is not None and batch_size % microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise PlanError(
            f"microbatches={microbatches} does not divide the batch of {batch_size}. "
            f"Valid: {', '.join(map(str, divisors))}; or change the batch size."
        )


def check_microbatches(batch_size: int | None, microbatches: object) -> None:
    """0.2's name of ``check_batch_split`` (deprecated: ``pipeviz.schedule.traits.check_microbatches`` is the schedule's
    rule, a different check)."""
    deprecated("pipeviz.plan.check_microbatches is deprecated since pipeviz 0.3: call check_batch_split (the same "
               "check); pipeviz.schedule.traits.check_microbatches is the schedule's rule.")
    check_batch_split(batch_size, microbatches)


def microbatch_inputs(graph: ModelGraph, microbatches: int) -> tuple[tuple[object, ...], dict[str, object]]:
    """The graph's example inputs cut into ``microbatches`` chunks along dim 0; returns the first chunk."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    check_batch_split(graph.batch_size, microbatches)
    args, kwargs = split_args_kwargs_into_chunks(graph.example_args, graph.example_kwargs, microbatches)
    return args[0], kwargs[0]


def torch_splits(graph: ModelGraph, splits: Splits) -> tuple[dict[str, SplitPoint], list[tuple[str, int, SplitPoint]]]:
    """torch's ``split_spec`` for modules called once, and (fqn, call, point) marks for the others.
    A container (never called itself) is marked at its last (END) or first (BEGINNING) called module."""
    spec: dict[str, SplitPoint] = {}
    per_call: list[tuple[str, int, SplitPoint]] = []
    for name, point in splits:
        unit = graph.unit(name)
        while not unit.called:
            unit = graph.unit(unit.children[-1] if point is SplitPoint.END else unit.children[0])
        if unit.calls == 1:
            spec[unit.fqn] = point
        else:
            call = int(unit.name.rpartition("@")[2])
            per_call.append((unit.fqn, call, point))
    return spec, per_call


def build_pipe(graph: ModelGraph, splits: Splits, microbatches: int = 1) -> Pipe:
    """torch's ``Pipe`` for ``splits`` over ``graph``, traced on a fresh deep copy of the model (the user's model is
    never patched) with one microbatch of the example inputs.

    Raises:
        PlanError: ``microbatches`` does not divide the example batch, a manual plan, or a model holding an op
            torch cannot split (``torch.cond``: ``graph.notes`` says so at trace time).
    """
    from torch.distributed.pipelining import pipeline

    if not graph.capture.traced:
        raise PlanError(
            "This plan comes from pv.manual_plan: there is no traced graph to build a Pipe from. "
            "Fix: use plan.stage_modules() (one nn.Module per stage) with torch's PipelineStage."
        )
    if graph.capture.unsupported:
        raise PlanError(graph.capture.unsupported[0])
    mb_args, mb_kwargs = microbatch_inputs(graph, microbatches)
    model = graph.capture.fresh_copy()
    spec, per_call = torch_splits(graph, splits)
    mark_calls(model, per_call)
    # A meta model is split on fake CPU tensors (the CPU's code paths, no memory); its stages hold meta
    # tensors, which the ranks load or initialise (pipeviz.capture.weights).
    meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    mode: Any = fake_cpu(model) if meta else contextlib.nullcontext()
    if meta:
        mb_args, mb_kwargs = pytree.tree_map(
            lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, (mb_args, mb_kwargs))
    with TRACE_LOCK, warnings.catch_warnings(), mode:
        # torch 2.13's own pytree deprecation notice, raised inside pipeline(): nothing a user can act on.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        # A fake model: torch's split deep-copies constant tensors (GPT-2's), and Tensor.__deepcopy__ asks a
        # FakeTensor for its data pointer, which warns; the copies are fake, and defake() replaces them.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
        with regions_inlined():  # torch's split loses no_grad / autocast regions' bodies (pipeviz.adapter.regions)
            pipe = pipeline(model, mb_args=mb_args, mb_kwargs=mb_kwargs or None, split_spec=spec or None)
    if meta:
        defake(pipe.split_gm)
    return pipe
