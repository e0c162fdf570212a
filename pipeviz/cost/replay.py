"""This machine's kernel times, measured per op and shape: what ``hardware="cpu"`` costs a layer with.

A roofline needs a peak and a bandwidth; on a CPU neither predicts a small or skinny matmul (a 16 x 1024 x 2048
product runs at a third of a 512-cube's rate here: the weight does not stay in cache), nor what PyTorch spends per
op around the kernel (dispatch, autograd's bookkeeping: ~10-20 µs an op, forward and backward). So the ``"cpu"``
preset times the ops themselves: each op of the trace is run again on random tensors of its shapes at the
microbatch size, forward and backward (``torch.autograd.grad``), one thread (a pipeline rank on its own core, as
``pv.launch`` pins them), and the times are cached by (op, shapes, dtype). This is not ``pv.profile``: no layer of
the model runs, only one aten op at a time with the arguments the trace recorded (``Op.spec``), so it needs no
weights and no data and answers for microbatch sizes never run. Ops it cannot replay (sizes given as arguments
that the microbatch changes, more than ``MAX_BYTES`` of tensors or ``MAX_FLOPS`` of work) fall back to the
roofline of the measured rates.

Example:
    >>> fwd, bwd = op_seconds(graph.capture.ops[3], scale=0.25)     # a quarter of the traced batch
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch
from torch.utils import _pytree as pytree

from pipeviz.capture.ops import TensorSpec

__all__ = ["MAX_BYTES", "MAX_FLOPS", "OpArgs", "ReplayOp", "TensorSpec", "loss_seconds", "op_seconds", "replayable",
           "scaled_shape"]

MAX_BYTES = 256 * 2**20  # an op whose tensors are larger is estimated, not replayed (a meta-device big model)
MAX_FLOPS = 2e9  # nor one with more work (~30 ms a run here): a matmul that large runs at the measured peak rate
_SECONDS = 0.05  # time spent measuring one op (each of forward and backward), after a warm-up call
_CACHED = 2**20  # bytes of tensors an op may touch and still find in cache in a run (a core's L2, roughly)
_CALLS = 15  # at most this many timed calls (each after a cache flush), and at least _MIN_CALLS
_MIN_CALLS = 5
# Larger than a CPU's last-level cache: writing it evicts what an op's previous call left there.
_FLUSH = torch.empty(64 * 2**20 // 4, dtype=torch.float32)




# A traced op's arguments (``pipeviz.capture.export.Op.spec``): positional ones, and keyword ones as (name, value)
# pairs;
# tensors as ``TensorSpec``, lists as tuples (hashable).
OpArgs = tuple[tuple[object, ...], tuple[tuple[str, object], ...]]
# A tensor argument to replay: (shape, dtype, needs a gradient, is an activation, layout: ``TensorSpec.order``).
_Shaped = tuple[tuple[int, ...], torch.dtype, bool, bool, tuple[int, ...] | None]


class ReplayOp(Protocol):
    """What a replay reads of a traced op (a ``pipeviz.capture.export.Op``)."""

    @property
    def target(self) -> str: ...

    @property
    def flops(self) -> int: ...

    @property
    def spec(self) -> OpArgs | None: ...


def replayable(op: ReplayOp) -> bool:
    """Whether ``op`` (a ``pipeviz.capture.export.Op``) carries the arguments a replay needs."""
    return op.spec is not None and op.target.startswith("aten.")


def op_seconds(op: ReplayOp, scale: float, dtype: torch.dtype | None = None, batch: int | None = None
               ) -> tuple[float, float] | None:
    """Forward and backward seconds of ``op`` at ``scale`` x the traced batch of ``batch`` examples (each
    activation's batch dim scaled: ``scaled_shape``), in ``dtype`` (default: as traced), on one thread; None when it
    cannot be replayed."""
    if not replayable(op) or op.flops * scale > MAX_FLOPS or op.spec is None:
        return None
    args, kwargs = op.spec
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, TensorSpec)]

    def shapes(constants: bool) -> tuple[_Shaped, ...]:
        # constants: also scale a tensor that is neither an activation nor trained but carries the batch's dim
        # (an attention mask built from positions alone, expanded to the batch), else it keeps its traced shape
        # and disagrees with the scaled activations it meets: GPT-2's and Llama's attention did not replay.
        return tuple((scaled_shape(replace(t, activation=True) if constants and not t.grad and batch in t.shape else t,
                                   scale, batch),
                      t.dtype if dtype is None or not t.dtype.is_floating_point else dtype, t.grad, t.activation,
                      t.order) for t in leaves)

    plain, wide = shapes(False), shapes(True)
    for attempt in (plain,) if wide == plain else (plain, wide):
        try:
            return _measure(op.target, (args, kwargs), attempt)
        except Exception:  # an op that does not replay on random tensors at these shapes
            continue
    return None  # the caller estimates it


def loss_seconds(outputs: list[tuple[tuple[int, ...], torch.dtype]], scale: float,
                 dtype: torch.dtype | None = None) -> tuple[float, float]:
    """Forward and backward seconds of the loss on the last stage, at ``scale`` x the traced batch: a log-softmax
    over the last dim of each floating output (``Capture.outputs``' shapes; cross-entropy's cost, the loss the
    memory model assumes too: ``graph._loss_input_bytes``). The loss function itself is not traced; a cheaper one
    (MSE) costs less. Zero for what cannot be replayed."""
    fwd = bwd = 0.0
    for shape, dt in outputs:
        if not dt.is_floating_point or not shape:
            continue
        spec = TensorSpec(tuple(shape), dt, True, True)
        scaled = (scaled_shape(spec, scale), dt if dtype is None else dtype, True, True, None)
        if _numel(scaled[0]) * _itemsize(scaled[1]) > MAX_BYTES:
            continue
        try:
            f, b = _measure("aten._log_softmax.default", ((spec, -1, False), ()), (scaled,))
        except Exception:  # a dtype this CPU cannot run: the loss goes uncounted, as before
            continue
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def scaled_shape(t: TensorSpec, scale: float, batch: int | None = None) -> tuple[int, ...]:
    """An activation's shape at ``scale`` x the traced batch: the batch's dim is the first whose size is the batch
    (``(seq, batch, dim)`` as ``nn.MultiheadAttention`` lays it out), else dim 0 (``(batch, ...)``, or the batch
    flattened with other dims); parameters and what is not computed from the batch keep their shape."""
    if not t.activation or not t.shape or scale == 1:
        return t.shape
    dims = list(t.shape)
    at = 0 if not batch or dims[0] == batch else next((i for i, d in enumerate(dims) if d == batch), 0)
    dims[at] = max(1, round(dims[at] * scale))
    return tuple(dims)


def _thaw(tree: OpArgs, tensors: list[torch.Tensor]) -> tuple[tuple[object, ...], dict[str, object]]:
    """The recorded arguments (tuples for lists, keyword arguments as pairs: ``Op.spec``) with each ``TensorSpec``
    replaced by the next of ``tensors``, lists restored."""
    it = iter(tensors)

    def go(x: object) -> object:
        if isinstance(x, TensorSpec):
            return next(it)
        if isinstance(x, tuple):
            return [go(v) for v in x]
        return x

    args, kwargs = tree
    return tuple(go(a) for a in args), {k: go(v) for k, v in kwargs}


def _resolve(target: str) -> Callable[..., object]:
    ns, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


@functools.lru_cache(maxsize=4096)
def _measure(target: str, frozen: OpArgs, shapes: tuple[_Shaped, ...]) -> tuple[float, float]:
    """(forward, backward) seconds; ``shapes``: each tensor argument's (shape, dtype, needs a gradient, is an
    activation, layout: ``TensorSpec.order``)."""
    if sum(_numel(s) * _itemsize(dt) for s, dt, _, _, _ in shapes) > MAX_BYTES:
        raise ValueError("too large to replay")
    from pipeviz.adapter.malloc import keep_heap

    # As in the workers: without it every large output (a weight's gradient) is fresh mmap pages, and a
    # 1024 x 2048 Linear's backward measured 8.5 ms here instead of 4.8.
    keep_heap()
    fn = _resolve(target)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a pipeline rank on its own core
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            tensors = [_random(s, dt, grad, order) for s, dt, grad, _, order in shapes]
        args, kwargs = _thaw(frozen, tensors)
        warm = [t for t, (_, _, _, activation, _) in zip(tensors, shapes, strict=True) if activation]
        flush = sum(t.numel() * t.element_size() for t in tensors) > _CACHED
        grads = [t for t in tensors if t.requires_grad]
        # Grad mode as in training: recording the graph and saving tensors is part of a training forward's cost.
        with torch.set_grad_enabled(bool(grads)):
            forward = _timed(lambda: fn(*args, **kwargs), warm, flush)
        if not grads:
            return forward, 0.0
        with torch.enable_grad():
            out = [o for o in pytree.tree_leaves(fn(*args, **kwargs))
                   if isinstance(o, torch.Tensor) and o.requires_grad]
            if not out:
                return forward, 0.0
            ones = [torch.ones_like(o) for o in out]
            backward = _timed(lambda: torch.autograd.grad(out, grads, ones, retain_graph=True, allow_unused=True),
                              [*warm, *ones], flush)
        # One torch.autograd.grad call costs far more than one node of a whole backward (~60 µs against ~10 here):
        # the call's own cost, measured on a trivial op, is taken off and a node's (a trivial forward's) added.
        entry, node = _autograd_call()
        # Each parameter's gradient is added into its .grad once a microbatch (every microbatch but a step's first):
        # a pass over the weight that a 16-row Linear's backward spends a third of its time on here.
        accumulate = sum(_accumulate(tuple(t.shape), t.dtype) for t, (_, _, _, activation, _)
                         in zip(tensors, shapes, strict=True) if t.requires_grad and not activation)
        return forward, max(backward - entry, 0.0) + node + accumulate
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=256)
def _accumulate(shape: tuple[int, ...], dtype: torch.dtype) -> float:
    """Seconds of adding a gradient of ``shape`` into a parameter's ``.grad`` (autograd's AccumulateGrad)."""
    acc, g = torch.zeros(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    return _timed(lambda: acc.add_(g), [], 2 * acc.numel() * acc.element_size() > _CACHED)


@functools.lru_cache(maxsize=1)
def _autograd_call() -> tuple[float, float]:
    """Seconds of a ``torch.autograd.grad`` call on a one-element product, and of that product's forward call."""
    x = torch.randn(1, requires_grad=True)
    with torch.enable_grad():
        y = x * 2.0
    ones = torch.ones_like(y)
    # Warm (no flush): a flush makes the call's code cold, 412 µs and 196 µs here instead of ~65 and ~5.
    entry = _timed(lambda: torch.autograd.grad([y], [x], [ones], retain_graph=True), [], flush=False)
    node = _timed(lambda: torch.ops.aten.mul.Tensor(x.detach(), 2.0), [], flush=False)
    return entry, node


def _random(shape: tuple[int, ...], dtype: torch.dtype, grad: bool, order: tuple[int, ...] | None = None
            ) -> torch.Tensor:
    if dtype.is_floating_point:
        if order is not None:  # laid out as traced: a row-major tensor of the dims in memory order, permuted back
            inverse = sorted(range(len(order)), key=lambda i: order[i])
            return torch.randn([shape[d] for d in order], dtype=dtype).permute(inverse).requires_grad_(grad)
        return torch.randn(shape, dtype=dtype).requires_grad_(grad)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)  # indices: 0 is valid for any table


def _timed(fn: Callable[[], object], warm: list[torch.Tensor], flush: bool = True) -> float:
    """Seconds of one ``fn()``, as a run meets it: each call after the caches were flushed (a run streams a
    layer's weights from memory once a microbatch: a loop over one op would find them in cache) and the
    activations ``warm`` read again (the op before just wrote them; ``flush=False``: an op whose tensors fit in
    a core's own cache, which a flush would make cold along with the code that runs it); the median of up to
    ``_CALLS`` calls or ``_SECONDS`` of them."""
    fn()  # warm-up: allocations, one-time dispatch
    times: list[float] = []
    while len(times) < _MIN_CALLS or (len(times) < _CALLS and sum(times) < _SECONDS):
        if flush:
            _FLUSH.zero_()
        for t in warm:
            t.detach().sum()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
