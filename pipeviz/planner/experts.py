"""Expert parallelism in ``pv.plan_cluster``: which ``ep`` degrees a model's routed experts allow, and one device's
costs with them (``pipeviz.sim.experts``: the all-to-alls, 1/ep of the experts' weights, gradients and optimizer
state), priced as ``pv.simulate`` prices the row.

Example:
    >>> expert_counts(graph)                    # {'model.layers.0.mlp.experts': 8, ...}: routed experts per block
    >>> ep_degrees(graph, None)                 # [1, 2, 4, 8]: what plan_cluster searches (divisors of 8)
    >>> ep_degrees(graph, [3])                  # ValueError naming ep=3 and the valid choices
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from pipeviz.sim.experts import ep_exchanges, with_experts

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pipeviz.capture.view import GraphView
    from pipeviz.cost.model import Costs
    from pipeviz.cost.options import CostOptions
    from pipeviz.plan.split import SplitPlan

__all__ = ["ep_degrees", "expert_costs", "expert_counts"]

_LISTED = re.compile(r"^(?P<block>.+\.experts)\.\d+$")  # an nn.ModuleList's expert (MoENet, transformers 4.x)
_EXPERTS = re.compile(r"^.+\.experts$")  # a block's routed experts (not Qwen2-MoE's shared_expert, DeepSeek's
# shared_experts: the character before "experts" is a dot)


def expert_counts(graph: GraphView) -> dict[str, int]:
    """The routed experts of each MoE block the graph computes: ``{"<block>.experts": E}``. Experts in an
    ``nn.ModuleList`` (``<block>.experts.<e>``: MoENet, transformers 4.x) are counted as its entries;
    transformers 5.x's fused experts (3-D ``gate_up_proj`` / ``down_proj``) by their leading dim. Empty for a dense
    model. (A ``zoo.repeat_layers`` copy of a block is counted as the traced block it copies.)"""
    cap = graph.capture
    listed: dict[str, set[str]] = {}  # block -> its experts seen in the ops (a ModuleList is never called itself)
    fused: set[str] = set()
    for op in cap.ops:
        for name in op.stack:
            if m := _LISTED.match(name):
                listed.setdefault(m["block"], set()).add(name)
            elif _EXPERTS.match(name):
                fused.add(name)
    counts: dict[str, int | None] = {}
    for name in sorted(fused | set(listed)):
        _, children = cap.modules.get(name, ("", ()))
        entries = [c for c in children if re.fullmatch(re.escape(name) + r"\.\d+", c)] or listed.get(name)
        counts[name] = len(entries) if entries else _fused_count(cap.model, name)
    traced = [n for n in counts.values() if n]
    return {k: v or traced[0] for k, v in counts.items() if v or traced}


def _fused_count(model: object, name: str) -> int | None:
    """The leading dim of a fused experts module's 3-D weights (None where the module is not in the model: a
    repeated block's copy, counted as the traced one)."""
    try:
        module = model.get_submodule(name)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return None
    n = getattr(module, "num_experts", None)
    if isinstance(n, int):
        return n
    for p in module.parameters(recurse=False):
        if p.dim() == 3:
            return int(p.shape[0])
    return None


def ep_degrees(graph: GraphView, ep: Sequence[int] | None) -> list[int]:
    """The expert-parallel degrees ``plan_cluster`` searches: ``ep`` as given, checked, else every divisor of the
    routed experts' count (each of ep ranks holds an equal block of every MoE block's experts, as torchtitan and
    Megatron-LM shard them); ``[1]`` for a dense model. A layout uses the degrees that divide its ``dp x cp``.

    Raises:
        ValueError: an ep that is not a positive int, an ep > 1 on a model without routed experts, or one that does
            not divide the experts' count (the message names the value and the valid choices).
    """
    counts = expert_counts(graph)
    common = math.gcd(*counts.values()) if counts else 1
    valid = [e for e in range(1, common + 1) if common % e == 0]
    if ep is None:
        return valid
    eps = list(ep)
    for e in eps:
        if not isinstance(e, int) or isinstance(e, bool) or e < 1:
            raise ValueError(f"ep={e!r} is not a positive int (the number of ranks each MoE block's routed experts are "
                             f"sharded over). Valid ep: {', '.join(map(str, valid))}.")
        if e > 1 and not counts:
            raise ValueError(f"ep={e}: the model has no routed experts (no '<block>.experts' module, listed or fused) "
                             "for expert parallelism to shard. Fix: ep=1 (or leave ep out), or a mixture-of-experts "
                             "model.")
        if common % e:
            sizes = sorted(set(counts.values()))
            raise ValueError(f"ep={e} does not divide the {'/'.join(map(str, sizes))} routed experts of the model's "
                             f"MoE blocks: each of ep ranks holds an equal block of them. Valid ep: "
                             f"{', '.join(map(str, valid))}. Fix: one of those.")
    return eps


def expert_costs(costs: Costs, plan: SplitPlan, base: CostOptions, ep: int, tp: int, cp: int,
                 scale: float) -> Costs:
    """One device's costs per microbatch (``costs``: ``parallel_costs`` of a microbatch of one replica, its
    ``cp`` share) with ``ep``: each forward and backward pays its all-to-alls on the link the expert-parallel group
    spans (``scale``: the microbatch's bytes relative to the trace, before the ``cp`` split) and the busiest
    owner's extra compute (``base.expert_imbalance``); the routed experts' weights, gradients and optimizer state
    are 1/ep (``pipeviz.sim.experts.with_experts``: what ``pv.simulate`` charges the row). ``costs`` unchanged at
    ep 1."""
    if ep == 1:
        return costs
    from pipeviz.schedule.mesh import Mesh

    # a group of ep replicas: the microbatch's rows, of its cp share, as pv.simulate spreads a step's over dp x cp
    mesh = Mesh(1, ep, tp, cp, ep)
    via = base.link(mesh.rank(0, dp=ep - 1, cp=cp - 1) + 1)  # pv.simulate's ep link: replicas g·ep … (g+1)·ep − 1
    ex = ep_exchanges(plan, 1, mesh, via, scale * ep)
    priced, _ = with_experts(costs, plan, ex, ep, base.expert_imbalance)
    return priced
