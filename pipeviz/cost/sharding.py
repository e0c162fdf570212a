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

from pipeviz.capture.export import op_saved_bytes

if TYPE_CHECKING:
    from pipeviz.plan.split import SplitPlan

__all__ = ["TpCollective", "TpShares", "launch_collectives", "launch_tp_seconds", "tp_shares"]


@dataclass(frozen=True)
class TpShares:
    """Per stage, the fraction of its bytes one of the ``tp`` shards keeps (1 / tp where everything is cut, 1
    where nothing is)."""

    params: tuple[float, ...]
    activations: tuple[float, ...]


def tp_shares(plan: SplitPlan, sharded: Mapping[str, str], tp: int, sequence_parallel: bool = False) -> TpShares:
    """The shares of ``plan``'s stages one shard keeps when the modules in ``sharded`` (module name ->
    ``"colwise"`` / ``"rowwise"``) are cut ``tp`` ways: a sharded projection's weight (and a column-wise one's
    bias) counts 1 / tp, every other parameter whole; a saved tensor counts 1 / tp where the op saving it reads a
    slice (downstream of a column-wise projection, up to and including the row-wise one that sums it; the loss
    of a vocabulary-sharded LM head), else whole (a column-wise projection saves its whole input, gathered).
    ``sequence_parallel``: what a row-wise projection's output reaches before the next column-wise one (norms,
    dropout, the residual stream) is split by token, 1 / tp too."""
    cap = plan.graph.capture
    canonical = {alias: name for name, names in cap.aliases.items() for alias in names}
    weights: dict[str, set[str]] = {}  # canonical weight name -> styles (a tied embedding / LM head: both)
    cut: set[str] = set()  # canonical parameter names one shard holds a 1/tp piece of
    for module, style in sharded.items():
        weight = canonical.get(f"{module}.weight", f"{module}.weight")
        weights.setdefault(weight, set()).add(style)
        cut.add(weight)
        if style == "colwise":
            cut.add(canonical.get(f"{module}.bias", f"{module}.bias"))
    n = plan.num_stages
    slices: set[int] = set()  # ops whose output is a slice of the features
    tokens: set[int] = set()  # sequence parallelism: ops whose output is a slice of the tokens
    saved, kept = [0.0] * n, [0.0] * n
    for op in cap.ops:
        styles = {s for p in op.params if p in weights for s in weights[p]}
        if len(styles) > 1:  # a tied weight: its embedding lookup is the row-wise use, its projection the column-wise
            styles = {"rowwise" if "embedding" in op.target else "colwise"}
        reads_slice = any(i in slices for i in op.inputs)
        if "colwise" in styles:
            slices.add(op.index)
            share = 1.0  # it saves its whole input
        elif "rowwise" in styles:
            share = 1 / tp  # it saves its sliced input; its output is summed whole (or split by token)
            if sequence_parallel:
                tokens.add(op.index)
        elif reads_slice or any(i in tokens for i in op.inputs):
            (slices if reads_slice else tokens).add(op.index)
            share = 1 / tp
        else:
            share = 1.0
        stage = plan._stage_of_op(op.index)
        nbytes = op_saved_bytes(op)
        saved[stage] += nbytes
        kept[stage] += nbytes * share
    last, loss = plan.graph.index.loss_saved
    if loss and 0 <= last < len(cap.ops):  # the loss's saved tensors: a slice where the logits are one
        stage = plan._stage_of_op(last)
        saved[stage] += loss
        kept[stage] += loss / tp if last in slices else loss
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


@dataclass(frozen=True)
class TpCollective:
    """One collective a tensor-parallel run of the launch's layout issues per microbatch: ``kind``
    (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``), in the ``backward`` or the forward, at ``layer``,
    on a tensor of ``nbytes`` whole (the traced batch's)."""

    kind: str
    backward: bool
    layer: str
    nbytes: float


def launch_collectives(plan: SplitPlan, sharded: Mapping[str, str], sequence_parallel: bool = False,
                       ) -> list[list[TpCollective]]:
    """Per stage, the collectives one microbatch's forward and backward issue when ``pv.launch`` shards the
    modules in ``sharded`` (what ``pipeviz.adapter.dtensor_graph`` puts in the graph, checked against the run's
    own TP events in ``tests/test_tensor_parallel_hf.py``):

    - a row-wise projection's output: all-reduced in the forward (Megatron's *g*), or, with
      ``sequence_parallel``, reduce-scattered by token (its gradient all-gathered in the backward);
    - a column-wise group's input (q, k and v share one; the MLP's first projections; the LM head): its
      gradient all-reduced in the backward (*f*), or all-gathered in the forward and reduce-scattered in the
      backward where the input is split by token;
    - a vocabulary-sharded embedding: its lookups' parts all-reduced (sequence parallel: reduce-scattered);
    - a column-wise output still sharded when the stage ends: on the last stage ``pv.cross_entropy``'s two
      all-reduces of one value per token (torch's ``loss_parallel``: a max and a sum), else all-gathered;
    - sequence parallel: the token-split stream all-gathered where the stage hands it on, and a stage entered
      with a whole stream splits it at its first row-wise output (an all-gather of that gradient back).

    Layers whose modules the model does not hold (a planning graph's repeated blocks) count as a held layer of
    their kind does."""
    model = plan.graph.model
    mods = dict(model.named_modules())
    order = {n: i for i, n in enumerate(mods)}
    kinds: dict[str, list[tuple[str, bool, str | None]]] = {}
    inside: dict[str, list[tuple[str, bool, str | None]]] = {}
    for layer in plan.graph.layers:
        base = layer.name.split("@")[0]
        if base in mods:
            found = sorted((m for m in sharded if m == base or m.startswith(base + ".")), key=order.__getitem__)
            inside[layer.name] = [(sharded[m], type(mods[m]).__name__ == "Embedding", m) for m in found]
            kinds.setdefault(layer.kind, inside[layer.name])
    for layer in plan.graph.layers:
        if layer.name not in inside:
            inside[layer.name] = [(style, emb, None) for style, emb, _ in kinds.get(layer.kind, [])]
    layers = {layer.name: layer for layer in plan.graph.layers}
    out: list[list[TpCollective]] = []
    for index, stage in enumerate(plan.stages):
        events: list[TpCollective] = []
        tokens = False  # sequence parallel: the stream is split by token here
        open_group: tuple[str, float, float] | None = None  # (layer, its output bytes, one value per token)

        def add(kind: str, backward: bool, name: str, nbytes: float, events: list[TpCollective] = events) -> None:
            events.append(TpCollective(kind, backward, name, nbytes))

        for name in stage.layers:
            layer = layers[name]
            for style, embedding, module in inside[name]:
                own = module is not None and module == name.split("@")[0]  # the layer is the projection itself
                if style == "colwise":
                    if open_group is None:  # a group's input: replicated once however many read it
                        width = layer.in_bytes if own else layer.out_bytes
                        if sequence_parallel and tokens:
                            add("all_gather", False, name, width)
                            add("reduce_scatter", True, name, width)
                        else:
                            add("all_reduce", True, name, width)
                    features = _out_features(mods.get(module or ""))
                    open_group = (name, layer.out_bytes, layer.out_bytes / features if features else 0.0)
                    continue
                open_group = None
                if not sequence_parallel:
                    add("all_reduce", False, name, layer.out_bytes)
                    continue
                add("reduce_scatter", False, name, layer.out_bytes)
                add("all_gather", True, name, layer.out_bytes)
                if not embedding and not tokens:  # the stage's whole stream meets the split one: split too
                    add("all_gather", True, name, layer.out_bytes)
                tokens = True
        last = index == plan.num_stages - 1
        if open_group is not None:
            group, nbytes, per_token = open_group
            if last:
                add("all_reduce", False, group, per_token)
                add("all_reduce", False, group, per_token)
            else:
                add("all_gather", False, group, nbytes)
        elif sequence_parallel and tokens and not last and stage.layers:
            add("all_gather", False, stage.layers[-1], layers[stage.layers[-1]].out_bytes)
        out.append(events)
    return out


def _out_features(mod: object) -> int:
    """A projection's output features (an ``nn.Linear``'s, HF ``Conv1D``'s ``nf``), else 0."""
    for key in ("out_features", "nf"):
        value = getattr(mod, key, None)
        if isinstance(value, int):
            return value
    return 0


def launch_tp_seconds(plan: SplitPlan, sharded: Mapping[str, str], microbatches: float, dp: int, tp: int,
                      via: tuple[float, float], scale: float = 1.0, sequence_parallel: bool = False,
                      ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage, seconds of the launch layout's collectives (``launch_collectives``) in one forward and in one
    backward of one microbatch (``nbytes x scale / (microbatches x dp)`` each): a ring all-reduce
    (``all_reduce_time``), an all-gather or a reduce-scatter half of one."""
    from pipeviz.cost.comm import all_reduce_time

    def seconds(c: TpCollective) -> float:
        nbytes = c.nbytes * scale / (microbatches * dp)
        whole = all_reduce_time(nbytes, tp, via)
        return whole if c.kind == "all_reduce" else whole / 2

    per_stage = launch_collectives(plan, sharded, sequence_parallel)
    return (tuple(sum(seconds(c) for c in cs if not c.backward) for cs in per_stage),
            tuple(sum(seconds(c) for c in cs if c.backward) for cs in per_stage))
