"""The manual route: a plan from per-stage lists of module names, for models torch.export cannot capture.

It needs no trace. Each stage is built from a deep copy of its modules (pruning the rest, as torchtitan
does) and runs them in sequence, so it fits models whose forward runs a sequence of modules (an
``nn.Sequential``, or a loop over an ``nn.ModuleList``). pipeviz checks that claim: the modules run in
sequence must reproduce the model's output on the example inputs.

Example:
    >>> plan = pv.manual_plan(model, [["embed", "blocks.0"], ["blocks.1", "head"]], example_args=(x,))
    >>> plan.stages[0].params, plan.stage_modules()[1]
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from pipeviz._compat import positional_legacy
from pipeviz.capture.export import Capture, batch_size_of
from pipeviz.capture.ops import Op, tensor_bytes
from pipeviz.capture.structure import (
    alias_groups,
    buffer_names,
    elementwise_modules,
    frozen_names,
    module_table,
    tensor_sizes,
)
from pipeviz.graph.model import ModelGraph
from pipeviz.plan.errors import PlanError
from pipeviz.plan.sequence import SequenceStage
from pipeviz.plan.split import SplitPlan

__all__ = ["SequenceStage", "manual_plan"]


@positional_legacy("example_kwargs")
def manual_plan(
    model: nn.Module,
    stages: Sequence[Sequence[str]],
    example_args: tuple[object, ...] | torch.Tensor = (),
    *,
    example_kwargs: Mapping[str, object] | None = None,
) -> SplitPlan:
    """A plan given as per-stage lists of module names, for models torch.export cannot trace.

    Args:
        model: the model; never modified.
        stages: module FQNs per stage, in execution order (``[["layer0"], ["layer1", "output_proj"]]``).
        example_args / example_kwargs: one full batch, used to check the sequence and measure costs.

    Returns:
        A ``SplitPlan`` whose graph has exactly these modules as layers. ``plan.stage_modules()`` gives
        the stage modules; ``plan.pipe()`` is not available (there is no traced graph).

    Raises:
        PlanError: an unknown module name, an empty stage, or modules that run in sequence do not
            reproduce the model's output (then the forward is not a plain sequence).
    """
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    kwargs = dict(example_kwargs or {})
    lists = [list(s) for s in stages]
    if len(lists) < 1 or any(not s for s in lists):
        raise PlanError(f"Every stage needs at least one module name; got {lists}.")
    names = [n for s in lists for n in s]
    known = [n for n, _ in model.named_modules() if n]
    for n in names:
        if n not in known:
            import difflib

            close = difflib.get_close_matches(n, known, n=3, cutoff=0.5)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise PlanError(f"Unknown module {n!r}.{hint} Modules: {', '.join(known[:30])}.")
    if len(set(names)) != len(names):
        raise PlanError(f"A module is listed twice in {lists}; list each once.")
    cap = _capture_sequence(model, names, example_args, kwargs)
    graph = ModelGraph(cap, names)
    return SplitPlan.from_stages(graph, lists)


def _capture_sequence(model: nn.Module, names: list[str], args: tuple[object, ...], kwargs: dict[str, object]
                      ) -> Capture:
    runner = SequenceStage(model, names)
    runner.train(model.training)
    canonical, groups = alias_groups(model)
    ops: list[Op] = []
    with torch.no_grad():
        expected = copy.deepcopy(model)(*args, **kwargs)
        x: object = None
        for i, name in enumerate(names):
            mod = runner.get_submodule(name)
            with FlopCounterMode(display=False) as mode:
                if i == 0:
                    x = mod(*args, **kwargs)
                else:
                    x = mod(*x) if isinstance(x, tuple) else mod(x)
            sub = model.get_submodule(name)
            params = tuple(dict.fromkeys(
                canonical[f"{name}.{p}"]
                for p, _ in [*sub.named_parameters(remove_duplicate=False), *sub.named_buffers(remove_duplicate=False)]
            ))
            ops.append(Op(
                index=i, name=name, target="module", stack=(name,), calls=(0,), flops=mode.get_total_flops(),
                out_bytes=tensor_bytes(x), inputs=(i - 1,) if i else (), model_inputs=() if i else ("input",),
                params=params,
            ))
    got, want = pytree.tree_leaves(x), pytree.tree_leaves(expected)
    same = len(got) == len(want) and all(
        isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
        for a, b in zip(got, want, strict=True)
    )
    if not same:
        raise PlanError(
            f"Running {names} in sequence does not reproduce {type(model).__name__}'s output, so its forward does "
            "more than call these modules in turn. Fix: list every module the forward calls, in order, or make "
            "the model traceable for pv.trace."
        )
    numel, nbytes = tensor_sizes(model, groups)
    return Capture(
        model=model, example_args=args, example_kwargs=kwargs, ops=ops, modules=module_table(model),
        param_numel=numel, param_bytes=nbytes,
        aliases=groups, batch_size=batch_size_of(args, kwargs), traced=False, buffers=buffer_names(model),
        elementwise=elementwise_modules(model), frozen=frozen_names(model, groups),
        outputs=[(tuple(t.shape), t.dtype) for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)],
        out_spec=pytree.tree_structure(x),
    )
