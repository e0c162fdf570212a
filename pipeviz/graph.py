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

import bisect
import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from pipeviz.capture import Capture, capture

if TYPE_CHECKING:
    from pipeviz.plan import SplitPlan

_CONTAINERS = ("ModuleList", "ModuleDict", "Sequential")


@dataclass(frozen=True)
class Layer:
    """One layer of a ``ModelGraph``: a module called in the model's forward.

    Attributes:
        name: the module's FQN in the original model (``"transformer.h.3"``).
        kind: the module's class name.
        index: position in execution order.
        params: parameter elements; a tensor shared by several layers counts once, in the first.
        param_bytes: bytes of those parameters.
        flops: forward FLOPs for the example batch (``torch.utils.flop_counter``).
        out_bytes: bytes of the activations this layer hands to the rest of the model.
        shared: canonical names of parameters this layer shares with other layers (tied weights).
        calls: how many times forward calls the module (more than 1: not a split point).
        expandable: whether ``graph.expand(name)`` can show its children.
        activation_bytes: bytes of every activation the layer produces (what backward keeps alive).
    """

    name: str
    kind: str
    index: int
    params: int
    param_bytes: int
    flops: int
    out_bytes: int
    shared: tuple[str, ...]
    calls: int
    expandable: bool
    activation_bytes: int = 0


def trace(
    model: nn.Module,
    example_args: tuple[Any, ...] | Any = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    depth: int | None = None,
) -> ModelGraph:
    """Capture ``model`` once with torch.export and return its layer graph.

    The user's model is never modified: pipeviz traces a deep copy. HF models with ``use_cache`` get
    ``use_cache=False`` on pipeviz's copies, with a warning (a KV cache cannot be exported or pipelined).

    Example:
        >>> graph = pv.trace(model, example_args=(x,))            # natural blocks
        >>> graph = pv.trace(model, example_args=(x,), depth=3)   # every module down to depth 3

    Args:
        model: any ``nn.Module``.
        example_args: positional inputs for one full batch (a single tensor is accepted too).
        example_kwargs: keyword inputs (attention masks, ...).
        depth: ``None`` for the natural blocks (containers such as ``ModuleList`` are opened, blocks are
            kept whole); an int for every module down to that depth. ``graph.expand`` / ``graph.collapse``
            change it later without tracing again.

    Returns:
        The ``ModelGraph``.

    Raises:
        TraceError: torch.export cannot capture the forward; the message names the cause and the manual
            route (``pv.manual_plan``).
    """
    return ModelGraph(capture(model, example_args, example_kwargs), depth=depth)


class ModelGraph:
    """Layers of a traced model at one granularity, with edges, costs and valid split points.

    Build it with ``pv.trace``. Views at other granularities (``expand``, ``collapse``, ``regroup``) share
    the same capture, so they cost no tracing.
    """

    def __init__(self, cap: Capture, layer_names: Sequence[str] | None = None, *, depth: int | None = None) -> None:
        self._cap = cap
        used: dict[str, int] = {}  # module fqn -> number of calls
        for op in cap.ops:
            for fqn, call in zip(op.stack, op.calls, strict=True):
                used[fqn] = max(used.get(fqn, 0), call + 1)
        for fqn in list(used):  # containers (a ModuleList) are never called but hold called modules
            while "." in fqn:
                fqn = fqn.rpartition(".")[0]
                used.setdefault(fqn, 1)
        self._calls = used
        names = list(layer_names) if layer_names is not None else self._choose(depth)
        if not names:
            raise ValueError(
                f"{type(cap.model).__name__} has no submodules that run in forward, so there is nothing to split. "
                "Fix: build the model from submodules (e.g. an nn.ModuleList of blocks)."
            )
        self._build(names)

    # ----------------------------------------------------------------- granularity
    def _children(self, fqn: str) -> list[str]:
        return [c for c in self._cap.modules.get(fqn, ("", ()))[1] if c in self._calls]

    def _choose(self, depth: int | None) -> list[str]:
        mods = self._cap.modules

        def is_block_list(fqn: str) -> bool:
            # Repeated blocks (GPT-2's h, BERT's encoder.layer): a container of >= 2 composite modules of
            # one class. A container of different parts (T5Block.layer: attention, then MLP) is not one.
            kids = self._children(fqn)
            return (mods[fqn][0] in _CONTAINERS and len(kids) >= 2 and len({mods[k][0] for k in kids}) == 1
                    and any(self._children(k) for k in kids))

        def holds_block_list(fqn: str) -> bool:
            return is_block_list(fqn) or any(holds_block_list(k) for k in self._children(fqn))

        def opens(fqn: str) -> bool:
            if not self._children(fqn):
                return False
            if depth is not None:
                return fqn == "" or fqn.count(".") + 1 < depth
            return fqn == "" or mods[fqn][0] in _CONTAINERS or holds_block_list(fqn)

        out: list[str] = []

        def walk(fqn: str) -> None:
            if opens(fqn):
                for kid in self._children(fqn):
                    walk(kid)
            else:
                out.append(fqn)

        walk("")
        # A wrapper with a single child says nothing: open it until there is something to split.
        while len(out) == 1 and self._children(out[0]) and depth is None:
            out = self._children(out[0])
        return out

    def expand(self, name: str) -> ModelGraph:
        """A new graph with layer ``name`` replaced by its child modules (no re-tracing)."""
        self._require_layer(name)
        kids = self._children(name)
        if not kids:
            raise ValueError(f"Layer {name!r} has no child modules to expand. Expandable: {self._expandable()}.")
        names = [n for layer in self.layers for n in (kids if layer.name == name else [layer.name])]
        return ModelGraph(self._cap, names)

    def collapse(self, name: str) -> ModelGraph:
        """A new graph with every layer inside module ``name`` merged into one layer ``name``."""
        if name not in self._calls or name == "":
            raise ValueError(f"Unknown module {name!r}. {self._suggest(name, list(self._calls))}")
        inside = [layer.name for layer in self.layers if layer.name.startswith(name + ".")]
        if not inside:
            raise ValueError(f"No layer lies inside {name!r}; layers: {', '.join(self._names)}.")
        names: list[str] = []
        for layer in self.layers:
            if layer.name.startswith(name + "."):
                if name not in names:
                    names.append(name)
            else:
                names.append(layer.name)
        return ModelGraph(self._cap, names)

    def regroup(self, depth: int | None = None) -> ModelGraph:
        """A new graph at another granularity: ``None`` for natural blocks, an int for a module depth."""
        return ModelGraph(self._cap, depth=depth)

    def _expandable(self) -> str:
        return ", ".join(layer.name for layer in self.layers if layer.expandable) or "none"

    # ----------------------------------------------------------------- build
    def _build(self, names: Sequence[str]) -> None:
        cap = self._cap
        chosen = set(names)
        owners: dict[tuple[str, ...], str | None] = {}

        def owner_of(stack: tuple[str, ...]) -> str | None:
            # Outermost first: the first chosen module, or chosen ancestor (an uncalled container such as
            # a ModuleList never appears in the stack itself), owns the op.
            for fqn in stack:
                atoms = fqn.split(".")
                for k in range(1, len(atoms) + 1):
                    if ".".join(atoms[:k]) in chosen:
                        return ".".join(atoms[:k])
            return None

        op_layer: list[str | None] = []
        for op in cap.ops:
            if op.stack not in owners:
                owners[op.stack] = owner_of(op.stack)
            op_layer.append(owners[op.stack])
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, owner in enumerate(op_layer):
            if owner is not None:
                first.setdefault(owner, i)
                last[owner] = i
        missing = [n for n in names if n not in first]
        if missing:
            raise ValueError(f"Modules {missing} run no ops in forward and cannot be layers.")
        order = sorted(first, key=first.__getitem__)
        self._names: tuple[str, ...] = tuple(order)
        self._pos = {n: i for i, n in enumerate(order)}
        self._first = [first[n] for n in order]
        self._last = [last[n] for n in order]
        self._op_layer = [self._pos[o] if o is not None else -1 for o in op_layer]

        # Values: (producer op, last consumer op, bytes); used for send_bytes and layer out_bytes.
        last_use: dict[int, int] = {}
        out_layers: dict[int, set[int]] = {}
        for op in cap.ops:
            for src in op.inputs:
                last_use[src] = max(last_use.get(src, -1), op.index)
                out_layers.setdefault(src, set()).add(self._op_layer[op.index])
        self._values = [(src, end, cap.ops[src].out_bytes) for src, end in sorted(last_use.items())]
        self._flops_prefix = [0]
        for op in cap.ops:
            self._flops_prefix.append(self._flops_prefix[-1] + op.flops)
        self._param_uses: dict[str, list[int]] = {}
        self._input_uses: dict[str, list[int]] = {}
        for op in cap.ops:
            for p in op.params:
                self._param_uses.setdefault(p, []).append(op.index)
            for x in op.model_inputs:
                self._input_uses.setdefault(x, []).append(op.index)

        n = len(order)
        flops = [0] * n
        out_bytes = [0] * n
        acts = [0] * n
        for op in cap.ops:
            li = self._op_layer[op.index]
            if li >= 0:
                flops[li] += op.flops
                acts[li] += op.out_bytes
                if any(dst != li for dst in out_layers.get(op.index, ())) or op.index in self._graph_outputs():
                    out_bytes[li] += op.out_bytes
        layer_params: list[list[str]] = [[] for _ in range(n)]
        owner_of: dict[str, int] = {}
        users: dict[str, set[int]] = {}
        for p, uses in self._param_uses.items():
            ls = {self._op_layer[u] for u in uses if self._op_layer[u] >= 0}
            users[p] = ls
            if ls:
                owner_of[p] = min(ls)
                layer_params[min(ls)].append(p)
        self._param_owner = owner_of
        self.layers: list[Layer] = [
            Layer(
                name=name, kind=cap.modules[name][0], index=i,
                params=sum(cap.param_numel.get(p, 0) for p in layer_params[i] if p in cap.param_numel),
                param_bytes=sum(cap.param_bytes.get(p, 0) for p in layer_params[i]),
                flops=flops[i], out_bytes=out_bytes[i],
                shared=tuple(sorted(p for p, ls in users.items() if i in ls and len(ls) > 1)),
                calls=self._calls[name], expandable=bool(self._children(name)), activation_bytes=acts[i],
            )
            for i, name in enumerate(order)
        ]
        self.edges: list[tuple[str, str]] = self._edges()

    def _graph_outputs(self) -> set[int]:
        # Ops nobody reads inside the graph are the model's outputs.
        if not hasattr(self, "_outputs"):
            read = {src for op in self._cap.ops for src in op.inputs}
            self._outputs = {op.index for op in self._cap.ops if op.index not in read and op.out_bytes}
        return self._outputs

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

    # ----------------------------------------------------------------- queries
    @property
    def model(self) -> nn.Module:
        """The user's model (never modified by pipeviz)."""
        return self._cap.model

    @property
    def example_args(self) -> tuple[Any, ...]:
        return self._cap.example_args

    @property
    def example_kwargs(self) -> dict[str, Any]:
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
        """Parameter elements of the whole model, shared tensors counted once."""
        return sum(self._cap.param_numel.get(p, 0) for p in self._param_uses)

    @property
    def total_flops(self) -> int:
        return self._flops_prefix[-1]

    @property
    def skip_edges(self) -> list[tuple[str, str]]:
        """Edges that jump over at least one layer (skip / residual connections between layers)."""
        return [(a, b) for a, b in self.edges if self._pos[b] - self._pos[a] > 1]

    @property
    def split_candidates(self) -> list[str]:
        """Layer names after which a split is valid (``graph.split([...])`` accepts these)."""
        return [layer.name for layer in self.layers[:-1] if layer.calls == 1]

    def layer(self, name: str) -> Layer:
        """The ``Layer`` called ``name``."""
        self._require_layer(name)
        return self.layers[self._pos[name]]

    def split(self, spec: Iterable[str] | Mapping[str, Any]) -> SplitPlan:
        """Split after each named layer (or as a ``{name: SplitPoint}`` map) and return the ``SplitPlan``.

        Example:
            >>> plan = graph.split(["layer0", "layer1"])
            >>> plan = graph.split({"layer1": pv.SplitPoint.BEGINNING})
        """
        from pipeviz.plan import SplitPlan

        return SplitPlan.from_spec(self, spec)

    def __repr__(self) -> str:
        return f"ModelGraph({type(self.model).__name__}, {len(self.layers)} layers, {len(self.edges)} edges)"

    # ----------------------------------------------------------------- helpers for plans
    def _require_layer(self, name: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Layer names are strings, got {name!r} ({type(name).__name__}).")
        if name in self._pos:
            return
        raise ValueError(self._not_a_layer(name))

    def _not_a_layer(self, name: str) -> str:
        choices = self.split_candidates
        listed = ", ".join(choices[:20]) + (f", … ({len(choices)} in all)" if len(choices) > 20 else "")
        if name in self._cap.modules and name:
            outer = next((n for n in self._names if name.startswith(n + ".")), None)
            if outer is not None:
                return (
                    f"{name!r} is inside layer {outer!r}, not a layer at this granularity. "
                    f"Fix: split at {outer!r}, or go deeper first: graph = graph.expand({outer!r}). "
                    f"Valid split points: {listed}."
                )
            inner = [n for n in self._names if n.startswith(name + ".")]
            if inner:
                return (
                    f"{name!r} is a container of layers ({inner[0]} … {inner[-1]}), not one layer. "
                    f"Fix: split at one of its layers, or graph = graph.collapse({name!r}). "
                    f"Valid split points: {listed}."
                )
            return (f"Module {name!r} runs no ops in forward, so it cannot be a split point. "
                    f"Valid split points: {listed}.")
        hint = self._suggest(name, list(self._names))
        return f"Unknown layer {name!r}. {hint + ' ' if hint else ''}Valid split points: {listed}."

    @staticmethod
    def _suggest(name: str, pool: list[str]) -> str:
        close = difflib.get_close_matches(name, pool, n=3, cutoff=0.8)
        return f"Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""

    def _stage_of(self, markers: Sequence[float], pos: int) -> int:
        return bisect.bisect_left(markers, pos)
