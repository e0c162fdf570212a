"""``simulate()`` a plan under a schedule: a ``Timeline`` with step time, bubble and memory per rank.

Each rank runs its actions in the order torch's runtime does (``pipeviz.schedules.orders``), each as soon
as its rank is free and its input has arrived: a forward needs the previous stage's forward, a backward
(or input-grad) the next stage's backward, a weight-grad its own input-grad. Costs and memory come from
``pipeviz.costs`` (FLOPs by default, measured times on a graph with a ``pv.profile`` attached).

With ``dp`` replicas and ``tp`` shards (``pv.launch(..., dp=N)``'s layout, ``pipeviz.mesh``) the costs are one
rank's (``pipeviz.costs.parallel_costs``), the events are replica 0's pipeline (ranks ``0..pp-1``), and the
replicas' gradient average is placed the way the runtime does it (``_Reduction``).

Example:
    >>> tl = pv.simulate(plan, schedule="1F1B", microbatches=8)
    >>> pv.simulate(plan, "1F1B", 8, dp=4, tp=2).meta["mesh"]           # (pp, dp, tp)
    >>> tl.step_time, tl.bubble_fraction, tl.peak_activation_bytes
    >>> pv.compare(plan, microbatches=8).table()        # pipeviz.balance.compare: every schedule on p ranks
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipeviz import schedules as sched
from pipeviz.costs import (
    DDP_BUCKET_BYTES,
    CostOptions,
    Costs,
    all_reduce_time,
    ddp_buckets,
    memory_per_rank,
    parallel_costs,
    peak_activations,
    stage_costs,
    tp_collectives,
)
from pipeviz.hardware import DTYPE_BYTES, Hardware, dtype_name
from pipeviz.mesh import Mesh
from pipeviz.plan import SplitPlan
from pipeviz.timeline import COMPUTE, Event, Timeline

__all__ = ["DP_REDUCE", "Collectives", "Comparison", "Costs", "estimate_costs", "simulate"]

DP_REDUCE = ("ddp", "after_flush", "distributed")
MEGATRON_BUCKET_PARAMS = 40_000_000  # Megatron-Core's DDP bucket: max(40M, 1M x dp) parameters


@dataclass(frozen=True)
class Collectives:
    """How a run does its collectives, where frameworks differ (``pv.simulate(..., collectives=...)``).

    Example:
        >>> megatron_2021 = Collectives(dp_reduce="after_flush", grad_dtype="float16", scatter_gather=True)
        >>> pv.simulate(plan, "1F1B", 64, dp=8, tp=8, hardware="a100", collectives=megatron_2021)

    Attributes:
        dp_reduce: where the replicas' gradient average goes.

            - ``"ddp"`` (default): torch DDP's 25 MiB buckets overlapping each stage's last backward (the
              split-backward schedules: one all-reduce per rank after its last action, as torch's runtime does).
            - ``"after_flush"``: every rank's gradients in one all-reduce after its last action, not overlapped
              (Megatron-LM's ``--DDP-impl local`` of 2021: ``allreduce_gradients()`` after the pipeline flush).
            - ``"distributed"``: Megatron-Core's distributed optimizer with ``--overlap-grad-reduce
              --overlap-param-gather``: gradients reduce-scattered (half an all-reduce's bytes) in buckets of
              ``max(40M, 1M x dp)`` parameters from each stage's last backward on, as DDP's but on their own
              stream (the backward does not wait for them; the optimizer step does): what outlasts the rank's
              compute is charged as a ``"DP"`` event after its last action. The updated parameters are
              all-gathered (in ``dtype``) stage by stage from the step's start, in the order of the stages'
              first forwards, and a stage's first forward ends no earlier than its gather: with several stages
              per rank (interleaved) each stage's reduction starts at its own last backward and each stage's
              gather hides behind the earlier stages' forwards, as Megatron-Core r0.8.0 does per model chunk.
        grad_dtype: the dtype gradients are reduced in (``"float16"``: Megatron 2021's fp16 runs; ``"float32"``:
            Megatron's bf16 runs, ``--accumulate-allreduce-grads-in-fp32``). Default: the traced parameters'.
        tp_overlap: tensor-parallel collectives overlap the matmuls they feed (Megatron-Core ``--tp-comm-overlap``,
            torchtitan's async TP): a stage pays only what its collectives outlast its compute by.
        scatter_gather: pipeline hand-offs under tensor parallelism send 1/tp of the activation per shard, each
            over its own NIC, gathered over NVLink on arrival (Narayanan et al. 2021, sec. 4.1, the
            "scatter/gather optimization"; sequence parallelism's sharded activations hand on the same 1/tp).

    Raises:
        ValueError: an unknown ``dp_reduce`` or ``grad_dtype`` (the message lists the valid ones).
    """

    dp_reduce: str = "ddp"
    grad_dtype: str | None = None
    tp_overlap: bool = False
    scatter_gather: bool = False

    def __post_init__(self) -> None:
        if self.dp_reduce not in DP_REDUCE:
            raise ValueError(f"Unknown dp_reduce={self.dp_reduce!r}; valid: {', '.join(DP_REDUCE)}. Fix: "
                             "dp_reduce='ddp' (torch DDP), 'after_flush' (Megatron-LM local DDP) or 'distributed' "
                             "(Megatron-Core's distributed optimizer).")
        if self.grad_dtype is not None:
            object.__setattr__(self, "grad_dtype", dtype_name(self.grad_dtype, "grad_dtype"))


def estimate_costs(plan: SplitPlan, microbatches: int, **options: Any) -> Costs:
    """Per-stage costs of ``plan`` for one microbatch: ``pipeviz.costs.stage_costs`` (kept under this name)."""
    return stage_costs(plan, microbatches, **options)


def _degree(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        what = "data-parallel replicas" if name == "dp" else "tensor-parallel shards per stage"
        raise ValueError(f"{name} must be a positive int (the number of {what}), got {value!r}. "
                         f"Fix: {name}=1 for none, or a whole number such as {name}=2.")


def simulate(
    plan: SplitPlan | None = None,
    schedule: str = "1F1B",
    microbatches: int = 4,
    stages_per_rank: int | None = None,
    costs: Costs | None = None,
    order: Sequence[Sequence[str]] | None = None,
    num_stages: int | None = None,
    optimizer_states: int | None = None,
    cores: int | None = None,
    forward_only: bool = False,
    dp: int = 1,
    tp: int = 1,
    dp_bandwidth: float | None = None,
    tp_bandwidth: float | None = None,
    *,
    hardware: Hardware | str | None = None,
    dtype: str | None = None,
    recompute: str | None = None,
    options: CostOptions | None = None,
    device: str | None = None,
    flops_per_s: float | None = None,
    bandwidth: float | None = None,
    latency: float | None = None,
    backend: str | None = None,
    collectives: Collectives | None = None,
) -> Timeline:
    """Simulate one training step of ``plan`` under ``schedule``.

    Args:
        plan: the ``SplitPlan`` (or ``None`` with ``num_stages`` and ``costs`` for a what-if).
        schedule: any of torch's schedules; ``order`` overrides its action order (a custom schedule).
        microbatches: microbatches per step.
        stages_per_rank: multi-stage schedules (default 2).
        costs: per-stage ``Costs``; default ``pipeviz.costs.stage_costs(plan, microbatches, options=...)``.
        optimizer_states: tensors of optimizer state per parameter for the memory figure (default
            ``options.optimizer_states``, Adam's 2).
        cores: simulate the run on this many CPU cores ("as run here" on a machine with fewer cores than
            ranks): at most ``cores`` actions compute at once, a rank ready to compute waits for a free core.
            Default: a core (or a GPU) per rank. With replicas or shards, all ``pp x dp x tp`` processes share
            them: replica 0's pipeline gets ``cores / (dp x tp)`` (a fraction spread as slower cores), and an
            all-reduce holds its core. Not modelled, measured by ``benchmarks/simulator_accuracy.py``: time-
            slicing's own cost (4 processes on 2 cores are preempted 52-94 times a step each and use 7-24 % more
            CPU than their compute), the cores the scheduler leaves idle (8-18 % of the step there) and the
            work between steps (optimizer, gradient scaling), which delays the other processes on a shared
            core: such runs measured 12-24 % longer than simulated.
        forward_only: an inference run (``pv.launch`` without a ``loss_fn``): the schedule's forwards only,
            and memory without gradients or optimizer state.
        dp: data-parallel replicas of the pipeline, each on 1/dp of every microbatch: compute, activations
            and hand-off bytes scale by 1/dp. After its last backward each stage's gradients are averaged
            across replicas, a ring all-reduce of its parameter bytes
            (``pipeviz.costs.all_reduce_time``: ``2(dp-1)/dp x bytes / bandwidth + 2(dp-1) x latency``):

            - DDP (every schedule but the split-backward ones): DDP's 25 MiB buckets are reduced one after
              another on the rank's link; all but the last (the stage's first layers) start when the stage's
              last backward starts, overlapping it, the last once that backward's compute ends. DDP's reducer
              waits for them inside that backward, so the event ends at ``max(compute end, reduction end)``,
              and the stage's last input grad leaves only then (as measured on a real run).
            - InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: one all-reduce of all the rank's gradients
              after its last action, not overlapped: a ``"DP"`` event (stage -1, mb -1), as the runtime does.
        tp: tensor-parallel shards per stage: compute, parameters (with gradients and optimizer state) and,
            roughly, activations divide by tp; each forward and each backward (or input-grad pass) pays the
            layers' all-reduces (``pipeviz.costs.tp_all_reduces``: 2 per block, 1 per single Linear or
            Embedding, 0 for norms) of the layer's output, ``2(tp-1)/tp x bytes / bandwidth + 2(tp-1) x
            latency`` each, on the critical path. Needs a plan for the collectives (none in a what-if).
        dp_bandwidth, tp_bandwidth: bytes/s of the data- and tensor-parallel links (default: the pipeline's
            link, ``bandwidth`` / ``backend`` / ``device`` cost options; latency from the same link).
        hardware, dtype, recompute, device, flops_per_s, bandwidth, latency, backend: ``pipeviz.costs.CostOptions``
            fields as keywords (they override ``options``). On a ``hardware`` the ranks are placed as
            ``pv.launch`` places them (``pipeviz.mesh``: pipeline rank outermost, shard innermost), node by node:
            a hand-off between two pipeline ranks in one node goes over ``intra_node``, else ``inter_node``; the
            shards' all-reduces over the link their group spans, likewise the replicas'; each replica's
            microbatch is costed at its own size (a roofline does not divide by dp).
        options: a ``pipeviz.costs.CostOptions`` (hardware, dtype, recompute, links, batch scale).
        collectives: a ``Collectives``: where the replicas' gradient reduction goes (DDP's overlap, Megatron's
            after the flush or its distributed optimizer), the gradients' dtype, overlapped tensor-parallel
            collectives, scattered hand-offs. Default: torch's (DDP, traced dtype, nothing overlapped). On a
            ``hardware``, a group spanning nodes uses one NIC per member in each node
            (``Hardware.link(span, rails)``).

    Returns:
        A simulated ``Timeline``; ``meta`` holds ``peak_activation_bytes`` and ``memory_bytes`` per rank,
        ``mesh`` ``(pp, dp, tp)``, and with replicas ``dp_bytes`` / ``dp_seconds``: per rank, the gradient bytes
        it all-reduces and the all-reduce seconds.

    Raises:
        ValueError: ``dp`` or ``tp`` not a positive int.
        ScheduleError: an invalid schedule/microbatch combination, or a custom order that deadlocks
            (the message names what each rank waits for).
    """
    for name, value in (("dp", dp), ("tp", tp)):
        _degree(name, value)
    opts = CostOptions.of(options, hardware=hardware, dtype=dtype, recompute=recompute, device=device,
                          flops_per_s=flops_per_s, bandwidth=bandwidth, latency=latency, backend=backend)
    if optimizer_states is None:
        optimizer_states = opts.optimizer_states
    n = plan.num_stages if plan is not None else num_stages
    if n is None:
        raise ValueError("simulate() needs a plan, or num_stages with costs.")
    lay = sched.layout(schedule, n, stages_per_rank)
    acts = [list(a) for a in order] if order is not None else sched.orders(schedule, n, microbatches, stages_per_rank)
    if forward_only:
        acts = [[a for a in rank_acts if sched.parse(a)[1] == "F"] for rank_acts in acts]
    else:
        sched.validate(acts, n, microbatches, lay.stage_ranks)
    hw = opts.hw
    per_replica = hw is not None and costs is None  # a roofline: cost one replica's microbatch at its own size
    if costs is None:
        if plan is None:
            raise ValueError("simulate() without a plan needs costs=Costs(...).")
        copts = replace(opts, batch_scale=opts.batch_scale / dp) if per_replica else opts
        costs = stage_costs(plan, microbatches, options=copts)
    if cores is not None and (not isinstance(cores, int) or cores < 1):
        raise ValueError(f"cores must be a positive int or None, got {cores!r}.")
    coll = collectives or Collectives()
    mesh = Mesh(lay.num_ranks, dp, tp)
    bw, lat = opts.link(2)
    tp_via = opts.link(tp, allreduce=True) if hw is not None else (tp_bandwidth or bw, lat)
    dp_via = (dp_bandwidth or bw, lat)
    if hw is not None:
        # The replicas of one shard sit tp ranks apart: a node holds devices_per_node / tp of them, each with its
        # own NIC, and NCCL rings over all of those NICs at once (Hardware.link's rails).
        dbw, dlat = hw.link(mesh.replicas(0)[-1] + 1, rails=min(dp, max(1, hw.devices_per_node // tp)),
                            allreduce=True)
        dp_via = (opts.bandwidth or dbw, dlat if opts.latency is None else opts.latency)
    if tp_bandwidth and hw is not None:
        tp_via = (tp_bandwidth, tp_via[1])
    if dp_bandwidth and hw is not None:
        dp_via = (dp_bandwidth, dp_via[1])
    collective = None
    if tp > 1 and plan is not None:
        scale = opts.byte_scale(plan.graph) * opts.batch_scale
        collective = tp_collectives(plan, microbatches, dp, tp, tp_via, scale)
    costs = parallel_costs(costs, 1 if per_replica else dp, tp, collective)
    if coll.tp_overlap and costs.collective:
        # Overlapped with the matmuls they feed: only what outlasts the stage's forward compute stays exposed.
        costs = replace(costs, collective=tuple(max(0.0, c - f) for c, f in zip(costs.collective, costs.forward,
                                                                                     strict=True)))
    if opts.recompute == "full" and costs.collective:
        # The backward's recomputed forward pays the forward's all-reduces again (Megatron-LM: 4 all-reduces per
        # block in a recomputing backward, 2 in a forward).
        costs = replace(costs, backward=tuple(b + c for b, c in zip(costs.backward, costs.collective, strict=True)))
    if costs.overhead and not costs.runtime and lay.info.multi:
        costs = replace(costs, runtime=runtime_actions(lay, costs.overhead))
    if hw is not None and costs.send_bytes:
        costs = replace(costs, comm=_placed_comm(costs, lay, mesh, opts, tp if coll.scatter_gather else 1))
    share = cores / (dp * tp) if cores is not None else math.inf  # replica 0's pipeline's share of the cores

    def run(c: Costs) -> tuple[list[Event], _Reduction | None]:
        red = None
        if dp > 1 and not forward_only:
            traced = _traced_element_bytes(plan)
            grad = DTYPE_BYTES[coll.grad_dtype] / traced if coll.grad_dtype else 1.0
            param = DTYPE_BYTES[opts.dtype] / traced if opts.dtype else 1.0
            red = _Reduction(acts, lay, c, dp, dp_via, coll.dp_reduce, grad, param,
                             (coll.grad_dtype and DTYPE_BYTES[coll.grad_dtype]) or traced)
        if share >= lay.num_ranks:
            return _run(acts, lay, c, n, red), red
        slots = math.ceil(share)
        return _run_on_cores(acts, lay, c, n, slots, slots / share, red), red

    if hw is not None and hw.contention > 1 and per_replica and cores != 1:
        # Replicas and shards compute the same actions at the same moments on the other cores: always contended.
        events, red = _contended(run, costs, lay, hw.contention, mirrored=dp * tp > 1)
    else:
        events, red = run(costs)
    if red is not None:
        events += red.after_step(events)
    peaks = ([max(costs.activation_bytes[s] for s in lay.stages_of(r)) for r in lay.ranks] if forward_only
             else peak_activations(acts, costs.activation_bytes, costs.weight_fraction, costs.input_freed))
    memory = memory_per_rank(None, lay.schedule, microbatches, stages_per_rank, optimizer_states, costs=costs,
                             order=acts, forward_only=forward_only)
    meta: dict[str, Any] = {"peak_activation_bytes": peaks, "memory_bytes": memory, "costs": costs.source,
                            "cores": cores, "forward_only": forward_only, "mesh": (lay.num_ranks, dp, tp)}
    if hw is not None:
        meta["hardware"], meta["dtype"], meta["recompute"] = hw.name, opts.dtype, opts.recompute
    if dp > 1 or tp > 1:
        meta["processes"] = [mesh.label(mesh.rank(r)) for r in lay.ranks]
    if red is not None:
        meta["dp_bytes"], meta["dp_seconds"] = red.nbytes, red.seconds
    return Timeline(events, lay.num_ranks, n, microbatches, lay.schedule, source="simulated", meta=meta, mesh=mesh,
                    ranks="pipeline")


def _placed_comm(costs: Costs, lay: sched.Layout, mesh: Mesh, opts: CostOptions,
                 scatter: int = 1) -> tuple[float, ...]:
    """Each boundary's hand-off on the link between the two ranks' devices: intra-node when both sit in one node
    (``devices_per_node`` consecutive process ranks), else inter-node. ``scatter`` > 1 (the scatter/gather
    optimization over tp shards): between nodes each shard sends 1/scatter of it on its own NIC, and the
    receiving node all-gathers the pieces over its intra-node link."""
    hw = opts.hw
    assert hw is not None
    out = []
    for s, nbytes in enumerate(costs.send_bytes):
        a, b = mesh.rank(lay.stage_ranks[s]), mesh.rank(lay.stage_ranks[s + 1])
        same_node = a // hw.devices_per_node == b // hw.devices_per_node
        bw, lat = opts.link(1 if same_node else hw.devices_per_node + 1)
        if scatter > 1 and not same_node:
            ibw, ilat = opts.link(1)
            out.append(nbytes / scatter / bw + lat + (scatter - 1) / scatter * nbytes / ibw + ilat)
        else:
            out.append(nbytes / bw + lat)
    return tuple(out)


def _traced_element_bytes(plan: SplitPlan | None) -> float:
    """Bytes of one parameter element as traced (the parameters' average; 4 without a plan)."""
    if plan is None:
        return 4.0
    cap = plan.graph.capture
    numel = sum(cap.param_numel.values())
    return (sum(cap.param_bytes.values()) / numel if numel else 4.0) or 4.0


class _Reduction:
    """Where the replicas' gradient reduction goes (``Collectives.dp_reduce``): buckets overlapping each stage's
    last backward (``"ddp"``: all-reduces; ``"distributed"``: reduce-scatters, and each stage's parameters
    all-gathered before its first forward ends), or one ``DP`` event per rank after its last action
    (``"after_flush"``, and ``"ddp"`` under the split-backward schedules, as torch's runtime does)."""

    def __init__(self, acts: list[list[str]], lay: sched.Layout, costs: Costs, dp: int, via: tuple[float, float],
                 mode: str = "ddp", grad_scale: float = 1.0, param_scale: float = 1.0,
                 grad_element: float = 4.0) -> None:
        self.dp, self.via, self.costs = dp, via, costs
        self.mode = "after_flush" if mode == "ddp" and lay.info.split_backward else mode
        self.grads = [p * grad_scale for p in costs.param_bytes]  # per stage, the bytes reduced
        self.nbytes = [sum(self.grads[s] for s in lay.stages_of(r)) for r in lay.ranks]
        self.bucket = (DDP_BUCKET_BYTES if mode == "ddp"
                       else int(max(MEGATRON_BUCKET_PARAMS, 1_000_000 * dp) * grad_element))
        self.seconds = [0.0] * lay.num_ranks
        last_of: dict[tuple[int, int], int] = {}  # (rank, stage) -> index of the stage's last backward action
        for rank, rank_acts in enumerate(acts if self.mode != "after_flush" else []):
            for i, action in enumerate(rank_acts):
                s, kind, _ = sched.parse(action)
                if kind != "F":
                    last_of[(rank, s)] = i
        self.last = {(rank, i): s for (rank, s), i in last_of.items()}  # (rank, action index) -> stage
        self.link_free = [0.0] * lay.num_ranks  # a rank's reductions run one after another on its link
        # The distributed optimizer's parameter all-gather, stage by stage (Megatron-Core r0.8.0 dispatches each
        # model chunk's all-gather ahead of that chunk's first forward: param_sync_func per chunk in the
        # interleaved schedule, bucket by bucket in forward pre-hooks): the rank's stages are gathered one after
        # another from the step's start, in the order of their first forwards, and a stage's first forward ends
        # no earlier than its parameters have arrived. With one stage per rank this is the whole gather against
        # the first forward; interleaved, the later stages' gathers hide behind the earlier stages' forwards.
        self.gathered: dict[tuple[int, int], float] = {}  # (rank, index of a stage's first forward) -> arrival
        for rank, rank_acts in enumerate(acts if self.mode == "distributed" else []):
            t, seen = 0.0, set()
            for i, action in enumerate(rank_acts):
                s, kind, _ = sched.parse(action)
                if kind == "F" and s not in seen:
                    seen.add(s)
                    t += all_reduce_time(costs.param_bytes[s] * param_scale, dp, via) / 2
                    self.gathered[(rank, i)] = t
            self.seconds[rank] += t
            self.link_free[rank] = t  # the same link: the step's reductions queue behind its gathers

    def _time(self, nbytes: float) -> float:
        """One bucket: an all-reduce, or (distributed optimizer) a reduce-scatter, half its steps and bytes."""
        t = all_reduce_time(nbytes, self.dp, self.via)
        return t / 2 if self.mode == "distributed" else t

    def finish(self, rank: int, index: int, start: float, end: float) -> float:
        """When action ``index`` of ``rank``, computing from ``start`` to ``end``, returns (DDP, and Megatron's
        overlapped reduce-scatter, wait for the buckets' reductions in the stage's last backward)."""
        arrived = self.gathered.get((rank, index))
        if arrived is not None:  # a stage's first forward waits for the last of its parameters
            return max(end, arrived)
        s = self.last.get((rank, index))
        if s is None:
            return end
        buckets = ddp_buckets(round(self.grads[s]), self.bucket)
        if not buckets:
            return end
        t = max(self.link_free[rank], start)
        for b in buckets[:-1]:  # ready while the backward runs: overlapped from its start
            t += self._time(b)
        t = max(t, end) + self._time(buckets[-1])  # the first layers: ready at the end
        self.seconds[rank] += sum(self._time(b) for b in buckets)
        self.link_free[rank] = t
        # torch DDP's reducer waits for its buckets inside the backward; Megatron-Core's overlapped
        # reduce-scatter runs on its own stream and is waited for once, before the optimizer step (after_step).
        return end if self.mode == "distributed" else t

    def after_step(self, events: list[Event]) -> list[Event]:
        """``DP`` events after each rank's last action: the whole all-reduce (``"after_flush"``), or the
        distributed optimizer's reduce-scatters still running."""
        out = []
        for rank, nbytes in enumerate(self.nbytes):
            mine = [e for e in events if e.rank == rank]
            if not mine:
                continue
            if self.mode == "after_flush":
                t = all_reduce_time(nbytes, self.dp, self.via)
                self.seconds[rank] = t
            elif self.mode == "distributed":
                # The reduce-scatters still running after the rank's last action (the all-gathers are in the
                # stages' first forwards, ``finish``).
                t = max(0.0, self.link_free[rank] - max(e.end for e in mine))
            else:
                continue
            if t > 0:
                end = max(e.end for e in mine)
                out.append(Event(rank, -1, "DP", -1, end, end + t))
        return out


def _contended(run: Callable[[Costs], tuple[list[Event], Any]], costs: Costs, lay: sched.Layout, factor: float,
               mirrored: bool) -> tuple[list[Event], Any]:
    """``run(costs)`` with each rank's ops stretched by ``1 + (factor - 1) x`` the share of their time another rank
    computes (``Hardware.contention``: ranks on the cores of one processor share its cache and memory
    bandwidth). The share comes from the run itself, so it is run again with the stretched ops (twice: the share
    settles within a percent); ``mirrored``: other processes always compute alongside (replicas), a share of 1."""
    events, red = run(costs)
    for _ in range(1 if mirrored else 2):
        shares = [1.0] * lay.num_ranks if mirrored else _overlap(events, lay.num_ranks)
        scale = [1 + (factor - 1) * shares[r] for r in lay.stage_ranks]
        stretched = replace(costs, forward=tuple(f * k for f, k in zip(costs.forward, scale, strict=True)),
                            backward=tuple(b * k for b, k in zip(costs.backward, scale, strict=True)))
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


def _run(acts: list[list[str]], lay: sched.Layout, costs: Costs, n: int, red: _Reduction | None = None) -> list[Event]:
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(acts)
    pos = [0] * len(acts)
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
                if red is not None:
                    end = red.finish(rank, pos[rank], start, end)
                done[(s, kind, mb)] = end
                free[rank] = end
                pos[rank] += 1
                events.append(Event(rank, s, kind, mb, start, end))
                progressed = True
        if not progressed:
            waits = [f"rank {r} waits at {a[pos[r]]}" for r, a in enumerate(acts) if pos[r] < len(a)]
            raise sched.ScheduleError(
                "The schedule deadlocks: no rank can run its next action. " + "; ".join(waits) + ". Fix: order each "
                "rank's actions so every forward comes after the previous stage's and every backward after the "
                "next stage's."
            )
    return events


def _run_on_cores(acts: list[list[str]], lay: sched.Layout, costs: Costs, n: int, cores: int, slow: float = 1.0,
                  red: _Reduction | None = None) -> list[Event]:
    """Like ``_run``, with at most ``cores`` actions running at once: the next action to start is always the
    one that can start earliest (list scheduling), on the core that frees first; every action takes ``slow``
    times as long (cores shared with other replicas' processes). A data-parallel all-reduce in a rank's last
    backward holds that rank's core: on CPU, gloo's copies and sums are the cores' own work."""
    import heapq

    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(acts)
    pos = [0] * len(acts)
    core_free = [0.0] * cores
    events: list[Event] = []
    total = sum(len(a) for a in acts)
    while len(events) < total:
        best: tuple[float, int] | None = None
        for rank, rank_acts in enumerate(acts):
            if pos[rank] >= len(rank_acts):
                continue
            s, kind, mb = sched.parse(rank_acts[pos[rank]])
            ready = _ready(s, kind, mb, done, costs, lay, n)
            if ready is not None and (best is None or max(free[rank], ready) < best[0]):
                best = (max(free[rank], ready), rank)
        if best is None:
            raise sched.ScheduleError("The schedule deadlocks: no rank can run its next action.")
        earliest, rank = best
        core_at = heapq.heappop(core_free)
        s, kind, mb = sched.parse(acts[rank][pos[rank]])
        start = max(earliest, core_at)
        end = start + costs.duration(s, kind) * slow
        if red is not None:
            end = red.finish(rank, pos[rank], start, end)
        # Gloo's all-reduce on CPU is the cores' own work (copies through the loopback, the sums): it holds the core.
        heapq.heappush(core_free, end)
        done[(s, kind, mb)] = end
        free[rank] = end
        pos[rank] += 1
        events.append(Event(rank, s, kind, mb, start, end))
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


@dataclass
class Comparison:
    """What-if table over schedules (``pv.compare``): ``rows`` of dicts (schedule, ranks, stages, step_time, bubble,
    memory_bytes, peak_activation_bytes, plan), ``timelines`` by schedule, ``skipped`` with reasons."""

    rows: list[dict[str, Any]]
    timelines: dict[str, Timeline]
    skipped: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """One line per schedule: ranks, stages, step, bubble, peak memory per rank; then the skipped ones."""
        head = f"{'schedule':<22}{'ranks':>6}{'stages':>7}{'step':>12}{'bubble':>9}  peak memory per rank"
        lines = [head]
        for r in self.rows:
            mem = ", ".join(f"{b / 2**20:.1f}" for b in r["memory_bytes"])
            stages = r.get("stages", r["ranks"])
            lines.append(f"{r['schedule']:<22}{r['ranks']:>6}{stages:>7}{r['step_time'] * 1e3:>10.3f}ms"
                         f"{r['bubble']:>8.0%}  [{mem}] MiB")
        lines += [f"{k:<22}skipped: {v.split('. Fix:')[0]}" for k, v in self.skipped.items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
