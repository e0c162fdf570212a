"""The one cost and memory model: what a layer and a stage cost in time, and what a rank holds in memory.

The stage preview, ``pv.simulate``, ``pv.balance``, the report and the Explorer all read these numbers, so
one plan has one memory figure everywhere.

Every function takes the same settings: a ``CostOptions`` (hardware, dtype, recompute, links, batch scale) or its
fields as keywords.

Time: a layer's forward and backward per microbatch come from a ``pv.profile`` measurement attached to the
graph (``graph.with_profile(prof)``), scaled to the microbatch size; else, on a ``pv.Hardware``, from a roofline
per op (``pipeviz.hardware``); else from its FLOPs at a device's rate (backward = 2 x forward). Recomputation
adds forward work to each backward (``"full"``: the whole forward; ``"selective"``: attention's score ops). A
hand-off between stages costs bytes / bandwidth + latency.

Memory per rank, for a (plan, schedule, microbatches, optimizer state):

    sum over the rank's stages of  param_bytes x (1 weights + 1 gradients + optimizer_states)  +  buffer_bytes
    + the most activation bytes the rank's schedule keeps alive at once

where a stage keeps ``activation_bytes / microbatches`` alive per microbatch between its forward and its
backward (zero-bubble: the input-grad pass frees what the ops after the stage's last weight op saved,
``Costs.input_freed``, the weight-grad pass the rest), less
what recomputation drops (``layer_activation_bytes``), plus, under recomputation, one layer's rebuilt activations.
The peak is read off the schedule's action order, so it is exact for that order whatever the timings.

A stage's activations are what autograd saves for its backward (``StageInfo.activation_bytes``), counted at trace
time as a run counts them (``pipeviz.runtime.memory``): each tensor once, parameters never, a view as its base,
nothing in a no_grad region (``Op.saved_bytes``); a copy of its own of every saved tensor it received from an
earlier stage (``SplitPlan.received_saved_bytes``); on the last stage what the loss saves (an output-sized
log-softmax). Not counted, as the run's meter does not count them: a stage's outputs and received inputs that no
op saves (torch's stage holds them until the backward; on a GPU they are in ``memory_allocated``, not here).
Measured on CPU runs (``benchmarks/memory_accuracy.py``): within 0.1 % of the simulator's peak per rank under
GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble.

Composed with data (``dp`` replicas) and tensor (``tp`` shards) parallelism (``parallel_costs``): each replica
trains on 1/dp of every microbatch, so a microbatch's compute, activations and hand-off bytes scale by 1/dp;
each shard computes 1/tp of a stage and holds 1/tp of its parameters (gradients, optimizer state) and, roughly,
of its activations (norms and buffers are replicated in truth: an approximation). Tensor parallelism pays
all-reduces of layer outputs on the critical path (``tp_all_reduces``), and the replicas average their
gradients once per step (``all_reduce_time`` of the rank's parameter bytes; ``pv.simulate`` places it).

Example:
    >>> costs = stage_costs(plan, microbatches=4)
    >>> memory_per_rank(plan, "1F1B", microbatches=4)          # bytes per rank
    >>> stage_costs(plan, 4, options=CostOptions(hardware="h100", dtype="bfloat16", recompute="selective"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipeviz import schedules as sched
from pipeviz.capture import op_saved_bytes
from pipeviz.hardware import (
    DTYPE_BYTES,
    Hardware,
    dtype_name,
    hardware,
    layer_roofline,
    loss_kernel_times,
    op_table,
)
from pipeviz.mesh import Mesh

if TYPE_CHECKING:
    from pipeviz.graph import ModelGraph
    from pipeviz.plan import SplitPlan, StageInfo

__all__ = ["DDP_BUCKET_BYTES", "FLOPS_PER_S", "LINKS", "OPTIMIZER_STATES", "RECOMPUTE", "CostOptions", "Costs",
           "all_reduce_time", "ddp_buckets", "in_flight", "layer_activation_bytes", "layer_times", "link",
           "measured_here", "memory_per_rank", "parallel_costs", "peak_activations", "stage_costs", "stage_info_memory",
           "stage_memory", "tp_all_reduces", "tp_collectives"]

# Rough defaults, overridable: sustained FLOP/s of one process, and link bandwidth/latency per transport.
# gloo's latency is what a pipeline sees between ranks on one host (README, "Performance").
FLOPS_PER_S = {"cpu": 2e10, "cuda": 2e14}
LINKS = {"gloo": (1e9, 2e-4), "nccl": (1e11, 1e-5), "host": (1e10, 5e-5), "none": (float("inf"), 0.0)}
BACKWARD_PER_FORWARD = 2.0  # a backward computes two matmuls per forward matmul (input and weight grads)
OPTIMIZER_STATES = 2  # tensors of optimizer state per parameter by default: Adam's two moments
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb=25
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class CostOptions:
    """Everything the cost model needs besides the plan: one typed object that ``stage_costs``,
    ``memory_per_rank``, ``pv.simulate``, ``pv.balance``, ``pv.compare`` and ``pv.plan_cluster`` all take.

    Example:
        >>> opts = CostOptions(hardware="h100", dtype="bfloat16", recompute="selective")
        >>> pv.simulate(plan, "1F1B", 8, options=opts)         # the same as the keywords below
        >>> pv.simulate(plan, "1F1B", 8, hardware="h100", dtype="bfloat16", recompute="selective")

    Attributes:
        hardware: a ``pv.Hardware`` or preset name; layer times then come from a roofline per op
            (``pipeviz.hardware.op_time``) and links from the hardware (intra- or inter-node by where the ranks
            sit). ``None``: FLOPs at ``flops_per_s`` (default by ``device``) and the ``backend``'s link.
        dtype: the training dtype (``"bfloat16"``, ``"float32"``, ...): the peak used and the size of activations,
            hand-offs and weight reads relative to the dtype the model was traced in (parameters, gradients and
            optimizer state keep the traced size: mixed precision keeps float32 masters). Default: the hardware's
            fast dtype; without hardware, the traced sizes.
        recompute: ``"none"``, ``"selective"`` (attention's score/softmax activations recomputed in the backward,
            Korthikanti et al. 2022) or ``"full"`` (each layer keeps only its input and runs its forward again in
            the backward).
        device, flops_per_s, bandwidth, latency, backend: the FLOP-rate and link settings without hardware
            (``bandwidth`` / ``latency`` override the hardware's links too).
        optimizer_states: tensors of optimizer state per parameter (Adam: 2).
        batch_scale: the step's batch as a multiple of the traced example batch, in tokens (``pv.plan_cluster``
            plans a global batch and sequence length the graph was not traced with): compute, activations and
            hand-offs scale with it, parameters do not.

    Raises:
        ValueError: an unknown recompute mode, hardware or dtype (the message lists the valid ones).
    """

    hardware: Hardware | str | None = None
    dtype: str | None = None
    recompute: str = "none"
    device: str = "cpu"
    flops_per_s: float | None = None
    bandwidth: float | None = None
    latency: float | None = None
    backend: str | None = None
    optimizer_states: int = OPTIMIZER_STATES
    batch_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Unknown recompute={self.recompute!r}; valid: {', '.join(RECOMPUTE)}. Fix: "
                             "recompute='selective' keeps all but attention's scores, 'full' only each layer's input.")
        if self.hardware is not None:
            hw = hardware(self.hardware)
            object.__setattr__(self, "hardware", hw)
            object.__setattr__(self, "dtype", hw.dtype(self.dtype))
        elif self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if not self.batch_scale > 0:
            raise ValueError(f"batch_scale must be positive, got {self.batch_scale!r}.")

    @classmethod
    def of(cls, options: CostOptions | None = None, **changes: Any) -> CostOptions:
        """``options`` (default: all defaults) with every keyword that is not ``None`` replaced: how the
        functions that take both ``options=`` and today's keywords merge them."""
        given = {k: v for k, v in changes.items() if v is not None}
        base = options if options is not None else cls()
        return replace(base, **given) if given else base

    @property
    def hw(self) -> Hardware | None:
        """The ``Hardware`` (resolved from a name on construction), or None."""
        return self.hardware if isinstance(self.hardware, Hardware) else None

    def link(self, span: int = 2, allreduce: bool = False) -> tuple[float, float]:
        """``(bandwidth, latency)`` between ranks ``span`` apart (a group over ``span`` consecutive ranks): the
        hardware's intra- or inter-node link (an all-reduce's share of it with ``allreduce=True``), else the
        backend's; ``bandwidth`` / ``latency`` override."""
        hw = self.hw
        if hw is None:
            return link(self.device, self.backend, self.bandwidth, self.latency)
        bw, lat = hw.link(span, allreduce=allreduce)
        return self.bandwidth or bw, lat if self.latency is None else self.latency

    def byte_scale(self, graph: ModelGraph) -> float:
        """Activation and hand-off bytes in ``dtype`` relative to the traced ones (1 without a dtype)."""
        if self.dtype is None:
            return 1.0
        cap = graph.capture
        numel = sum(cap.param_numel.values())
        traced = sum(cap.param_bytes.values()) / numel if numel else 4.0
        return DTYPE_BYTES[self.dtype] / (traced or 4.0)


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
        recompute_bytes: per stage, activations a backward rebuilds for a moment under recomputation (one
            layer's, the largest); empty without recomputation.
        send_bytes: per boundary, bytes one microbatch hands on (``pv.simulate`` prices them on the link the
            two ranks share); empty when unknown.
        runtime: per stage, fixed seconds an ``F``, ``B`` or ``I`` pays for the send and receive actions that go
            with it under torch's multi-stage runtime (``pv.simulate`` sets it: ``overhead`` per cross-rank
            hand-off); empty for single-stage schedules, whose hand-offs ride inside the compute action.
        input_freed: per stage, the share of ``activation_bytes`` a zero-bubble input-grad pass (``I``) frees, the
            rest going at its ``W`` (``SplitPlan.input_grad_freed_bytes``); empty: ``weight_fraction`` at ``I``.
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
    recompute_bytes: tuple[int, ...] = ()
    send_bytes: tuple[float, ...] = ()
    runtime: tuple[float, ...] = ()
    input_freed: tuple[float, ...] = ()

    def duration(self, stage: int, kind: str) -> float:
        """Seconds of one action: ``F``, ``B``, or a zero-bubble ``I`` / ``W`` half of a backward (tensor-parallel
        all-reduces go with ``F``, ``B`` and ``I``: the weight-grad pass sends nothing)."""
        coll = self.collective[stage] if self.collective and kind != "W" else 0.0
        if self.runtime and kind != "W":
            coll += self.runtime[stage]
        if kind == "F":
            return self.forward[stage] + coll + self.overhead
        if kind == "B":
            return self.backward[stage] + coll + self.overhead
        if kind not in ("I", "W"):
            raise sched.ScheduleError(f"Cannot price an action of kind {kind!r}; valid: F, B, I, W (forward, backward, "
                                "input-grad, weight-grad).")
        part = self.weight_fraction if kind == "W" else 1 - self.weight_fraction
        return self.backward[stage] * part + coll + self.overhead

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0,
                activation_bytes: int = 1) -> Costs:
        """Equal costs on every stage: the textbook setting."""
        return cls((forward,) * num_stages, (backward,) * num_stages, (comm,) * max(0, num_stages - 1),
                   (activation_bytes,) * num_stages, (0,) * num_stages)


def layer_times(graph: ModelGraph, microbatches: float = 1, device: str | None = None,
                flops_per_s: float | None = None, options: CostOptions | None = None,
                ) -> tuple[list[float], list[float], str]:
    """Per-layer forward and backward seconds for one microbatch, and where they come from.

    Measured when the graph carries a ``pv.profile`` of its layers (``graph.with_profile``), scaled from the
    microbatch size it was measured at (a measurement wins over any estimate made for that kind of device:
    ``measured_here``); else, on a ``Hardware``
    (``options.hardware``), a roofline per op summed over the layer's ops (``pipeviz.hardware.op_time``: matmuls by
    their FLOPs, elementwise ops by the bytes they read and write, views free; backward = 2 x forward), or on
    ``"cpu"`` each op replayed at its shapes (``pipeviz.kernels``: its own forward and backward); else FLOPs at
    ``flops_per_s`` (default by device). Recomputation adds to the
    backward: the whole forward (``"full"``) or attention's score ops (``"selective"``).

    Example:
        >>> fwd, bwd, source = layer_times(graph, 4, options=CostOptions(hardware="h100"))

    Returns:
        ``(forward, backward, source)`` with ``source`` ``"measured"``, ``"roofline"`` or ``"flops"``.
    """
    opts = CostOptions.of(options, device=device, flops_per_s=flops_per_s)
    k = opts.batch_scale / microbatches  # the microbatch as a fraction of the traced example batch
    prof = graph.profile
    table = op_table(graph.capture)
    spans = list(zip(graph.index.layer_first, graph.index.layer_last, strict=True))
    sel_flops = [sum(table.flops[i] for i in table.selective if a <= i <= b) for a, b in spans]
    hw = opts.hw
    if measured_here(graph, hw):
        assert prof is not None
        scale = prof.microbatches * k  # a microbatch of 1/m of the batch takes m_prof/m as long
        fwd = [prof.forward[n] * scale for n in graph.layer_names]
        bwd = [prof.backward[n] * scale for n in graph.layer_names]
        # Selective recomputation's share of a measured forward: its ops' share of the layer's FLOPs.
        sel = [f * sf / layer.flops if layer.flops else 0.0
               for f, sf, layer in zip(fwd, sel_flops, graph.layers, strict=True)]
        source = "measured"
    elif hw is not None:
        fwd, sel, bwd = layer_roofline(graph, hw, opts.dtype, k, opts.byte_scale(graph))
        source = "roofline"
    else:
        rate = opts.flops_per_s or FLOPS_PER_S["cuda" if str(opts.device).startswith("cuda") else "cpu"]
        fwd = [layer.flops * k / rate for layer in graph.layers]
        bwd = [f * BACKWARD_PER_FORWARD for f in fwd]
        sel = [f * k / rate for f in sel_flops]
        source = "flops"
    if opts.recompute == "full":
        bwd = [b + f for b, f in zip(bwd, fwd, strict=True)]
    elif opts.recompute == "selective":
        bwd = [b + x for b, x in zip(bwd, sel, strict=True)]
    return fwd, bwd, source


def measured_here(graph: ModelGraph, hw: Hardware | None) -> bool:
    """Whether the graph's ``pv.profile`` applies: it covers every layer and (on a ``Hardware``) was measured on
    that kind of device, a CPU profile for ``"cpu"``, a GPU one for a GPU preset. A CPU measurement says nothing
    of an H100, so there the roofline is used."""
    prof = graph.profile
    if prof is None or not all(name in prof.forward for name in graph.layer_names):
        return False
    return hw is None or (hw.name == "cpu") == str(prof.device).startswith("cpu")


def layer_activation_bytes(graph: ModelGraph, options: CostOptions | None = None) -> list[float]:
    """Per layer, the activation bytes one example batch keeps alive until its backward, in ``options.dtype``:

    - ``"none"``: what autograd saves for the layer's backward (``Layer.saved_bytes``: each tensor once, in the
      first layer that saves it; parameters never; a view shares its base's memory; a no_grad region saves
      nothing);
    - ``"selective"``: all but what attention's scores, their scaling/masking and softmax (and its dropout)
      save: the ``5as/h`` term of Korthikanti et al. 2022; a fused attention (SDPA, flash) saves none of them
      anyway;
    - ``"full"``: only the layer's input (``Layer.in_bytes``; the output layer keeps the loss's too).

    Example:
        >>> sum(layer_activation_bytes(graph, CostOptions(recompute="full")))
    """
    opts = options or CostOptions()
    s = opts.byte_scale(graph)
    ops = graph.capture.ops
    spans = list(zip(graph.index.layer_first, graph.index.layer_last, strict=True))
    if opts.recompute == "full":  # the loss's saved tensors (in the output layer's saved_bytes) stay
        loss = [layer.saved_bytes - sum(op_saved_bytes(ops[i]) for i in range(a, b + 1))
                for layer, (a, b) in zip(graph.layers, spans, strict=True)]
        return [((layer.in_bytes or min(layer.out_bytes, layer.activation_bytes)) + x) * s
                for layer, x in zip(graph.layers, loss, strict=True)]
    dropped = [0.0] * len(graph.layers)
    if opts.recompute == "selective":
        table = op_table(graph.capture)
        dropped = [sum(op_saved_bytes(ops[i]) for i in table.selective if a <= i <= b) for a, b in spans]
    return [(layer.saved_bytes - d) * s for layer, d in zip(graph.layers, dropped, strict=True)]


def stage_costs(
    plan: SplitPlan, microbatches: float, device: str | None = None, flops_per_s: float | None = None,
    bandwidth: float | None = None, latency: float | None = None, backend: str | None = None, *,
    hardware: Hardware | str | None = None, dtype: str | None = None, recompute: str | None = None,
    options: CostOptions | None = None,
) -> Costs:
    """Costs of ``plan``'s stages for one microbatch (see the module docstring for the rules).

    Example:
        >>> stage_costs(plan, 8, hardware="h100", dtype="bfloat16", recompute="full").backward

    Args:
        plan: the split.
        microbatches: microbatches the (traced example, times ``options.batch_scale``) batch is cut into.
        device, flops_per_s, bandwidth, latency, backend, hardware, dtype, recompute: ``CostOptions`` fields,
            given as keywords (they override ``options``).
        options: a ``CostOptions``.

    Communication: bytes / bandwidth + latency: the hardware's intra-node link, or the backend's (gloo on CPU,
    NCCL on GPUs); ``pv.simulate`` re-prices each boundary on the link its two ranks share.
    """
    opts = CostOptions.of(options, device=device, flops_per_s=flops_per_s, bandwidth=bandwidth, latency=latency,
                          backend=backend, hardware=hardware, dtype=dtype, recompute=recompute)
    g = plan.graph
    stages = plan.stages
    fwd_l, bwd_l, source = layer_times(g, microbatches, options=opts)
    pos = {n: i for i, n in enumerate(g.layer_names)}
    fwd = [sum(fwd_l[pos[n]] for n in s.layers) for s in stages]
    bwd = [sum(bwd_l[pos[n]] for n in s.layers) for s in stages]
    overhead = 0.0
    prof = g.profile
    if source == "measured" and prof is not None:
        scale = prof.microbatches * opts.batch_scale / microbatches
        # Ops between layers (embedding sums, masks) are timed as a whole; share them by FLOPs.
        total = sum(s.flops for s in stages) or 1
        fwd = [f + prof.glue_forward * scale * s.flops / total for f, s in zip(fwd, stages, strict=True)]
        bwd = [b + prof.glue_backward * scale * s.flops / total for b, s in zip(bwd, stages, strict=True)]
        # The last stage computes the loss after its forward and starts its backward from the loss.
        fwd[-1] += prof.loss_forward * scale
        bwd[-1] += prof.loss_backward * scale
        overhead = prof.overhead
    elif source == "roofline" and opts.hw is not None:
        overhead = opts.hw.action_overhead
        if opts.hw.roofline == "kernels":  # this machine's kernels: the last stage's loss, replayed like its ops
            lf, lb = loss_kernel_times(g.capture, opts.batch_scale / microbatches, opts.dtype)
            fwd[-1], bwd[-1] = fwd[-1] + lf, bwd[-1] + lb
    bs = opts.byte_scale(g) * opts.batch_scale
    stored = layer_activation_bytes(g, opts)
    dropped = [layer.saved_bytes * opts.byte_scale(g) - kept for layer, kept in zip(g.layers, stored, strict=True)]
    # Under full recomputation a stage's first layer keeps its input, which is the copy the stage received: that
    # copy is not kept a second time.
    received = plan.received_saved_bytes if opts.recompute == "full" else [0] * len(stages)
    acts = tuple(max(0, int((s.activation_bytes - r) * bs - sum(dropped[pos[n]] for n in s.layers) * opts.batch_scale))
                 // microbatches for s, r in zip(stages, received, strict=True))
    rebuilt: tuple[int, ...] = ()
    if opts.recompute != "none":  # a backward rebuilds what recomputation dropped, one layer at a time
        kept_all = layer_activation_bytes(g, replace(opts, recompute="none"))
        # full: the layer's forward runs again and saves all it saves without recomputation (its kept input among
        # it, no second time); selective: the dropped score ops' tensors come back.
        extra = kept_all if opts.recompute == "full" else [max(0.0, k - r) for k, r in zip(kept_all, stored,
                                                                                             strict=True)]
        rebuilt = tuple(round(max(extra[pos[n]] for n in s.layers) * opts.batch_scale / microbatches) for s in stages)
    sends = tuple(s.send_bytes * bs / microbatches for s in stages[:-1])
    bw, lat = opts.link(2)
    comm = tuple(b / bw + lat for b in sends)
    # What a zero-bubble I pass frees, as a share of what the stage keeps (recomputation keeps other tensors: there
    # the even split stays).
    freed = tuple(min(1.0, f / s.activation_bytes) if s.activation_bytes else 1.0
                  for f, s in zip(plan.input_grad_freed_bytes, stages, strict=True)) if opts.recompute == "none" else ()
    return Costs(tuple(fwd), tuple(bwd), comm, tuple(int(a) for a in acts), tuple(s.param_bytes for s in stages),
                 overhead=overhead, source=source, buffer_bytes=tuple(s.buffer_bytes for s in stages), latency=lat,
                 recompute_bytes=rebuilt, send_bytes=sends, input_freed=freed)


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


def tp_collectives(plan: SplitPlan, microbatches: float, dp: int = 1, tp: int = 1,
                   via: tuple[float, float] | None = None, scale: float = 1.0) -> tuple[float, ...]:
    """Per stage, seconds of tensor-parallel all-reduces in one forward of one microbatch (as many again in
    its backward): ``sum over layers of tp_all_reduces(layer) x all_reduce_time(out_bytes / (m x dp), tp)``
    (``scale``: the bytes' dtype and batch relative to the traced ones, ``CostOptions``)."""
    via = via or link()
    layers = {layer.name: layer for layer in plan.graph.layers}
    return tuple(
        sum(tp_all_reduces(layers[n]) * all_reduce_time(layers[n].out_bytes * scale / (microbatches * dp), tp, via)
            for n in s.layers)
        for s in plan.stages
    )


def parallel_costs(costs: Costs, mesh: Mesh | int = 1, tp: int | None = None,
                   collective: Sequence[float] | None = None) -> Costs:
    """``costs`` of one microbatch of a pipeline alone, for one process of that pipeline in ``mesh`` (its ``dp``
    replicas, ``cp`` shares of every sequence and ``tp`` shards per stage): forward and backward / (dp x cp x tp),
    activations likewise (roughly, for tp), hand-offs' bytes / (dp x cp) (``comm - latency``), parameters / tp;
    ``collective`` (``tp_collectives`` plus ``cp_collectives``) replaces ``costs.collective`` when given. A trivial
    mesh returns ``costs`` itself. (``parallel_costs(costs, dp, tp)``, the form before the mesh, still works.)"""
    if not isinstance(mesh, Mesh):
        mesh = Mesh(pp=1, dp=mesh, tp=tp or 1)
    dp, cp, tp = mesh.dp, mesh.cp, mesh.tp
    if dp == cp == tp == 1 and collective is None:
        return costs
    k, rows = dp * cp * tp, dp * cp
    return replace(
        costs,
        forward=tuple(f / k for f in costs.forward),
        backward=tuple(b / k for b in costs.backward),
        comm=tuple((c - costs.latency) / rows + costs.latency for c in costs.comm),
        activation_bytes=tuple(round(a / k) for a in costs.activation_bytes),
        param_bytes=tuple(round(p / tp) for p in costs.param_bytes),
        collective=tuple(collective) if collective is not None else costs.collective,
        recompute_bytes=tuple(round(a / k) for a in costs.recompute_bytes),
        send_bytes=tuple(b / rows for b in costs.send_bytes),
    )


def attention_kv_bytes(plan: SplitPlan) -> list[float]:
    """Per stage, the bytes of keys and values its attention ops read in one forward of the traced batch
    (``scaled_dot_product_attention``'s second and third inputs; twice its output where the trace does not tell
    them apart): what context parallelism gathers from the other shares of the sequence."""
    ops = plan.graph.capture.ops
    out = [0.0] * plan.num_stages
    for op in ops:
        if "scaled_dot_product" not in op.target:
            continue
        kv = sum(ops[i].out_bytes for i in op.inputs[1:3]) if len(op.inputs) >= 3 else 2 * op.out_bytes
        out[plan._stage_of_op(op.index)] += kv
    return out


def cp_collectives(plan: SplitPlan, microbatches: float, mesh: Mesh, via: tuple[float, float],
                   scale: float = 1.0) -> tuple[float, ...]:
    """Per stage, seconds of context parallelism's exchange in one forward of one microbatch: the keys and values
    of every attention op all-gathered across the ``cp`` shares of the sequence (torch's ``context_parallel`` and
    torchtitan default to this all-gather rotation: ``(cp-1)/cp x bytes / bandwidth + (cp-1) x latency``, half a
    ring all-reduce), not overlapped; its backward gathers them again and reduce-scatters their gradients: twice
    as much (``pv.simulate`` adds that to the backward)."""
    return tuple(all_reduce_time(kv * scale / (microbatches * mesh.dp), mesh.cp, via) / 2
                 for kv in attention_kv_bytes(plan))


def peak_activations(order: Sequence[Sequence[str]], activation_bytes: Sequence[int],
                     weight_fraction: float = 0.5, input_freed: Sequence[float] = ()) -> list[int]:
    """Per rank, the most activation bytes alive at once when each rank runs its ``order``: a forward
    adds its stage's per-microbatch bytes, a backward frees them (an input-grad pass the stage's share
    ``input_freed[s]``, else ``weight_fraction`` of them, a weight-grad pass the rest)."""
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
                at_input = input_freed[s] if input_freed else weight_fraction
                live -= size * (at_input if kind == "I" else 1 - at_input)
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
                    optimizer_states: int | None = None, costs: Costs | None = None,
                    order: Sequence[Sequence[str]] | None = None, forward_only: bool = False, *,
                    hardware: Hardware | str | None = None, dtype: str | None = None, recompute: str | None = None,
                    options: CostOptions | None = None, **link_options: Any) -> list[int]:
    """Bytes each rank holds at its peak when ``plan`` trains under ``schedule`` (the module's formula).

    ``forward_only``: an inference run keeps weights and buffers, no gradients or optimizer state, and one
    microbatch's activations of a stage at a time. Under recomputation a backward rebuilds one layer's
    activations for a moment: the largest such layer of the rank's stages adds to its peak.
    ``optimizer_states`` defaults to ``options.optimizer_states`` (Adam's 2); ``link_options`` are the other
    ``stage_costs`` keywords (``device``, ``bandwidth``, ...).

    Example:
        >>> memory_per_rank(plan, "GPipe", 8) == [s.memory_bytes for s in plan.stages]    # one stage per rank
        True
    """
    if costs is None:
        if plan is None:
            raise ValueError("memory_per_rank() needs a plan, or costs=Costs(...).")
        costs = stage_costs(plan, microbatches, hardware=hardware, dtype=dtype, recompute=recompute, options=options,
                            **link_options)
    if optimizer_states is None:
        optimizer_states = options.optimizer_states if options is not None else OPTIMIZER_STATES
    n = len(costs.forward)
    lay = sched.layout(schedule, n, stages_per_rank)
    acts = [list(a) for a in order] if order is not None else sched.orders(schedule, n, microbatches, stages_per_rank)
    buffers = costs.buffer_bytes or (0,) * n
    if forward_only:
        return [max(costs.activation_bytes[s] for s in lay.stages_of(r))
                + sum(costs.param_bytes[s] + buffers[s] for s in lay.stages_of(r)) for r in lay.ranks]
    peaks = peak_activations(acts, costs.activation_bytes, costs.weight_fraction, costs.input_freed)
    rebuilt = costs.recompute_bytes or (0,) * n
    return [
        peaks[r] + max(rebuilt[s] for s in lay.stages_of(r))
        + sum(stage_memory(costs.param_bytes[s], buffers[s], 0, optimizer_states) for s in lay.stages_of(r))
        for r in lay.ranks
    ]


def stage_info_memory(stage: StageInfo, optimizer_states: int = OPTIMIZER_STATES) -> int:
    """``StageInfo.memory_bytes``: the stage on a rank of its own with every microbatch in flight (GPipe, the
    most any schedule keeps), whatever the microbatch count: its whole batch's activations."""
    return stage_memory(stage.param_bytes, stage.buffer_bytes, stage.activation_bytes, optimizer_states)
