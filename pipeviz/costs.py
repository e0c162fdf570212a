"""The one cost and memory model: what a layer and a stage cost in time, and what a rank holds in memory.

The stage preview, ``pv.simulate``, ``pv.balance``, the report and the Explorer all read these numbers, so
one plan has one memory figure everywhere.

Time: a layer's forward and backward per microbatch come from a ``pv.profile`` measurement attached to the
graph (``graph.with_profile(prof)``), scaled to the microbatch size, or from its FLOPs at a device's rate
(backward = 2 x forward). A hand-off between stages costs bytes / bandwidth + latency.

Memory per rank, for a (plan, schedule, microbatches, optimizer state):

    sum over the rank's stages of  param_bytes x (1 weights + 1 gradients + optimizer_states)  +  buffer_bytes
    + the most activation bytes the rank's schedule keeps alive at once

where a stage keeps ``activation_bytes / microbatches`` alive per microbatch between its forward and its
backward (zero-bubble: the input-grad pass frees ``weight_fraction`` of it, the weight-grad pass the rest).
The peak is read off the schedule's action order, so it is exact for that order whatever the timings.

Example:
    >>> costs = stage_costs(plan, microbatches=4)
    >>> memory_per_rank(plan, "1F1B", microbatches=4)          # bytes per rank
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeviz import schedules as sched

if TYPE_CHECKING:
    from pipeviz.graph import ModelGraph
    from pipeviz.plan import SplitPlan, StageInfo

__all__ = ["FLOPS_PER_S", "LINKS", "OPTIMIZER_STATES", "Costs", "in_flight", "layer_times", "memory_per_rank",
           "peak_activations", "stage_costs", "stage_info_memory", "stage_memory"]

# Rough defaults, overridable: sustained FLOP/s of one process, and link bandwidth/latency per transport.
# gloo's latency is what a pipeline sees between ranks on one host (README, "Performance").
FLOPS_PER_S = {"cpu": 2e10, "cuda": 2e14}
LINKS = {"gloo": (1e9, 2e-4), "nccl": (1e11, 1e-5), "host": (1e10, 5e-5), "none": (float("inf"), 0.0)}
BACKWARD_PER_FORWARD = 2.0  # a backward computes two matmuls per forward matmul (input and weight grads)
OPTIMIZER_STATES = 2  # tensors of optimizer state per parameter by default: Adam's two moments


@dataclass(frozen=True)
class Costs:
    """Per-stage durations for one microbatch, in seconds, and bytes.

    Attributes:
        forward, backward: per stage; ``backward`` is the full backward (input + weight grads).
        comm: per boundary ``s -> s+1``: seconds to move one microbatch's activations (and, back, grads).
        activation_bytes: per stage, activations one in-flight microbatch keeps alive.
        param_bytes: per stage, parameters held (shared copies included).
        buffer_bytes: per stage, buffers held.
        weight_fraction: share of a backward that is weight grads (``W`` in zero-bubble schedules).
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
    buffer_bytes: tuple[int, ...] = ()

    def duration(self, stage: int, kind: str) -> float:
        """Seconds of one action: ``F``, ``B``, or a zero-bubble ``I`` / ``W`` half of a backward."""
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


def layer_times(graph: ModelGraph, microbatches: int = 1, device: str = "cpu",
                flops_per_s: float | None = None) -> tuple[list[float], list[float], str]:
    """Per-layer forward and backward seconds for one microbatch, and where they come from.

    Measured when the graph carries a ``pv.profile`` of its layers (``graph.with_profile``), scaled from the
    microbatch size it was measured at; otherwise FLOPs at ``flops_per_s`` (default by device).

    Returns:
        ``(forward, backward, source)`` with ``source`` ``"measured"`` or ``"flops"``.
    """
    prof = graph.profile
    if prof is not None and all(name in prof.forward for name in graph.layer_names):
        scale = prof.microbatches / microbatches  # a microbatch of 1/m of the batch takes m_prof/m as long
        return ([prof.forward[n] * scale for n in graph.layer_names],
                [prof.backward[n] * scale for n in graph.layer_names], "measured")
    rate = flops_per_s or FLOPS_PER_S["cuda" if str(device).startswith("cuda") else "cpu"]
    fwd = [layer.flops / microbatches / rate for layer in graph.layers]
    return fwd, [f * BACKWARD_PER_FORWARD for f in fwd], "flops"


def stage_costs(
    plan: SplitPlan, microbatches: int, device: str = "cpu", flops_per_s: float | None = None,
    bandwidth: float | None = None, latency: float | None = None, backend: str | None = None,
) -> Costs:
    """Costs of ``plan``'s stages for one microbatch (see the module docstring for the rules).

    Communication: bytes / ``bandwidth`` + ``latency``, defaults per backend (gloo on CPU, NCCL on GPUs).
    """
    g = plan.graph
    stages = plan.stages
    fwd_l, bwd_l, source = layer_times(g, microbatches, device, flops_per_s)
    pos = {n: i for i, n in enumerate(g.layer_names)}
    fwd = [sum(fwd_l[pos[n]] for n in s.layers) for s in stages]
    bwd = [sum(bwd_l[pos[n]] for n in s.layers) for s in stages]
    overhead = 0.0
    prof = g.profile
    if source == "measured" and prof is not None:
        scale = prof.microbatches / microbatches
        # Ops between layers (embedding sums, masks) are timed as a whole; share them by FLOPs.
        total = sum(s.flops for s in stages) or 1
        fwd = [f + prof.glue_forward * scale * s.flops / total for f, s in zip(fwd, stages, strict=True)]
        bwd = [b + prof.glue_backward * scale * s.flops / total for b, s in zip(bwd, stages, strict=True)]
        # The last stage computes the loss after its forward and starts its backward from the loss.
        fwd[-1] += prof.loss_forward * scale
        bwd[-1] += prof.loss_backward * scale
        overhead = prof.overhead
    link = backend or ("nccl" if str(device).startswith("cuda") else "gloo")
    bw, lat = LINKS.get(link, LINKS["gloo"])
    bw, lat = bandwidth or bw, latency if latency is not None else lat
    comm = tuple(s.send_bytes / microbatches / bw + lat for s in stages[:-1])
    return Costs(tuple(fwd), tuple(bwd), comm, tuple(s.activation_bytes // microbatches for s in stages),
                 tuple(s.param_bytes for s in stages), overhead=overhead, source=source,
                 buffer_bytes=tuple(s.buffer_bytes for s in stages))


def peak_activations(order: Sequence[Sequence[str]], activation_bytes: Sequence[int],
                     weight_fraction: float = 0.5) -> list[int]:
    """Per rank, the most activation bytes alive at once when each rank runs its ``order``: a forward
    adds its stage's per-microbatch bytes, a backward frees them (an input-grad pass ``weight_fraction`` of
    them, a weight-grad pass the rest)."""
    peaks = []
    for acts in order:
        live = peak = 0.0
        for action in acts:
            s, kind, _ = sched.parse(action)
            size = activation_bytes[s]
            if kind == "F":
                live += size
                peak = max(peak, live)
            elif kind == "B":
                live -= size
            else:
                live -= size * (weight_fraction if kind == "I" else 1 - weight_fraction)
        peaks.append(round(peak))
    return peaks


def in_flight(schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None,
              weight_fraction: float = 0.5) -> list[float]:
    """Per stage, the most microbatches whose activations it keeps alive at once under ``schedule`` (GPipe:
    all of them; 1F1B: ``min(m, p - stage)``), read off the schedule's order."""
    counts = [0.0] * num_stages
    peaks = [0.0] * num_stages
    for acts in sched.orders(schedule, num_stages, microbatches, stages_per_rank):
        for action in acts:
            s, kind, _ = sched.parse(action)
            counts[s] += {"F": 1.0, "B": -1.0, "I": -weight_fraction, "W": -(1 - weight_fraction)}[kind]
            peaks[s] = max(peaks[s], counts[s])
    return peaks


def stage_memory(param_bytes: int, buffer_bytes: int, activation_bytes_in_flight: float,
                 optimizer_states: int = OPTIMIZER_STATES) -> int:
    """One stage's bytes: weights, gradients and optimizer state per parameter, buffers, live activations."""
    return round(param_bytes * (2 + optimizer_states) + buffer_bytes + activation_bytes_in_flight)


def memory_per_rank(plan: SplitPlan | None, schedule: str, microbatches: int, stages_per_rank: int | None = None,
                    optimizer_states: int = OPTIMIZER_STATES, costs: Costs | None = None,
                    order: Sequence[Sequence[str]] | None = None, forward_only: bool = False,
                    **cost_options: Any) -> list[int]:
    """Bytes each rank holds at its peak when ``plan`` trains under ``schedule`` (the module's formula).

    ``forward_only``: an inference run keeps weights and buffers, no gradients or optimizer state, and one
    microbatch's activations of a stage at a time.

    Example:
        >>> memory_per_rank(plan, "GPipe", 8) == [s.memory_bytes for s in plan.stages]    # one stage per rank
        True
    """
    if costs is None:
        if plan is None:
            raise ValueError("memory_per_rank() needs a plan, or costs=Costs(...).")
        costs = stage_costs(plan, microbatches, **cost_options)
    n = len(costs.forward)
    lay = sched.layout(schedule, n, stages_per_rank)
    acts = [list(a) for a in order] if order is not None else sched.orders(schedule, n, microbatches, stages_per_rank)
    buffers = costs.buffer_bytes or (0,) * n
    if forward_only:
        return [max(costs.activation_bytes[s] for s in lay.stages_of(r))
                + sum(costs.param_bytes[s] + buffers[s] for s in lay.stages_of(r)) for r in range(lay.num_ranks)]
    peaks = peak_activations(acts, costs.activation_bytes, costs.weight_fraction)
    return [
        peaks[r] + sum(stage_memory(costs.param_bytes[s], buffers[s], 0, optimizer_states) for s in lay.stages_of(r))
        for r in range(lay.num_ranks)
    ]


def stage_info_memory(stage: StageInfo, optimizer_states: int = OPTIMIZER_STATES) -> int:
    """``StageInfo.memory_bytes``: the stage on a rank of its own with every microbatch in flight (GPipe, the
    most any schedule keeps), whatever the microbatch count: its whole batch's activations."""
    return stage_memory(stage.param_bytes, stage.buffer_bytes, stage.activation_bytes, optimizer_states)
