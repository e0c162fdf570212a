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

import bisect
import contextlib
import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.pipelining import SplitPoint
from torch.utils import _pytree as pytree

from pipeviz._compat import deprecated
from pipeviz.adapter import defake, fake_cpu, regions_inlined
from pipeviz.capture.export import TRACE_LOCK
from pipeviz.capture.view import GraphIndex
from pipeviz.cost.rule import stage_bytes

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.pipelining import Pipe

    from pipeviz.capture.view import GraphView as ModelGraph  # the graph module makes plans: named by its protocol

__all__ = ["GraphIndex", "PlanError", "SplitPlan", "StageInfo", "check_batch_split", "check_microbatches",
           "human_bytes"]


# Who prices a plan (stage_memory, table with cost options): the cost model registers itself here when imported
# (pipeviz.cost.memory), so the plan module imports nothing of it, not even for types.
_PRICERS: list[Callable[..., list[int]]] = []


def register_pricer(pricer: Callable[..., list[int]]) -> None:
    """Make ``pricer(plan, options, **cost_options) -> bytes per stage`` what ``SplitPlan.stage_memory`` calls."""
    _PRICERS.append(pricer)


class PlanError(ValueError):
    """An invalid split plan; the message names the bad value, the valid choices and the fix."""


@dataclass(frozen=True)
class StageInfo:
    """Preview of one pipeline stage, computed from the graph (no tracing).

    Attributes:
        index: stage number.
        layers: layer names in execution order.
        params: parameter elements the stage owns (buffers excluded; a tensor shared with an earlier stage
            counts there).
        flops: forward FLOPs for the example batch.
        send_bytes: bytes this stage sends to the next one per example batch: every activation
            produced here or earlier that a later stage reads (skip connections included).
        recv_bytes: bytes arriving from earlier stages.
        inputs: model inputs (placeholder names) this stage reads.
        shared_params: parameters this stage holds a copy of that other stages hold too (tied or reused).
        param_bytes: bytes of every parameter the stage holds (shared copies included).
        frozen_bytes: the part of ``param_bytes`` that does not train (``requires_grad=False``): no gradient, no
            optimizer state.
        activation_bytes: bytes autograd saves for the stage's backward, for the example batch: what a
            pipelined run keeps alive from each forward to its backward (``Op.saved_bytes`` over the stage's
            ops, a tensor received from an earlier stage counted here too, and on the last stage what the loss
            saves, one output-sized tensor). ``pipeviz.runtime.memory`` measures the same thing on a run.
        buffer_bytes: bytes of the buffers the stage holds (running statistics, ``inv_freq``, ...).
        memory_bytes: the stage's training footprint on a rank of its own (``pipeviz.costs``): parameters,
            gradients and Adam's two states, buffers, and every microbatch's activations in flight (GPipe, the
            most any schedule keeps). ``pv.simulate(...).memory_bytes`` gives it per rank for a schedule.
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
    buffer_bytes: int = 0
    frozen_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        # on a rank of its own with every microbatch in flight (GPipe, the most any schedule keeps)
        return stage_bytes(self.param_bytes, self.buffer_bytes, self.activation_bytes,
                           frozen_bytes=self.frozen_bytes)


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
    _positions: list[float] = field(init=False, repr=False, compare=False, default_factory=list)

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
        object.__setattr__(self, "_positions", [p for p, _, _ in placed])
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
        kept = tuple(s for s, p in zip(self.splits, self._positions, strict=True) if not lo < p < hi)
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
        return list(self._positions)

    @property
    def split_spec(self) -> dict[str, SplitPoint]:
        """The split points as torch's ``split_spec`` dict (``fqn@k`` names are pipeviz's per-call splits,
        placed by ``pipe()`` itself since torch's ``split_spec`` cannot name one call)."""
        return dict(self.splits)

    def _stage_of_op(self, op: int) -> int:
        return bisect.bisect_left(self._positions, op)

    @cached_property
    def received_saved_bytes(self) -> list[int]:
        """Per stage, bytes it saves for backward of tensors it received from an earlier stage that the sender
        saves too (an MLP block's ReLU output: saved by the ReLU and by the next Linear). In the unsplit model
        that is one tensor; in a pipelined run it is two (the receiver saves its own copy), so it counts once
        in each stage that saves it (part of ``StageInfo.activation_bytes``)."""
        stage = self._stage_of_op
        out = [0] * self.num_stages
        again: set[tuple[int, int, int]] = set()
        for op, first, slot, nbytes in self.graph.index.resaved:
            s = stage(op)
            if stage(first) != s and (s, first, slot) not in again:
                again.add((s, first, slot))
                out[s] += nbytes
        return out

    @cached_property
    def input_grad_freed_bytes(self) -> list[int]:
        """Per stage, the saved bytes (``StageInfo.activation_bytes``' units) its input-grad pass frees under a
        zero-bubble schedule: what the ops after the stage's last op using a parameter saved (a stage without
        parameters: all of it). torch's ``stage_backward_input`` keeps the graph below the weight ops for the
        weight-grad pass and detaches the stage's outputs, which frees only the part above them."""
        idx = self.graph.index
        stage = self._stage_of_op
        cuts = [0, *(int(p + 0.5) for p in self.positions), idx.num_ops]
        last = [cuts[s] - 1 for s in range(self.num_stages)]  # before the stage's first op: no parameter
        for uses in idx.param_uses.values():
            for u in uses:
                last[stage(u)] = max(last[stage(u)], u)
        prefix = idx.saved_prefix or idx.act_prefix
        freed = [prefix[cuts[s + 1]] - prefix[last[s] + 1] for s in range(self.num_stages)]
        op, loss = idx.loss_saved
        if loss and op <= last[stage(op)]:  # the loss runs after the output op, whatever weights that op reads
            freed[stage(op)] += loss
        return freed

    @cached_property
    def stages(self) -> list[StageInfo]:
        """Per-stage preview (layers, params, FLOPs, bytes sent), computed from the graph's index."""
        idx = self.graph.index
        n = self.num_stages
        stage = self._stage_of_op
        frozen = self.graph.capture.frozen
        layers: list[list[str]] = [[] for _ in range(n)]
        for name, first in zip(idx.layer_names, idx.layer_first, strict=True):
            layers[stage(first)].append(name)
        cuts = [0, *(int(p + 0.5) for p in self.positions), idx.num_ops]
        flops = [idx.flops_prefix[cuts[s + 1]] - idx.flops_prefix[cuts[s]] for s in range(n)]
        act = [idx.saved_prefix[cuts[s + 1]] - idx.saved_prefix[cuts[s]] for s in range(n)] if idx.saved_prefix \
            else [idx.act_prefix[cuts[s + 1]] - idx.act_prefix[cuts[s]] for s in range(n)]
        act = [a + r for a, r in zip(act, self.received_saved_bytes, strict=True)]
        send, recv = [0] * n, [0] * n
        for src, end, nbytes in idx.values:
            for s in range(stage(src), stage(end)):  # relayed through every stage in between
                send[s] += nbytes
                recv[s + 1] += nbytes
        owned = [0] * n
        held: list[set[str]] = [set() for _ in range(n)]
        bufs: list[set[str]] = [set() for _ in range(n)]
        for p, uses in idx.param_uses.items():
            using = {stage(u) for u in uses}
            owned[min(using)] += idx.numel.get(p, 0)
            for s in using:
                held[s].add(p)
        for b, uses in idx.buffer_uses.items():
            for s in {stage(u) for u in uses}:
                bufs[s].add(b)
        inputs: list[list[str]] = [[] for _ in range(n)]
        for x, uses in idx.input_uses.items():
            for s in sorted({stage(u) for u in uses}):
                inputs[s].append(x)
        return [
            StageInfo(
                index=s, layers=tuple(layers[s]), params=owned[s], flops=flops[s], send_bytes=send[s],
                recv_bytes=recv[s], inputs=tuple(inputs[s]),
                shared_params=tuple(sorted(p for p in held[s] if any(p in held[t] for t in range(n) if t != s))),
                param_bytes=sum(idx.nbytes.get(p, 0) for p in held[s]), activation_bytes=act[s],
                buffer_bytes=sum(idx.nbytes.get(b, 0) for b in bufs[s]),
                frozen_bytes=sum(idx.nbytes.get(p, 0) for p in held[s] if p in frozen),
            )
            for s in range(n)
        ]

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
        rows = [("stage", "layers", "params", "GFLOPs", "sends", "memory")]
        if memory is None:
            memory = (self.stage_memory(options, **cost_options) if options is not None or cost_options
                      else [s.memory_bytes for s in self.stages])
        for s, mem in zip(self.stages, memory, strict=True):
            names = ", ".join(s.layers) if len(s.layers) <= 4 else f"{s.layers[0]} … {s.layers[-1]} ({len(s.layers)})"
            rows.append((str(s.index), names, f"{s.params:,}", f"{s.flops / 1e9:.3f}", human_bytes(s.send_bytes),
                         human_bytes(mem)))
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
        idx = self.graph.index
        held: list[set[str]] = [set() for _ in range(self.num_stages)]
        for uses_of in (idx.param_uses, idx.buffer_uses):
            for name, uses in uses_of.items():
                for s in {self._stage_of_op(u) for u in uses}:
                    held[s].add(name)
        return [frozenset(h) for h in held]

    def microbatch_inputs(self, microbatches: int) -> tuple[tuple[object, ...], dict[str, object]]:
        """The example inputs cut into ``microbatches`` chunks along dim 0; returns the first chunk."""
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

        check_batch_split(self.graph.batch_size, microbatches)
        args, kwargs = split_args_kwargs_into_chunks(self.graph.example_args, self.graph.example_kwargs, microbatches)
        return args[0], kwargs[0]

    def pipe(self, microbatches: int = 1) -> Pipe:
        """Build torch's ``Pipe`` for this plan from a fresh deep copy of the model.

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
        from torch.distributed.pipelining import pipeline

        from pipeviz.plan.marks import mark_calls

        if not self.graph.capture.traced:
            raise PlanError(
                "This plan comes from pv.manual_plan: there is no traced graph to build a Pipe from. "
                "Fix: use plan.stage_modules() (one nn.Module per stage) with torch's PipelineStage."
            )
        if self.graph.capture.unsupported:
            raise PlanError(self.graph.capture.unsupported[0])
        mb_args, mb_kwargs = self.microbatch_inputs(microbatches)
        model = self.graph.capture.fresh_copy()
        spec, per_call = self._torch_splits()
        mark_calls(model, per_call)
        # A meta model is split on fake CPU tensors (the CPU's code paths, no memory); its stages hold meta
        # tensors, which the ranks load or initialise (pipeviz.capture.weights).
        meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        mode: Any = fake_cpu(model) if meta else contextlib.nullcontext()
        if meta:
            mb_args, mb_kwargs = pytree.tree_map(
                lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, (mb_args, mb_kwargs))
        with TRACE_LOCK, warnings.catch_warnings(), mode:
            # torch 2.13's own pytree deprecation notice, raised inside pipeline(): nothing a user can act on.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            # A fake model: torch's split deep-copies constant tensors (GPT-2's), and Tensor.__deepcopy__ asks a
            # FakeTensor for its data pointer, which warns; the copies are fake, and defake() replaces them.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
            with regions_inlined():  # torch's split loses no_grad / autocast regions' bodies (pipeviz.adapter.regions)
                pipe = pipeline(model, mb_args=mb_args, mb_kwargs=mb_kwargs or None, split_spec=spec or None)
        if meta:
            defake(pipe.split_gm)
        if pipe.num_stages != self.num_stages:  # a disagreement would be a pipeviz bug, never silently accepted
            raise RuntimeError(
                f"torch built {pipe.num_stages} stages for a {self.num_stages}-stage plan {self!r}; please report."
            )
        return pipe

    def _torch_splits(self) -> tuple[dict[str, SplitPoint], list[tuple[str, int, SplitPoint]]]:
        """torch's ``split_spec`` for modules called once, and (fqn, call, point) marks for the others.
        A container (never called itself) is marked at its last (END) or first (BEGINNING) called module."""
        g = self.graph
        spec: dict[str, SplitPoint] = {}
        per_call: list[tuple[str, int, SplitPoint]] = []
        for name, point in self.splits:
            unit = g.unit(name)
            while not unit.called:
                unit = g.unit(unit.children[-1] if point is SplitPoint.END else unit.children[0])
            if unit.calls == 1:
                spec[unit.fqn] = point
            else:
                call = int(unit.name.rpartition("@")[2])
                per_call.append((unit.fqn, call, point))
        return spec, per_call

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


def check_batch_split(batch_size: int | None, microbatches: object) -> None:
    """Raise ``PlanError`` unless ``microbatches`` is a positive divisor of ``batch_size`` (the schedule's own rule
    on microbatches is ``pipeviz.schedule.traits.check_microbatches``)."""
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive int, got {microbatches!r}.")
    if batch_size is not None and batch_size % microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise PlanError(
            f"microbatches={microbatches} does not divide the batch of {batch_size}. "
            f"Valid: {', '.join(map(str, divisors))}; or change the batch size."
        )


def check_microbatches(batch_size: int | None, microbatches: object) -> None:
    """0.2's name of ``check_batch_split`` (deprecated: ``pipeviz.schedule.traits.check_microbatches`` is the schedule's
    rule, a different check)."""
    deprecated("pipeviz.plan.check_microbatches is deprecated since pipeviz 0.3: call check_batch_split (the same "
               "check); pipeviz.schedule.traits.check_microbatches is the schedule's rule.")
    check_batch_split(batch_size, microbatches)


def human_bytes(n: float) -> str:
    """Bytes in IEC units: ``65536`` -> ``"64.0 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


