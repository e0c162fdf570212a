"""``simulate()`` a plan under a schedule: a ``Timeline`` with step time, bubble and memory per rank.

Each rank runs its actions in the order torch's runtime does (``pipeviz.schedules.orders``), each as soon
as its rank is free and its input has arrived: a forward needs the previous stage's forward, a backward
(or input-grad) the next stage's backward, a weight-grad its own input-grad. Costs come from FLOPs by
default, or from measurements (``pv.profile``).

Example:
    >>> tl = pv.simulate(plan, schedule="1F1B", microbatches=8)
    >>> tl.step_time, tl.bubble_fraction, tl.peak_activation_bytes
    >>> pv.compare(plan, microbatches=8).table()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeviz import schedules as sched
from pipeviz.plan import SplitPlan
from pipeviz.timeline import Event, Timeline

# Rough defaults, overridable: sustained FLOP/s of one process, and link bandwidth/latency per transport.
# gloo's latency is what a pipeline sees between ranks on one host: a stage's output reaches the next
# stage's forward 0.3-0.7 ms after it was made for 128-256 KiB (measured on the 2-core CI machine).
FLOPS_PER_S = {"cpu": 2e10, "cuda": 2e14}
LINKS = {"gloo": (1e9, 2e-4), "nccl": (1e11, 1e-5), "host": (1e10, 5e-5), "none": (float("inf"), 0.0)}


@dataclass(frozen=True)
class Costs:
    """Per-stage durations for one microbatch, in seconds, and bytes.

    Attributes:
        forward, backward: per stage; ``backward`` is the full backward (input + weight grads).
        weight_fraction: share of a backward that is weight grads (``W`` in zero-bubble schedules).
        comm: per boundary ``s -> s+1``: seconds to move one microbatch's activations (and, back, grads).
        activation_bytes: per stage, activations one in-flight microbatch keeps alive.
        param_bytes: per stage, parameters held (tied copies included).
        overhead: fixed seconds per action (launch and bookkeeping).
        source: ``"flops"`` or ``"measured"``.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    comm: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    weight_fraction: float = 0.5
    overhead: float = 0.0
    source: str = "flops"

    def duration(self, stage: int, kind: str) -> float:
        if kind == "F":
            return self.forward[stage] + self.overhead
        if kind == "B":
            return self.backward[stage] + self.overhead
        part = self.weight_fraction if kind == "W" else 1 - self.weight_fraction
        return self.backward[stage] * part + self.overhead

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0,
                activation_bytes: int = 1) -> Costs:
        """Equal costs on every stage: the textbook setting."""
        return cls((forward,) * num_stages, (backward,) * num_stages, (comm,) * max(0, num_stages - 1),
                   (activation_bytes,) * num_stages, (0,) * num_stages)


def estimate_costs(
    plan: SplitPlan, microbatches: int, device: str = "cpu", flops_per_s: float | None = None,
    bandwidth: float | None = None, latency: float | None = None, backend: str | None = None,
) -> Costs:
    """Costs of ``plan``'s stages for one microbatch: measured times if ``pv.profile`` calibrated the graph
    at this microbatch size, otherwise FLOPs / ``flops_per_s`` (backward = 2 x forward).

    Communication: bytes / ``bandwidth`` + ``latency``, defaults per backend (gloo on CPU, NCCL on GPUs).
    """
    g = plan.graph
    stages = plan.stages
    prof = g.capture.profiles.get(microbatches)
    if prof is not None and all(layer in prof.forward for layer in g.layer_names):
        fwd = tuple(sum(prof.forward.get(layer, 0.0) for layer in s.layers) for s in stages)
        bwd = tuple(sum(prof.backward.get(layer, 0.0) for layer in s.layers) for s in stages)
        # Ops between layers (embedding sums, masks) are timed as a whole; share them by FLOPs.
        glue_f, glue_b = prof.glue_forward, prof.glue_backward
        total = sum(s.flops for s in stages) or 1
        fwd = tuple(f + glue_f * s.flops / total for f, s in zip(fwd, stages, strict=True))
        bwd = tuple(b + glue_b * s.flops / total for b, s in zip(bwd, stages, strict=True))
        # The last stage computes the loss after its forward and starts its backward from the loss.
        fwd = (*fwd[:-1], fwd[-1] + prof.loss_forward)
        bwd = (*bwd[:-1], bwd[-1] + prof.loss_backward)
        source, overhead = "measured", prof.overhead
    else:
        rate = flops_per_s or FLOPS_PER_S["cuda" if device.startswith("cuda") else "cpu"]
        fwd = tuple(s.flops / microbatches / rate for s in stages)
        bwd = tuple(2 * f for f in fwd)
        source, overhead = "flops", 0.0
    link = backend or ("nccl" if device.startswith("cuda") else "gloo")
    bw, lat = LINKS.get(link, LINKS["gloo"])
    bw, lat = bandwidth or bw, latency if latency is not None else lat
    comm = tuple(s.send_bytes / microbatches / bw + lat for s in stages[:-1])
    return Costs(fwd, bwd, comm, tuple(s.activation_bytes // microbatches for s in stages),
                 tuple(s.param_bytes for s in stages), overhead=overhead, source=source)


def simulate(
    plan: SplitPlan | None = None,
    schedule: str = "1F1B",
    microbatches: int = 4,
    stages_per_rank: int | None = None,
    costs: Costs | None = None,
    order: Sequence[Sequence[str]] | None = None,
    num_stages: int | None = None,
    optimizer_states: int = 2,
    **cost_options: Any,
) -> Timeline:
    """Simulate one training step of ``plan`` under ``schedule``.

    Args:
        plan: the ``SplitPlan`` (or ``None`` with ``num_stages`` and ``costs`` for a what-if).
        schedule: any of torch's schedules; ``order`` overrides its action order (a custom schedule).
        microbatches: microbatches per step.
        stages_per_rank: multi-stage schedules (default 2).
        costs: per-stage ``Costs``; default ``estimate_costs(plan, microbatches, **cost_options)``.
        optimizer_states: tensors of optimizer state per parameter for the memory estimate (Adam: 2).

    Returns:
        A simulated ``Timeline``; ``meta`` holds ``peak_activation_bytes`` and ``memory_bytes`` per rank.

    Raises:
        ScheduleError: an invalid schedule/microbatch combination, or a custom order that deadlocks
            (the message names what each rank waits for).
    """
    n = plan.num_stages if plan is not None else num_stages
    if n is None:
        raise ValueError("simulate() needs a plan, or num_stages with costs.")
    lay = sched.layout(schedule, n, stages_per_rank)
    acts = [list(a) for a in order] if order is not None else sched.orders(schedule, n, microbatches, stages_per_rank)
    sched.validate(acts, n, microbatches, lay.stage_ranks)
    if costs is None:
        if plan is None:
            raise ValueError("simulate() without a plan needs costs=Costs(...).")
        costs = estimate_costs(plan, microbatches, **cost_options)
    events, peaks = _run(acts, lay, costs, n)
    memory = [
        peaks[r] + (2 + optimizer_states) * sum(costs.param_bytes[s] for s in lay.stages_of(r))
        for r in range(lay.num_ranks)
    ]
    return Timeline(events, lay.num_ranks, n, microbatches, lay.schedule, source="simulated",
                    meta={"peak_activation_bytes": peaks, "memory_bytes": memory, "costs": costs.source})


def _run(acts: list[list[str]], lay: sched.Layout, costs: Costs, n: int) -> tuple[list[Event], list[int]]:
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(acts)
    pos = [0] * len(acts)
    live = [0] * len(acts)
    peak = [0] * len(acts)
    events: list[Event] = []
    total = sum(len(a) for a in acts)
    while len(events) < total:
        progressed = False
        for rank, rank_acts in enumerate(acts):
            while pos[rank] < len(rank_acts):
                s, kind, mb = sched.parse(rank_acts[pos[rank]])
                ready = _ready(s, kind, mb, done, costs, lay, n)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + costs.duration(s, kind)
                done[(s, kind, mb)] = end
                free[rank] = end
                pos[rank] += 1
                events.append(Event(rank, s, kind, mb, start, end))
                progressed = True
                act = costs.activation_bytes[s]
                if kind == "F":
                    live[rank] += act
                    peak[rank] = max(peak[rank], live[rank])
                elif kind == "B":
                    live[rank] -= act
                else:  # zero bubble: input grads free part of the activations, weight grads the rest
                    live[rank] -= round(act * (costs.weight_fraction if kind == "I" else 1 - costs.weight_fraction))
        if not progressed:
            waits = [f"rank {r} waits at {a[pos[r]]}" for r, a in enumerate(acts) if pos[r] < len(a)]
            raise sched.ScheduleError(
                "The schedule deadlocks: no rank can run its next action. " + "; ".join(waits) + ". Fix: order each "
                "rank's actions so every forward comes after the previous stage's and every backward after the "
                "next stage's."
            )
    return events, peak


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


@dataclass
class Comparison:
    """What-if table over schedules: ``rows`` of dicts, ``timelines`` by schedule, ``skipped`` with reasons."""

    rows: list[dict[str, Any]]
    timelines: dict[str, Timeline]
    skipped: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        head = f"{'schedule':<22}{'ranks':>6}{'step':>12}{'bubble':>9}  peak memory per rank"
        lines = [head]
        for r in self.rows:
            mem = ", ".join(f"{b / 2**20:.1f}" for b in r["memory_bytes"])
            lines.append(f"{r['schedule']:<22}{r['ranks']:>6}{r['step_time'] * 1e3:>10.3f}ms{r['bubble']:>8.0%}  "
                         f"[{mem}] MiB")
        lines += [f"{k:<22}skipped: {v.split('. Fix:')[0]}" for k, v in self.skipped.items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def figure(self) -> Any:
        """Bar chart of step time and bubble per schedule (plotly, imported on first use)."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        names = [r["schedule"] for r in self.rows]
        fig = make_subplots(rows=1, cols=2, subplot_titles=("step time (ms)", "bubble"))
        fig.add_trace(go.Bar(x=names, y=[r["step_time"] * 1e3 for r in self.rows], name="step"), 1, 1)
        fig.add_trace(go.Bar(x=names, y=[r["bubble"] for r in self.rows], name="bubble"), 1, 2)
        fig.update_layout(showlegend=False, height=320, margin={"t": 40, "b": 40, "l": 40, "r": 10})
        fig.update_yaxes(tickformat=".0%", row=1, col=2)
        return fig


def compare(plan: SplitPlan, schedules: Sequence[str] | None = None, microbatches: int = 8,
            stages_per_rank: int | None = None, **simulate_options: Any) -> Comparison:
    """Simulate ``plan`` under several schedules (default: all 7) and tabulate step time, bubble and memory.

    Schedules that cannot run this plan (e.g. ZBV with an odd stage count) are listed in ``skipped``.
    """
    rows, tls, skipped = [], {}, {}
    for name in schedules or sched.ALL:
        canon = sched.canonical(name)
        spr = None if canon in sched.SINGLE else stages_per_rank
        try:
            tl = simulate(plan, canon, microbatches, spr, **simulate_options)
        except sched.ScheduleError as exc:
            skipped[canon] = str(exc)
            continue
        tls[canon] = tl
        rows.append({"schedule": canon, "ranks": tl.num_ranks, "step_time": tl.step_time,
                     "bubble": tl.bubble_fraction, "memory_bytes": tl.meta["memory_bytes"],
                     "peak_activation_bytes": tl.meta["peak_activation_bytes"]})
    return Comparison(rows, tls, skipped)
