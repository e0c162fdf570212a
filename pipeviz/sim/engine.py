"""The simulator's engine: each rank plays its actions in order, each as soon as its rank is free and its input has
arrived (``play``), optionally on fewer cores than ranks (``play_on_cores``) or with ranks slowing each other
(``contended``). ``pipeviz.sim.simulate`` prepares the costs and calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar

from pipeviz.cost.model import Costs
from pipeviz.schedule import traits as sched
from pipeviz.schedule.timeline import COMPUTE, Event
from pipeviz.sim.collectives import Reduction
from pipeviz.sim.ep_overlap import PairOverlap

__all__ = ["check_order", "contended", "play", "play_on_cores", "runtime_actions"]

T = TypeVar("T")


def check_order(order: Sequence[Sequence[sched.Action]], lay: sched.Layout, microbatches: int) -> sched.Order:
    """A custom order's per-rank action lists, checked: one list per pipeline rank of ``lay``, every stage's
    forward and backward of every microbatch once on the rank holding the stage (``schedules.validate``), and
    an order that can run (played once with unit costs: a rank waiting on an action another rank has not reached
    is a deadlock, which a launch would only show as a hang), then its communication order as torch's runtime
    lowers it (``pipeviz.schedule.comm_order.check_order_comms``: sends and receives posted and waited on as the ranks
    will).

    Raises:
        ScheduleError: naming the rank and action that break it.
    """
    acts = [list(rank_acts) for rank_acts in order]
    if len(acts) != lay.num_ranks:
        raise sched.ScheduleError(
            f"order has {len(acts)} rank lists; {lay.schedule} puts {lay.num_stages} stages on {lay.num_ranks} "
            f"pipeline ranks ({lay.stage_ranks}). Fix: one list of actions per pipeline rank.")
    sched.validate(acts, lay.num_stages, microbatches, lay.stage_ranks)
    n = lay.num_stages
    unit = Costs(forward=(1.0,) * n, backward=(2.0,) * n, comm=(0.0,) * max(n - 1, 0), activation_bytes=(0,) * n,
                 param_bytes=(0,) * n)
    play(acts, lay, unit, n)
    # then as the run will issue it: the sends and receives torch's runtime adds, each blocking as gloo's do
    from pipeviz.schedule.comm_order import check_order_comms

    check_order_comms(acts, lay.stage_ranks, microbatches)
    return acts


def contended(run: Callable[[Costs], tuple[list[Event], T]], costs: Costs, lay: sched.Layout, factor: float,
              mirrored: bool) -> tuple[list[Event], T]:
    """``run(costs)`` with each rank's ops stretched by ``1 + (factor - 1) x`` the share of their time another rank
    computes (``Hardware.contention``: ranks on the cores of one processor share its cache and memory
    bandwidth). The share comes from the run itself, so it is run again with the stretched ops (twice: the share
    settles within a percent); ``mirrored``: other processes always compute alongside (replicas), a share of 1."""
    events, red = run(costs)
    for _ in range(1 if mirrored else 2):
        shares = [1.0] * lay.num_ranks if mirrored else _overlap(events, lay.num_ranks)
        scale = [1 + (factor - 1) * shares[r] for r in lay.stage_ranks]
        stretched = replace(costs, forward=tuple(f * k for f, k in zip(costs.forward, scale, strict=True)),
                            backward=tuple(b * k for b, k in zip(costs.backward, scale, strict=True)),
                            recompute_seconds=tuple(r * k for r, k in zip(costs.recompute_seconds, scale,
                                                                          strict=False)))
        events, red = run(stretched)
    return events, red


def _overlap(events: list[Event], ranks: int) -> list[float]:
    """Per rank, the share of its compute time during which another rank computes too."""
    marks = sorted((t, d, e.rank) for e in events if e.kind in COMPUTE and e.end > e.start
                   for t, d in ((e.start, 1), (e.end, -1)))  # at one instant, ends before starts
    active: set[int] = set()
    busy, shared = [0.0] * ranks, [0.0] * ranks
    prev = 0.0
    for t, d, r in marks:
        if active and t > prev:
            for q in active:
                busy[q] += t - prev
                if len(active) > 1:
                    shared[q] += t - prev
        if d > 0:
            active.add(r)
        else:
            active.discard(r)
        prev = t
    return [s / b if b > 0 else 0.0 for s, b in zip(shared, busy, strict=True)]


def runtime_actions(lay: sched.Layout, overhead: float) -> tuple[float, ...]:
    """Per stage, the fixed seconds of the send and receive actions that go with each of its ``F``, ``B`` or
    ``I`` under torch's multi-stage runtime (``_PipelineScheduleRuntime``): there a hand-off between two ranks is
    a ``SEND_*`` action on one and a ``RECV_*`` on the other, each run under its own profiler range like a
    compute action, so each costs ``overhead`` too (a forward receives from the stage before and sends to the
    one after; its backward the same boundaries the other way). On this machine the gaps between an
    Interleaved1F1B rank's compute actions measured ~0.9 ms each against ~0.3 ms for 1F1B, whose hand-offs ride
    inside the compute action: 42 runtime actions a step against 16 compute ones on a rank of 2 x 2 stages
    with 4 microbatches."""
    r = lay.stage_ranks
    n = len(r)
    crossings = [int(s > 0 and r[s - 1] != r[s]) + int(s < n - 1 and r[s] != r[s + 1]) for s in range(n)]
    return tuple(overhead * k for k in crossings)


def play(acts: sched.Order, lay: sched.Layout, costs: Costs, n: int, red: Reduction | None = None,
         pairs: PairOverlap | None = None) -> list[Event]:
    """Each rank's actions in order, each as soon as its rank is free and its input has arrived; ``pairs``
    (``ep_overlap``): a rank's overlapped forward/backward pairs run as one (``pipeviz.sim.ep_overlap``)."""
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(acts)
    pos = [0] * len(acts)
    events: list[Event] = []
    total = sum(len(a) for a in acts)
    while len(events) < total:
        progressed = False
        for rank, rank_acts in enumerate(acts):
            while pos[rank] < len(rank_acts):
                step = _next(rank, pos[rank], rank_acts, done, costs, lay, n, pairs)
                if step is None:
                    break
                ready, took = step
                start = max(free[rank], ready)
                end = _place(rank, pos[rank], rank_acts, start, took, done, events, costs, red,
                             _width(rank, pos[rank], pairs) == 2)
                free[rank] = end
                pos[rank] += _width(rank, pos[rank], pairs)
                progressed = True
        if not progressed:
            raise _deadlock(acts, lay, done, pos)
    return events


def _width(rank: int, p: int, pairs: PairOverlap | None) -> int:
    return 2 if pairs is not None and (rank, p) in pairs.at else 1


def _next(rank: int, p: int, rank_acts: Sequence[sched.Action], done: dict[tuple[int, str, int], float],
          costs: Costs, lay: sched.Layout, n: int, pairs: PairOverlap | None,
          slow: float = 1.0) -> tuple[float, float] | None:
    """(when the rank's next action, or overlapped pair, can start, its seconds), or None while an input is
    missing."""
    s, kind, mb = rank_acts[p]
    ready = _ready(s, kind, mb, done, costs, lay, n)
    if ready is None or _width(rank, p, pairs) == 1:
        return None if ready is None else (ready, costs.duration(s, kind) * slow)
    assert pairs is not None
    s2, kind2, mb2 = rank_acts[p + 1]
    ready2 = _ready(s2, kind2, mb2, done, costs, lay, n)
    if ready2 is None:
        return None
    return max(ready, ready2), pairs.seconds(costs, s, s2, slow)


def _place(rank: int, p: int, rank_acts: Sequence[sched.Action], start: float, took: float,
           done: dict[tuple[int, str, int], float], events: list[Event], costs: Costs,
           red: Reduction | None, paired: bool) -> float:
    """The rank's action at ``p`` (or, ``paired``, it and the next: ``took`` covers both) run from ``start``: its
    events, its end."""
    s, kind, mb = rank_acts[p]
    if not paired:
        end = start + took
        if red is not None:
            end = red.finish(rank, p, start, end)
        done[(s, kind, mb)] = end
        events.append(Event(rank, s, kind, mb, start, end))
        return end
    s2, kind2, mb2 = rank_acts[p + 1]
    f, b = costs.duration(s, kind), costs.duration(s2, kind2)
    mid = start + took * f / (f + b) if f + b > 0 else start
    end = start + took
    if red is not None:
        end = red.finish(rank, p + 1, mid, end)
    # both outputs leave when the pair ends (torch's runtime sends them in the actions after it)
    done[(s, kind, mb)] = done[(s2, kind2, mb2)] = end
    events += [Event(rank, s, kind, mb, start, mid), Event(rank, s2, kind2, mb2, mid, end)]
    return end


def _deadlock(acts: sched.Order, lay: sched.Layout, done: Collection[tuple[int, str, int]],
              pos: Sequence[int]) -> sched.ScheduleError:
    """The error for an order no rank can go on with, with the report a launch that hung on it would give
    (``pipeviz.schedule.hang.diagnose``: per rank the last action, the one it is blocked in, whom it waits for, the
    cycle)."""
    from pipeviz.schedule.hang import diagnose

    waits = [f"rank {r} waits at {a[pos[r]]}" for r, a in enumerate(acts) if pos[r] < len(a)]
    report = diagnose(acts, lay.stage_ranks, set(done))
    err = sched.ScheduleError(
        "The schedule deadlocks: no rank can run its next action. " + "; ".join(waits) + ". Fix: order each "
        "rank's actions so every forward comes after the previous stage's and every backward after the "
        "next stage's. A launch would hang here:\n" + str(report))
    err.report = report
    return err


def play_on_cores(acts: sched.Order, lay: sched.Layout, costs: Costs, n: int, cores: int, slow: float = 1.0,
                  red: Reduction | None = None, pairs: PairOverlap | None = None,
                  idle: Mapping[tuple[int, str], float] | None = None) -> list[Event]:
    """Like ``play``, with at most ``cores`` actions running at once: the next action to start is always the
    one that can start earliest (list scheduling), on the core that frees first; every action takes ``slow``
    times as long (cores shared with other replicas' processes). A data-parallel all-reduce in a rank's last
    backward holds that rank's core: on CPU, gloo's copies and sums are the cores' own work. ``idle``: per
    ``(stage, kind)`` the seconds of such an action its process sleeps off its core, waiting for another process
    (a tensor-parallel collective's wait for the other shard): the core frees that much before the action ends."""
    import heapq

    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(acts)
    pos = [0] * len(acts)
    core_free = [0.0] * cores
    events: list[Event] = []
    total = sum(len(a) for a in acts)
    while len(events) < total:
        best: tuple[float, int, float] | None = None
        for rank, rank_acts in enumerate(acts):
            if pos[rank] >= len(rank_acts):
                continue
            step = _next(rank, pos[rank], rank_acts, done, costs, lay, n, pairs, slow)
            if step is not None and (best is None or max(free[rank], step[0]) < best[0]):
                best = (max(free[rank], step[0]), rank, step[1])
        if best is None:
            raise _deadlock(acts, lay, done, pos)
        earliest, rank, took = best
        core_at = heapq.heappop(core_free)
        start = max(earliest, core_at)
        width = _width(rank, pos[rank], pairs)
        end = _place(rank, pos[rank], acts[rank], start, took, done, events, costs, red, width == 2)
        # Gloo's all-reduce on CPU is the cores' own work (copies through the loopback, the sums): it holds the core;
        # a wait for another process to join one does not (the process sleeps in gloo's receive).
        asleep = sum(idle.get((a.stage, a.kind), 0.0) for a in acts[rank][pos[rank]:pos[rank] + width]) if idle else 0.0
        heapq.heappush(core_free, max(start, end - asleep))
        free[rank] = end
        pos[rank] += _width(rank, pos[rank], pairs)
    return events


def _ready(s: int, kind: str, mb: int, done: dict[tuple[int, str, int], float], costs: Costs,
           lay: sched.Layout, n: int) -> float | None:
    """Time the inputs of an action are available, or None if they are not produced yet."""

    def comm(a: int, b: int) -> float:
        return 0.0 if lay.stage_ranks[a] == lay.stage_ranks[b] else costs.comm[min(a, b)]

    if kind == "F":
        if s == 0:
            return 0.0
        prev = done.get((s - 1, "F", mb))
        return None if prev is None else prev + comm(s - 1, s)
    if kind == "W":
        return done.get((s, "I", mb))
    own = done.get((s, "F", mb))
    if own is None:
        return None
    if s == n - 1:
        return own
    nxt = done.get((s + 1, "B", mb), done.get((s + 1, "I", mb)))
    return None if nxt is None else max(own, nxt + comm(s, s + 1))
