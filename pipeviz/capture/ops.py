"""A traced op as pipeviz reads it: ``Op`` (its module, shapes, FLOPs, the bytes autograd saves for its
backward), the tensors it takes as ``TensorSpec``s (what the CPU replay times), its FLOPs counted, and the ops no
stage can run."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

_T = TypeVar("_T")


@dataclass(frozen=True)
class Op:
    """One ATen op of the captured forward, in execution order."""

    index: int
    name: str
    target: str
    stack: tuple[str, ...]  # module FQNs, outermost first, root excluded
    calls: tuple[int, ...]  # call number of each module in ``stack`` (0 = first call)
    flops: int
    out_bytes: int  # bytes of the op's tensor outputs, for the example batch
    inputs: tuple[int, ...]  # indices of the ops whose outputs this op reads
    model_inputs: tuple[str, ...]  # model input placeholders this op reads
    params: tuple[str, ...]  # canonical names of the parameters/buffers this op reads
    region: str = ""  # the no_grad / autocast region the op runs in ("" if none): no split falls inside one
    # Bytes autograd saves for backward while this op runs (``count_flops``): each tensor once, in the first op
    # that saves it; parameters and buffers never. None when unknown (the manual route): ``out_bytes`` stands in.
    saved_bytes: int | None = None
    # The op's arguments, tensors as shapes (``pipeviz.kernels.TensorSpec``): what hardware="cpu" replays to time
    # the op on this machine. None where an argument cannot be described (the manual route has no ops at all).
    spec: Any = None
    # Tensors this op saves that an earlier op saved first: (that op's index, which of the tensors it saved first,
    # bytes). A pipeline stage holds its own copy of what it receives: a tensor saved on both sides of a split
    # counts in both stages.
    resaved: tuple[tuple[int, int, int], ...] = ()
    # An output whose size depends on the data (the rows routed to one expert: an unbacked size in the trace). A
    # pipeline stage receives tensors of shapes fixed before the run, so no split may send one.
    data_dependent: bool = False


def op_saved_bytes(op: Op) -> int:
    """Bytes ``op`` saves for backward (``Op.saved_bytes``), or its output bytes where that is unknown."""
    return op.out_bytes if op.saved_bytes is None else op.saved_bytes


def batched_nodes(gm: torch.fx.GraphModule, batch: int | None) -> set[str]:
    """Names of the nodes computed from the batch: inputs whose first dim is the batch size, and every op that reads
    one (``pipeviz.kernels`` scales their first dim with the microbatch; a position table stays as it is)."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() and batch and val.shape[0] == batch:
                out.add(node.name)
        elif node.op == "call_function" and any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def _layout(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dims from outermost to innermost in memory for a dense tensor whose layout is not the plain
    row-major one (a transposed activation: ``.contiguous()`` on it copies, a matmul reads it strided); None for a
    contiguous tensor or one with gaps or broadcast dims (replayed contiguous)."""
    order = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    real = [d for d in order if shape[d] != 1]  # size-1 dims carry no layout
    return None if real == sorted(real) else order


def grad_nodes(gm: torch.fx.GraphModule, buffers: frozenset[str]) -> set[str]:
    """Names of the nodes training computes a gradient for: parameters (floating ``get_attr`` targets that are not
    buffers) and every floating op output computed from one. The model's inputs need none: the first stage's first
    Linear computes its weight's gradient only (``pipeviz.kernels`` replays what needs one)."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        if node.op == "get_attr":
            if str(node.target) not in buffers and (floating or not isinstance(val, torch.Tensor)):
                out.add(node.name)
        elif node.op == "call_function" and (floating or not isinstance(val, torch.Tensor)) and any(
                a.name in out for a in node.all_input_nodes):
            out.add(node.name)  # a tuple output (its getitem is the tensor) passes the flag on
    return out


def op_spec(node: torch.fx.Node, grads: set[str], batched: set[str]
          ) -> tuple[tuple[object, ...], tuple[tuple[str, object], ...]] | None:
    """The op's arguments with each tensor as a ``TensorSpec`` (shape, dtype, activation or not, gradient or not):
    what ``pipeviz.kernels`` replays to time the op on this machine. None if an argument is neither a tensor nor a
    plain value (a symbolic size, a tensor list's element missing its metadata)."""

    bad = False

    def one(arg: object) -> object:
        nonlocal bad
        if not isinstance(arg, torch.fx.Node):
            return arg if isinstance(arg, int | float | bool | str | torch.dtype | torch.layout | torch.memory_format
                                     | type(None)) else _device_or_bad(arg)
        val = arg.meta.get("val")
        if isinstance(val, int | float | bool):
            return val
        if not isinstance(val, torch.Tensor):
            bad = True
            return None
        if not all(isinstance(d, int) for d in val.shape):  # a size the data decides (MoE routing): no replay
            bad = True
            return None
        shape = tuple(val.shape)
        grad = val.dtype.is_floating_point and arg.name in grads
        return TensorSpec(shape, val.dtype, arg.name in batched, grad, _layout(shape, tuple(val.stride())))

    def _device_or_bad(arg: object) -> torch.device | None:
        nonlocal bad
        if isinstance(arg, torch.device):
            return torch.device("cpu")  # replayed on this machine whatever device the trace saw
        bad = True
        return None

    # Lists as tuples, keyword arguments as (name, value) pairs: an Op (a frozen dataclass) stays hashable.
    args = tuple(_frozen(x) for x in pytree.tree_map(one, list(node.args)))
    kwargs = tuple((k, _frozen(pytree.tree_map(one, v))) for k, v in node.kwargs.items())
    return None if bad else (args, kwargs)


def _frozen(tree: object) -> object:
    return tuple(_frozen(x) for x in tree) if isinstance(tree, list | tuple) else tree


def unsupported_ops(gm: torch.fx.GraphModule) -> list[str]:
    """What torch's ``pipeline()`` cannot split, one sentence each: a higher-order op left after the regions are
    inlined that carries a subgraph (``torch.cond``, ``while_loop``, ``map``): torch loses subgraphs when it
    builds the stages ("Unable to find nn_module_stack"), whatever the split."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        subgraphs = [a for a in node.all_input_nodes if a.op == "get_attr"
                     and isinstance(getattr(gm, str(a.target), None), torch.fx.GraphModule)]
        if not subgraphs:
            continue  # flat_apply and the like carry no graph: they run on the ranks
        stack = node.meta.get("nn_module_stack") or {}
        where = f"in module {list(stack.values())[-1][0]!r}" if stack and list(stack.values())[-1][0] \
            else "in the model's forward"
        out.append(
            f"torch.{node.target.name()} ({where}, op {node.name!r}) cannot be pipelined: torch's pipeline() loses "
            "the subgraphs it carries when it builds the stages, whatever the split. Fix: compute both branches "
            "and pick with torch.where, or use the manual route: pv.manual_plan(model, [[...stage 0 module "
            "names...], [...]], example_args=...)."
        )
    return out


class SavedTensors:
    """What autograd saves for backward during one forward, by the graph node that saves it.

    Counted as ``pipeviz.runtime.memory.MemoryMeter`` counts a real run's activations: each distinct tensor once
    (a view with the same storage, start and size is the same tensor), parameters and buffers (and views of
    them) never. Works on real and fake tensors: a tensor is known by its storage object, not its address (a
    fake tensor has none).
    """

    def __init__(self) -> None:
        self.first: dict[str, int] = {}  # node -> bytes of the tensors it is the first to save
        self.again: dict[str, list[tuple[str, int, int]]] = {}  # node -> (first saver, its slot, bytes)
        self.ok = False  # set once a whole forward ran with grad enabled
        self.node = ""  # the node running now
        self._seen: dict[tuple[int, int, int], tuple[str, int]] = {}  # key -> (first saver, slot there)
        self._slots: dict[str, int] = {}  # node -> tensors it saved first
        self._skip: set[int] = set()  # storages of parameters and buffers
        self._held: list[torch.Tensor] = []  # saved tensors kept alive: a freed storage's id could be reused

    def skip(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages never counted (the module's parameters and buffers)."""
        self._skip |= {t.untyped_storage()._cdata for t in tensors}

    def pack(self, t: _T) -> _T:
        if not isinstance(t, torch.Tensor) or not self.node:
            return t
        try:
            storage = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # a tensor without storage: nothing to count
            return t
        if storage in self._skip:
            return t
        nbytes = int(t.numel()) * t.element_size()
        key = (storage, int(t.storage_offset()) * t.element_size(), nbytes)
        seen = self._seen.get(key)
        if seen is None:
            slot = self._slots.get(self.node, 0)
            self._slots[self.node] = slot + 1
            self._seen[key] = (self.node, slot)
            self.first[self.node] = self.first.get(self.node, 0) + nbytes
            self._held.append(t)
        elif seen[0] != self.node and all((f, k) != seen for f, k, _ in self.again.get(self.node, ())):
            self.again.setdefault(self.node, []).append((*seen, nbytes))
        return t


def count_flops(gm: torch.fx.GraphModule, flat_inputs: Sequence[object], sizes: dict[str, int] | None = None,
                 saved: SavedTensors | None = None) -> dict[str, int]:
    """Forward FLOPs of every node, counted by torch.utils.flop_counter while the graph runs once; with
    ``sizes``, each node's output bytes as it ran (data-dependent shapes get their real size); with ``saved``,
    the tensors each node saves for backward (the forward then runs with grad enabled, as in training: no_grad
    regions switch it off where the model does, and save nothing)."""
    counts: dict[str, int] = {}

    class _Counter(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            if saved is not None:
                saved.node = n.name
            before = mode.get_total_flops()
            out = super().run_node(n)
            counts[n.name] = mode.get_total_flops() - before
            if sizes is not None:
                sizes[n.name] = tensor_bytes(out)
            return out

    mode = FlopCounterMode(display=False, custom_mapping=flop_formulas())
    if saved is not None:
        constants = [getattr(gm, str(n.target), None) for n in gm.graph.nodes if n.op == "get_attr"]
        saved.skip([*gm.parameters(), *gm.buffers(), *(c for c in constants if isinstance(c, torch.Tensor))])
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack)
        try:
            with torch.enable_grad(), hooks, mode:
                _Counter(gm).run(*flat_inputs)
            saved.ok = True
            return counts
        except Exception:  # a forward that fails only with grad enabled: its FLOPs are counted without it
            counts.clear()
        finally:
            saved.node = ""
            saved._held.clear()
    with torch.no_grad(), mode:
        _Counter(gm).run(*flat_inputs)
    return counts


def _unpack(t: _T) -> _T:
    return t


def cpu_flash_attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: object,
                               out_val: object = None, **kwargs: object) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


_CPU_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_attention_flops}


def grouped_mm_flops(a_shape: Sequence[int], b_shape: Sequence[int], *args: object,
                     out_shape: Sequence[int] | None = None, **kwargs: object) -> int:
    """FLOPs of a grouped matmul (``aten._grouped_mm``, transformers 5's ``grouped_mm_fallback``): each row of the
    input ``(S, K)`` multiplied by its group's ``(K, N)`` weight of ``(G, K, N)``, ``2 x S x K x N``; batched 3-D
    inputs ``(G, M, K) @ (G, K, N)`` the same per group. Only the rows routed to each expert are computed (top-k
    of E per token, as torchtitan's and Megatron's grouped GEMMs run), so a mixture-of-experts block's experts
    cost their routed tokens, not every token x every expert."""
    out = list(out_shape or ())
    if len(out) == 3 and len(a_shape) == 2 and len(b_shape) == 2:  # (K, S) @ (S, N) -> (G, K, N): a weight grad
        out = out[1:]
    n = 1
    for d in out:
        n *= int(d)
    return 2 * n * int(a_shape[-1])


def flop_formulas() -> dict[Any, Any]:
    """The FLOP formulas ``count_flops`` adds to torch's counter (which counts neither the CPU's flash attention
    nor grouped matmuls: transformers 5's fused experts counted 0 FLOPs without them). transformers registers its
    ``grouped_mm_fallback`` op when its MoE integration is imported, so the table is read at each count."""
    out: dict[Any, Any] = dict(_CPU_ATTENTION)
    if hasattr(torch.ops.aten, "_grouped_mm"):
        out[torch.ops.aten._grouped_mm] = grouped_mm_flops
    if hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        out[torch.ops.transformers.grouped_mm_fallback] = grouped_mm_flops
    return out


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument of a traced op: its shape and dtype, whether it is an activation computed from the batch
    (its first dim is the batch's, scaled with the microbatch) or not (parameters, buffers, constants and what is
    computed from them alone, such as position embeddings: kept as traced), and whether training
    computes its gradient (parameters and what is computed from them; not the model's inputs, buffers or integer
    tensors), and its layout in memory where it is not row-major (``order``: a transposed activation is replayed
    transposed, so a ``.contiguous()`` of it copies as in the run)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    activation: bool
    grad: bool
    # Dims from outermost to innermost in memory when not row-major (a transposed view); None: contiguous.
    order: tuple[int, ...] | None = None


def tensor_bytes(value: object) -> int:
    """Bytes of the tensors in ``value``; a size the trace left symbolic (tokens routed to one expert) counts
    at its hint when torch has one, else as 0 (the measured size replaces it when the graph ran for real)."""
    total = 0
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            n = 1
            for d in t.shape:
                n *= concrete_size(d)
            total += n * t.element_size()
    return total


def data_dependent(value: object) -> bool:
    """Whether a traced value holds a tensor with a size the trace could not fix (no hint: it depends on the data,
    as the rows routed to one expert do)."""
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            for d in t.shape:
                if isinstance(d, torch.SymInt) and not _has_hint(d):
                    return True
    return False


def _has_hint(d: torch.SymInt) -> bool:
    try:
        return bool(d.node.shape_env.has_guarding_hint(d.node.expr))
    except Exception:
        return False


def concrete_size(d: int | torch.SymInt) -> int:
    if isinstance(d, int):
        return d
    try:
        env, expr = d.node.shape_env, d.node.expr
        # A backed size has a hint (the example's value); an unbacked one (data-dependent: routed tokens) has
        # none here, and its bytes come from the measured run instead.
        return int(env.guarding_hint_or_throw(expr)) if env.has_guarding_hint(expr) else 0
    except Exception:
        return 0
