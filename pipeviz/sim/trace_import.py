"""Read a pipelined run recorded by ``torch.profiler`` (Kineto's Chrome-trace JSON, one file per rank, as torchtitan
writes them) into a pipeviz ``Timeline``, and the costs that replay it in ``pv.simulate``: another framework's run
drawn on pipeviz's timeline beside a simulation of the same layout, with the same critical-path and idle analysis.

What is read: the ranges torch's pipelining schedules open around each action with ``record_function``:
``PP:<action>`` under the multi-stage runtime (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV: ``PP:1F3`` is stage 1's forward of microbatch 3, ``PP:0REDUCE_GRAD`` a gradient reduction) and
``Forward <i>`` / ``Backward <i>`` under ``ScheduleGPipe`` (one stage per rank: stage = rank; a ``Backward <i>``
around no op, as a forward-only step opens them, is left out). torch 2.13's
``Schedule1F1B`` opens none: its trace has nothing to read (said, with the fix). On a GPU trace the ranges Kineto
places on the device (``gpu_user_annotation``: when the GPU ran the action) are used where present, else the CPU's.

Which rank a file is: its ``distributedInfo.rank`` (Kineto writes it when a process group is up), else ``rank<r>`` in
its name (torchtitan's ``rank0_trace.json``), else its place in the list. Times: Kineto's ``ts`` (µs) plus the file's
``baseTimeNanoseconds``, one clock for ranks on one host; the timeline starts at the earliest action. Steps: the k-th
time a rank runs an action is step k.

Example:
    >>> tl = pv.import_trace("outputs/profile_trace/iteration_10")   # a folder of rank<r>_trace.json
    >>> sim = pv.simulate(None, tl.schedule, tl.microbatches, costs=trace_costs(tl), num_stages=tl.num_stages)
    >>> pv.timeline_figure(tl, overlay=sim, why=True)
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipeviz.cost.model import Costs
from pipeviz.schedule import traits as sched
from pipeviz.schedule.timeline import COMPUTE, Event, Timeline

__all__ = ["import_trace", "trace_costs"]

_PP = re.compile(r"^PP:(\d+)(F|B|I|W|REDUCE_GRAD)(\d*)$")
_GPIPE = re.compile(r"^(Forward|Backward) (\d+)$")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)

PathLike = str | Path


def _files(traces: PathLike | Sequence[PathLike] | Mapping[int, PathLike]) -> list[tuple[int | None, Path]]:
    if isinstance(traces, Mapping):
        return [(int(r), Path(p)) for r, p in traces.items()]
    items = [traces] if isinstance(traces, str | Path) else list(traces)
    out: list[tuple[int | None, Path]] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")))
            if not found:
                raise FileNotFoundError(f"import_trace(): no .json or .json.gz trace in the folder {path}. Fix: the "
                                        "folder torch.profiler's export_chrome_trace wrote (torchtitan: "
                                        "<dump_folder>/profile_trace/iteration_<n>).")
            out += [(None, p) for p in found]
        elif path.exists():
            out.append((None, path))
        else:
            raise FileNotFoundError(f"import_trace(): {path} does not exist. Fix: a Chrome-trace JSON written by "
                                    "torch.profiler (prof.export_chrome_trace), or a folder of them.")
    return out


Trace = tuple[Mapping[str, object], list[Mapping[str, object]]]  # (the file's fields, its events)


def _load(path: Path) -> Trace:
    with (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz")
          else open(path, encoding="utf-8")) as f:
        data = json.load(f)
    if isinstance(data, list):  # a bare list of events
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"import_trace(): {path} is not a Chrome trace (no traceEvents list). Fix: the JSON that "
                         "torch.profiler's export_chrome_trace writes.")
    return data, [ev for ev in data["traceEvents"] if isinstance(ev, Mapping)]


def _rank_of(data: Mapping[str, object], path: Path, place: int) -> int:
    info = data.get("distributedInfo")
    if isinstance(info, Mapping) and isinstance(info.get("rank"), int):
        return int(str(info["rank"]))
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else place


def _base_ns(trace: Trace) -> int:
    return int(str(trace[0].get("baseTimeNanoseconds") or 0))


# Ops inside an action's range that are communication: before the first other op the rank waited to receive, after
# the last it sent (gloo's and NCCL's ranges, c10d's ops, the profiler's record of collectives, waits).
_COMM_OP = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms|ProcessGroup)|[Ww]ait")
Action = tuple[float, float, int, str, int]  # (start s, end s, stage, kind, microbatch)
Op = tuple[float, float, bool]  # (start µs, end µs, is communication)


class _Ops:
    """One trace's op ranges by thread, in start order: what each pipeline range holds."""

    def __init__(self, evs: Sequence[Mapping[str, object]]) -> None:
        self.by_thread: dict[tuple[object, object], list[Op]] = {}
        for ev in evs:
            name = str(ev.get("name", ""))
            if ev.get("ph") != "X" or "dur" not in ev or _PP.match(name) or _GPIPE.match(name):
                continue
            if str(ev.get("cat", "")) not in ("cpu_op", "user_annotation", ""):
                continue
            start = float(str(ev["ts"]))
            self.by_thread.setdefault((ev.get("pid"), ev.get("tid")), []).append(
                (start, start + float(str(ev["dur"])), bool(_COMM_OP.search(name))))
        for ops in self.by_thread.values():
            ops.sort()

    def inside(self, rng: Mapping[str, object]) -> list[Op]:
        """The ops that start inside ``rng`` on its thread."""
        ops = self.by_thread.get((rng.get("pid"), rng.get("tid")), [])
        start = float(str(rng["ts"]))
        end = start + float(str(rng["dur"]))
        lo = bisect.bisect_left(ops, (start, -math.inf, False))
        hi = bisect.bisect_left(ops, (end, -math.inf, False))
        return ops[lo:hi]


def _actions(trace: Trace, rank: int, base0_ns: int) -> tuple[list[Action], list[tuple[float, float]]]:
    """The pipeline actions in one rank's trace, and the stretches inside their ranges the rank spent on
    communication (start s, end s). ``base0_ns``: the earliest ``baseTimeNanoseconds`` of all ranks (subtracted as
    integers: seconds since 1970 as a float keep only a fraction of a microsecond).

    torch's range around an action holds more than its computation: the wait for its input (a forward's activations,
    a backward's gradients) before it, the send of its output after it. Where the range holds ops (a CPU trace), the
    action is its first to its last other op and the rest is communication; a range without ops (the device's, or a
    trace recorded without them) is the action whole."""
    _, evs = trace
    base = (_base_ns(trace) - base0_ns) / 1e9
    ops = _Ops(evs)
    found: dict[bool, list[Action]] = {True: [], False: []}
    comm: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for ev in evs:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        name, cat = str(ev.get("name", "")), str(ev.get("cat", ""))
        on_gpu = cat == "gpu_user_annotation"
        if not on_gpu and cat not in ("user_annotation", "cpu_op", ""):
            continue
        if m := _PP.match(name):
            stage, kind, mb = int(m.group(1)), m.group(2), int(m.group(3) or -1)
            if kind == "REDUCE_GRAD":
                kind = "DP"
        elif m := _GPIPE.match(name):
            stage, kind, mb = rank, "F" if m.group(1) == "Forward" else "B", int(m.group(2))
        else:
            continue
        t0 = float(str(ev["ts"]))
        t1 = t0 + float(str(ev["dur"]))
        inner = [] if on_gpu else ops.inside(ev)
        work = [(a, b) for a, b, is_comm in inner if not is_comm]
        if not work and name.startswith("Backward") and ops.by_thread and not on_gpu:
            continue  # GPipe opens "Backward <i>" in a forward-only step too, around no computation
        a, b = (min(x for x, _ in work), max(y for _, y in work)) if work else (t0, t1)
        found[on_gpu].append((base + a / 1e6, base + b / 1e6, stage, kind, mb))
        comm[on_gpu] += [(base + x / 1e6, base + y / 1e6) for x, y in ((t0, a), (b, t1)) if y > x]
    gpu = bool(found[True])  # the device's times where Kineto recorded them
    return found[gpu], comm[gpu]


def import_trace(traces: PathLike | Sequence[PathLike] | Mapping[int, PathLike], *, schedule: str | None = None,
                 microbatches: int | None = None) -> Timeline:
    """A ``Timeline`` (``source="measured"``) of a pipelined run recorded by ``torch.profiler``: every rank's
    forwards, backwards (or input- and weight-grad passes) and gradient reductions, on one clock.

    Example:
        >>> tl = pv.import_trace(["rank0_trace.json", "rank1_trace.json"], schedule="Interleaved1F1B")
        >>> pv.critical_path(tl), pv.idle_gaps(tl), pv.timeline_figure(tl, why=True)

    Args:
        traces: a Chrome-trace file, a folder of them (one per rank), a list, or a dict rank -> file.
        schedule: the schedule's name, for titles and for simulating the same layout (default: read from the trace
            where it can be: ``"GPipe"`` for ``Forward <i>`` ranges; else ``"imported"``).
        microbatches: per step (default: the most microbatch indices any step ran).

    Raises:
        FileNotFoundError, ValueError: no trace, or no pipeline action in it (with what torch names them).
    """
    files = _files(traces)
    loaded = [_load(path) for _, path in files]
    base0 = min(_base_ns(t) for t in loaded)
    events: list[Event] = []
    gpipe_names = False
    seen_ranks: dict[int, Path] = {}
    for place, ((given, path), trace) in enumerate(zip(files, loaded, strict=True)):
        rank = given if given is not None else _rank_of(trace[0], path, place)
        if rank in seen_ranks:
            raise ValueError(f"import_trace(): {seen_ranks[rank].name} and {path.name} are both rank {rank}. Fix: "
                             "one trace per rank (a dict rank -> file says which is which).")
        seen_ranks[rank] = path
        counts: dict[tuple[int, str, int], int] = {}
        actions, waits = _actions(trace, rank, base0)
        steps_at: list[tuple[float, int]] = []
        for start, end, stage, kind, mb in sorted(actions):
            key = (stage, kind, mb)
            step = counts.get(key, 0)
            counts[key] = step + 1
            events.append(Event(rank, stage, kind, mb, start, end, step))
            steps_at.append((start, step))
        for start, end in waits:  # blocked on communication, in the step of the action it belongs to
            step = max((st for t, st in steps_at if t <= end), default=0)
            events.append(Event(rank, -1, "COMM", -1, start, end, step))
        gpipe_names |= any(_GPIPE.match(str(ev.get("name", ""))) for ev in trace[1])
    if not any(e.kind in COMPUTE for e in events):
        raise ValueError(
            f"import_trace(): no pipeline action in {', '.join(p.name for _, p in files)}. torch's schedules name "
            "them with record_function: 'PP:<stage><F|B|I|W><microbatch>' (the multi-stage runtime) and "
            "'Forward <i>' / 'Backward <i>' (ScheduleGPipe); torch 2.13's Schedule1F1B names none. Fix: profile "
            "the schedule's step() with torch.profiler.profile() (record_shapes not needed) around a multi-stage "
            "schedule or GPipe, and export_chrome_trace one file per rank.")
    t0 = min(e.start for e in events)
    events = [Event(e.rank, e.stage, e.kind, e.mb, e.start - t0, e.end - t0, e.step) for e in events]
    num_stages = max(e.stage for e in events) + 1
    per_step: dict[int, set[int]] = {}
    for e in events:
        if e.kind in COMPUTE:
            per_step.setdefault(e.step, set()).add(e.mb)
    m = microbatches or max(len(v) for v in per_step.values())
    name = schedule or ("GPipe" if gpipe_names else "imported")
    if schedule is not None:
        name = sched.canonical(schedule)
    return Timeline(events=events, num_ranks=max(seen_ranks) + 1, num_stages=num_stages, microbatches=m,
                    schedule=name, source="measured",
                    meta={"imported": [str(p) for _, p in files], "ranks": sorted(seen_ranks)})


def trace_costs(timeline: Timeline) -> Costs:
    """Per-stage costs read off a timeline (the median forward, backward and weight-grad share of each stage),
    for ``pv.simulate(None, timeline.schedule, timeline.microbatches, costs=trace_costs(tl),
    num_stages=timeline.num_stages)``: the same layout simulated, to set beside what ran. No link cost and no
    memory: a trace of record_function ranges says neither."""
    n = timeline.num_stages
    by: dict[tuple[int, str], list[float]] = {}
    for e in timeline.events:
        if e.kind in COMPUTE:
            by.setdefault((e.stage, e.kind), []).append(e.duration)

    def med(stage: int, kind: str) -> float:
        return statistics.median(by[(stage, kind)]) if (stage, kind) in by else 0.0

    forward = tuple(med(s, "F") for s in range(n))
    backward = tuple(med(s, "B") or (med(s, "I") + med(s, "W")) for s in range(n))
    split = [(med(s, "W"), med(s, "I") + med(s, "W")) for s in range(n) if (s, "W") in by]
    weight = sum(w for w, _ in split) / sum(t for _, t in split) if split and sum(t for _, t in split) else 0.5
    return Costs(forward=forward, backward=backward, comm=(0.0,) * max(n - 1, 0), activation_bytes=(0,) * n,
                 param_bytes=(0,) * n, weight_fraction=weight, source="measured")
