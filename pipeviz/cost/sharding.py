"""What a tensor-parallel shard keeps of a stage: the share of its parameters and of its saved activations,
from the layout ``pv.launch`` shards (``default_tp_plan`` or ``tp_plan``), not a uniform 1/tp.

A column-wise projection's weight is cut into tp pieces and its output is a slice of the features (the heads, the
MLP's hidden units); everything computed from a slice is a slice, until a row-wise projection sums the pieces
back into a whole tensor. Embeddings, norms, the LM head and the residual stream stay whole on every shard. Measured
on HF Llama at tp = 2 (``tests/test_tensor_parallel_hf.py``), the uniform 1/tp put a stage's parameters 15 % and
its activations 27 % under what the shards held.

Example:
    >>> shares = tp_shares(plan, {"model.layers.0.mlp.gate_proj": "colwise", ...}, tp=2)
    >>> shares.params[0], shares.activations[0]      # fractions of stage 0's bytes one shard keeps
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeviz.capture import op_saved_bytes

if TYPE_CHECKING:
    from pipeviz.plan import SplitPlan

__all__ = ["TpShares", "tp_shares"]


@dataclass(frozen=True)
class TpShares:
    """Per stage, the fraction of its bytes one of the ``tp`` shards keeps (1 / tp where everything is cut, 1
    where nothing is)."""

    params: tuple[float, ...]
    activations: tuple[float, ...]


def tp_shares(plan: SplitPlan, sharded: Mapping[str, str], tp: int) -> TpShares:
    """The shares of ``plan``'s stages one shard keeps when the modules in ``sharded`` (module name ->
    ``"colwise"`` / ``"rowwise"``) are cut ``tp`` ways: a sharded projection's weight (and a column-wise one's
    bias) counts 1 / tp, every other parameter whole; a saved tensor counts 1 / tp where the op saving it reads a
    slice (downstream of a column-wise projection, up to and including the row-wise one that sums it), else
    whole (a column-wise projection saves its whole input)."""
    cap = plan.graph.capture
    canonical = {alias: name for name, names in cap.aliases.items() for alias in names}
    weights: dict[str, str] = {}  # canonical weight name -> style
    cut: set[str] = set()  # canonical parameter names one shard holds a 1/tp piece of
    for module, style in sharded.items():
        weight = canonical.get(f"{module}.weight", f"{module}.weight")
        weights[weight] = style
        cut.add(weight)
        if style == "colwise":
            cut.add(canonical.get(f"{module}.bias", f"{module}.bias"))
    n = plan.num_stages
    slices: set[int] = set()  # ops whose output is a slice of the features
    saved, kept = [0.0] * n, [0.0] * n
    for op in cap.ops:
        styles = {weights[p] for p in op.params if p in weights}
        reads_slice = any(i in slices for i in op.inputs)
        if "colwise" in styles:
            slices.add(op.index)
            share = 1.0  # it saves its whole input
        elif "rowwise" in styles:
            share = 1 / tp  # it saves its sliced input; its output is summed whole
        elif reads_slice:
            slices.add(op.index)
            share = 1 / tp
        else:
            share = 1.0
        stage = plan._stage_of_op(op.index)
        nbytes = op_saved_bytes(op)
        saved[stage] += nbytes
        kept[stage] += nbytes * share
    held: list[set[str]] = [set() for _ in range(n)]
    for p, uses in plan.graph.index.param_uses.items():
        for u in uses:
            held[plan._stage_of_op(u)].add(p)
    sizes = plan.graph.index.nbytes
    params = []
    for names in held:
        whole = sum(sizes.get(p, 0) for p in names)
        piece = sum(sizes.get(p, 0) / (tp if p in cut else 1) for p in names)
        params.append(piece / whole if whole else 1.0)
    return TpShares(params=tuple(params),
                    activations=tuple(k / s if s else 1.0 for k, s in zip(kept, saved, strict=True)))
