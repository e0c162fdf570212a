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

Composed with data (``dp`` replicas) and tensor (``tp`` shards) parallelism (``parallel_costs``): each replica
trains on 1/dp of every microbatch, so a microbatch's compute, activations and hand-off bytes scale by 1/dp;
each shard computes 1/tp of a stage and holds 1/tp of its parameters (gradients, optimizer state) and, roughly,
of its activations (norms and buffers are replicated in truth: an approximation). Tensor parallelism pays
all-reduces of layer outputs on the critical path (``tp_all_reduces``), and the replicas average their
gradients once per step (``all_reduce_time`` of the rank's parameter bytes; ``pv.simulate`` places it).

Example:
    >>> costs = stage_costs(plan, microbatches=4)
    >>> memory_per_rank(plan, "1F1B", microbatches=4)          # bytes per rank
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipeviz import schedules as sched

if TYPE_CHECKING:
    from pipeviz.graph import ModelGraph
    from pipeviz.plan import SplitPlan, StageInfo

__all__ = ["DDP_BUCKET_BYTES", "FLOPS_PER_S", "LINKS", "OPTIMIZER_STATES", "Costs", "all_reduce_time", "ddp_buckets",
           "in_flight", "layer_times", "link", "memory_per_rank", "parallel_costs", "peak_activations", "stage_costs",
           "stage_info_memory", "stage_memory", "tp_all_reduces", "tp_collectives"]

# Rough defaults, overridable: sustained FLOP/s of one process, and link bandwidth/latency per transport.
# gloo's latency is what a pipeline sees between ranks on one host (README, "Performance").
FLOPS_PER_S = {"cpu": 2e10, "cuda": 2e14}
LINKS = {"gloo": (1e9, 2e-4), "nccl": (1e11, 1e-5), "host": (1e10, 5e-5), "none": (float("inf"), 0.0)}
BACKWARD_PER_FORWARD = 2.0  # a backward computes two matmuls per forward matmul (input and weight grads)
OPTIMIZER_STATES = 2  # tensors of optimizer state per parameter by default: Adam's two moments
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb=25


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
        collective: per stage, seconds of tensor-parallel all-reduces in one forward (and as many in one
            backward or input-grad pass), on the critical path; empty without tensor parallelism.
        latency: the part of each ``comm`` a smaller microbatch does not shrink (``parallel_costs``).
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
    collective: tuple[float, ...] = ()
    latency: float = 0.0

    def duration(self, stage: int, kind: str) -> float:
        """Seconds of one action: ``F``, ``B``, or a zero-bubble ``I`` / ``W`` half of a backward (tensor-parallel
        all-reduces go with ``F``, ``B`` and ``I``: the weight-grad pass sends nothing)."""
        coll = self.collective[stage] if self.collective and kind != "W" else 0.0
        if kind == "F":
            return self.forward[stage] + coll + self.overhead
        if kind == "B":
            return self.backward[stage] + coll + self.overhead
        part = self.weight_fraction if kind == "W" else 1 - self.weight_fraction
        return self.backward[stage] * part + coll + self.overhead

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
    bw, lat = link(device, backend, bandwidth, latency)
    comm = tuple(s.send_bytes / microbatches / bw + lat for s in stages[:-1])
    return Costs(tuple(fwd), tuple(bwd), comm, tuple(s.activation_bytes // microbatches for s in stages),
                 tuple(s.param_bytes for s in stages), overhead=overhead, source=source,
                 buffer_bytes=tuple(s.buffer_bytes for s in stages), latency=lat)


def link(device: str | None = "cpu", backend: str | None = None, bandwidth: float | None = None,
         latency: float | None = None) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` of a link: ``LINKS[backend]`` (default gloo on CPU, NCCL on GPUs),
    either figure overridden."""
    name = backend or ("nccl" if str(device).startswith("cuda") else "gloo")
    bw, lat = LINKS.get(name, LINKS["gloo"])
    return bandwidth or bw, lat if latency is None else latency


def all_reduce_time(nbytes: float, ranks: int, via: tuple[float, float]) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` processes on link ``via``:
    ``2(N-1)/N x bytes / bandwidth + 2(N-1) x latency`` (a reduce-scatter then an all-gather, N-1 steps each,
    every step moving bytes/N; Patarasuk & Yuan 2009, NCCL's ring). Zero for one process or no bytes."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = via
    steps = 2 * (ranks - 1)
    return steps / ranks * nbytes / bw + steps * lat


def ddp_buckets(nbytes: int, bucket: int = DDP_BUCKET_BYTES) -> list[int]:
    """Gradient bytes per DDP bucket in the order DDP reduces them (reverse parameter order): full
    ``bucket``-sized ones first, the rest (the stage's first layers, ready only at the end of the backward)
    last. Parameter boundaries and DDP's smaller first bucket are ignored."""
    if nbytes <= 0:
        return []
    full, rest = divmod(nbytes, bucket)
    return [bucket] * full + ([rest] if rest else [])


def tp_all_reduces(layer: Any) -> int:
    """All-reduces of a layer's output per forward (and as many of its input grad per backward) under tensor
    parallelism, from what the graph knows of the layer (Megatron-LM, Shoeybi et al. 2019):

    - 0 for a layer without parameters, or a normalisation layer (``"Norm"`` in its kind): replicated;
    - 1 for a single module (not expandable: ``Linear``, ``Embedding``, a convolution): one row-parallel
      (or vocabulary-parallel) op whose output is summed across shards;
    - 2 for a composite layer (a block): attention and MLP each end in a row-parallel all-reduce. A block
      holding one Linear (``zoo.MyNetworkBlock``) is counted as a block too: an overestimate.
    """
    if not (layer.params or layer.shared) or "Norm" in layer.kind:
        return 0
    return 2 if layer.expandable else 1


def tp_collectives(plan: SplitPlan, microbatches: int, dp: int = 1, tp: int = 1,
                   via: tuple[float, float] | None = None) -> tuple[float, ...]:
    """Per stage, seconds of tensor-parallel all-reduces in one forward of one microbatch (as many again in
    its backward): ``sum over layers of tp_all_reduces(layer) x all_reduce_time(out_bytes / (m x dp), tp)``."""
    via = via or link()
    layers = {layer.name: layer for layer in plan.graph.layers}
    return tuple(
        sum(tp_all_reduces(layers[n]) * all_reduce_time(layers[n].out_bytes / (microbatches * dp), tp, via)
            for n in s.layers)
        for s in plan.stages
    )


def parallel_costs(costs: Costs, dp: int = 1, tp: int = 1, collective: Sequence[float] | None = None) -> Costs:
    """``costs`` of one microbatch of a pipeline alone, for one rank of that pipeline composed with ``dp``
    replicas and ``tp`` shards per stage: forward and backward / (dp x tp), activations / (dp x tp) (roughly,
    for tp), hand-offs' bytes / dp (``comm - latency``), parameters / tp; ``collective`` (``tp_collectives``)
    replaces ``costs.collective`` when given. ``dp = tp = 1`` returns ``costs`` itself."""
    if dp == 1 and tp == 1 and collective is None:
        return costs
    k = dp * tp
    return replace(
        costs,
        forward=tuple(f / k for f in costs.forward),
        backward=tuple(b / k for b in costs.backward),
        comm=tuple((c - costs.latency) / dp + costs.latency for c in costs.comm),
        activation_bytes=tuple(round(a / k) for a in costs.activation_bytes),
        param_bytes=tuple(round(p / tp) for p in costs.param_bytes),
        collective=tuple(collective) if collective is not None else costs.collective,
    )


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
