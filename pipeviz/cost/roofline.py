"""The roofline of a captured model on a ``Hardware``: ``op_table`` reads what a capture recorded per op (FLOPs, the
bytes it reads and writes, the weights it reads, attention-score ops), ``op_time`` prices one op
(``max(flops / (peak[dtype] x efficiency), bytes / memory_bandwidth)``) and ``layer_roofline`` sums it over each
layer's ops; on the ``"cpu"`` preset each op is replayed instead (``pipeviz.cost.replay``).

Example:
    >>> times, back = layer_roofline(graph, pv.hardware("h100"), "bfloat16", k=4.0)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeviz.cost.machine import DTYPE_BYTES, Hardware

if TYPE_CHECKING:
    import torch

    from pipeviz.capture.export import Capture
    from pipeviz.capture.view import GraphView

__all__ = ["OpTable", "forget_kernel_times", "layer_roofline", "loss_kernel_times", "matmul_efficiency", "op_table",
           "op_time"]


def op_time(flops: float, nbytes: float, hw: Hardware, dtype: str | None = None) -> float:
    """Seconds of one op on ``hw``: its math at ``rate(dtype)`` and its memory traffic at ``memory_bandwidth``,
    combined as ``hw.roofline`` says.

    - ``"additive"`` (the GPU presets): ``flops / rate + bytes / bandwidth``. A matmul of arithmetic intensity
      ``I = flops / bytes`` then runs at ``rate x I / (I + I_ridge)``, with ``I_ridge = rate / bandwidth`` the
      roofline's ridge point (Williams et al. 2009): its efficiency rises with its size and shape toward
      ``efficiency`` and never passes it (``matmul_efficiency``). Megatron-LM's README reads its H100 weak
      scaling (41 % of peak at 1.7B, 47-48 % at 314B-462B) the same way: "larger GEMMs have higher arithmetic
      intensity and are consequently more efficient to execute". An element-wise op (no FLOPs) costs its bytes.
    - ``"max"`` (``"cpu"``, whose rates are measured): ``max(flops / rate, bytes / bandwidth)``, the plain
      roofline: a matmul is compute-bound, an element-wise op memory-bound.
    """
    if hw.roofline in ("max", "kernels"):  # (the plain roofline is what "kernels" falls back to)
        return max(flops / hw.rate(dtype), nbytes / hw.memory_bandwidth)
    return flops / hw.rate(dtype) + nbytes / hw.memory_bandwidth


def matmul_efficiency(m: int, k: int, n: int, hw: Hardware, dtype: str | None = None) -> float:
    """The fraction of the dense peak an ``(m x k) @ (k x n)`` matmul reaches in ``op_time``'s model: at most
    ``hw.efficiency``, rising with the matmul's arithmetic intensity (bytes: the two inputs read and the output
    written once, in ``dtype``).

    Example:
        >>> h100 = pv.hardware("h100")
        >>> matmul_efficiency(4096, 2048, 6144, h100) < matmul_efficiency(4096, 18432, 6912, h100) < h100.efficiency
        True
    """
    name = hw.dtype(dtype)
    flops = 2.0 * m * k * n
    nbytes = DTYPE_BYTES[name] * (m * k + k * n + m * n)
    return flops / op_time(flops, nbytes, hw, name) / hw.peak(name)


# Ops that move no data: views, metadata and Python-level getters (the roofline gives them no time).
_FREE = frozenset({"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
                   "slice", "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
                   "sym_size", "sym_numel", "sym_stride", "getitem", "lift_fresh_copy", "view_as_real",
                   "view_as_complex", "_assert_tensor_metadata", "empty", "scalar_tensor", "arange"})


@dataclass(frozen=True)
class OpTable:
    """Per op of a capture: forward FLOPs, activation bytes read + written, weight bytes read, output bytes, the
    ops selective recomputation drops (attention scores), the views (no data of their own), and the activation
    bytes with element-wise chains fused (``_fused_activation_bytes``, for ``Hardware.fused``)."""

    flops: tuple[float, ...]
    act: tuple[float, ...]
    weight: tuple[float, ...]
    out: tuple[float, ...]
    selective: tuple[int, ...]
    views: tuple[int, ...] = ()
    fused_act: tuple[float, ...] = ()


_OP_TABLES: dict[int, tuple[weakref.ref[Capture], OpTable]] = {}


def op_table(cap: Capture) -> OpTable:
    """Per op of a capture, what the roofline needs (cached while the capture lives)."""
    hit = _OP_TABLES.get(id(cap))
    if hit is not None and hit[0]() is cap:
        return hit[1]
    ops = cap.ops
    seq, elem = _tokens_and_element_size(cap)
    flops, act, weight, out, views = [], [], [], [], []
    for op in ops:
        base = op.target.split(".")[1] if op.target.startswith("aten.") else op.target.rsplit(".", 1)[-1]
        free = base in _FREE and not op.flops
        if free:
            views.append(op.index)
        if base == "scaled_dot_product_attention" and not op.flops and seq:
            # A capture whose counter missed the attention kernel (pipeviz.capture.export maps torch's CPU kernel to
            # torch's SDPA formula; another kernel may be missing): QK^T and PV, 2 x 2 FLOPs per query element
            # per key, over the sequence's keys (self-attention; no causal halving, as PaLM's MFU convention).
            flops.append(4.0 * op.out_bytes / elem * seq)
        else:
            flops.append(float(op.flops))
        out.append(float(op.out_bytes))
        act.append(0.0 if free else float(op.out_bytes + sum(ops[i].out_bytes for i in op.inputs)))
        weight.append(0.0 if free else float(sum(cap.param_bytes.get(p, 0) for p in op.params)))
    table = OpTable(tuple(flops), tuple(act), tuple(weight), tuple(out), _attention_scores(cap), tuple(views),
                    _fused_activation_bytes(cap, flops, act, set(views)))
    _OP_TABLES[id(cap)] = (weakref.ref(cap), table)
    return table


def _fused_activation_bytes(cap: Capture, flops: list[float], act: list[float], views: set[int]) -> tuple[float, ...]:
    """``act`` with chains of element-wise ops fused into one kernel each, as Megatron-LM's fused kernels
    (bias-GeLU, scale-mask-softmax, bias-dropout-add) and torch.compile's generated ones run them: where an
    element-wise op (no FLOPs, not a view) reads the output of another that nothing else reads (through views),
    that output is neither written by the producer nor read back by the consumer. A matmul's output is always
    written (it ends its kernel)."""
    ops = cap.ops
    base = list(range(len(ops)))
    for op in ops:  # a view's data is its input's
        if op.index in views and op.inputs:
            base[op.index] = base[op.inputs[0]]
    readers: dict[int, int] = {}
    for op in ops:
        if op.index in views:
            continue
        for b in {base[i] for i in op.inputs}:
            readers[b] = readers.get(b, 0) + 1
    out = list(act)
    for op in ops:
        j = op.index
        if j in views or flops[j]:
            continue
        for p in {base[i] for i in op.inputs}:
            if p in views or flops[p] or readers.get(p) != 1 or not act[p]:
                continue
            nbytes = ops[p].out_bytes
            out[j] = max(0.0, out[j] - nbytes)
            out[p] = max(0.0, out[p] - nbytes)
    return tuple(out)


def _tokens_and_element_size(cap: Capture) -> tuple[int, float]:
    """The traced sequence length (dim 1 of the first integer input of rank >= 2; 0 if none) and the bytes of a
    floating-point element as traced (the parameters' average)."""
    import torch

    seq = 0
    for x in [*cap.example_args, *cap.example_kwargs.values()]:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point():
            seq = int(x.shape[1])
            break
    numel = sum(cap.param_numel.values())
    return seq, (sum(cap.param_bytes.values()) / numel if numel else 4.0) or 4.0


def _attention_scores(cap: Capture) -> tuple[int, ...]:
    """Ops whose outputs are attention scores (Korthikanti et al.'s selectively recomputed part): each softmax,
    the ops before it with the same output size back to the score matmul (scaling, masking), and the ops after
    it with the same size (dropout)."""
    ops = cap.ops
    readers: dict[int, list[int]] = {}
    for op in ops:
        for i in op.inputs:
            readers.setdefault(i, []).append(op.index)
    marked: set[int] = set()
    for op in ops:
        if "softmax" not in op.target:
            continue
        size = op.out_bytes
        todo = [op.index]
        while todo:
            i = todo.pop()
            if i in marked:
                continue
            marked.add(i)
            if "bmm" in ops[i].target or "matmul" in ops[i].target or "baddbmm" in ops[i].target:
                continue  # the score matmul: its inputs (queries, keys) are kept anyway
            todo += [j for j in ops[i].inputs if ops[j].out_bytes == size]
            todo += [j for j in readers.get(i, []) if ops[j].out_bytes == size and j > op.index]
    return tuple(sorted(marked))


_ROOFLINE: dict[tuple[Any, ...], tuple[OpTable, tuple[list[float], list[float], list[float]]]] = {}


def forget_kernel_times() -> None:
    """Drop every remembered ``hardware="cpu"`` kernel time (and the layer times built from them), so the next
    estimate times the ops again: on a shared machine whose speed drifts (this one's moves by 10-20 % from one
    second to the next), a benchmark retakes its measurement in each round's conditions."""
    from pipeviz.cost import replay as kernels

    for cached in (kernels._measure, kernels._accumulate, kernels._autograd_call):
        cached.cache_clear()
    _ROOFLINE.clear()


def _add(a: float, b: float) -> float:
    return a + b


def layer_roofline(graph: GraphView, hw: Hardware, dtype: str | None, k: float,
                   s: float) -> tuple[list[float], list[float], list[float]]:
    """Per layer, forward seconds on ``hw`` (the roofline per op, summed), those of its attention-score ops, and
    backward seconds (2 x forward; with ``roofline="kernels"`` each op's measured backward); remembered for the
    last few (graph, hardware, microbatch size) asked: the planner asks many times."""
    key = (id(graph.capture), graph.layer_names, hw, dtype, k, s)
    table = op_table(graph.capture)
    hit = _ROOFLINE.get(key)
    if hit is not None and hit[0] is table:  # the same capture, not a new one at a reused address
        return hit[1]
    rate, bw = hw.rate(dtype), hw.memory_bandwidth
    combine = max if hw.roofline in ("max", "kernels") else _add  # op_time's rule, inlined: asked many times
    acts = table.fused_act if hw.fused and table.fused_act else table.act
    times = [combine(f * k / rate, (a * k + w) * s / bw) for f, a, w in zip(table.flops, acts, table.weight,
                                                                            strict=True)]
    back = [2.0 * t for t in times]  # a backward computes two matmuls per forward matmul
    spans = list(zip(graph.index.layer_first, graph.index.layer_last, strict=True))
    if hw.roofline == "kernels":
        times, back = _kernel_times(graph.capture, times, back, k, dtype and hw.dtype(dtype))
        # Every op the stage runs, the ones between layers too (an embedding sum, a mask), with the layer before.
        starts = [a for a, _ in spans]
        spans = [(a if i else 0, (starts[i + 1] - 1) if i + 1 < len(starts) else len(times) - 1)
                 for i, a in enumerate(starts)]
    fwd = [sum(times[a:b + 1]) for a, b in spans]
    bwd = [sum(back[a:b + 1]) for a, b in spans]
    sel = [sum(times[i] for i in table.selective if a <= i <= b) for a, b in spans]
    if len(_ROOFLINE) > 256:
        _ROOFLINE.clear()
    _ROOFLINE[key] = (table, (fwd, sel, bwd))
    return fwd, sel, bwd


_TORCH_DTYPES = {"float32": "float32", "tf32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _torch_dtype(dtype: str | None) -> torch.dtype | None:
    """The torch dtype a replay runs ``dtype`` in (tf32 as float32); None: as traced (or not replayable)."""
    import torch

    return getattr(torch, _TORCH_DTYPES[dtype]) if dtype in _TORCH_DTYPES else None


def loss_kernel_times(cap: Capture, k: float, dtype: str | None) -> tuple[float, float]:
    """Forward and backward seconds of the loss (a log-softmax over the outputs a loss reads,
    ``pipeviz.kernels.loss_seconds``) at ``k`` x the traced batch, as this machine runs it."""
    from pipeviz.cost.replay import loss_seconds

    return loss_seconds(cap.loss_outputs, k, _torch_dtype(dtype))


def _kernel_times(cap: Capture, times: list[float], back: list[float], k: float,
                  dtype: str | None) -> tuple[list[float], list[float]]:
    """Each op's forward and backward seconds as this machine runs it (``pipeviz.kernels``), the roofline's where
    it cannot be replayed."""
    from pipeviz.cost.replay import op_seconds

    torch_dtype = _torch_dtype(dtype)
    fwd, bwd = list(times), list(back)
    for op in cap.ops:
        measured = op_seconds(op, k, torch_dtype, cap.batch_size)
        if measured is not None:
            fwd[op.index], bwd[op.index] = measured
    return fwd, bwd
