"""Tensor parallelism inside a stage: each stage's projections sharded over ``tp`` processes with DTensor.

pipeviz's stages are flat graphs (``pipeviz.adapter.flatten_stage``), not trees of ``nn.Linear``, so torch's
``parallelize_module`` has no module to hook; the placements it gives are applied to the parameters directly,
and torch's DTensor runs the graph: a column-wise projection (``ColwiseParallel``: weight and bias ``Shard(0)``)
then a row-wise one (``RowwiseParallel``: weight ``Shard(1)``, bias replicated), the plan torchtitan applies
to LLaMA blocks and Megatron-LM to every transformer block. DTensor inserts the collectives the placements
need (the row-wise output's all-reduce, and the backward's). The stage's inputs enter as replicated DTensors
and its outputs leave as full tensors, so the pipeline's sends and receives are unchanged: shard ``t`` of a
stage talks to shard ``t`` of its neighbours.

Example:
    >>> run = pv.launch(plan, "1F1B", 4, 2, inputs=(x,), target=y, loss_fn=pv.cross_entropy, tp=2,
    ...                 tp_plan={"layer0.lin": "colwise", "layer1.lin": "rowwise"})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["STYLES", "check_tp_plan", "default_tp_plan", "shard_stage", "tp_placements"]

STYLES = ("colwise", "rowwise")


def default_tp_plan(model: nn.Module, stages: list[tuple[str, ...]]) -> dict[str, str]:
    """Megatron's MLP rule for plain ``nn.Linear`` chains: within each stage, in execution (module) order, a
    Linear whose output feeds the next Linear's input size is column-wise and that next one row-wise; the
    rest stay replicated. ``stages``: each stage's layers (module names)."""
    plan: dict[str, str] = {}
    for layers in stages:
        linears = [(name, mod) for layer in layers for name, mod in _linears(model, layer)]
        i = 0
        while i + 1 < len(linears):
            (a, la), (b, lb) = linears[i], linears[i + 1]
            if la.out_features == lb.in_features:
                plan[a], plan[b] = "colwise", "rowwise"
                i += 2
            else:
                i += 1
    return plan


def _linears(model: nn.Module, layer: str) -> list[tuple[str, nn.Linear]]:
    base = layer.split("@")[0]
    try:
        root = model.get_submodule(base)
    except AttributeError:
        return []
    return [(f"{base}.{n}" if n else base, m) for n, m in root.named_modules() if isinstance(m, nn.Linear)]


def check_tp_plan(model: nn.Module, plan: Mapping[str, str], tp: int) -> dict[str, str]:
    """``plan`` checked against the model: each key an ``nn.Linear`` module, each style ``colwise`` or
    ``rowwise``, each sharded size divisible by ``tp``; returns the placements per parameter name
    (``tp_placements``). Raises ``ValueError`` naming the module, the sizes and the fix."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    out: dict[str, str] = {}
    for name, style in plan.items():
        if name not in linears:
            raise ValueError(f"tp_plan names {name!r}, which is not an nn.Linear of the model. Valid: "
                             f"{', '.join(list(linears)[:12])}{', …' if len(linears) > 12 else ''}.")
        if style not in STYLES:
            raise ValueError(f"tp_plan[{name!r}] is {style!r}; valid: 'colwise', 'rowwise'.")
        mod = linears[name]
        size = mod.out_features if style == "colwise" else mod.in_features
        if size % tp:
            what = "output features" if style == "colwise" else "input features"
            raise ValueError(f"{name!r} has {size} {what}, which tp={tp} shards cannot share equally. Fix: a tp "
                             f"that divides {size}, or leave {name!r} out of tp_plan (replicated).")
        out.update(tp_placements(name, style, mod.bias is not None))
    return out


def tp_placements(module: str, style: str, bias: bool) -> dict[str, str]:
    """Parameter name -> placement (``"shard0"``, ``"shard1"``, ``"replicate"``) for one projection."""
    if style == "colwise":
        return {f"{module}.weight": "shard0", **({f"{module}.bias": "shard0"} if bias else {})}
    return {f"{module}.weight": "shard1", **({f"{module}.bias": "replicate"} if bias else {})}


def shard_stage(stage: nn.Module, params: Mapping[str, str], placements: Mapping[str, str], mesh: DeviceMesh) -> int:
    """Turn ``stage``'s parameters and buffers into DTensors over the 1-D ``mesh``: ``params`` maps canonical
    names to the stage's own attribute paths, ``placements`` canonical names to ``"shard0"`` / ``"shard1"``;
    everything else is replicated (a DTensor op takes no plain tensor: BatchNorm's statistics too). A tensor
    held under two paths stays one tensor. Returns how many parameters were sharded."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    kinds = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}
    canonical = {inner: canon for canon, inner in params.items()}
    done: dict[int, Any] = {}
    sharded = 0
    tensors: list[tuple[str, torch.Tensor, bool]] = [
        (n, t, True) for n, t in stage.named_parameters(remove_duplicate=False)]
    tensors += [(n, t, False) for n, t in stage.named_buffers(remove_duplicate=False)]
    for path, value, is_param in tensors:
        *owner_path, leaf = path.split(".")
        owner: nn.Module = stage
        for atom in owner_path:
            owner = getattr(owner, atom)
        if id(value) not in done:
            place = placements.get(canonical.get(path, ""), "replicate") if is_param else "replicate"
            sharded += place != "replicate"
            dt = distribute_tensor(value.detach(), mesh, [kinds[place]])
            done[id(value)] = nn.Parameter(dt, requires_grad=value.requires_grad) if is_param else dt
        if is_param:
            owner.register_parameter(leaf, done[id(value)])
        else:
            owner.register_buffer(leaf, done[id(value)], persistent=leaf not in owner._non_persistent_buffers_set)
    recompile = getattr(stage, "recompile", None)
    if callable(recompile):
        recompile()
    return sharded


def to_replicated(mesh: DeviceMesh, values: tuple[object, ...]) -> tuple[object, ...]:
    """A stage's inputs as replicated DTensors (every shard got the same tensor from its neighbour)."""
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(v, mesh, [Replicate()], run_check=False) if isinstance(v, torch.Tensor) else v
                 for v in values)


def to_full(value: object) -> object:
    """A stage's DTensor outputs as full plain tensors (what the pipeline sends on)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils import _pytree as pytree

    def full(t: object) -> object:
        if isinstance(t, DTensor):
            return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim).to_local()
        return t

    return pytree.tree_map(full, value)
