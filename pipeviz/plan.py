"""``SplitPlan``: where a model is cut into pipeline stages, its per-stage preview and the real ``Pipe``.

A plan is data: the split points plus the graph they refer to. It is immutable (``toggle`` returns a new
plan), validated on construction, round-trips through JSON, and previews every stage from the graph
without tracing again.

Example:
    >>> plan = graph.split(["layer0", "layer1"])
    >>> [s.layers for s in plan.stages]
    [('layer0',), ('layer1',), ('layer2', 'output_proj')]
    >>> plan.toggle("layer2").num_stages
    4
    >>> pipe = plan.pipe(microbatches=4)      # torch.distributed.pipelining.Pipe
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch.distributed.pipelining import SplitPoint

from pipeviz.graph import ModelGraph


class PlanError(ValueError):
    """An invalid split; the message names the bad value, the valid choices and the fix."""


@dataclass(frozen=True)
class StageInfo:
    """Preview of one pipeline stage, computed from the graph.

    Attributes:
        index: stage number.
        layers: layer names in execution order.
        params: parameter elements owned by this stage (a tied tensor counts once, in its first stage).
        flops: forward FLOPs for the example batch, glue ops between layers included.
        send_bytes: bytes this stage passes to later stages for the example batch: every activation
            produced here or earlier that a later stage reads (skip connections included).
        recv_bytes: bytes arriving from earlier stages.
        inputs: model inputs (placeholder names) this stage reads.
        shared_params: tied parameters this stage holds a copy of that other stages hold too.
        param_bytes: bytes of every parameter the stage holds (tied copies included).
        activation_bytes: bytes of all activations the stage produces for the example batch (what
            backward keeps alive, roughly).
        memory_bytes: rough training footprint: parameters + gradients + activations.
    """

    index: int
    layers: tuple[str, ...]
    params: int
    flops: int
    send_bytes: int
    recv_bytes: int
    inputs: tuple[str, ...]
    shared_params: tuple[str, ...]
    param_bytes: int
    activation_bytes: int

    @property
    def memory_bytes(self) -> int:
        return 2 * self.param_bytes + self.activation_bytes


_POINTS = {"end": SplitPoint.END, "beginning": SplitPoint.BEGINNING}


def _point(value: Any, name: str) -> SplitPoint:
    if isinstance(value, SplitPoint):
        return value
    if isinstance(value, str) and value.lower() in _POINTS:
        return _POINTS[value.lower()]
    if hasattr(value, "name") and str(value.name).lower() in _POINTS:  # an equivalent enum
        return _POINTS[str(value.name).lower()]
    raise PlanError(
        f"Split point for {name!r} is {value!r}; valid: SplitPoint.END, SplitPoint.BEGINNING, 'end', 'beginning'."
    )


@dataclass(frozen=True)
class SplitPlan:
    """An immutable set of split points over a ``ModelGraph``. Build with ``graph.split(...)``.

    Attributes:
        graph: the graph the names refer to.
        splits: ``(layer name, SplitPoint)`` pairs in execution order.
    """

    graph: ModelGraph
    splits: tuple[tuple[str, SplitPoint], ...]

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_spec(cls, graph: ModelGraph, spec: Iterable[str] | Mapping[str, Any]) -> SplitPlan:
        """Validate ``spec`` (names split at END, or ``{name: SplitPoint}``) and build the plan.

        Raises:
            PlanError: unknown name, a name that is not a split point at this granularity, a split
                before the first or after the last layer, or two splits on one boundary.
            TypeError: ``spec`` is neither a list of names nor a mapping.
        """
        if isinstance(spec, str):
            raise TypeError(f"split() takes a list of layer names, got the string {spec!r}. Fix: split([{spec!r}]).")
        if isinstance(spec, Mapping):
            items = [(name, _point(pt, name)) for name, pt in spec.items()]
        elif isinstance(spec, Iterable):
            items = [(name, SplitPoint.END) for name in spec]
        else:
            raise TypeError(f"split() takes a list of layer names or a {{name: SplitPoint}} dict, got {spec!r}.")
        return cls(graph, tuple(items))

    @classmethod
    def from_stages(cls, graph: ModelGraph, stages: Iterable[Iterable[str]]) -> SplitPlan:
        """Build a plan from per-stage lists of layer names (they must cover the layers in order)."""
        lists = [list(s) for s in stages]
        flat = [n for s in lists for n in s]
        if flat != list(graph.layer_names) or any(not s for s in lists):
            raise PlanError(
                f"Stages {lists} must list every layer once, in execution order, with no empty stage. "
                f"Layers: {', '.join(graph.layer_names)}."
            )
        return cls(graph, tuple((s[-1], SplitPoint.END) for s in lists[:-1]))

    def __post_init__(self) -> None:
        g = self.graph
        seen: dict[float, str] = {}
        for name, point in self.splits:
            if not isinstance(name, str):
                raise TypeError(f"Layer names are strings, got {name!r} ({type(name).__name__}).")
            if name not in g.layer_names:
                raise PlanError(g._not_a_layer(name))
            layer = g.layer(name)
            valid = ", ".join(g.split_candidates)
            if layer.calls > 1:
                raise PlanError(
                    f"Layer {name!r} runs {layer.calls} times in forward, so a split marker there would fire "
                    f"{layer.calls} times. Valid split points: {valid}."
                )
            if point is SplitPoint.END and layer.index == len(g.layers) - 1:
                raise PlanError(
                    f"Cannot split at the END of {name!r}: it is the last layer, so the last stage would be empty. "
                    f"Valid split points: {valid}."
                )
            if point is SplitPoint.BEGINNING and layer.index == 0:
                raise PlanError(
                    f"Cannot split at the BEGINNING of {name!r}: it is the first layer, so stage 0 would be empty. "
                    f"Valid split points: {valid}."
                )
            # A boundary is identified by the layer it follows.
            boundary = layer.index if point is SplitPoint.END else layer.index - 1
            if boundary in seen:
                other = seen[boundary]
                raise PlanError(
                    f"Splits {other} and {name!r} at {point.name} fall on the same boundary (after "
                    f"{g.layers[boundary].name!r}), which would leave a stage empty. Fix: keep only one of them."
                )
            seen[boundary] = f"{name!r} at {point.name}"
        ordered = tuple(sorted(self.splits, key=lambda s: self._marker(*s)))
        object.__setattr__(self, "splits", ordered)

    def _marker(self, name: str, point: SplitPoint) -> float:
        # Markers sit between ops, where torch's pipe_split() lands: after a layer's last op (END) or
        # before its first op (BEGINNING). Glue ops between layers go to whichever side they fall on.
        i = self.graph._pos[name]
        return self.graph._last[i] + 0.5 if point is SplitPoint.END else self.graph._first[i] - 0.5

    # ----------------------------------------------------------------- edits
    def toggle(self, name: str) -> SplitPlan:
        """A new plan with the split after layer ``name`` added, or removed if it is there."""
        g = self.graph
        g._require_layer(name)
        i = g._pos[name]
        kept = tuple(
            (n, p) for n, p in self.splits
            if not ((n == name and p is SplitPoint.END) or (p is SplitPoint.BEGINNING and g._pos[n] == i + 1))
        )
        if len(kept) != len(self.splits):
            return SplitPlan(g, kept)
        return SplitPlan(g, (*self.splits, (name, SplitPoint.END)))

    # ----------------------------------------------------------------- preview
    @property
    def num_stages(self) -> int:
        return len(self.splits) + 1

    @property
    def split_spec(self) -> dict[str, SplitPoint]:
        """The ``split_spec`` torch's ``pipeline()`` takes."""
        return dict(self.splits)

    @cached_property
    def _markers(self) -> list[float]:
        return [self._marker(n, p) for n, p in self.splits]

    @cached_property
    def stages(self) -> list[StageInfo]:
        """Per-stage preview (layers, params, FLOPs, bytes sent), computed from the graph."""
        g, cap, markers = self.graph, self.graph.capture, self._markers
        n = self.num_stages

        def stage(pos: int) -> int:
            return bisect.bisect_left(markers, pos)

        layers: list[list[str]] = [[] for _ in range(n)]
        for i, name in enumerate(g.layer_names):
            layers[stage(g._first[i])].append(name)
        cuts = [0, *(int(m + 0.5) for m in markers), len(cap.ops)]
        flops = [g._flops_prefix[cuts[s + 1]] - g._flops_prefix[cuts[s]] for s in range(n)]
        act = [0] * n
        for s in range(n):
            act[s] = sum(op.out_bytes for op in cap.ops[cuts[s]:cuts[s + 1]])
        send = [0] * n
        recv = [0] * n
        for src, end, nbytes in g._values:
            a, b = stage(src), stage(end)
            for s in range(a, b):  # relayed through every stage in between
                send[s] += nbytes
                recv[s + 1] += nbytes
        owned = [0] * n
        held: list[set[str]] = [set() for _ in range(n)]
        for p, uses in g._param_uses.items():
            stages_using = {stage(u) for u in uses}
            owned[min(stages_using)] += cap.param_numel.get(p, 0)
            for s in stages_using:
                held[s].add(p)
        inputs: list[list[str]] = [[] for _ in range(n)]
        for x, uses in g._input_uses.items():
            for s in sorted({stage(u) for u in uses}):
                inputs[s].append(x)
        return [
            StageInfo(
                index=s, layers=tuple(layers[s]), params=owned[s], flops=flops[s], send_bytes=send[s],
                recv_bytes=recv[s], inputs=tuple(inputs[s]),
                shared_params=tuple(sorted(p for p in held[s] if any(p in held[t] for t in range(n) if t != s))),
                param_bytes=sum(cap.param_bytes.get(p, 0) for p in held[s]), activation_bytes=act[s],
            )
            for s in range(n)
        ]

    def stage_of(self, layer: str) -> int:
        """Stage index holding ``layer``."""
        self.graph._require_layer(layer)
        return next(s.index for s in self.stages if layer in s.layers)

    def table(self) -> str:
        """The stage preview as a plain-text table."""
        rows = [("stage", "layers", "params", "GFLOPs", "sends", "memory")]
        for s in self.stages:
            names = ", ".join(s.layers) if len(s.layers) <= 4 else f"{s.layers[0]} … {s.layers[-1]} ({len(s.layers)})"
            rows.append((str(s.index), names, f"{s.params:,}", f"{s.flops / 1e9:.3f}", _human(s.send_bytes),
                         _human(s.memory_bytes)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        cuts = ", ".join(f"{n}@{p.name}" for n, p in self.splits)
        return f"SplitPlan({self.num_stages} stages: {cuts or 'no splits'})"

    # ----------------------------------------------------------------- JSON
    def to_json(self) -> str:
        """JSON text: the split points, the stage lists and the layer names they refer to."""
        return json.dumps({
            "version": 1,
            "model": type(self.graph.model).__name__,
            "layers": list(self.graph.layer_names),
            "splits": [{"layer": n, "point": p.name.lower()} for n, p in self.splits],
            "stages": [list(s.layers) for s in self.stages],
        }, indent=1)

    @classmethod
    def from_json(cls, text: str, graph: ModelGraph) -> SplitPlan:
        """Rebuild a plan saved with ``to_json`` over ``graph`` (the same model at the same granularity)."""
        data = json.loads(text)
        if list(data.get("layers", [])) != list(graph.layer_names):
            raise PlanError(
                "The saved plan refers to other layers than this graph. Fix: trace the same model at the same "
                f"granularity. Saved: {data.get('layers')}; graph: {list(graph.layer_names)}."
            )
        return cls.from_spec(graph, {s["layer"]: s["point"] for s in data["splits"]})

    # ----------------------------------------------------------------- the real Pipe
    def microbatch_inputs(self, microbatches: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The example inputs cut into ``microbatches`` chunks along dim 0; returns the first chunk."""
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

        check_microbatches(self.graph.batch_size, microbatches)
        args, kwargs = split_args_kwargs_into_chunks(self.graph.example_args, self.graph.example_kwargs, microbatches)
        return args[0], kwargs[0]

    def pipe(self, microbatches: int = 1) -> Any:
        """Build torch's ``Pipe`` for this plan from a fresh deep copy of the model.

        The user's model is never patched (torch's ``pipeline()`` patches ``forward`` in place, so calling
        it twice on one model adds stale split markers). The Pipe is traced with one microbatch of the
        example inputs, the shape every stage will then expect.

        Returns:
            ``torch.distributed.pipelining.Pipe`` with ``num_stages == plan.num_stages``.

        Raises:
            PlanError: ``microbatches`` does not divide the example batch.
        """
        from torch.distributed.pipelining import pipeline

        if not self.graph.capture.traced:
            raise PlanError(
                "This plan comes from pv.manual_plan: there is no traced graph to build a Pipe from. "
                "Fix: use plan.stage_modules() (one nn.Module per stage) with torch's PipelineStage."
            )
        mb_args, mb_kwargs = self.microbatch_inputs(microbatches)
        model = self.graph.capture.fresh_copy()
        pipe = pipeline(model, mb_args=mb_args, mb_kwargs=mb_kwargs or None, split_spec=self.split_spec or None)
        if pipe.num_stages != self.num_stages:  # a disagreement would be a pipeviz bug, never silently accepted
            raise RuntimeError(
                f"torch built {pipe.num_stages} stages for a {self.num_stages}-stage plan {self!r}; please report."
            )
        return pipe

    def stage_modules(self, microbatches: int = 1) -> list[Any]:
        """One ``nn.Module`` per stage, built from fresh copies: the Pipe's submodules for a traced plan,
        ``SequenceStage`` modules (original module names kept) for a manual plan."""
        if self.graph.capture.traced:
            pipe = self.pipe(microbatches)
            return [pipe.get_stage_module(i) for i in range(self.num_stages)]
        from pipeviz.manual import SequenceStage

        return [SequenceStage(self.graph.model, s.layers) for s in self.stages]


def check_microbatches(batch_size: int | None, microbatches: Any) -> None:
    """Raise ``PlanError`` unless ``microbatches`` is a positive divisor of ``batch_size``."""
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive int, got {microbatches!r}.")
    if batch_size is not None and batch_size % microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise PlanError(
            f"microbatches={microbatches} does not divide the batch of {batch_size}. "
            f"Valid: {', '.join(map(str, divisors))}; or change the batch size."
        )


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


