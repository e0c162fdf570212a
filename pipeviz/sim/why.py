"""Why a step takes as long as it does: each action's dependencies, the critical path, and what every idle gap
waits for, on any ``Timeline`` (simulated or measured).

An action of a pipeline step depends on the action before it on its rank and on the data it needs: a forward on the
previous stage's forward of the same microbatch, a backward (or input-grad pass) on its own forward and on the next
stage's backward of the microbatch, a weight-grad pass on its input-grad pass; a rank's gradient reduction after
its last action (``DP``) on that action. ``critical_path`` walks back from the action that ends the step, always to
the dependency that freed it last: the chain of actions and waits whose lengths add up to the step. ``idle_gaps``
labels every stretch a rank does not compute with what its next action was waiting for (rank r's forward of
microbatch k, the hand-off after it, the step's start).

Example:
    >>> tl = pv.simulate(plan, "1F1B", 8)
    >>> path = pv.critical_path(tl)                   # Events, first to last
    >>> path[-1].end - path[0].start == tl.step_time  # the step, explained
    >>> for gap in pv.idle_gaps(tl): print(gap)       # "rank 0 idle 2.0-4.0 ms: waits for rank 1's B of mb 0 ..."
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeviz.schedule.timeline import COMPUTE, Event, Timeline

__all__ = ["Gap", "critical_path", "dependencies", "handoffs", "idle_gaps"]

_EPS = 1e-9


def _key(e: Event) -> tuple[int, str, int]:
    kind = "B" if e.kind == "I" else e.kind  # an input-grad pass stands for the backward it starts
    return e.stage, kind, e.mb


class _Index:
    """One step's actions by (stage, kind, microbatch) and by rank, in time order."""

    def __init__(self, events: Sequence[Event], num_stages: int) -> None:
        self.n = num_stages
        self.events = sorted(events, key=lambda e: (e.start, e.end))
        self.by_key: dict[tuple[int, str, int], Event] = {}
        self.by_rank: dict[int, list[Event]] = {}
        for e in self.events:
            if e.kind in COMPUTE:
                self.by_key.setdefault((e.stage, e.kind, e.mb), e)
                if e.kind in ("B", "I"):
                    self.by_key.setdefault(_key(e), e)
            if e.kind in COMPUTE or e.kind == "DP":
                self.by_rank.setdefault(e.rank, []).append(e)

    def data(self, e: Event) -> list[Event]:
        """The actions whose results ``e`` needs (the previous stage's forward, the next stage's backward, ...)."""
        s, mb = e.stage, e.mb
        out: list[Event | None] = []
        if e.kind == "F" and s > 0:
            out.append(self.by_key.get((s - 1, "F", mb)))
        elif e.kind in ("B", "I"):
            out.append(self.by_key.get((s, "F", mb)))
            if s < self.n - 1:
                out.append(self.by_key.get((s + 1, "B", mb)))
        elif e.kind == "W":
            out.append(self.by_key.get((s, "I", mb)))
        return [d for d in out if d is not None]

    def before(self, e: Event) -> Event | None:
        """The action before ``e`` on its rank (a ``DP`` event: the rank's last compute before it)."""
        mine = self.by_rank.get(e.rank, [])
        prior = [x for x in mine if x is not e and x.kind in COMPUTE and x.end <= e.start + _EPS]
        return max(prior, key=lambda x: x.end) if prior else None


def dependencies(tl: Timeline, event: Event) -> list[Event]:
    """What ``event`` waited for: the action before it on its rank and the actions whose data it needs (in
    ``tl``'s step of ``event``)."""
    index = _Index(tl.step_events(event.step), tl.num_stages)
    deps = index.data(event) if event.kind in COMPUTE else []
    prev = index.before(event)
    return [*([prev] if prev is not None else []), *deps]


def handoffs(tl: Timeline, step: int | None = None) -> list[tuple[Event, Event]]:
    """Every hand-off between ranks in ``step`` (default as ``critical_path``'s): ``(from, to)`` for each action
    whose data another rank's action produced (a forward's activations from the previous stage, a backward's
    gradients from the next), in the order the receiving actions start: the arrows of a dependency drawing."""
    if step is None:
        step = tl.steps[1] if len(tl.steps) > 1 else (tl.steps[0] if tl.steps else 0)
    index = _Index(tl.step_events(step), tl.num_stages)
    return [(d, e) for e in index.events if e.kind in COMPUTE for d in index.data(e) if d.rank != e.rank]


def critical_path(tl: Timeline, step: int | None = None) -> list[Event]:
    """The chain of actions that sets the length of ``step`` (default: the first step of a simulated timeline, the
    median one's neighbour of a measured run: its second step when it has one), first to last: from the action
    that ends the step, each link is the dependency that finished last (``dependencies``). Its span,
    ``path[-1].end - path[0].start``, is the step (on a simulated timeline exactly ``tl.step_times[step]``); what
    lies between consecutive links is communication or, on a measured run, a rank's own delay."""
    if step is None:
        step = tl.steps[1] if len(tl.steps) > 1 else (tl.steps[0] if tl.steps else 0)
    index = _Index(tl.step_events(step), tl.num_stages)
    candidates = [e for e in index.events if e.kind in COMPUTE or e.kind == "DP"]
    if not candidates:
        return []
    e = max(candidates, key=lambda x: (x.end, x.kind in COMPUTE))
    path = [e]
    while True:
        deps = ([] if e.kind == "DP" else index.data(e))
        prev = index.before(e)
        options = [*deps, *([prev] if prev is not None else [])]
        options = [d for d in options if d.end <= e.start + _EPS]
        if not options:
            break
        # the one that freed ``e`` last; on a tie the data dependency (the rank was already free)
        e = max(options, key=lambda d: (d.end, d is not prev))
        path.append(e)
    return path[::-1]


@dataclass(frozen=True)
class Gap:
    """A stretch of a step in which ``rank`` does not compute, and what its next action waited for.

    Attributes:
        rank, start, end: where and when.
        waits_for: the action the next one needed last (another rank's, whose result arrives over a link), or None.
        next: the action that ran after the gap (None: the rank had no more in the step).
        reason: the label: ``"waits for rank 1's B of microbatch 0 (stage 1)"``, ``"the step's start"``, ...
    """

    rank: int
    start: float
    end: float
    waits_for: Event | None
    next: Event | None
    reason: str

    @property
    def duration(self) -> float:
        return self.end - self.start

    def __str__(self) -> str:
        return f"rank {self.rank} idle {self.start * 1e3:.3f}-{self.end * 1e3:.3f} ms: {self.reason}"


def _describe(e: Event) -> str:
    return f"rank {e.rank}'s {e.kind} of microbatch {e.mb} (stage {e.stage})"


def idle_gaps(tl: Timeline, step: int | None = None, min_seconds: float = 0.0) -> list[Gap]:
    """Every stretch of ``step`` (default as ``critical_path``'s) in which a rank does not compute, at least
    ``min_seconds`` long, labelled with what the action after it waited for: another rank's action (and the
    hand-off after it), the rank's own previous action (then it is a rank's delay: on a measured run the host's
    scheduling, a busy core), or the step's start (a pipeline's fill). Ordered by rank, then time."""
    if step is None:
        step = tl.steps[1] if len(tl.steps) > 1 else (tl.steps[0] if tl.steps else 0)
    index = _Index(tl.step_events(step), tl.num_stages)
    events = [e for e in index.events if e.kind in COMPUTE]
    if not events:
        return []
    t0 = min(e.start for e in events)
    out: list[Gap] = []
    for rank in sorted(index.by_rank):
        mine = [e for e in index.by_rank[rank] if e.kind in COMPUTE]
        free = t0
        for e in mine:
            if e.start - free > max(min_seconds, _EPS):
                deps = [d for d in index.data(e) if d.rank != rank or d.end > free + _EPS]
                last = max(deps, key=lambda d: d.end) if deps else None
                if last is not None and last.end > free + _EPS:
                    hand_off = e.start - last.end
                    reason = f"waits for {_describe(last)}" + (
                        f", then its hand-off ({hand_off * 1e3:.3f} ms)" if hand_off > 1e-6 and last.rank != rank
                        else "")
                elif free <= t0 + _EPS and not index.data(e):
                    reason = "the step's start"
                else:
                    reason = "nothing it depends on: the rank's own delay (the host, a busy core)"
                    last = None
                out.append(Gap(rank, free, e.start, last, e, reason))
            free = max(free, e.end)
    return out
