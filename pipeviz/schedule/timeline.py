"""``Event`` and ``Timeline``: what ran where and when, measured by ``launch`` or made by the simulator.

Example:
    >>> tl = run.timeline()
    >>> tl.step_time, tl.bubble_fraction
    >>> tl.to_chrome_trace("run.json")        # open in https://ui.perfetto.dev
    >>> pv.timeline_figure(tl)                   # the plotly Gantt chart (pipeviz.widgets.figures)
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeviz.schedule.mesh import DIMS, Mesh, PipelineRank, ProcessRank
from pipeviz.schedule.traits import Action, Kind

__all__ = ["COMPUTE", "KINDS", "Event", "Timeline"]


COMPUTE = ("F", "B", "I", "W")
KINDS = {
    "F": "forward", "B": "backward (input and weight grads)", "I": "backward, input grads only",
    "W": "backward, weight grads only", "COMM": "waiting on communication",
    "DP": "data-parallel gradient all-reduce across replicas",
    "TP": "tensor-parallel collective within a stage's shards (launch to wait)",
    "CP": "context-parallel exchange of an attention's keys and values (or their gradients) among a stage's "
          "sequence shares",
    "A2A": "expert-parallel all-to-all: tokens dispatched to their experts' processes, or combined back",
    "EVAL": "forward of a held-out batch (evaluation after the step, no gradients)",
}


@dataclass(frozen=True)
class Event:
    """One action on one rank.

    Attributes:
        rank: process that ran it.
        stage: pipeline stage (-1 for actions that belong to no stage, such as a communication wait).
        kind: ``F``, ``B``, ``I``, ``W`` (compute) or ``COMM`` (blocked on communication).
        mb: microbatch index (-1 when not one).
        start, end: seconds since the run (or simulated step) started; one clock across ranks.
        step: training step.
    """

    rank: int
    stage: int
    kind: str
    mb: int
    start: float
    end: float
    step: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """torch's action notation: ``2F0`` is stage 2, forward, microbatch 0."""
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass
class Timeline:
    """Events of one or more steps with the metrics people ask for.

    Attributes:
        events: every event, in start order.
        num_ranks, num_stages, microbatches: the run's shape.
        schedule: torch's schedule name.
        source: ``"measured"`` (from a run) or ``"simulated"``.
    """

    events: list[Event]
    num_ranks: int
    num_stages: int
    microbatches: int
    schedule: str
    source: str = "measured"
    meta: dict[str, Any] = field(default_factory=dict)
    mesh: Mesh | None = None  # the run's layout; None: a pure pipeline of num_ranks processes
    # What an event's ``rank`` is: "process" (a measured run: one row per process), or "pipeline" (a simulation,
    # which plays one pipeline, replica 0's, shard 0's: its ranks are pipeline ranks).
    ranks: str = "process"

    def __post_init__(self) -> None:
        self.events = sorted(self.events, key=lambda e: (e.start, e.rank))
        by_step: dict[int, list[Event]] = {}
        for e in self.events:  # grouped once: metrics on 10,000 events stay cheap
            by_step.setdefault(e.step, []).append(e)
        self._by_step = by_step

    @property
    def steps(self) -> list[int]:
        return sorted(self._by_step)

    @property
    def layout(self) -> Mesh:
        """The layout the events come from (a pure pipeline when none was given)."""
        return self.mesh or Mesh(pp=max(1, self.num_ranks))

    @property
    def pipeline_ranks(self) -> int:
        """Pipeline ranks (``num_ranks`` counts processes in a measured run with replicas or shards)."""
        return self.layout.pp

    def process_of(self, rank: int) -> ProcessRank:
        """The process an event's ``rank`` stands for: itself in a measured run; in a simulation, the process of
        replica 0, share 0, shard 0 at that pipeline rank (where its events are drawn over a measured run)."""
        return self.layout.rank(rank) if self.ranks == "pipeline" else ProcessRank(rank)

    def pipeline_of(self, rank: int) -> PipelineRank:
        """The pipeline rank of an event's ``rank`` (which stages it runs)."""
        return PipelineRank(rank) if self.ranks == "pipeline" else self.layout.pipeline_rank(rank)

    def process_label(self, rank: int) -> str:
        """How a row is named: ``"rank 2"``, or the process's mesh coordinates (``"pp1 dp0"``: pipeline rank 1,
        replica 0) for a run with replicas."""
        names = self.meta.get("processes")
        return str(names[rank]) if isinstance(names, list) and rank < len(names) else f"rank {rank}"

    def step_events(self, step: int) -> list[Event]:
        return list(self._by_step.get(step, ()))

    def _span(self, events: Iterable[Event]) -> float:
        # A data-parallel all-reduce after the last compute (the split-backward schedules') ends the step.
        evs = [e for e in events if e.kind in COMPUTE or e.kind == "DP"]
        return max(e.end for e in evs) - min(e.start for e in evs) if evs else 0.0

    @property
    def step_times(self) -> list[float]:
        """Per step: first compute start to last compute end, across all ranks."""
        return [self._span(self.step_events(s)) for s in self.steps]

    @property
    def step_time(self) -> float:
        """Median step time in seconds (the first, warm-up step is left out when there are three or more)."""
        times = self.step_times
        if len(times) >= 3:
            times = times[1:]
        return statistics.median(times) if times else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time spent idle (not computing) within a step, median over steps."""
        fractions = []
        for s in self.steps or [0]:
            evs = self.step_events(s)
            span = self._span(evs)
            if span <= 0:
                continue
            busy = sum(e.duration for e in evs if e.kind in COMPUTE)
            fractions.append(max(0.0, 1.0 - busy / (span * self.num_ranks)))
        if len(fractions) >= 3:
            fractions = fractions[1:]
        return statistics.median(fractions) if fractions else 0.0

    @property
    def peak_activation_bytes(self) -> list[int] | None:
        """Per rank, the most activation bytes alive at once (simulated timelines; None when not known)."""
        return self.meta.get("peak_activation_bytes")

    @property
    def memory_bytes(self) -> list[int] | None:
        """Per rank, parameters + gradients + optimizer state + peak activations (simulated timelines)."""
        return self.meta.get("memory_bytes")

    @property
    def tp_layout(self) -> str | None:
        """The tensor-parallel layout a simulation priced (``Collectives.tp_layout``): ``"launch"`` (what
        ``pv.launch`` shards) or ``"megatron"`` (Megatron-LM's: every block and the vocabulary); None without
        tensor parallelism, or for a measured run."""
        return self.meta.get("tp_layout")

    def order(self, rank: int, step: int | None = None) -> list[Action]:
        """The compute actions of ``rank`` in the order they ran (``Action``s: ``str()`` gives torch's ``0F0``)."""
        step = self.steps[0] if step is None and self.steps else step
        return [Action(e.stage, Kind(e.kind), e.mb) for e in self.events
                if e.rank == rank and e.step == step and e.kind in COMPUTE]

    # ----------------------------------------------------------------- export
    def to_dict(self) -> dict[str, object]:
        return {"num_ranks": self.num_ranks, "num_stages": self.num_stages, "microbatches": self.microbatches,
                "schedule": self.schedule, "source": self.source, "meta": self.meta, "ranks": self.ranks,
                "mesh": None if self.mesh is None else dict(zip(DIMS, self.mesh.degrees, strict=True)),
                "events": [asdict(e) for e in self.events]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        d = json.loads(text)
        events = [Event(**e) for e in d.pop("events")]
        mesh = d.pop("mesh", None)
        return cls(events=events, mesh=Mesh(**mesh) if mesh else None, **d)

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write Chrome-trace JSON (one track per rank, microseconds, one clock) that Perfetto opens."""
        trace: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": self.process_label(r)}}
            for r in range(self.num_ranks)
        ]
        trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": self.process_label(r)}}
                  for r in range(self.num_ranks)]
        for e in self.events:
            trace.append({
                "name": e.label if e.kind in COMPUTE else e.kind, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank,
                "ts": e.start * 1e6, "dur": max(e.duration, 0.0) * 1e6,
                "args": {"stage": e.stage, "microbatch": e.mb, "step": e.step, "kind": KINDS.get(e.kind, e.kind)},
            })
        out = Path(path)
        out.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
        return out

    def __repr__(self) -> str:
        tp = f", tp {self.layout.tp} ({self.tp_layout} layout)" if self.tp_layout else ""
        return (f"Timeline({self.source}, {self.schedule}, {self.num_stages} stages on {self.num_ranks} ranks{tp}, "
                f"{self.microbatches} microbatches, {len(self.events)} events, step {self.step_time * 1e3:.2f} ms, "
                f"bubble {self.bubble_fraction:.0%})")
