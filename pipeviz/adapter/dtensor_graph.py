"""A flat stage's graph made ready to run on DTensors (``prepare_graph``, called by
``tensor_parallel.shard_stage`` once its parameters are DTensors).

What torch.export leaves in a traced graph and what DTensor can run differ: its metadata asserts have no
sharding rule, plain tensors the graph makes (positions, masks) meet sharded ones, the CPU attention kernel and
library ops (transformers' MoE experts) have no rules, ``nonzero``'s shape is the data's. And the layouts
torch's ``ColwiseParallel`` / ``RowwiseParallel`` hooks would give a module go into the graph, which has no module
to hook (Megatron's *f* and *g*), with Megatron's fused QKV (``fused_columns``, ``split_fused``) and its
vocabulary-parallel embedding. Each fix is here once; the tests that pin them are
``tests/test_tensor_parallel_hf.py`` (HF Llama, Mistral, BERT, GPT-2, Qwen2-MoE) and the version grid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["fused_columns", "prepare_graph", "replicated", "replicated_input", "split_fused", "token_sharded"]

_Rule = Callable[..., Any]  # a sharding rule torch's register_sharding takes


def prepare_graph(stage: nn.Module, params: Mapping[str, str], placements: Mapping[str, str],
                  sequence_parallel: bool = False) -> None:
    """Make ``stage`` (an ``fx.GraphModule`` whose parameters are DTensors) run on DTensors as Megatron-LM shards:
    ``params`` maps canonical names to the stage's attribute paths, ``placements`` canonical names to
    ``"shard0"`` / ``"shard1"`` / ``"replicate"``; ``sequence_parallel``: between the sharded regions the
    activations split by token (Korthikanti et al. 2022). Process-wide registrations are made once."""
    _drop_metadata_asserts(stage)
    _megatron_boundaries(stage, params, placements, sequence_parallel)
    _replicate_plain_tensors()
    _register_cpu_attention()
    _register_custom_ops(stage)
    _register_data_dependent()
    recompile = getattr(stage, "recompile", None)
    if callable(recompile):
        recompile()


def replicated(value: object) -> object:
    """``value`` as a replicated DTensor: Megatron's *g* after a row-wise projection (the all-reduce of its
    partial sums; in the backward, nothing). A plain value passes unchanged."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, DTensor) and any(not p.is_replicate() for p in value.placements):
        return value.redistribute(placements=[Replicate()] * value.device_mesh.ndim)
    return value


def token_sharded(value: object) -> object:
    """A row-wise projection's output under sequence parallelism: its partial sums reduce-scattered by token (the
    second-to-last dim: the sequence of ``[batch, seq, hidden]``, the tokens of ``[tokens, hidden]``), so what
    follows up to the next column-wise group (norms, dropout, the residual add) holds 1/tp of the tokens. The
    backward all-gathers the gradient (DTensor's redistribute). A plain value passes unchanged."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(value, DTensor) and value.ndim >= 2:
        dim = value.ndim - 2
        if not all(p.is_shard(dim) for p in value.placements):
            return value.redistribute(placements=[Shard(dim)] * value.device_mesh.ndim)
    return value


class _ReplicatedGrad(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient's partial sums (Megatron's *f*)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return replicated(grad)  # type: ignore[return-value]


class _VocabParallelEmbedding(torch.autograd.Function):
    """Megatron's ``VocabParallelEmbedding`` on a DTensor weight sharded by rows (``Shard(0)``): each shard looks up
    the ids in its slice of the vocabulary (the others give zeros) and the partial results are summed by the
    caller; the backward scatters the gradient into this shard's rows only. DTensor's own rule computes that
    gradient for the whole vocabulary on every shard (it has no row-wise rule for ``embedding_dense_backward``)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial

        assert isinstance(weight, DTensor)
        local = weight.to_local()
        mesh = weight.device_mesh
        rows = local.shape[0]
        start = mesh.get_local_rank() * rows  # an even split: check_tp_plan refuses a vocabulary tp does not divide
        ids = indices.to_local() if isinstance(indices, DTensor) else indices
        outside = (ids < start) | (ids >= start + rows)
        local_ids = (ids - start).masked_fill(outside, 0)
        out = torch.ops.aten.embedding.default(local, local_ids).masked_fill(outside.unsqueeze(-1), 0)
        ctx.save_for_backward(local_ids, outside)
        ctx.rows, ctx.mesh, ctx.scale = rows, mesh, scale_grad_by_freq
        ctx.padding = padding_idx - start if start <= padding_idx < start + rows else -1
        return DTensor.from_local(out, mesh, [Partial()], run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from torch.distributed.tensor import DTensor, Shard

        local_ids, outside = ctx.saved_tensors
        whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
        whole = whole.masked_fill(outside.unsqueeze(-1), 0)
        rows_grad = torch.ops.aten.embedding_dense_backward.default(whole, local_ids, ctx.rows, ctx.padding, ctx.scale)
        return DTensor.from_local(rows_grad, ctx.mesh, [Shard(0)], run_check=False), None, None, None, None


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """``aten.embedding`` of a vocabulary-sharded weight, as Megatron computes it (``_VocabParallelEmbedding``):
    partial sums out, this shard's rows of the gradient back."""
    apply: Callable[..., torch.Tensor] = _VocabParallelEmbedding.apply  # (autograd's apply is untyped)
    return apply(weight, indices, padding_idx, scale_grad_by_freq, sparse)


def fused_columns(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  transposed: bool = False) -> torch.Tensor:
    """A fused ``[q | k | v]`` projection whose weight is cut by heads (``_StridedShard``: shard t holds the t-th
    slice of q's, k's and v's columns), as Megatron computes its fused QKV: each shard multiplies its replicated
    input by its own columns, no collective. The output is marked sharded along its last dim, its local part
    ``[q_t | k_t | v_t]``: only ``split_fused`` reads it. ``transposed``: HF ``Conv1D``'s ``addmm(bias, x, weight)``
    (weight ``[in, out]``), else ``linear(x, weight, bias)``. The input's gradient leaves as partial sums, for
    the all-reduce (or reduce-scatter) in front of it."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    assert isinstance(weight, DTensor)
    local_x = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
    local_b = bias.to_local() if isinstance(bias, DTensor) else bias
    if transposed:
        out = torch.addmm(local_b, local_x, weight.to_local()) if local_b is not None else local_x @ weight.to_local()
    else:
        out = torch.nn.functional.linear(local_x, weight.to_local(), local_b)
    return DTensor.from_local(out, weight.device_mesh, [Shard(out.ndim - 1)], run_check=False)


def split_fused(value: torch.Tensor, size: int, dim: int = 0) -> list[torch.Tensor]:
    """``torch.split(value, size, dim)`` of a ``fused_columns`` output into q, k and v: each shard's local
    ``[q_t | k_t | v_t]`` split in three, each part sharded along ``dim`` (its heads), as q / k / v projections
    sharded column-wise give them."""
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(value, DTensor)
    mesh = value.device_mesh
    local = value.to_local()
    dim = dim % local.ndim
    return [DTensor.from_local(part, mesh, [Shard(dim)], run_check=False)
            for part in local.split(size // mesh.size(), dim)]


def replicated_input(value: object) -> object:
    """A column-wise projection's input: replicated (as ``replicated``), and its gradient all-reduced once in
    the backward however many projections read it (Megatron's *f*: q, k and v share one). An input sharded by
    token (sequence parallelism) is all-gathered instead, and its gradient's partial sums reduce-scattered back
    by DTensor's redistribute."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) and any(p.is_shard() for p in value.placements):
        return replicated(value)
    value = replicated(value)
    if isinstance(value, DTensor) and value.requires_grad:
        apply: Callable[..., torch.Tensor] = _ReplicatedGrad.apply  # (autograd's apply is untyped)
        return apply(value)
    return value


def _megatron_boundaries(stage: nn.Module, params: Mapping[str, str], placements: Mapping[str, str],
                         sequence_parallel: bool = False) -> int:
    """Put the layouts torch's ``ColwiseParallel`` / ``RowwiseParallel`` hooks give a module into the flat
    graph, which has no module to hook: a column-wise projection's input replicated (once per input, however
    many projections read it: q, k and v share one), a row-wise projection's output replicated at once (and a
    vocabulary-sharded embedding's: its shards' lookups summed). Left to
    itself DTensor's op-by-op choice reduce-scattered a row-wise output, all-gathered it for the next
    projection and all-reduced inside RMSNorm (measured on HF Llama: 17-26 collectives per microbatch and stage
    against Megatron's 4, one all-reduce per row-wise projection each way). ``sequence_parallel``: a row-wise
    output is reduce-scattered by token instead (``token_sharded``). Returns the projections marked."""
    graph = getattr(stage, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return 0
    canonical = {inner: canon for canon, inner in params.items()}
    aten = torch.ops.aten

    def style(node: torch.fx.Node) -> tuple[str, int] | None:
        """("colwise" | "rowwise" | "fused", index of the activation argument) for a sharded projection's node."""
        if node.op != "call_function":
            return None
        if node.target is aten.linear.default:  # weight [out, in]
            act, weight, by = 0, node.args[1], {"shard0": "colwise", "shard1": "rowwise", "fused0": "fused"}
        elif node.target is aten.addmm.default:  # HF Conv1D: bias + x @ weight, weight [in, out]
            act, weight, by = 1, node.args[2], {"shard1": "colwise", "shard0": "rowwise", "fused1": "fused"}
        elif node.target is aten.embedding.default:  # weight [vocab, dim]: each shard's rows, a partial lookup
            act, weight, by = 1, node.args[0], {"shard0": "rowwise"}
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
        if node.target is aten.embedding.default:
            node.target = vocab_parallel_embedding
        if kind in ("colwise", "fused"):
            x = node.args[act]
            if isinstance(x, torch.fx.Node):
                # HF Conv1D flattens [batch, seq, hidden] to [tokens, hidden] first: the layout is set on the
                # unflattened input (a token-split one is gathered before it is flattened)
                source, flat = (x.args[0], x) if _flattens(x) else (x, None)
                assert isinstance(source, torch.fx.Node)
                if source not in inputs:
                    with graph.inserting_after(source):
                        inputs[source] = graph.call_function(replicated_input, (source,))
                if flat is not None:
                    flat.args = (inputs[source], *flat.args[1:])
                else:
                    args = list(node.args)
                    args[act] = inputs[source]
                    node.args = tuple(args)
            if kind == "fused":
                _fuse(graph, node)
        else:
            # a Conv1D's output is unflattened to [batch, seq, hidden] first: the layout is set after that
            after = _unflattened(node)
            with graph.inserting_after(after):
                out = graph.call_function(token_sharded if sequence_parallel else replicated, (after,))
            after.replace_all_uses_with(out, delete_user_cb=_other_than(out))
    return marked


def _other_than(made: torch.fx.Node) -> Callable[[torch.fx.Node], bool]:
    """For ``replace_all_uses_with``: every user but the node that reads the original (``made``)."""
    return lambda user: user is not made


_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _flattens(node: torch.fx.Node) -> bool:
    """A view to ``[tokens, features]`` (HF Conv1D's ``x.view(-1, x.size(-1))``)."""
    return (node.op == "call_function" and node.target in _RESHAPES and len(node.args) > 1
            and isinstance(node.args[1], list | tuple) and len(node.args[1]) == 2
            and isinstance(node.args[0], torch.fx.Node))


def _unflattened(node: torch.fx.Node) -> torch.fx.Node:
    """``node``, or its only user where that views it back to ``[batch, seq, features]`` (HF Conv1D's
    ``x.view(size_out)``)."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in _RESHAPES and \
            isinstance(users[0].args[1], list | tuple) and len(users[0].args[1]) > 2:
        return users[0]
    return node


def _fuse(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """A fused q/k/v projection (``node``: its ``linear`` or ``addmm``) computed by heads (``fused_columns``), and
    the ``split`` into q, k and v that follows it (through views) made ``split_fused``. Raises ``ValueError`` where
    no such split follows: a fused projection whose output is not cut into its parts cannot be sharded by heads."""
    aten = torch.ops.aten
    if node.target is aten.addmm.default:
        bias, x, weight = node.args[:3]
        node.args, node.kwargs = (x, weight, bias, True), {}
    else:
        x, weight, *rest = node.args
        node.args, node.kwargs = (x, weight, rest[0] if rest else None, False), {}
    node.target = fused_columns
    at = node
    while len(at.users) == 1 and next(iter(at.users)).target in _RESHAPES:
        at = next(iter(at.users))
    splits = [u for u in at.users if u.target in (aten.split.Tensor, aten.split_with_sizes.default)]
    if len(splits) != 1 or len(at.users) != 1 or splits[0].target is not aten.split.Tensor:
        raise ValueError(f"{weight} is sharded as a fused q/k/v projection, but its output is not split into its "
                         "parts by one torch.split. Fix: leave it out of tp_plan (replicated).")
    splits[0].target = split_fused


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
    from torch.distributed.tensor.experimental import register_sharding as untyped

    register_sharding: Callable[[Any], Callable[[_Rule], _Rule]] = untyped  # (torch leaves it untyped)

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
