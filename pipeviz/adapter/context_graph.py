"""Context parallelism inside a traced stage graph: each of ``cp`` processes runs the stage on its share of every
sequence (``ContextGraph``), the graph as traced at the whole length.

The share is load-balanced for causal attention as Megatron-LM and torchtitan balance it: the sequence is cut
into ``2·cp`` equal chunks and share ``r`` holds chunks ``r`` and ``2·cp−1−r`` (``zigzag_positions``), so every
share's queries see the same number of earlier keys. The graph runs op by op (an ``fx.Interpreter``); a value is
*local* (this share's tokens) when its shape differs from the traced one in its sequence dim, else *whole*:

- ops the tokens never reach (position tables, masks, ``arange``) run as traced, on the whole sequence;
- a whole value meeting a local one in an elementwise op (position embeddings, rotary tables) is cut to this
  share's positions (global positions: each token keeps its place in the sequence);
- ``view`` / ``reshape`` / ``expand`` of a local value take its local length;
- attention (``scaled_dot_product_attention``) exchanges keys and values: one all-gather per attention forward of
  every share's keys and values (stacked), in sequence order; its backward is a reduce-scatter of their gradients
  (on gloo, which has no reduce-scatter, an all-reduce of which each share keeps its part). The queries stay
  local; the mask's rows are this share's (causal: local queries against global keys; a padding mask as traced);
- an op that would mix tokens otherwise (a reduction over the sequence, picking a token by position, attention
  written as matmuls) raises ``ContextError``, naming the op: the launch checks run each stage once on fake
  tensors (``dry``) so this is refused before any process starts.

Example:
    >>> share = Share(seq=16, cp=2, rank=0)                 # tokens 0-3 and 12-15
    >>> ContextGraph(stage_graph, share)(*local_inputs)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["ContextError", "ContextGraph", "ShapeRecorder", "Share", "attention_forms", "zigzag_positions"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_aten = torch.ops.aten
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
# ops whose output does not depend on their input's values (a new tensor of a given size): whole even from a local
_CONSTANT = {_aten.new_ones.default, _aten.new_zeros.default, _aten.new_full.default, _aten.new_empty.default,
             _aten._assert_tensor_metadata.default}


class ContextError(ValueError):
    """An op of a stage graph that context parallelism cannot run on a share of the sequence exactly."""


def zigzag_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions share ``rank`` of ``cp`` holds of a sequence of ``seq`` tokens: chunks ``rank`` and
    ``2·cp−1−rank`` of ``2·cp`` (``seq`` divisible by ``2·cp``)."""
    c = seq // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])


@dataclass
class Share:
    """This process's share of every sequence: ``seq`` tokens split over ``cp`` shares, this one ``rank``; the cp
    process group (``None`` and ``dry``: shapes only, every share's keys taken to be this one's); ``record(start,
    end)`` is told of every exchange (wall clock)."""

    seq: int
    cp: int
    rank: int
    group: Any = None
    dry: bool = False
    record: Callable[[float, float], None] | None = None
    positions: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.positions = zigzag_positions(self.seq, self.cp, self.rank)

    @property
    def length(self) -> int:
        return self.seq // self.cp

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``t``'s entries at this share's positions along ``dim`` (a whole sequence there)."""
        return _local_op(t, lambda x: x.index_select(dim, self.positions.to(x.device)))

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every share's ``x`` (local along ``dim``) put together in sequence order: the whole sequence."""
        if self.dry:
            parts = [x] * self.cp
        else:
            import torch.distributed as dist

            parts = [torch.empty_like(x) for _ in range(self.cp)]
            start = time.time()
            dist.all_gather(parts, x.contiguous(), group=self.group)
            if self.record is not None:
                self.record(start, time.time())
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([halves[k][0] if k < self.cp else halves[2 * self.cp - 1 - k][1]
                          for k in range(2 * self.cp)], dim)

    def scatter(self, g: torch.Tensor, dim: int) -> torch.Tensor:
        """The gradient of ``gather``: every share's gradient of this share's part, summed (a reduce-scatter)."""
        chunks = g.chunk(2 * self.cp, dim)
        mine = [torch.cat([chunks[r], chunks[2 * self.cp - 1 - r]], dim) for r in range(self.cp)]
        if self.dry:
            return mine[self.rank]
        import torch.distributed as dist

        stacked = torch.stack(mine).contiguous()
        start = time.time()
        if dist.get_backend(self.group) == "gloo":  # gloo has no reduce-scatter: all-reduce, keep this share's part
            dist.all_reduce(stacked, group=self.group)
            out = stacked[self.rank].clone()
        else:
            out = torch.empty_like(mine[0])
            dist.reduce_scatter_tensor(out, stacked, group=self.group)
        if self.record is not None:
            self.record(start, time.time())
        return out


class _Gather(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward (``Share.gather`` / ``Share.scatter``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, share: Share, dim: int) -> torch.Tensor:
        ctx.share, ctx.dim = share, dim
        return share.gather(x, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.share.scatter(g.contiguous(), ctx.dim), None, None


def _gather(x: torch.Tensor, share: Share, dim: int) -> torch.Tensor:
    out: torch.Tensor = _Gather.apply(x, share, dim)  # type: ignore[no-untyped-call]
    return out


def _local_op(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` on a tensor, or on a DTensor's local part (its sequence dim is never sharded), wrapped back."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return DTensor.from_local(fn(t.to_local()), t.device_mesh, t.placements, run_check=False)
    return fn(t)


Shapes = dict[str, Any]  # node name -> its traced shape (a tuple), or a list of them (an op of several outputs)


def _shape_of(value: object) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, tuple | list):
        return [_shape_of(v) for v in value]
    return None


class ShapeRecorder:
    """Run a stage graph as it is, recording every node's shape (``shapes``): what ``ContextGraph`` compares a
    share's values with (a pickled graph keeps no shapes of its own)."""

    def __init__(self, graph: fx.GraphModule) -> None:
        self.graph = graph
        self.shapes: Shapes = {}

    def __call__(self, *args: object) -> object:
        recorder = self

        class _Recording(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                out = super().run_node(n)
                if n.op not in ("get_attr", "output"):
                    recorder.shapes[n.name] = _shape_of(out)
                return out

        return _Recording(self.graph).run(*args)


def _differs(t: object, traced: tuple[int, ...] | None) -> list[int]:
    """The dims where ``t`` is shorter than traced: its sequence dim when it is a local value, else none."""
    if not isinstance(t, torch.Tensor) or traced is None or t.dim() != len(traced):
        return []
    return [d for d in range(t.dim()) if t.shape[d] != traced[d]]


class ContextGraph:
    """Run a traced stage graph (``fx.GraphModule``, traced at the whole sequence) on this share's tokens; call it
    as the graph module is called."""

    def __init__(self, graph: fx.GraphModule, share: Share, shapes: Shapes) -> None:
        self.graph, self.share, self.shapes = graph, share, shapes

    def __call__(self, *args: object) -> object:
        return _Interpreter(self.graph, self.share, self.shapes).run(*args)


class _Interpreter(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, share: Share, shapes: Shapes) -> None:
        super().__init__(module)
        self.share, self.shapes = share, shapes

    def traced(self, node: object) -> tuple[int, ...] | None:
        shape = self.shapes.get(node.name) if isinstance(node, fx.Node) else None
        return shape if isinstance(shape, tuple) else None

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        local = {a: d for a in n.all_input_nodes if (d := _differs(self.env.get(a), self.traced(a)))}
        if not local:  # the tokens never reach it: as traced, on the whole sequence
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        target = n.target
        if target is _SDPA:
            return self.attention(n, args, kwargs)
        if target in _VIEWS or target is _aten.expand.default:
            src = n.args[0]
            assert isinstance(src, fx.Node)
            args = (args[0], self.resized(n, src, args[0], target is _aten.expand.default), *args[2:])
        elif isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            args, kwargs = self.cut_whole(n, local, args, kwargs)
        elif target is _aten.where.self:
            args, kwargs = self.cut_whole(n, local, args, kwargs)
        out = target(*args, **kwargs)  # type: ignore[operator]
        self.check(n, out)
        return out

    def cut_whole(self, n: fx.Node, local: dict[fx.Node, list[int]], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A whole value meeting a local one elementwise: cut to this share's positions in the local one's
        sequence dim (aligned from the right, as broadcasting aligns)."""
        node, dims = next(iter(local.items()))
        traced = self.traced(node)
        assert traced is not None
        if len(dims) != 1 or traced[dims[0]] != self.share.seq:
            raise ContextError(f"{n.name} ({n.target}): a value with {traced[dims[0]]} in its sequence dim meets "
                               f"one of the whole sequence ({self.share.seq} tokens)")
        from_right = len(traced) - dims[0]
        whole, cut = traced[dims[0]], self.share.length

        def one(t: object) -> object:
            if isinstance(t, torch.Tensor):
                j = t.dim() - from_right
                if j >= 0 and t.shape[j] == whole and whole != cut:
                    return self.share.take(t, j)
            return t

        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    def resized(self, n: fx.Node, src: fx.Node, x: torch.Tensor, expand: bool) -> list[int]:
        """The size a view, reshape or expand of a local value takes: the traced one, its sequence dim local."""
        before, after = self.traced(src), self.traced(n)
        assert before is not None and after is not None
        dims = _differs(x, before)
        if len(dims) != 1:
            raise ContextError(f"{n.name} ({n.target}) of a value local in {len(dims)} dims")
        i = dims[0]
        new = list(after)
        if expand:
            new[len(after) - len(before) + i] = x.shape[i]
            return new
        lo = 1
        for d in range(i):
            lo *= before[d]
        hi = lo * before[i]
        at, run = 1, []  # run: the output dims that together are exactly the input's sequence dim
        for j, size in enumerate(after):
            if at <= lo and at * size >= hi:  # one output dim holds it whole (perhaps merged with others)
                new[j] = size // before[i] * x.shape[i]
                return new
            if at >= lo and at * size <= hi:
                run.append(j)
            at *= size
        seq_dims = [j for j in run if after[j] == self.share.seq]
        if len(seq_dims) == 1:  # a merged (batch x sequence) dim unmerged: the sequence is the dim of its length
            new[seq_dims[0]] = self.share.length
            return new
        raise ContextError(f"{n.name} ({n.target}) splits the sequence dim ({before} -> {after}): its tokens would "
                           "not be this share's")

    def check(self, n: fx.Node, out: object) -> None:
        """A local input makes a local output: the traced shape with the sequence dim this share's length."""
        if n.target in _CONSTANT:
            return
        val = self.shapes.get(n.name)
        outs = out if isinstance(out, tuple | list) else [out]
        vals = val if isinstance(val, list) else [val]
        for o, traced in zip(outs, vals, strict=False):
            if not isinstance(o, torch.Tensor) or not isinstance(traced, tuple):
                continue
            dims = _differs(o, traced)
            if not dims:
                raise ContextError(
                    f"{n.name} ({n.target}, {traced}) takes the tokens of this share only but gives a value of the "
                    "whole sequence's shape: it reduces over the sequence or picks tokens by position (a pooler, "
                    "a mean over tokens, attention written as matmuls), which a share of the sequence cannot do "
                    "alone")
            for d in dims:
                if o.shape[d] * self.share.cp != traced[d]:
                    raise ContextError(f"{n.name} ({n.target}) gives {tuple(o.shape)} where the traced {traced} "
                                       f"over {self.share.cp} shares was expected")

    def attention(self, n: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """Local queries against every share's keys and values (one all-gather), the mask's rows this share's."""
        names = ("attn_mask", "dropout_p", "is_causal")
        opts = {**dict(zip(names, args[3:], strict=False)), **kwargs}
        q, k, v = (_plain(t) for t in args[:3])
        mask, causal = opts.get("attn_mask"), bool(opts.get("is_causal", False))
        if float(opts.get("dropout_p", 0.0) or 0.0) > 0:
            raise ContextError(f"{n.name}: attention dropout {opts['dropout_p']} draws a mask per share, not the "
                               "whole sequence's")
        for name, t, node in zip(("query", "key", "value"), args[:3], n.args[:3], strict=True):  # (global shapes)
            if _differs(t, self.traced(node)) != [t.dim() - 2]:
                raise ContextError(f"{n.name}: its {name} is not this share's tokens along dim -2 ({tuple(t.shape)})")
        if k.shape == v.shape:  # one exchange for both
            keys, values = _gather(torch.stack([k, v]), self.share, k.dim() - 1).unbind(0)
        else:
            keys, values = _gather(k, self.share, k.dim() - 2), _gather(v, self.share, v.dim() - 2)
        pos = self.share.positions.to(q.device)
        if mask is None and causal:
            mask = pos[:, None] >= torch.arange(self.share.seq, device=q.device)[None, :]
        elif mask is not None:
            mask = _plain(mask)
            if mask.shape[-2] == self.share.seq:
                mask = self.share.take(mask, mask.dim() - 2)
        rest = {k2: opts[k2] for k2 in ("scale", "enable_gqa") if k2 in opts}
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **rest)
        first = args[0]
        from torch.distributed.tensor import DTensor

        if isinstance(first, DTensor):  # tensor parallel: heads sharded, the output as the query is
            return DTensor.from_local(out, first.device_mesh, first.placements, run_check=False)
        return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def attention_forms(graph: fx.Graph) -> Iterator[str]:
    """What a stage graph's attention does that a share of the sequence cannot run exactly: each a phrase."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _SDPA:
            p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
            if isinstance(p, float) and p > 0:
                yield f"attention dropout {p} ({node.name})"
