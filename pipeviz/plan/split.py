"""``SplitPlan``: where a model is cut into pipeline stages, its per-stage preview and the real ``Pipe``.

A plan is data: the split points plus the graph they refer to. It is immutable (``toggle`` returns a new
plan), validated on construction, round-trips through JSON, and previews every stage from the graph's
``GraphIndex`` without tracing again.

Example:
    >>> plan = graph.split(["layer0", "layer1"])
    >>> [s.layers for s in plan.stages]
    [('layer0',), ('layer1',), ('layer2', 'output_proj')]
    >>> plan.toggle("layer2").num_stages
    4
    >>> pipe = plan.pipe(microbatches=4)      # torch.distributed.pipelining.Pipe
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch.distributed.pipelining import SplitPoint

from pipeviz.plan.errors import PlanError
from pipeviz.plan.pipe import build_pipe, microbatch_inputs
from pipeviz.plan.preview import Preview, StageInfo, stage_table

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.pipelining import Pipe

    from pipeviz.capture.view import GraphView as ModelGraph  # the graph module makes plans: named by its protocol

__all__ = ["SplitPlan", "register_pricer"]


# Who prices a plan (stage_memory, table with cost options): the cost model registers itself here when imported
# (pipeviz.cost.memory), so the plan module imports nothing of it, not even for types.
_PRICERS: list[Callable[..., list[int]]] = []


def register_pricer(pricer: Callable[..., list[int]]) -> None:
    """Make ``pricer(plan, options, **cost_options) -> bytes per stage`` what ``SplitPlan.stage_memory`` calls."""
    _PRICERS.append(pricer)


_POINTS = {"end": SplitPoint.END, "beginning": SplitPoint.BEGINNING}


def _point(value: object, name: str) -> SplitPoint:
    if isinstance(value, SplitPoint):
        return value
    if isinstance(value, str) and value.lower() in _POINTS:
        return _POINTS[value.lower()]
    if hasattr(value, "name") and str(value.name).lower() in _POINTS:  # an equivalent enum
        return _POINTS[str(value.name).lower()]
    raise PlanError(
        f"Split point for {name!r} is {value!r}; valid: SplitPoint.END, SplitPoint.BEGINNING, 'end', 'beginning'."
    )


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """An immutable set of split points over a ``ModelGraph``. Build with ``graph.split(...)``.

    Split points name any module at any depth (``graph.split_candidates``), ``fqn@k`` for one call of a
    module that runs several times. The plan's ``graph`` is the view it was made on, with any layer a split
    falls inside opened up, so every stage is a run of whole layers.

    Attributes:
        graph: the graph the stages are listed over.
        splits: ``(module name, SplitPoint)`` pairs in execution order.
    """

    graph: ModelGraph
    splits: tuple[tuple[str, SplitPoint], ...]
    # the per-stage arithmetic over the splits' positions (pipeviz.plan.preview), set on construction
    _preview: Preview = field(init=False, repr=False, compare=False)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_spec(cls, graph: ModelGraph, spec: Iterable[str] | Mapping[str, object]) -> SplitPlan:
        """Validate ``spec`` (names split at END, or ``{name: SplitPoint}``) and build the plan.

        Raises:
            PlanError: unknown name, a split before the first or after the last module, two splits on one
                boundary, a stage that would run no module, or state a pipeline cannot keep exact.
            TypeError: ``spec`` is neither a list of names nor a mapping.
        """
        if isinstance(spec, str):
            raise TypeError(f"split() takes a list of module names, got the string {spec!r}. Fix: split([{spec!r}]).")
        if isinstance(spec, Mapping):
            items = [(name, _point(pt, name)) for name, pt in spec.items()]
        elif isinstance(spec, Iterable):
            items = [(name, SplitPoint.END) for name in spec]
        else:
            raise TypeError(f"split() takes a list of module names or a {{name: SplitPoint}} dict, got {spec!r}.")
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
        idx = g.index
        last_op = idx.num_ops - 1
        first_layer, last_layer = idx.layer_first[0], idx.layer_last[-1]
        seen: dict[float, str] = {}
        placed: list[tuple[float, str, SplitPoint]] = []
        for name, point in self.splits:
            if not isinstance(name, str):
                raise TypeError(f"Module names are strings, got {name!r} ({type(name).__name__}).")
            pos = g.position(name, point)
            if pos > last_layer or pos >= last_op:
                raise PlanError(
                    f"Cannot split at the {point.name} of {name!r}: no module runs after it, so the last stage would "
                    f"be empty. {g.valid_splits_text()}"
                )
            if pos < first_layer or pos <= 0:
                raise PlanError(
                    f"Cannot split at the {point.name} of {name!r}: no module runs before it, so stage 0 would be "
                    f"empty. {g.valid_splits_text()}"
                )
            region = g.region_at(pos)
            if region:
                raise PlanError(
                    f"Cannot split at the {point.name} of {name!r}: it runs inside a {region}, and a region "
                    "runs whole in one stage (its grad mode or autocast state cannot cross a stage boundary). Fix: "
                    f"split before or after the block, or move {name!r} out of it. {g.valid_splits_text()}"
                )
            sized_by_data = g.data_dependent_at(pos)
            if sized_by_data:
                raise PlanError(
                    f"Cannot split at the {point.name} of {name!r}: the stage would send {sized_by_data}, whose size "
                    "depends on the data (the rows routed to one expert), and a pipeline stage receives tensors of "
                    "shapes fixed before the run. Fix: split before or after the whole mixture-of-experts block. "
                    f"{g.valid_splits_text()}"
                )
            if pos in seen:
                raise PlanError(
                    f"Splits {seen[pos]} and {name!r} at {point.name} fall on the same boundary, which would leave "
                    "a stage empty. Fix: keep only one of them."
                )
            seen[pos] = f"{name!r} at {point.name}"
            placed.append((pos, name, point))
        placed.sort()
        refined = g.refine([p for p, _, _ in placed])
        object.__setattr__(self, "graph", refined)
        object.__setattr__(self, "splits", tuple((n, p) for _, n, p in placed))
        object.__setattr__(self, "_preview", Preview(refined.index, refined.capture.frozen,
                                                     tuple(p for p, _, _ in placed)))
        self._check_state()

    def _check_state(self) -> None:
        # A buffer the forward updates (BatchNorm statistics) held by two stages would be updated in two
        # places, each seeing only its own calls: the unsplit model's sequence of updates cannot be rebuilt.
        idx = self.graph.index
        for b in sorted(idx.mutated):
            stages = sorted({self._stage_of_op(u) for u in idx.buffer_uses.get(b, ())})
            if len(stages) > 1:
                raise PlanError(
                    f"Buffer {b!r} is updated during forward and used in stages {stages}: each stage would update "
                    "its own copy, so training could not match the unsplit model. Fix: keep every use of its "
                    "module in one stage (a module called twice: both calls on the same side of the split)."
                )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SplitPlan) and other.graph == self.graph and other.splits == self.splits

    def __hash__(self) -> int:
        return hash((self.graph, self.splits))

    # ----------------------------------------------------------------- edits
    def onto(self, graph: ModelGraph) -> SplitPlan:
        """This plan over another view of the same model (after ``expand``, ``collapse``, ``regroup``): every
        split that falls between two of ``graph``'s layers is kept (under its own name); a split that falls
        inside one of them is dropped, so a collapsed block stays collapsed."""
        if graph.capture is not self.graph.capture:
            raise PlanError("onto() moves a plan between views of the same traced model; this graph comes from "
                            "another trace. Fix: SplitPlan.from_json(plan.to_json(), graph).")
        idx = graph.index
        spans = list(zip(idx.layer_first, idx.layer_last, strict=True))
        kept = tuple(s for s, p in zip(self.splits, self.positions, strict=True)
                     if not any(a < p < b for a, b in spans))
        return SplitPlan(graph, kept)

    def toggle(self, name: str) -> SplitPlan:
        """A new plan with a split after layer ``name`` added, or removed if one is there (a split between
        this layer and the next, by whatever module it was named)."""
        g = self.graph
        g._require_layer(name)
        idx = g.index
        i = idx.layer_names.index(name)
        lo = idx.layer_last[i]
        hi = idx.layer_first[i + 1] if i + 1 < len(idx.layer_names) else idx.num_ops
        kept = tuple(s for s, p in zip(self.splits, self._preview.positions, strict=True) if not lo < p < hi)
        if len(kept) != len(self.splits):
            return SplitPlan(g, kept)
        return SplitPlan(g, (*self.splits, (name, SplitPoint.END)))

    # ----------------------------------------------------------------- preview
    @property
    def num_stages(self) -> int:
        return len(self.splits) + 1

    @property
    def positions(self) -> list[float]:
        """Op positions of the splits (``k + 0.5``: between ops ``k`` and ``k + 1``), in order."""
        return list(self._preview.positions)

    @property
    def split_spec(self) -> dict[str, SplitPoint]:
        """The split points as torch's ``split_spec`` dict (``fqn@k`` names are pipeviz's per-call splits,
        placed by ``pipe()`` itself since torch's ``split_spec`` cannot name one call)."""
        return dict(self.splits)

    def _stage_of_op(self, op: int) -> int:
        # the cost model (pipeviz.cost) asks a plan for an op's stage by this name
        return self._preview.stage_of_op(op)

    @property
    def received_saved_bytes(self) -> list[int]:
        """Per stage, bytes it saves for backward of tensors received from an earlier stage that the sender saves
        too: counted in each stage that saves one (``Preview.received_saved_bytes``)."""
        return self._preview.received_saved_bytes

    @property
    def input_grad_freed_bytes(self) -> list[int]:
        """Per stage, the saved bytes its input-grad pass frees under a zero-bubble schedule
        (``Preview.input_grad_freed_bytes``)."""
        return self._preview.input_grad_freed_bytes

    @property
    def stages(self) -> list[StageInfo]:
        """Per-stage preview (layers, params, FLOPs, bytes sent), computed from the graph's index."""
        return self._preview.stages

    def stage_of(self, layer: str) -> int:
        """Stage index holding ``layer``."""
        self.graph._require_layer(layer)
        return next(s.index for s in self.stages if layer in s.layers)

    def stage_memory(self, options: object = None, **cost_options: object) -> list[int]:
        """Each stage's training footprint on a rank of its own with the whole batch in flight (the preview's
        ``StageInfo.memory_bytes``), in the cost model's settings (a ``pv.CostOptions`` or its fields as keywords):
        ``pipeviz.cost.memory.plan_stage_memory`` (a plan never prices itself; the cost model answers for it).

        Example:
            >>> plan.stage_memory(hardware="h100", dtype="bfloat16", recompute="full")
        """
        if not _PRICERS:
            raise RuntimeError("No cost model is loaded to price the plan. Fix: import pipeviz (or "
                               "pipeviz.cost.memory).")
        return list(_PRICERS[-1](self, options, **cost_options))

    def table(self, options: object = None, *, memory: list[int] | None = None, **cost_options: object) -> str:
        """The stage preview as a plain-text table: ``memory`` per stage, else ``StageInfo.memory_bytes``, or, with
        cost options, in their settings (``stage_memory``)."""
        if memory is None:
            memory = (self.stage_memory(options, **cost_options) if options is not None or cost_options
                      else [s.memory_bytes for s in self.stages])
        return stage_table(self.stages, memory)

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
        """Rebuild a plan saved with ``to_json`` over ``graph`` (the same model, any granularity)."""
        data = json.loads(text)
        try:
            plan = cls.from_spec(graph, {s["layer"]: s["point"] for s in data["splits"]})
        except (PlanError, ValueError) as exc:
            raise PlanError(f"The saved plan does not fit this graph ({exc}). Fix: trace the same model.") from exc
        saved = list(data.get("layers", []))
        if saved and saved not in (list(graph.layer_names), list(plan.graph.layer_names)):
            raise PlanError(
                "The saved plan refers to other layers than this graph. Fix: trace the same model at the same "
                f"granularity. Saved: {data.get('layers')}; graph: {list(plan.graph.layer_names)}."
            )
        return plan

    # ----------------------------------------------------------------- the real Pipe
    def stage_tensors(self) -> list[frozenset[str]]:
        """Canonical names of the parameters and buffers each stage holds (a shared one in every holder)."""
        return self._preview.stage_tensors()

    def microbatch_inputs(self, microbatches: int) -> tuple[tuple[object, ...], dict[str, object]]:
        """The example inputs cut into ``microbatches`` chunks along dim 0; returns the first chunk."""
        return microbatch_inputs(self.graph, microbatches)

    def pipe(self, microbatches: int = 1) -> Pipe:
        """Build torch's ``Pipe`` for this plan from a fresh deep copy of the model (``pipeviz.plan.pipe``).

        The user's model is never patched (torch's ``pipeline()`` patches ``forward`` in place, so calling
        it twice on one model adds stale split markers). The Pipe is traced with one microbatch of the
        example inputs, the shape every stage will then expect. Splits on one call of a module that runs
        several times (``fqn@k``) are marked with torch's ``pipe_split()`` at that call.

        Returns:
            ``torch.distributed.pipelining.Pipe`` with ``num_stages == plan.num_stages``.

        Raises:
            PlanError: ``microbatches`` does not divide the example batch, a manual plan, or a model holding an op
                torch cannot split (``torch.cond``: ``graph.notes`` says so at trace time).
        """
        pipe = build_pipe(self.graph, self.splits, microbatches)
        if pipe.num_stages != self.num_stages:  # a disagreement would be a pipeviz bug, never silently accepted
            raise RuntimeError(
                f"torch built {pipe.num_stages} stages for a {self.num_stages}-stage plan {self!r}; please report."
            )
        return pipe

    def stage_modules(self, microbatches: int = 1) -> list[nn.Module]:
        """One ``nn.Module`` per stage, built from fresh copies: the Pipe's submodules for a traced plan (run as
        generated code rather than torch's default ``fx.Interpreter``: ``pipeviz.adapter.compiled_submodules``),
        ``SequenceStage`` modules (original module names kept) for a manual plan."""
        if self.graph.capture.traced:
            from pipeviz.adapter import compiled_submodules

            pipe = self.pipe(microbatches)
            return [compiled_submodules(pipe.get_stage_module(i)) for i in range(self.num_stages)]
        from pipeviz.plan.sequence import SequenceStage

        return [SequenceStage(self.graph.model, s.layers) for s in self.stages]

