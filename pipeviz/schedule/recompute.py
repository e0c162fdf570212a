"""Activation recomputation at run time: a stage's layers run under ``torch.utils.checkpoint`` (non-reentrant).

``LaunchConfig.recompute`` chooses, for every stage or per stage:

- ``"none"``: autograd saves what each op needs for its backward (the default);
- ``"full"``: each layer of the stage (the graph's layers: ``graph.layer_names``) runs as one checkpointed
  region, so a layer keeps only its inputs until its backward, which runs the layer's forward again first
  (Megatron-LM's and torchtitan's full recomputation, one transformer block at a time);
- ``"selective"``: only attention's score ops (the score matmul, its scaling and masking, the softmax, its dropout
  and the matmul with the values) run checkpointed: Korthikanti et al. 2022's selective recomputation, the
  ``5as/h`` term. A fused attention (``scaled_dot_product_attention``) keeps no scores, so there nothing changes.

The regions are cut from the stage's flat graph (``pipeviz.adapter.FlatStage``: every op knows the module it ran
in), so the model is not rewritten and parameter names, DDP, FSDP2 and tensor parallelism see the stage as it is:
parameters are read from the stage when a region runs (FSDP2's unsharded ones in the forward and in the
backward's recomputation). What the run's memory meter counts (``pipeviz.runtime.memory``) is what stays alive: a
region's inputs, held by the checkpoint until its backward.

Exactness: torch's checkpoint restores the random state, so dropout draws the same mask again, and the
recomputation writes no buffer twice (BatchNorm's running statistics and its step counter update once, in the
forward): an op that writes a buffer gets a copy of it when it runs again.

Example:
    >>> run = pv.launch(plan, "1F1B", 8, 2, inputs=(x,), target=y, loss_fn=pv.cross_entropy, recompute="full")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["MODES", "Recomputed", "Region", "attention_ops", "recompute_modes", "regions"]

MODES = ("none", "selective", "full")


def recompute_modes(value: str | Sequence[str], num_stages: int) -> tuple[str, ...]:
    """``LaunchConfig.recompute`` as one mode per stage; raises ``ValueError`` naming the bad value, the choices and
    the fix (``validate_launch`` turns it into a ``LaunchError`` before any process starts)."""
    modes = [value] * num_stages if isinstance(value, str) else list(value) if isinstance(value, Sequence) else None
    if modes is None:
        raise ValueError(f"recompute must be one of {', '.join(map(repr, MODES))} or one per stage, got {value!r}. "
                         "Fix: recompute='full'.")
    if len(modes) != num_stages:
        raise ValueError(f"recompute= gives {len(modes)} modes for a plan of {num_stages} stages. Fix: one mode per "
                         f"stage (e.g. {['full'] * (num_stages - 1) + ['none']}), or one mode for all.")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"recompute mode {m!r} is not one of {', '.join(map(repr, MODES))}. Fix: 'full' (each "
                             "layer keeps only its inputs), 'selective' (attention's scores) or 'none'.")
    return tuple(modes)


@dataclass
class Region:
    """A run of the stage's nodes that is checkpointed as one: its nodes, the values it reads from outside
    (parameters and buffers excluded: they are read from the stage when it runs) and the ones read after it."""

    nodes: list[fx.Node]
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)


def _layer_of(module: str, layers: Sequence[str]) -> str | None:
    for name in layers:
        if module == name or module.startswith(name + "."):
            return name
    return None


def attention_ops(graph: fx.Graph) -> tuple[tuple[str, ...], ...]:
    """The score ops of each explicit attention (the cost model's rule, ``roofline._attention_scores``, on the
    stage graph): each softmax, the ops before it of the same size back to the score matmul (scaling, masking),
    the ones after it of the same size (dropout), and the matmul that reads the probabilities (it would save them
    otherwise); one tuple of node names per softmax. Named, because it needs the sizes torch's trace recorded
    (``node.meta["val"]``), which a pickled stage no longer has: ``build_stages`` finds them, the ranks use them."""

    def numel(n: fx.Node) -> int | None:
        val = n.meta.get("val")
        return val.numel() if isinstance(val, torch.Tensor) else None

    def is_matmul(n: fx.Node) -> bool:
        return any(k in str(n.target) for k in ("bmm", "matmul", "baddbmm", "einsum"))

    found: list[tuple[str, ...]] = []
    taken: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or "softmax" not in str(node.target) or node in taken:
            continue
        size = numel(node)
        marked: set[fx.Node] = set()
        todo = [node]
        while todo:
            n = todo.pop()
            if n in marked:
                continue
            marked.add(n)
            if n is not node and is_matmul(n):
                continue  # the score matmul (queries by keys) or the one with the values: the region's edge
            todo += [a for a in n.all_input_nodes if a.op == "call_function" and numel(a) == size]
            todo += [u for u in n.users if u.op == "call_function" and (numel(u) == size or is_matmul(u))]
        taken |= marked
        found.append(tuple(n.name for n in graph.nodes if n in marked))
    return tuple(found)


def regions(gm: fx.GraphModule, node_modules: dict[str, str], layers: Sequence[str], mode: str,
            attention: Sequence[Sequence[str]] = ()) -> list[Region]:
    """The checkpointed regions of a stage graph under ``mode`` (``MODES``), in graph order: one per layer
    (``layers``, by the module each op ran in: ``node_modules``), or one per attention (``attention_ops``: from
    its first score op to its last, with what runs in between)."""
    if mode == "none":
        return []
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    cuts: list[list[fx.Node]] = []
    if mode == "full":
        current: str | None = None
        for n in nodes:
            layer = _layer_of(node_modules.get(n.name, ""), layers)
            if layer is None and cuts:  # ops between layers (a position add) go with the layer before
                cuts[-1].append(n)
                continue
            if layer != current or not cuts:
                cuts.append([])
                current = layer
            cuts[-1].append(n)
    elif mode == "selective":
        where = {n.name: i for i, n in enumerate(nodes)}
        for names in attention:
            at = sorted(where[x] for x in names if x in where)
            if at:
                cuts.append(nodes[at[0]:at[-1] + 1])
    else:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")
    out: list[Region] = []
    for cut in cuts:
        inside = set(cut)
        inputs = list(dict.fromkeys(a for n in cut for a in n.all_input_nodes
                                    if a not in inside and a.op != "get_attr"))
        outputs = [n for n in cut if any(u not in inside for u in n.users)]
        out.append(Region(cut, inputs, outputs))
    return out


class _Keep(torch.autograd.Function):
    """Saves a region's inputs, so the run's memory meter (saved-tensor hooks) counts what the checkpoint holds for
    the region's backward; returns its first argument (a view), gradients pass through unchanged."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*kept)
        ctx.n = len(kept)  # type: ignore[attr-defined]  # autograd's ctx holds what forward leaves; torch types none
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *([None] * ctx.n))  # type: ignore[attr-defined]  # set in forward (torch types no ctx fields)


def _fetch(module: nn.Module, target: str) -> object:
    value: object = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _written(node: fx.Node) -> set[int]:
    """Positions of the arguments an op writes in place: its schema's ``Tensor(a!)``, and the running statistics of
    ``aten.batch_norm`` and ``aten.instance_norm``, composite ops whose schemas do not say that they write them."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return set()
    written = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    if schema.name in ("aten::batch_norm", "aten::instance_norm"):
        written |= {3, 4}
    return written


class Recomputed:
    """Runs a stage's flat graph with ``regions`` checkpointed; called as the stage module is (kept outside the
    module tree, like a compiled stage)."""

    def __init__(self, module: fx.GraphModule, found: list[Region]) -> None:
        self.module = module
        self.regions = found
        first = {r.nodes[0]: r for r in found}
        self.steps: list[fx.Node | Region] = []
        skip: set[fx.Node] = set()
        for n in module.graph.nodes:
            if n in skip:
                continue
            region = first.get(n)
            if region is None:
                self.steps.append(n)
            else:
                self.steps.append(region)
                skip.update(region.nodes)
        # per node, the positions of buffers it writes: a recomputation writes copies instead
        self.writes = {n: _written(n) for r in found for n in r.nodes if n.op == "call_function"}

    def __call__(self, *args: object) -> object:
        env: dict[fx.Node, object] = {}
        placeholders = iter(args)
        for step in self.steps:
            if isinstance(step, Region):
                self._region(step, env)
                continue
            if step.op == "placeholder":
                env[step] = next(placeholders)
            elif step.op == "output":
                return fx.node.map_arg(step.args[0], lambda n: cast(fx.node.Argument, env[n]))
            else:
                env[step] = self._run(step, env, again=False)
        raise RuntimeError("a stage graph without an output node")

    def _run(self, node: fx.Node, env: dict[fx.Node, object], again: bool) -> object:
        if node.op == "get_attr":
            return _fetch(self.module, str(node.target))

        def value(n: fx.Node) -> fx.node.Argument:  # (a tensor, at run time: fx's types name the graph's values)
            return cast(fx.node.Argument, env[n] if n in env else _fetch(self.module, str(n.target)))

        args = fx.node.map_arg(node.args, value)
        kwargs = fx.node.map_arg(node.kwargs, value)
        if again and self.writes.get(node):
            # BatchNorm's running statistics, num_batches_tracked.add_(1): written once, in the forward
            args = tuple(a.clone() if i in self.writes[node] and isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args))
        if node.op == "call_function":
            assert callable(node.target)  # fx: a call_function's target is the function (a str only for methods)
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, str(node.target))(*rest, **kwargs)
        if node.op == "call_module":
            return self.module.get_submodule(str(node.target))(*args, **kwargs)
        raise RuntimeError(f"unexpected node {node.format_node()}")

    def _region(self, region: Region, env: dict[fx.Node, object]) -> None:
        calls = [0]

        def body(*values: object) -> tuple[object, ...]:
            again = calls[0] > 0
            calls[0] += 1
            local = dict(zip(region.inputs, values, strict=True))
            for n in region.nodes:
                local[n] = self._run(n, local, again)
            return tuple(local[n] for n in region.outputs)

        values = [env[n] for n in region.inputs]
        kept = [v for v in values if isinstance(v, torch.Tensor)]
        # The meter counts what the checkpoint holds through an input that carries a gradient (an op on it records
        # a graph node, which keeps its saved tensors until the region's backward has run); the region's outputs
        # stay as they are (a zero-bubble schedule detaches the stage's outputs in place, which a view refuses).
        carrier = next((i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad), None)
        if carrier is not None:
            keep: Callable[..., torch.Tensor] = _Keep.apply  # (autograd's apply is untyped)
            values[carrier] = keep(values[carrier], *kept)
        outs = checkpoint(body, *values, use_reentrant=False)
        for n, v in zip(region.outputs, outs, strict=True):
            env[n] = v
