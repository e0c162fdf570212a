"""Tensor parallelism inside a stage: each stage's projections sharded over ``tp`` processes with DTensor, the
way Megatron-LM shards a transformer.

The layout (``default_tp_plan``): the attention's q, k, v column-wise (each shard whole heads) and its output
projection row-wise, the MLP's first projections column-wise and its last row-wise: the model's own HF
``base_model_tp_plan`` where it has one, else by module name, else Megatron's rule for ``nn.Linear`` chains.
``check_tp_plan`` refuses a layout that cannot work (sizes or heads ``tp`` does not divide) before any process.

pipeviz's stages are flat graphs (``pipeviz.adapter.flatten_stage``), not trees of ``nn.Linear``, so torch's
``parallelize_module`` has no module to hook. ``shard_stage`` does what it would: the placements
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

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipeviz.plan import SplitPlan

__all__ = ["STYLES", "check_tp_plan", "default_tp_plan", "shard_stage", "shard_summary", "sharded_modules",
           "tp_placements"]

STYLES = ("colwise", "rowwise")


# Megatron's layout by module name, for models without HF's own plan: the attention's q, k, v projections and the
# MLP's first projections column-wise (each shard its heads / its slice of the hidden units), the attention's
# output projection and the MLP's last one row-wise (their partial sums all-reduced). HF's own names (BERT,
# DistilBERT, GPT-2's MLP, OPT, Llama-likes) and torch's. Fused projections (GPT-2's c_attn, packed q/k/v) stay
# replicated: a column split of [q | k | v] would cut across them.
_COLWISE = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|query|key|value|q_lin|k_lin|v_lin|gate_proj|up_proj|fc1|c_fc|"
                      r"lin1|w1|w3)$|\.intermediate\.dense$")
_ROWWISE = re.compile(r"(^|\.)(o_proj|out_proj|out_lin|down_proj|fc2|lin2|w2)$|\.attention\.output\.dense$|"
                      r"\.mlp\.c_proj$|\.(layer|layers)\.\d+\.output\.dense$")
_ATTENTION = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|query|key|value|q_lin|k_lin|v_lin)$")
_KV = re.compile(r"(^|\.)(k_proj|v_proj|key|value|k_lin|v_lin)$")


def default_tp_plan(model: nn.Module, stages: list[tuple[str, ...]]) -> dict[str, str]:
    """The layout Megatron-LM gives a transformer, for the projections inside ``stages`` (each stage's layers,
    module names): the model's own ``config.base_model_tp_plan`` where HF ships one (Llama, Mistral, Qwen2, ...:
    its ``colwise`` / ``rowwise`` entries; packed and expert entries stay replicated), else by name (q / k / v and
    the MLP's first projections column-wise, the attention's output and the MLP's last row-wise: BERT, GPT-2's
    MLP, OPT, ...), else Megatron's MLP rule for plain ``nn.Linear`` chains: in execution order, a Linear whose
    output feeds the next Linear's input size is column-wise and that next one row-wise."""
    inside = [(name, mod) for layers in stages for layer in layers for name, mod in _projections(model, layer)]
    hf = _hf_plan(model, [name for name, _ in inside])
    if hf:
        return hf
    named = {name: "colwise" if _COLWISE.search(name) else "rowwise"
             for name, _ in inside if _COLWISE.search(name) or _ROWWISE.search(name)}
    if "colwise" in named.values() and "rowwise" in named.values():
        return named
    plan: dict[str, str] = {}
    for layers in stages:
        linears = [(name, mod) for layer in layers for name, mod in _projections(model, layer)
                   if isinstance(mod, nn.Linear)]
        i = 0
        while i + 1 < len(linears):
            (a, la), (b, lb) = linears[i], linears[i + 1]
            if la.out_features == lb.in_features:
                plan[a], plan[b] = "colwise", "rowwise"
                i += 2
            else:
                i += 1
    return plan


def sharded_modules(plan: SplitPlan, tp_plan: Mapping[str, str] | None = None) -> dict[str, str]:
    """The modules a tensor-parallel launch of ``plan`` shards (module -> ``"colwise"`` / ``"rowwise"``):
    ``tp_plan`` as given, else ``default_tp_plan`` over the plan's stages. What ``pv.launch`` shards,
    ``pv.simulate`` costs and the Explorer describes: one answer for all three."""
    if tp_plan is not None:
        return dict(tp_plan)
    return default_tp_plan(plan.graph.model, [s.layers for s in plan.stages])


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
    """``plan`` checked against the model: each key an ``nn.Linear`` (or GPT-2's ``Conv1D``), each style
    ``colwise`` or ``rowwise``, each sharded size divisible by ``tp``, and the attention's heads (query and
    key/value heads, from the model's config) divisible by ``tp`` where q / k / v are sharded; returns the
    placements per parameter name (``tp_placements``). Raises ``ValueError`` naming the module, the sizes and
    the fix."""
    linears = {n: m for n, m in model.named_modules() if _is_projection(m)}
    out: dict[str, str] = {}
    for name, style in plan.items():
        if name not in linears:
            raise ValueError(f"tp_plan names {name!r}, which is not an nn.Linear of the model. Valid: "
                             f"{', '.join(list(linears)[:12])}{', …' if len(linears) > 12 else ''}.")
        if style not in STYLES:
            raise ValueError(f"tp_plan[{name!r}] is {style!r}; valid: 'colwise', 'rowwise'.")
        mod = linears[name]
        fan_in, fan_out = _features(mod)
        size = fan_out if style == "colwise" else fan_in
        if size % tp:
            what = "output features" if style == "colwise" else "input features"
            raise ValueError(f"{name!r} has {size} {what}, which tp={tp} shards cannot share equally. Fix: a tp "
                             f"that divides {size}, or leave {name!r} out of tp_plan (replicated).")
        bias = getattr(mod, "bias", None) is not None
        out.update(tp_placements(name, style, bias, transposed=_is_conv1d(mod)))
    _check_heads(model, plan, tp)
    return out


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

        def span(n: int) -> str:
            return "t" if n == 1 else f"{n}t-{n}t+{n - 1}"

        kv_part = f" (key/value heads {span(kv_per)} of {kv})" if kv != heads else ""
        lines.append(f"attention: shard t holds heads {span(per)} of {heads}{kv_part}, and the output projection's "
                     "matching input columns; their sums are all-reduced")
    elif heads:
        lines.append("attention: whole on every shard (its projections are not in the plan: a fused q/k/v, as "
                     "GPT-2's c_attn, cannot be cut by columns into whole heads)")
    mlp = [n for n, style in plan.items() if style == "colwise" and not _ATTENTION.search(n) and n in mods]
    if mlp:
        units = _features(mods[mlp[0]])[1]
        lines.append(f"MLP: {units // tp} of {units} hidden units per shard ({mlp[0].rsplit('.', 1)[-1]} column-wise, "
                     "its partner row-wise)")
    elif not attention:
        lines.append(f"{len(plan)} projections sharded (tp_plan)")
    vocab = _config_int(config, "vocab_size")
    lines.append("whole on every shard: embeddings" + (f" and LM head (vocabulary {vocab})" if vocab else "")
                 + ", norms, and every projection tp_plan leaves out")
    return lines


def _config_int(config: object, *keys: str) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def tp_placements(module: str, style: str, bias: bool, transposed: bool = False) -> dict[str, str]:
    """Parameter name -> placement (``"shard0"``, ``"shard1"``, ``"replicate"``) for one projection.
    ``transposed``: the weight is stored ``[in, out]`` (HF's ``Conv1D``), so its dims swap."""
    out_dim, in_dim = ("shard1", "shard0") if transposed else ("shard0", "shard1")
    if style == "colwise":
        return {f"{module}.weight": out_dim, **({f"{module}.bias": "shard0"} if bias else {})}
    return {f"{module}.weight": in_dim, **({f"{module}.bias": "replicate"} if bias else {})}


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
    _drop_metadata_asserts(stage)
    _megatron_boundaries(stage, params, placements)
    _replicate_plain_tensors()
    _register_cpu_attention()
    _register_custom_ops(stage)
    _register_data_dependent()
    recompile = getattr(stage, "recompile", None)
    if callable(recompile):
        recompile()
    return sharded


def replicated(value: object) -> object:
    """``value`` as a replicated DTensor: Megatron's *g* after a row-wise projection (the all-reduce of its
    partial sums; in the backward, nothing). A plain value passes unchanged."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, DTensor) and any(not p.is_replicate() for p in value.placements):
        return value.redistribute(placements=[Replicate()] * value.device_mesh.ndim)
    return value


class _ReplicatedGrad(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient's partial sums (Megatron's *f*)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return replicated(grad)  # type: ignore[return-value]


def replicated_input(value: object) -> object:
    """A column-wise projection's input: replicated (as ``replicated``), and its gradient all-reduced once in
    the backward however many projections read it (Megatron's *f*: q, k and v share one)."""
    from torch.distributed.tensor import DTensor

    value = replicated(value)
    if isinstance(value, DTensor) and value.requires_grad:
        return _ReplicatedGrad.apply(value)
    return value


def _megatron_boundaries(stage: nn.Module, params: Mapping[str, str], placements: Mapping[str, str]) -> int:
    """Put the layouts torch's ``ColwiseParallel`` / ``RowwiseParallel`` hooks give a module into the flat
    graph, which has no module to hook: a column-wise projection's input replicated (once per input, however
    many projections read it: q, k and v share one), a row-wise projection's output replicated at once. Left to
    itself DTensor's op-by-op choice reduce-scattered a row-wise output, all-gathered it for the next
    projection and all-reduced inside RMSNorm (measured on HF Llama: 17-26 collectives per microbatch and stage
    against Megatron's 4, one all-reduce per row-wise projection each way). Returns the projections marked."""
    graph = getattr(stage, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return 0
    canonical = {inner: canon for canon, inner in params.items()}
    aten = torch.ops.aten

    def style(node: torch.fx.Node) -> tuple[str, int] | None:
        """("colwise" | "rowwise", index of the activation argument) for a sharded projection's node."""
        if node.op != "call_function":
            return None
        if node.target is aten.linear.default:  # weight [out, in]
            act, weight, by = 0, node.args[1], {"shard0": "colwise", "shard1": "rowwise"}
        elif node.target is aten.addmm.default:  # HF Conv1D: bias + x @ weight, weight [in, out]
            act, weight, by = 1, node.args[2], {"shard1": "colwise", "shard0": "rowwise"}
        else:
            return None
        if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
            return None
        kind = by.get(placements.get(canonical.get(str(weight.target), ""), ""))
        return (kind, act) if kind else None

    marked = 0
    inputs: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        found = style(node)
        if found is None:
            continue
        kind, act = found
        marked += 1
        if kind == "colwise":
            x = node.args[act]
            if isinstance(x, torch.fx.Node):
                if x not in inputs:
                    with graph.inserting_after(x):
                        inputs[x] = graph.call_function(replicated_input, (x,))
                args = list(node.args)
                args[act] = inputs[x]
                node.args = tuple(args)
        else:
            with graph.inserting_after(node):
                out = graph.call_function(replicated, (node,))
            node.replace_all_uses_with(out, delete_user_cb=lambda user, made=out: user is not made)
    return marked


_IMPLICIT: list[object] = []  # the entered implicit_replication context, held for the process's life


def _replicate_plain_tensors() -> None:
    """From now on, in this process, a plain tensor meeting a DTensor counts as replicated (torch's
    ``implicit_replication``), in the forward and in autograd's backward alike. A traced stage makes plain
    tensors of its own (HF Llama's positions and rotary table, BERT's extended mask, from ``arange``, ``ones``,
    a buffer): the same on every shard, so replicated is what they are; without it DTensor refuses ("aten.mul.Tensor
    got mixed torch.Tensor and DTensor"). Entered once, never left: a worker process runs only sharded stages."""
    if _IMPLICIT:
        return
    from torch.distributed.tensor.experimental import implicit_replication

    ctx = implicit_replication()
    ctx.__enter__()
    _IMPLICIT.append(ctx)


_REGISTERED: list[bool] = []


def _register_cpu_attention() -> None:
    """Sharding rules for the CPU kernel of ``scaled_dot_product_attention`` (forward and backward), which torch's
    DTensor has for the CUDA kernels only ("aten._scaled_dot_product_flash_attention_for_cpu.default does not have
    a sharding strategy registered"): replicated, sharded by heads (dim 1: tensor parallelism) or by batch (dim 0),
    as torch's rules for the CUDA flash kernel. A mask follows the sharded dim where it has it whole (a
    ``[b, 1, s, s]`` mask is replicated under head sharding). Registered once per process, through torch's public
    ``register_sharding``."""
    if _REGISTERED:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    ways = (Replicate(), Shard(1), Shard(0))

    def mask_place(p: Any, query: Any, attn_mask: Any) -> list[Any]:
        if attn_mask is None:
            return [None]
        dim = p.dim if isinstance(p, Shard) else None
        whole = (dim is not None and len(attn_mask.shape) == len(query.shape)
                 and attn_mask.shape[dim] == query.shape[dim] != 1)
        return [p if whole else Replicate()]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward(query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False,
                attn_mask: Any = None, scale: float | None = None) -> list[tuple[list[Any], list[Any]]]:
        # outputs (output, logsumexp); inputs q, k, v, dropout_p, is_causal, attn_mask, scale
        return [([p, p], [p, p, p, None, None, *mask_place(p, query, attn_mask), None]) for p in ways]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, dropout_p: float,
                 is_causal: bool, attn_mask: Any = None,
                 scale: float | None = None) -> list[tuple[list[Any], list[Any]]]:
        # outputs (grad q, k, v); inputs grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask, scale
        return [([p, p, p], [p, p, p, p, p, p, None, None, *mask_place(p, query, attn_mask), None]) for p in ways]

    _REGISTERED.append(True)


def _register_custom_ops(stage: nn.Module) -> list[str]:
    """Library ops outside torch's ``aten`` in ``stage``'s graph (transformers' ``grouped_mm_fallback``, which runs
    an MoE's experts) get a replicated-only sharding rule, as does their ``<name>_backward`` op where there is one:
    DTensor has no rule for them ("does not have a sharding strategy registered"), and pipeviz shards no expert,
    so every input they meet is replicated and so are their outputs. Returns the ops registered now."""
    graph = getattr(stage, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return []
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.experimental import register_sharding

    def replicated(op: torch._ops.OpOverload) -> None:
        outputs = len(op._schema.returns)

        def rule(*args: object, **kwargs: object) -> list[tuple[list[Any], list[Any]]]:
            ins = [Replicate() if isinstance(a, DTensorSpec) else None for a in (*args, *kwargs.values())]
            return [([Replicate()] * outputs, ins)]

        register_sharding(op)(rule)

    done: list[str] = []
    for node in graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.namespace == "aten":
            continue
        if str(op) in _CUSTOM_DONE:
            continue
        replicated(op)
        _CUSTOM_DONE.add(str(op))
        done.append(str(op))
        packet = getattr(getattr(torch.ops, op.namespace), f"{op._schema.name.split('::')[-1]}_backward", None)
        backward = getattr(packet, "default", None)
        if isinstance(backward, torch._ops.OpOverload) and str(backward) not in _CUSTOM_DONE:
            replicated(backward)
            _CUSTOM_DONE.add(str(backward))
            done.append(str(backward))
    return done


_CUSTOM_DONE: set[str] = set()


def _on_local_tensors(op_call: torch._ops.OpOverload, args: tuple[object, ...],
                      kwargs: Mapping[str, object] | None) -> object:
    """An op whose output shape depends on the data (``nonzero``) on replicated DTensors: run on the local tensors
    (the same on every shard) and replicated again. A sharded input is refused by name."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils import _pytree as pytree

    meshes: list[Any] = []

    def local(value: object) -> object:
        if isinstance(value, DTensor):
            if not all(p.is_replicate() for p in value.placements):
                raise NotImplementedError(f"{op_call} on a sharded DTensor ({value.placements}): its output's "
                                          "shape depends on every shard's data")
            meshes.append(value.device_mesh)
            return value.to_local()
        return value

    out = op_call(*pytree.tree_map(local, args), **pytree.tree_map(local, dict(kwargs or {})))
    return pytree.tree_map(lambda t: DTensor.from_local(t, meshes[0], [Replicate()], run_check=False)
                           if isinstance(t, torch.Tensor) and meshes else t, out)


def _register_data_dependent() -> None:
    """``nonzero`` on replicated DTensors (transformers 4.57's MoE routing: ``torch.where(expert_mask)``), which
    DTensor cannot propagate (its output's shape is the data's): through DTensor's handler table, the way torch
    itself handles ``argmax`` and ``convolution`` (a private table: where a torch release drops it, nothing is
    registered and such a model fails as before, named by DTensor)."""
    from torch.distributed.tensor import DTensor

    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if isinstance(handlers, dict):
        handlers.setdefault(torch.ops.aten.nonzero.default, _on_local_tensors)


# Checks torch.export leaves in a graph (a buffer's dtype and device, as HF Llama's rotary table): DTensor has no
# sharding rule for them ("Operator aten._assert_tensor_metadata.default does not have a sharding strategy
# registered"), and they check what the trace already fixed. Dropped from a sharded stage's graph only.
_METADATA_ASSERTS = ("_assert_tensor_metadata",)


def _drop_metadata_asserts(stage: nn.Module) -> int:
    """Remove ``aten._assert_tensor_metadata`` calls (they return nothing) from ``stage``'s fx graph, if it has
    one, and make its constants' ``lift_fresh_copy`` a ``clone``; returns how many asserts were dropped."""
    graph = getattr(stage, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return 0
    dropped = 0
    for node in list(graph.nodes):
        name = getattr(getattr(node.target, "_schema", None), "name", "") if node.op == "call_function" else ""
        if name.split("::")[-1] in _METADATA_ASSERTS and not node.users:
            graph.erase_node(node)
            dropped += 1
        elif node.target is torch.ops.aten.lift_fresh_copy.default:
            # a copy of a constant the graph made (BERT's mask minimum under transformers 4.57), which DTensor
            # has no rule for; a clone is the same copy
            node.target = torch.ops.aten.clone.default
    return dropped


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
