"""``trace()`` a model into a ``ModelGraph``: layers in execution order, dataflow edges and costs.

Example:
    >>> import torch, pipeviz as pv
    >>> from pipeviz.zoo import MyNetwork
    >>> graph = pv.trace(MyNetwork(512, [512, 1024, 256]), example_args=(torch.randn(32, 512),))
    >>> [layer.name for layer in graph.layers]
    ['layer0', 'layer1', 'layer2', 'output_proj']
    >>> plan = graph.split(["layer0", "layer1"])          # 3 stages
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint

from pipeviz.capture.export import Capture, capture, loss_input_bytes, op_saved_bytes
from pipeviz.capture.names import listed, suggest
from pipeviz.capture.units import ROOT, CallTree, Unit
from pipeviz.capture.view import GraphIndex, Layer
from pipeviz.plan.errors import PlanError
from pipeviz.plan.megatron import split_megatron
from pipeviz.plan.split import SplitPlan

if TYPE_CHECKING:
    from pipeviz.capture.measured import Profile

__all__ = ["Layer", "ModelGraph", "trace"]


def trace(
    model: nn.Module,
    example_args: tuple[object, ...] | torch.Tensor = (),
    example_kwargs: Mapping[str, object] | None = None,
    *,
    depth: int | None = None,
) -> ModelGraph:
    """Capture ``model`` once with torch.export and return its layer graph.

    The user's model is never modified: pipeviz traces a deep copy. HF models with ``use_cache`` get
    ``use_cache=False`` on pipeviz's copies (a KV cache cannot be exported or pipelined; ``graph.notes``
    says so).

    Example:
        >>> graph = pv.trace(model, example_args=(x,))            # natural blocks
        >>> graph = pv.trace(model, example_args=(x,), depth=3)   # every module down to depth 3

    Args:
        model: any ``nn.Module`` (on the meta device too: nothing is allocated).
        example_args: positional inputs for one full batch (a single tensor is accepted too).
        example_kwargs: keyword inputs (attention masks, ...).
        depth: ``None`` for the natural blocks (lists of repeated blocks are opened, blocks are kept whole,
            parameter-free activations and dropout are glue, not layers); an int for every module down to
            that depth. ``graph.expand`` / ``graph.collapse`` change it later without tracing again.

    Returns:
        The ``ModelGraph``.

    Raises:
        TraceError: torch.export cannot capture the forward; the message names the cause and the fix.
    """
    return ModelGraph(capture(model, example_args, example_kwargs), depth=depth)


class ModelGraph:
    """Layers of a traced model at one granularity, with edges, costs and valid split points.

    Build it with ``pv.trace``. Views at other granularities (``expand``, ``collapse``, ``regroup``) share
    the same capture, so they cost no tracing. Splits may name any module at any depth (``split_candidates``),
    whatever the granularity shown.
    """

    def __init__(self, cap: Capture, layer_names: Sequence[str] | None = None, *, depth: int | None = None,
                 tree: CallTree | None = None, profile: Profile | None = None) -> None:
        self._cap = cap
        self._tree = tree or CallTree(cap)
        self.profile = profile
        names = list(layer_names) if layer_names is not None else self._tree.natural(depth)
        if not names:
            raise ValueError(
                f"{type(cap.model).__name__} has no submodules that run in forward, so there is nothing to split. "
                "Fix: build the model from submodules (e.g. an nn.ModuleList of blocks)."
            )
        self._build(names)

    # ----------------------------------------------------------------- granularity
    def expand(self, name: str) -> ModelGraph:
        """A new graph with layer ``name`` replaced by its child modules (no re-tracing)."""
        self._require_layer(name)
        kids = self._tree.visible_children(name)
        if not kids:
            raise ValueError(f"Layer {name!r} has no child modules to expand. Expandable: {self._expandable()}.")
        names = [n for layer in self.layers for n in (kids if layer.name == name else [layer.name])]
        return self._view(names)

    def collapse(self, name: str) -> ModelGraph:
        """A new graph with every layer inside module ``name`` merged into one layer ``name`` (one per call
        for a module that runs several times)."""
        targets = set(self._units_named(name))
        names: list[str] = []
        for layer in self.layers:
            outer = next((u for u in reversed(self._tree.ancestors(layer.name)) if u in targets), None)
            pick = outer if outer is not None else layer.name
            if pick not in names:
                names.append(pick)
        if list(names) == list(self._names):
            raise ValueError(f"No layer lies inside {name!r}; layers: {', '.join(self._names)}.")
        return self._view(names)

    def regroup(self, depth: int | None = None) -> ModelGraph:
        """A new graph at another granularity: ``None`` for natural blocks, an int for a module depth."""
        return ModelGraph(self._cap, depth=depth, tree=self._tree, profile=self.profile)

    def with_profile(self, profile: Profile | None) -> ModelGraph:
        """This view with measured layer times attached (``pv.profile(graph)``): ``simulate`` and
        ``balance(by="time")`` on it, and on plans made from it, use them. The graph itself is unchanged.

        Example:
            >>> graph = graph.with_profile(pv.profile(graph, microbatches=4))
        """
        return ModelGraph(self._cap, self._names, tree=self._tree, profile=profile)

    def _view(self, names: Sequence[str]) -> ModelGraph:
        return ModelGraph(self._cap, names, tree=self._tree, profile=self.profile)

    def _expandable(self) -> str:
        return ", ".join(layer.name for layer in self.layers if layer.expandable) or "none"

    def _units_named(self, name: str) -> tuple[str, ...]:
        """Units for a unit name, or every call's unit for a module FQN."""
        if not isinstance(name, str):
            raise TypeError(f"Module names are strings, got {name!r} ({type(name).__name__}).")
        if name in self._tree.units and name != ROOT:
            return (name,)
        if name in self._tree.by_fqn:
            return self._tree.by_fqn[name]
        hint = suggest(name, [n for n in self._tree.units if n])
        raise PlanError(f"Unknown module {name!r}. {hint + ' ' if hint else ''}{self.valid_splits_text()}")

    # ----------------------------------------------------------------- build
    def _build(self, names: Sequence[str]) -> None:
        cap, tree = self._cap, self._tree
        for name in names:
            if name not in tree.units or name == ROOT:
                raise ValueError(f"Modules [{name!r}] run no ops in forward and cannot be layers.")
        chosen = set(names)
        op_layer_name = [next((u for u in path if u in chosen), None) for path in tree.paths]
        order = sorted(chosen, key=lambda n: tree.units[n].first)
        owned = {n for n in op_layer_name if n is not None}
        missing = [n for n in order if n not in owned]
        if missing:
            raise ValueError(f"Modules {missing} run no ops in forward at this granularity (another chosen "
                             "module contains them), so they cannot be layers.")
        self._names: tuple[str, ...] = tuple(order)
        self._pos = {n: i for i, n in enumerate(order)}
        self._op_layer = [self._pos[o] if o is not None else -1 for o in op_layer_name]
        self._first = [tree.units[n].first for n in order]
        self._last = [tree.units[n].last for n in order]
        n = len(order)
        flops, out_bytes, acts, saved, in_bytes = [0] * n, [0] * n, [0] * n, [0] * n, [0] * n
        read: set[tuple[int, int | str]] = set()
        readers: dict[int, set[int]] = {}
        for op in cap.ops:
            for src in op.inputs:
                readers.setdefault(src, set()).add(self._op_layer[op.index])
        outputs = self._graph_outputs()
        for op in cap.ops:
            li = self._op_layer[op.index]
            if li >= 0:
                flops[li] += op.flops
                acts[li] += op.out_bytes
                saved[li] += self._op_saved[op.index]
                for src in op.inputs:
                    if self._op_layer[src] != li and (li, src) not in read:
                        read.add((li, src))
                        in_bytes[li] += cap.ops[src].out_bytes
                for x in op.model_inputs:
                    if (li, x) not in read:
                        read.add((li, x))
                        in_bytes[li] += cap.input_bytes.get(x, 0)
                if any(dst != li for dst in readers.get(op.index, ())) or op.index in outputs:
                    out_bytes[li] += op.out_bytes
        idx = self.index
        users: dict[str, set[int]] = {}
        for p, uses in [*idx.param_uses.items(), *idx.buffer_uses.items()]:
            users[p] = {self._op_layer[u] for u in uses if self._op_layer[u] >= 0}
        first_user = {p: min(ls) for p, ls in users.items() if ls}
        params, pbytes, bbytes = [0] * n, [0] * n, [0] * n
        for p, li in first_user.items():
            if p in idx.buffer_uses:
                bbytes[li] += idx.nbytes.get(p, 0)
            else:
                params[li] += idx.numel.get(p, 0)
                pbytes[li] += idx.nbytes.get(p, 0)
        self.layers: list[Layer] = [
            Layer(
                name=name, kind=tree.units[name].kind, index=i, params=params[i], param_bytes=pbytes[i],
                flops=flops[i], out_bytes=out_bytes[i],
                shared=tuple(sorted(p for p, ls in users.items() if i in ls and len(ls) > 1 and p in idx.param_uses)),
                calls=tree.units[name].calls, expandable=bool(tree.units[name].children), activation_bytes=acts[i],
                buffer_bytes=bbytes[i], saved_bytes=saved[i], in_bytes=in_bytes[i],
            )
            for i, name in enumerate(order)
        ]
        self.edges: list[tuple[str, str]] = self._edges()

    @cached_property
    def index(self) -> GraphIndex:
        """What a ``SplitPlan`` reads: op-level costs, values crossing each point and tensor uses."""
        cap = self._cap
        last_use: dict[int, int] = {}
        for op in cap.ops:
            for src in op.inputs:
                last_use[src] = max(last_use.get(src, -1), op.index)
        for out in self._graph_outputs():  # the model's outputs leave from the last stage
            last_use[out] = len(cap.ops) - 1
        flops, acts, saved = [0], [0], [0]
        for op in cap.ops:
            flops.append(flops[-1] + op.flops)
            acts.append(acts[-1] + op.out_bytes)
            saved.append(saved[-1] + self._op_saved[op.index])
        param_uses: dict[str, list[int]] = {}
        buffer_uses: dict[str, list[int]] = {}
        input_uses: dict[str, list[int]] = {}
        for op in cap.ops:
            for p in op.params:
                (buffer_uses if p in cap.buffers else param_uses).setdefault(p, []).append(op.index)
            for x in op.model_inputs:
                input_uses.setdefault(x, []).append(op.index)

        def frozen(d: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
            return {k: tuple(v) for k, v in d.items()}

        return GraphIndex(
            num_ops=len(cap.ops), layer_names=self._names, layer_first=tuple(self._first),
            layer_last=tuple(self._last), flops_prefix=tuple(flops), act_prefix=tuple(acts),
            values=tuple((src, end, cap.ops[src].out_bytes) for src, end in sorted(last_use.items())),
            param_uses=frozen(param_uses), buffer_uses=frozen(buffer_uses), input_uses=frozen(input_uses),
            numel=dict(cap.param_numel), nbytes=dict(cap.param_bytes), mutated=cap.mutated,
            saved_prefix=tuple(saved),
            resaved=tuple((op.index, first, slot, b) for op in cap.ops for first, slot, b in op.resaved),
            loss_saved=self._loss_saved,
        )

    @cached_property
    def _op_saved(self) -> list[int]:
        """Per op, the bytes it keeps for backward (``Op.saved_bytes``); the op making the model's output also
        keeps what the loss saves: the loss runs right after it, on the same stage, and its saved tensors live
        until that microbatch's backward like the stage's own."""
        out = [op_saved_bytes(op) for op in self._cap.ops]
        op, loss = self._loss_saved
        if op >= 0:
            out[op] += loss
        return out

    @cached_property
    def _loss_saved(self) -> tuple[int, int]:
        """(op, bytes): the loss's saved bytes and the output op ``_op_saved`` counts them at ((-1, 0): none)."""
        outputs = self._graph_outputs()
        return (max(outputs), loss_input_bytes(self._cap)) if outputs else (-1, 0)

    def _graph_outputs(self) -> set[int]:
        # Ops nobody reads inside the graph are the model's outputs; not an in-place op's (``copy_`` into a slice of
        # a fresh tensor, DeepSeek-V3's keys): its result is its input, read through that (else every stage relayed
        # each layer's keys to the head: GBs per hand-off).
        read = {src for op in self._cap.ops for src in op.inputs}
        last = len(self._cap.ops) - 1
        return {op.index for op in self._cap.ops if op.index not in read and op.out_bytes
                and (op.index == last or not op.target.split(".")[1:2] or not op.target.split(".")[1].endswith("_"))}

    def _edges(self) -> list[tuple[str, str]]:
        # Sources of each op's value: its own layer, or for glue ops the layers feeding them.
        sources: list[frozenset[int]] = []
        edges: set[tuple[int, int]] = set()
        for op in self._cap.ops:
            li = self._op_layer[op.index]
            feeding = frozenset().union(*(sources[s] for s in op.inputs)) if op.inputs else frozenset()
            if li >= 0:
                edges.update((s, li) for s in feeding if s != li)
                sources.append(frozenset({li}))
            else:
                sources.append(feeding)
        return [(self._names[a], self._names[b]) for a, b in sorted(edges)]

    # ----------------------------------------------------------------- split points
    def position(self, name: str, point: SplitPoint = SplitPoint.END) -> float:
        """Where a split at ``name`` (any module, any depth; ``fqn@k`` for one call) falls among the ops:
        between the op indices ``floor`` and ``ceil`` of the result.

        Raises:
            PlanError: unknown name, or a module that runs several times named without its call.
        """
        units = self._units_named(name)
        if len(units) > 1:
            raise PlanError(
                f"Module {name!r} runs {len(units)} times in forward, so a split there is ambiguous. "
                f"Fix: name one call: {', '.join(units)}."
            )
        unit = self._tree.units[units[0]]
        return unit.last + 0.5 if point is SplitPoint.END else unit.first - 0.5

    def unit(self, name: str) -> Unit:
        """The module call (or container) ``name`` refers to."""
        units = self._units_named(name)
        return self._tree.units[units[0]]

    @cached_property
    def split_candidates(self) -> list[str]:
        """Every module name a split can be placed after (``SplitPoint.END``), at any depth and in execution
        order: the layers of this view and the modules inside and around them. ``graph.split([...])``
        accepts each of them (and ``{name: SplitPoint.BEGINNING}`` for modules that do not start the model)."""
        last = len(self._cap.ops) - 1
        tail_ok = [False] * (last + 2)  # is there a module op after position i?
        seen = False
        for i in range(last, -1, -1):
            seen = seen or bool(self._tree.paths[i])
            tail_ok[i] = seen
        names = [u for u in self._tree.units.values() if u.name != ROOT and u.last < last and tail_ok[u.last + 1]
                 and not self.region_at(u.last + 0.5) and not self.data_dependent_at(u.last + 0.5)]
        names.sort(key=lambda u: (u.last, -u.first, self._tree.depth(u.name)))
        return [u.name for u in names]

    def region_at(self, position: float) -> str:
        """The no_grad / autocast region a split at ``position`` (between two ops) would cut through, as
        ``"torch.no_grad() block in Rotary.forward (rotary)"``; "" when it falls outside every region. A region runs
        whole in one stage: its grad mode or autocast state cannot cross a stage boundary."""
        ops = self._cap.ops
        lo, hi = int(position), int(position) + 1
        if 0 <= lo and hi < len(ops) and ops[lo].region and ops[lo].region == ops[hi].region:
            return ops[lo].region.partition(": ")[2]
        return ""

    def data_dependent_at(self, position: float) -> str:
        """The value a split at ``position`` would send whose size depends on the data (the rows routed to one
        expert of a mixture-of-experts block), as ``"linear_11 (blocks.1.experts.0.w2)"``; "" when none crosses
        it. A stage receives tensors of shapes fixed before the run, so no split may fall there."""
        for src, end in self._data_dependent_spans:
            if src < position < end:
                op = self._cap.ops[src]
                return f"{op.name} ({op.stack[-1]})" if op.stack else op.name
        return ""

    @cached_property
    def _data_dependent_spans(self) -> tuple[tuple[int, int], ...]:
        ops = self._cap.ops
        return tuple((src, end) for src, end, _ in self.index.values if ops[src].data_dependent)

    def refine(self, positions: Sequence[float]) -> ModelGraph:
        """This view, with every layer that a split position falls inside opened up, and stages that would
        hold only glue given the modules they run; ``self`` when nothing changes.

        Raises:
            PlanError: a stage between two positions runs no module at all (only ops between modules).
        """
        tree = self._tree
        names = list(self._names)
        while True:
            cut = next((n for n in names for p in positions
                        if tree.units[n].first < p < tree.units[n].last and tree.units[n].children), None)
            if cut is None:
                break
            i = names.index(cut)
            names[i:i + 1] = list(tree.units[cut].children)
        bounds = [-1.0, *positions, float(len(self._cap.ops))]
        for s in range(len(bounds) - 1):
            lo, hi = bounds[s], bounds[s + 1]
            if any(lo < tree.units[n].first < hi for n in names):
                continue
            inside = self._outermost_within(lo, hi)
            if not inside:
                raise PlanError(
                    f"Stage {s} would hold no module, only the ops between modules (positions {lo:g}..{hi:g}). "
                    "Fix: drop one of the two split points around it."
                )
            names += inside
        if sorted(names) == sorted(self._names):
            return self
        return self._view(sorted(set(names), key=lambda n: tree.units[n].first))

    def _outermost_within(self, lo: float, hi: float) -> list[str]:
        out: list[str] = []
        for unit in self._tree.units.values():
            if unit.name == ROOT or not (lo < unit.first and unit.last < hi):
                continue
            if not any(lo < self._tree.units[a].first and self._tree.units[a].last < hi
                       for a in self._tree.ancestors(unit.name)):
                out.append(unit.name)
        return out

    # ----------------------------------------------------------------- queries
    @property
    def model(self) -> nn.Module:
        """The user's model (never modified by pipeviz)."""
        return self._cap.model

    @property
    def example_args(self) -> tuple[object, ...]:
        return self._cap.example_args

    @property
    def example_kwargs(self) -> dict[str, object]:
        return self._cap.example_kwargs

    @property
    def batch_size(self) -> int | None:
        """Size of dim 0 of the first example input (what microbatches divide)."""
        return self._cap.batch_size

    @property
    def notes(self) -> list[str]:
        """Fixes pipeviz applied to its copies of the model (e.g. ``use_cache=False``)."""
        return list(self._cap.notes)

    @property
    def capture(self) -> Capture:
        return self._cap

    @property
    def layer_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def total_params(self) -> int:
        """Parameter elements of the whole model (buffers excluded), shared tensors counted once."""
        return sum(self.index.numel.get(p, 0) for p in self.index.param_uses)

    @property
    def total_buffer_bytes(self) -> int:
        """Bytes of every buffer the forward reads (running statistics, ``inv_freq``, ...)."""
        return sum(self.index.nbytes.get(p, 0) for p in self.index.buffer_uses)

    @property
    def total_flops(self) -> int:
        return self.index.flops_prefix[-1]

    @property
    def skip_edges(self) -> list[tuple[str, str]]:
        """Edges that jump over at least one layer (skip / residual connections between layers)."""
        return [(a, b) for a, b in self.edges if self._pos[b] - self._pos[a] > 1]

    def layer(self, name: str) -> Layer:
        """The ``Layer`` called ``name``."""
        self._require_layer(name)
        return self.layers[self._pos[name]]

    def can_split_after(self, name: str) -> bool:
        """Whether a split after layer ``name`` is valid (every layer but the last, and not before glue only)."""
        self._require_layer(name)
        return name in self._split_after

    def valid_splits_text(self) -> str:
        """One sentence for error messages: the layers a split can follow, and where the rest are listed."""
        layers = [n for n in self._names if n in self._split_after]
        inner = " (and the modules inside them: graph.split_candidates)" if len(self.split_candidates) > len(layers) \
            else ""
        return f"Valid split points: {listed(layers) or 'none (one layer)'}{inner}."

    @cached_property
    def _split_after(self) -> frozenset[str]:
        candidates = set(self.split_candidates)
        return frozenset(n for n in self._names[:-1] if n in candidates)

    def split(self, spec: Iterable[str] | Mapping[str, object]) -> SplitPlan:
        """Split after each named module (or as a ``{name: SplitPoint}`` map) and return the ``SplitPlan``.

        Any name in ``split_candidates`` works, at any depth, whatever this view's granularity: the plan's
        graph opens the layers a split falls inside.

        Example:
            >>> plan = graph.split(["layer0", "layer1"])
            >>> plan = graph.split({"layer1": pv.SplitPoint.BEGINNING})
        """
        return SplitPlan.from_spec(self, spec)

    def split_megatron(self, layout: str) -> SplitPlan:
        """The plan a Megatron-Core ``--pipeline-model-parallel-layout`` string describes (``"Ett|ttL"``: ``E``
        embedding, ``t`` a block, ``L`` head; ``pipeviz.plan.megatron.split_megatron``); ``pv.megatron_layout(plan)``
        is the inverse."""
        return split_megatron(self, layout)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ModelGraph) and other._cap is self._cap and other._names == self._names
                and other.profile is self.profile)

    def __hash__(self) -> int:
        return hash((id(self._cap), self._names, id(self.profile)))

    def __repr__(self) -> str:
        return f"ModelGraph({type(self.model).__name__}, {len(self.layers)} layers, {len(self.edges)} edges)"

    # ----------------------------------------------------------------- errors
    def _require_layer(self, name: object) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Layer names are strings, got {name!r} ({type(name).__name__}).")
        if name in self._pos:
            return
        raise ValueError(self._not_a_layer(name))

    def _not_a_layer(self, name: str) -> str:
        layers = listed(list(self._names))
        if name in self._tree.units and name:
            outer = next((n for n in self._names if n in self._tree.ancestors(name)), None)
            if outer is not None:
                return (f"{name!r} is inside layer {outer!r}, not a layer at this granularity. Fix: "
                        f"graph.expand({outer!r}) to see it, or split at it directly. Layers: {layers}.")
            return f"{name!r} holds several layers, not one. Fix: graph.collapse({name!r}). Layers: {layers}."
        hint = suggest(name, list(self._names))
        return f"Unknown layer {name!r}. {hint + ' ' if hint else ''}Layers: {layers}."
