"""Tensor parallelism inside a stage: each stage's projections sharded over ``tp`` processes with DTensor, the
way Megatron-LM shards a transformer.

The layout (``default_tp_plan``): the attention's q, k, v column-wise (each shard whole heads) and its output
projection row-wise (a fused ``[q | k | v]``, GPT-2's ``c_attn``, by heads: shard t its heads' q, k and v
columns), the MLP's first projections column-wise and its last row-wise, the vocabulary (embedding rows, LM head
columns, the loss on sharded logits): the model's own HF ``base_model_tp_plan`` where it has one, else by module
name, else Megatron's rule for ``nn.Linear`` chains. The layout ``pv.plan_cluster`` prices
(``Collectives(tp_layout="megatron")``).
``check_tp_plan`` refuses a layout that cannot work (sizes or heads ``tp`` does not divide) before any process.

pipeviz's stages are flat graphs (``pipeviz.adapter.flatten_stage``), not trees of ``nn.Linear``, so torch's
``parallelize_module`` has no module to hook. ``shard_stage`` does what it would (with
``pipeviz.adapter.dtensor_graph.prepare_graph``): the placements
``ColwiseParallel`` / ``RowwiseParallel`` give go on the parameters, and the layouts their hooks give go into the
graph (a column-wise projection's input replicated, its gradient all-reduced once: Megatron's *f*; a row-wise
projection's output all-reduced at once: *g*). It also makes the traced code DTensor-ready: torch.export's
metadata asserts dropped, plain tensors made in the graph treated as replicated, sharding rules for the CPU
attention kernel and for library ops (transformers' MoE experts, replicated). The stage's inputs enter as
replicated DTensors and its outputs leave as whole tensors, so the pipeline's sends and receives are unchanged:
shard ``t`` of a stage talks to shard ``t`` of its neighbours.

Example:
    >>> run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, tp=2)
    >>> run = pv.launch(plan, "1F1B", 4, 2, inputs=(x,), target=y, loss_fn=pv.cross_entropy, tp=2,
    ...                 tp_plan={"layer0.lin": "colwise", "layer1.lin": "rowwise"})
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeviz.adapter.dtensor_graph import prepare_graph

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipeviz.plan.split import SplitPlan

__all__ = ["FUSED_PIECES", "STYLES", "check_sequence_parallel", "check_tp_plan", "class_sharded", "default_tp_plan",
           "shard_stage", "shard_summary", "sharded_modules", "tp_placements", "vocab_modules"]

STYLES = ("colwise", "rowwise")


# Megatron's layout by module name, for models without HF's own plan: the attention's q, k, v projections and the
# MLP's first projections column-wise (each shard its heads / its slice of the hidden units), the attention's
# output projection and the MLP's last one row-wise (their partial sums all-reduced). HF's own names (BERT,
# DistilBERT, GPT-2, OPT, Llama-likes) and torch's. GPT-2's fused c_attn ([q | k | v] in one projection) is cut
# by heads as Megatron cuts its fused QKV: shard t holds q's, k's and v's columns of its heads (``FUSED``).
_COLWISE = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|query|key|value|q_lin|k_lin|v_lin|gate_proj|up_proj|fc1|c_fc|"
                      r"lin1|w1|w3|c_attn)$|\.intermediate\.dense$")
_ROWWISE = re.compile(r"(^|\.)(o_proj|out_proj|out_lin|down_proj|fc2|lin2|w2)$|\.attention\.output\.dense$|"
                      r"\.(mlp|attn)\.c_proj$|\.(layer|layers)\.\d+\.output\.dense$")
_ATTENTION = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|query|key|value|q_lin|k_lin|v_lin|c_attn)$")
# A fused q/k/v projection (GPT-2's c_attn): its output is [q | k | v], split in three by the attention
_FUSED = re.compile(r"(^|\.)c_attn$")
FUSED_PIECES = 3
_KV = re.compile(r"(^|\.)(k_proj|v_proj|key|value|k_lin|v_lin|c_attn)$")


def default_tp_plan(model: nn.Module, stages: list[tuple[str, ...]], tp: int | None = None) -> dict[str, str]:
    """The layout Megatron-LM gives a transformer, for the projections inside ``stages`` (each stage's layers,
    module names): the model's own ``config.base_model_tp_plan`` where HF ships one (Llama, Mistral, Qwen2, ...:
    its ``colwise`` / ``rowwise`` entries; packed and expert entries stay replicated), else by name (q / k / v and
    the MLP's first projections column-wise, the attention's output and the MLP's last row-wise: BERT, GPT-2's
    MLP, OPT, ...), else Megatron's MLP rule for plain ``nn.Linear`` chains: in execution order, a Linear whose
    output feeds the next Linear's input size is column-wise and that next one row-wise.

    And the vocabulary (``vocab_modules``): the input embedding's rows (``"rowwise"``, as torch's
    ``RowwiseParallel`` shards an ``nn.Embedding``) and the LM head's columns (``"colwise"``), where a stage holds
    them and ``tp`` (when given) divides the vocabulary; a vocabulary ``tp`` does not divide stays whole."""
    return {**_layers_plan(model, stages), **vocab_modules(model, stages, tp)}


def vocab_modules(model: nn.Module, stages: list[tuple[str, ...]], tp: int | None = None) -> dict[str, str]:
    """The model's input embedding (``"rowwise"``: each shard a slice of the vocabulary's rows; the lookups'
    partial results summed, as Megatron's ``VocabParallelEmbedding``) and its LM head (``"colwise"``: each shard
    the logits of its slice of the vocabulary, which ``pv.cross_entropy`` takes as they are, torch's
    ``loss_parallel``: no rank holds the whole logits), found by HF's ``get_input_embeddings`` /
    ``get_output_embeddings``, kept where a stage of ``stages`` holds them and ``tp`` divides the vocabulary."""
    out: dict[str, str] = {}
    names = {id(m): n for n, m in model.named_modules()}
    layers = [layer.split("@")[0] for held in stages for layer in held]
    for mod, style in ((_embeddings(model, "get_input_embeddings"), "rowwise"),
                       (_embeddings(model, "get_output_embeddings"), "colwise")):
        name = names.get(id(mod)) if mod is not None else None
        if mod is None or name is None or not any(name == layer or name.startswith(layer + ".") for layer in layers):
            continue
        vocab = mod.num_embeddings if isinstance(mod, nn.Embedding) else (
            _features(mod)[1] if _is_projection(mod) else None)
        if vocab is not None and (tp is None or vocab % tp == 0):
            out[name] = style
    return out


def _embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    """HF's ``get_input_embeddings()`` / ``get_output_embeddings()``, or None where the model has none."""
    found = getattr(model, getter, None)
    try:
        mod = found() if callable(found) else None
    except (NotImplementedError, AttributeError):
        return None
    return mod if isinstance(mod, nn.Module) else None


def _layers_plan(model: nn.Module, stages: list[tuple[str, ...]]) -> dict[str, str]:
    """``default_tp_plan`` without the vocabulary: the attention's and the MLP's projections."""
    inside = [(name, mod) for layers in stages for layer in layers for name, mod in _projections(model, layer)]
    hf = _hf_plan(model, [name for name, _ in inside])
    if hf:
        return hf
    head = _embeddings(model, "get_output_embeddings")
    named = {name: "colwise" if _COLWISE.search(name) else "rowwise"
             for name, _ in inside if (_COLWISE.search(name) or _ROWWISE.search(name))}
    if "colwise" in named.values() and "rowwise" in named.values():
        return _fused_with_their_split(model, stages, named)
    plan: dict[str, str] = {}
    for layers in stages:
        linears = [(name, mod) for layer in layers for name, mod in _projections(model, layer)
                   if isinstance(mod, nn.Linear) and mod is not head]
        i = 0
        order = [n for layer in layers for n, _ in _modules(model, layer)]
        while i + 1 < len(linears):
            (a, la), (b, lb) = linears[i], linears[i + 1]
            if la.out_features == lb.in_features and not _running_stats_between(model, order, a, b):
                plan[a], plan[b] = "colwise", "rowwise"
                i += 2
            else:
                i += 1
    return plan


def _fused_with_their_split(model: nn.Module, stages: list[tuple[str, ...]], named: dict[str, str]) -> dict[str, str]:
    """``named`` less each fused q/k/v projection whose stage holds none of its attention's row-wise projections:
    the stage ends at the projection, so the split into q, k and v that sharding by heads needs runs in the next
    stage (found by pipeviz fuzz: GPT-2 split after ``h.1.attn.c_attn`` under tp=2 failed inside the processes).
    Such a projection stays replicated."""
    out = dict(named)
    for layers in stages:
        held = {name for layer in layers for name, _ in _projections(model, layer)}
        for name in held:
            if _FUSED.search(name) and name in out:
                parent = name.rsplit(".", 1)[0] + "."
                if not any(o.startswith(parent) and out.get(o) == "rowwise" for o in held):
                    del out[name]
    return out


def sharded_modules(plan: SplitPlan, tp_plan: Mapping[str, str] | None = None, tp: int | None = None,
                    ) -> dict[str, str]:
    """The modules a tensor-parallel launch of ``plan`` over ``tp`` shards shards (module -> ``"colwise"`` /
    ``"rowwise"``): ``tp_plan`` as given, else ``default_tp_plan`` over the plan's stages. What ``pv.launch``
    shards, ``pv.simulate`` costs and the Explorer describes: one answer for all three."""
    if tp_plan is not None:
        return dict(tp_plan)
    return default_tp_plan(plan.graph.model, [s.layers for s in plan.stages], tp)



def _hf_plan(model: nn.Module, names: list[str]) -> dict[str, str]:
    """HF's ``base_model_tp_plan`` (patterns like ``layers.*.self_attn.q_proj`` under the base model) matched
    against ``names``; only its column-wise and row-wise entries."""
    config = getattr(model, "config", None)
    patterns = getattr(config, "base_model_tp_plan", None) or {}
    if not isinstance(patterns, Mapping) or not patterns:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    out: dict[str, str] = {}
    for pattern, style in patterns.items():
        if style not in STYLES:
            continue
        for full in (f"{prefix}.{pattern}" if prefix else pattern, pattern):
            for name in names:
                if fnmatch.fnmatchcase(name, full):
                    out[name] = style
    return out


def _projections(model: nn.Module, layer: str) -> list[tuple[str, nn.Module]]:
    """The ``nn.Linear`` and HF ``Conv1D`` modules (GPT-2's) inside ``layer``."""
    base = layer.split("@")[0]
    try:
        root = model.get_submodule(base)
    except AttributeError:
        return []
    return [(f"{base}.{n}" if n else base, m) for n, m in root.named_modules() if _is_projection(m)]


def _modules(model: nn.Module, layer: str) -> list[tuple[str, nn.Module]]:
    base = layer.split("@")[0]
    try:
        root = model.get_submodule(base)
    except AttributeError:
        return []
    return [(f"{base}.{n}" if n else base, m) for n, m in root.named_modules()]


def _running_stats_between(model: nn.Module, order: list[str], a: str, b: str) -> bool:
    """A batch norm keeping running statistics between two Linears: sharding the pair would hand it a shard of the
    features under DTensor, which computes right but never updates its running statistics (found by pipeviz fuzz:
    a BatchNorm between two Linears lost them under tp=2), so the pair stays replicated."""
    if a not in order or b not in order:
        return False
    between = order[order.index(a) + 1:order.index(b)]
    return any(isinstance(m := model.get_submodule(n), nn.modules.batchnorm._NormBase) and m.track_running_stats
               for n in between)


def _is_projection(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or _is_conv1d(mod)


def _is_conv1d(mod: nn.Module) -> bool:
    """HF's ``Conv1D`` (GPT-2): a Linear whose weight is stored transposed, ``[in, out]``."""
    return type(mod).__name__ == "Conv1D" and isinstance(getattr(mod, "nf", None), int)


def _features(mod: nn.Module) -> tuple[int, int]:
    """(input, output) features of a projection."""
    if _is_conv1d(mod):
        w = mod.get_parameter("weight")
        return int(w.shape[0]), int(w.shape[1])
    assert isinstance(mod, nn.Linear)
    return mod.in_features, mod.out_features


def check_tp_plan(model: nn.Module, plan: Mapping[str, str], tp: int) -> dict[str, str]:
    """``plan`` checked against the model: each key an ``nn.Linear`` (or GPT-2's ``Conv1D``) styled ``colwise`` or
    ``rowwise``, or an ``nn.Embedding`` styled ``rowwise`` (its vocabulary rows), each sharded size divisible by
    ``tp``, and the attention's heads (query and key/value heads, from the model's config) divisible by ``tp``
    where q / k / v are sharded; returns the placements per parameter name (``tp_placements``), under every name a
    tied parameter has. Raises ``ValueError`` naming the module, the sizes and the fix."""
    mods = {n: m for n, m in model.named_modules() if _is_projection(m) or isinstance(m, nn.Embedding)}
    out: dict[str, str] = {}
    for name, style in plan.items():
        if name not in mods:
            linears = [n for n, m in mods.items() if _is_projection(m)]
            raise ValueError(f"tp_plan names {name!r}, which is not an nn.Linear or nn.Embedding of the model. "
                             f"Valid: {', '.join(linears[:12])}{', …' if len(linears) > 12 else ''}.")
        if style not in STYLES:
            raise ValueError(f"tp_plan[{name!r}] is {style!r}; valid: 'colwise', 'rowwise'.")
        mod = mods[name]
        if isinstance(mod, nn.Embedding):
            if style != "rowwise":
                raise ValueError(f"tp_plan[{name!r}] is 'colwise', but {name!r} is an nn.Embedding, which pipeviz "
                                 "shards by its vocabulary rows only. Fix: 'rowwise', or leave it out (replicated).")
            size, what = mod.num_embeddings, "vocabulary rows"
        else:
            fan_in, fan_out = _features(mod)
            size = fan_out if style == "colwise" else fan_in
            what = "output features" if style == "colwise" else "input features"
        fused = style == "colwise" and bool(_FUSED.search(name))
        if size % (tp * (FUSED_PIECES if fused else 1)):
            shards = f"tp={tp} shards cannot share equally" + (
                f" in each of its {FUSED_PIECES} parts (q, k, v)" if fused else "")
            raise ValueError(f"{name!r} has {size} {what}, which {shards}. Fix: a tp that divides "
                             f"{size // FUSED_PIECES if fused else size}, or leave {name!r} out of tp_plan "
                             "(replicated).")
        bias = getattr(mod, "bias", None) is not None
        out.update(tp_placements(name, style, bias, transposed=_is_conv1d(mod),
                                 embedding=isinstance(mod, nn.Embedding), fused=fused))
    _check_heads(model, plan, tp)
    return _with_aliases(model, out)


def _with_aliases(model: nn.Module, placements: dict[str, str]) -> dict[str, str]:
    """``placements`` under every name of each parameter (a tied LM head's weight is the embedding's)."""
    names: dict[int, list[str]] = {}
    for n, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), []).append(n)
    out = dict(placements)
    for group in names.values():
        places = {placements[n] for n in group if n in placements}
        if len(places) > 1:
            raise ValueError(f"{group[0]!r} and {group[1]!r} are one tied parameter that tp_plan shards two ways "
                             f"({', '.join(sorted(places))}). Fix: give the modules holding it layouts that cut it "
                             "alike, or leave both out.")
        if places:
            place = places.pop()
            out.update(dict.fromkeys(group, place))
    return out


def check_sequence_parallel(model: nn.Module, plan: Mapping[str, str], stages: list[tuple[str, ...]]) -> None:
    """Sequence parallelism splits the tokens between the sharded regions, so the attention's projections must be
    sharded (a replicated one would attend over its shard's tokens only; per-token projections, an LM head's
    transform, may stay whole). HF ``Conv1D`` (GPT-2), which flattens the tokens, is gathered before it flattens
    and split again after it unflattens (``pipeviz.adapter.dtensor_graph``). Raises ``ValueError`` naming the
    first attention projection left whole, and the fix."""
    for layers in stages:
        for layer in layers:
            for name, _ in _projections(model, layer):
                mixes = _ATTENTION.search(name) or re.search(r"(^|\.)(c_attn|qkv|qkv_proj|Wqkv|in_proj)$", name)
                if name in plan or not mixes:
                    continue
                raise ValueError(f"sequence_parallel=True: {name!r} is not sharded (tp_plan leaves it replicated), "
                                 "so it would see only its shard's tokens. Fix: sequence_parallel=False (the "
                                 f"tensor-parallel regions are unchanged), or a tp_plan that shards {name!r}.")


def _check_heads(model: nn.Module, plan: Mapping[str, str], tp: int) -> None:
    """Column-wise q / k / v give each shard whole heads only when ``tp`` divides the head counts."""
    config = getattr(model, "config", None)
    heads = _config_int(config, "num_attention_heads", "n_head", "num_heads")
    if heads is None:
        return
    kv = _config_int(config, "num_key_value_heads") or heads
    sharded = [n for n, style in plan.items() if style == "colwise" and _ATTENTION.search(n)]
    if not sharded:
        return
    for count, what, names in ((heads, "attention heads", sharded),
                               (kv, "key/value heads", [n for n in sharded if _KV.search(n)])):
        if names and count % tp:
            valid = ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)
            raise ValueError(f"tp={tp} does not divide the model's {count} {what} ({names[0]!r} is sharded "
                             f"column-wise: each shard must hold whole heads). Valid tp: {valid}. Fix: one of "
                             f"those, or leave the attention's projections out of tp_plan (replicated).")


def shard_summary(model: nn.Module, plan: Mapping[str, str], tp: int) -> list[str]:
    """What each of ``tp`` shards holds under ``plan`` (module -> ``"colwise"`` / ``"rowwise"``), in words: the
    attention's heads (shard t holds heads ``t*h/tp`` to ``(t+1)*h/tp - 1``), the MLP's hidden units, and what
    stays whole on every shard.

    Example:
        >>> shard_summary(llama, default_tp_plan(llama, stages), 2)
        ['attention: shard t holds heads 2t-2t+1 of 4 (key/value heads t of 2)', 'MLP: 64 of 128 hidden units ...']
    """
    mods = dict(model.named_modules())
    config = getattr(model, "config", None)
    lines: list[str] = []
    attention = [n for n, style in plan.items() if style == "colwise" and _ATTENTION.search(n)]
    heads = _config_int(config, "num_attention_heads", "n_head", "num_heads")
    if attention and heads:
        kv = _config_int(config, "num_key_value_heads") or heads
        per, kv_per = heads // tp, max(kv // tp, 1)
        kv_part = f" (key/value heads {_span(kv_per)} of {kv})" if kv != heads else ""
        fused = " (of the fused q/k/v: its q, k and v columns of those heads)" if any(
            _FUSED.search(n) for n in attention) else ""
        lines.append(f"attention: shard t holds heads {_span(per)} of {heads}{kv_part}{fused}, and the output "
                     "projection's matching input columns; their sums are all-reduced")
    elif heads:
        lines.append("attention: whole on every shard (its projections are not in the plan)")
    names = {id(m): n for n, m in mods.items()}
    embedding, head = (names.get(id(_embeddings(model, g))) for g in ("get_input_embeddings", "get_output_embeddings"))
    mlp = [n for n, style in plan.items()
           if style == "colwise" and not _ATTENTION.search(n) and n in mods and n != head]
    if mlp:
        units = _features(mods[mlp[0]])[1]
        lines.append(f"MLP: {units // tp} of {units} hidden units per shard ({mlp[0].rsplit('.', 1)[-1]} column-wise, "
                     "its partner row-wise)")
    elif not attention:
        lines.append(f"{len(plan)} projections sharded (tp_plan)")
    vocab = _config_int(config, "vocab_size")
    cut = [what for name, what in ((embedding, "the embedding's rows"), (head, "the LM head's columns"))
           if name is not None and name in plan]
    if cut and vocab and vocab % tp == 0:
        lines.append(f"vocabulary: shard t holds tokens {_span(vocab // tp)} of {vocab} ({' and '.join(cut)}: the "
                     f"lookups' parts summed, the loss taken on each shard's logits, no shard holding all {vocab})")
    whole = [what for name, what in ((embedding, "the embedding"), (head, "the LM head"))
             if name is not None and name not in plan]
    reason = f" (tp={tp} does not divide the vocabulary of {vocab})" if whole and vocab and vocab % tp else ""
    lines.append("whole on every shard: " + ", ".join([*whole, "norms"]) + reason
                 + ", and every projection tp_plan leaves out")
    return lines


def _span(n: int) -> str:
    """Shard t's share of n items each: ``"nt-nt+n-1"`` (``"t"`` for one)."""
    return "t" if n == 1 else f"{n}t-{n}t+{n - 1}"


def _config_int(config: object, *keys: str) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def tp_placements(module: str, style: str, bias: bool, transposed: bool = False, embedding: bool = False,
                  fused: bool = False) -> dict[str, str]:
    """Parameter name -> placement (``"shard0"``, ``"shard1"``, ``"fused0"``, ``"fused1"``, ``"replicate"``) for
    one projection. ``transposed``: the weight is stored ``[in, out]`` (HF's ``Conv1D``), so its dims swap.
    ``embedding``: an ``nn.Embedding`` sharded row-wise (its vocabulary rows, dim 0). ``fused``: a column-wise
    ``[q | k | v]`` projection, each of its ``FUSED_PIECES`` parts cut alike (``"fusedD"``: shard t holds the t-th
    slice of each part along dim D, its heads' q, k and v: DTensor's ``_StridedShard(D, split_factor=3)``)."""
    if embedding:
        return {f"{module}.weight": "shard0"}
    out_dim, in_dim = ("shard1", "shard0") if transposed else ("shard0", "shard1")
    if style == "colwise" and fused:
        return {f"{module}.weight": "fused" + out_dim[-1], **({f"{module}.bias": "fused0"} if bias else {})}
    if style == "colwise":
        return {f"{module}.weight": out_dim, **({f"{module}.bias": "shard0"} if bias else {})}
    return {f"{module}.weight": in_dim, **({f"{module}.bias": "replicate"} if bias else {})}


def shard_stage(stage: nn.Module, params: Mapping[str, str], placements: Mapping[str, str], mesh: DeviceMesh,
                sequence_parallel: bool = False) -> int:
    """Turn ``stage``'s parameters and buffers into DTensors over the 1-D ``mesh``: ``params`` maps canonical
    names to the stage's own attribute paths, ``placements`` canonical names to ``"shard0"`` / ``"shard1"``;
    everything else is replicated (a DTensor op takes no plain tensor: BatchNorm's statistics too). A tensor
    held under two paths stays one tensor. ``sequence_parallel``: the activations between the sharded regions
    split by token (``prepare_graph``). Returns how many parameters were sharded."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard  # (torch's name for a strided cut)

    kinds = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate(),
             **{f"fused{d}": _StridedShard(d, split_factor=FUSED_PIECES) for d in (0, 1)}}
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
    prepare_graph(stage, params, placements, sequence_parallel)
    return sharded


def to_replicated(mesh: DeviceMesh, values: tuple[object, ...]) -> tuple[object, ...]:
    """A stage's inputs as replicated DTensors (every shard got the same tensor from its neighbour)."""
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(v, mesh, [Replicate()], run_check=False) if isinstance(v, torch.Tensor) else v
                 for v in values)


def class_sharded(value: object) -> bool:
    """Whether ``value`` is a DTensor sharded along its last dim (an LM head's logits cut by vocabulary): what
    torch's ``loss_parallel`` cross-entropy takes without gathering the logits."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) and value.ndim > 0 and any(
        p.is_shard(value.ndim - 1) or p.is_shard(-1) for p in value.placements)


def to_full(value: object) -> object:
    """A stage's DTensor outputs as full plain tensors (what the pipeline sends on)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils import _pytree as pytree

    def full(t: object) -> object:
        if isinstance(t, DTensor):
            return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim).to_local()
        return t

    return pytree.tree_map(full, value)
