"""``simulate()`` a plan as ``pv.launch`` would run it: a ``Timeline`` with step time, bubble and memory per rank.

The run is described once, by the ``pv.LaunchConfig`` ``pv.launch`` takes (schedule, microbatches, stages per rank,
the layout's ``dp`` / ``cp`` / ``tp``, and whether it trains: no ``loss_fn`` is a forward-only run); how it is
costed is a ``pv.CostOptions`` (the machine, the dtype, recomputation) and, for the collectives, a ``Collectives``.

Each rank runs its actions in the order torch's runtime does (``pipeviz.schedule.traits.orders``), each as soon as its
rank is free and its input has arrived (``pipeviz.sim.engine``): a forward needs the previous stage's forward, a
backward (or input-grad) the next stage's backward, a weight-grad its own input-grad. Costs and memory come from
``pipeviz.costs`` (FLOPs by default, measured times on a graph with a ``pv.profile`` attached).

With ``dp`` replicas, ``cp`` shares of every sequence and ``tp`` shards (``pipeviz.schedule.mesh``) the costs are one
process's (``pipeviz.costs.parallel_costs``), the events are replica 0's pipeline (pipeline ranks ``0..pp-1``,
``Timeline.ranks == "pipeline"``), and the gradient average over the replicas and shares is placed the way the
runtime does it (``pipeviz.sim.collectives.Reduction``).

Example:
    >>> cfg = pv.LaunchConfig(schedule="1F1B", microbatches=8, loss_fn=pv.cross_entropy, dp=4)
    >>> tl = pv.simulate(plan, cfg)                      # what pv.launch(plan, config=cfg, ...) would run
    >>> tl = pv.simulate(plan, "1F1B", 8)                # the short form: schedule and microbatches
    >>> pv.simulate(plan, cfg, options=pv.CostOptions(hardware="h100", dtype="bfloat16")).step_time
    >>> pv.compare(plan, microbatches=8).table()         # pipeviz.planner.balance.compare: every schedule on p ranks
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Unpack

from pipeviz._compat import deprecated, positional_legacy
from pipeviz.cost.comm import tp_collectives
from pipeviz.cost.memory import activation_curve, memory_per_rank, peak_activations
from pipeviz.cost.model import Costs, overlapped, parallel_costs, stage_costs
from pipeviz.cost.options import CostChanges, CostOptions
from pipeviz.cost.sharding import tp_shares
from pipeviz.plan.split import SplitPlan
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig, dp_reduce_mode, launch_config
from pipeviz.schedule.mesh import Mesh
from pipeviz.schedule.tensor_parallel import sharded_modules
from pipeviz.schedule.timeline import Event, Timeline
from pipeviz.sim.collectives import DP_REDUCE, Collectives, Reduction, cp_actions, replica_reduction, simulated_cp
from pipeviz.sim.engine import check_order, contended, play, play_on_cores, runtime_actions
from pipeviz.sim.ep_overlap import simulated_pairs
from pipeviz.sim.experts import simulated_ep, with_experts
from pipeviz.sim.tensor_parallel import idle_of, simulated_tp, with_dispatch

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    import torch

__all__ = ["DP_REDUCE", "Collectives", "Comparison", "ComparisonRow", "Costs", "estimate_costs", "simulate"]


def estimate_costs(plan: SplitPlan, microbatches: int, options: CostOptions | None = None,
                   **cost: Unpack[CostChanges]) -> Costs:
    """Per-stage costs of ``plan`` for one microbatch: ``pipeviz.costs.stage_costs`` (kept under this name), the cost
    settings a ``CostOptions`` or its fields as keywords."""
    return stage_costs(plan, microbatches, options=CostOptions.of(options, **cost))


class SimulateOptions(CostChanges, total=False):
    """``pv.simulate``'s keywords beside its own: ``CostOptions``' fields (``CostChanges``: they override
    ``options``'), and the short form's ``LaunchConfig`` fields (they override ``config``'s; their types are
    ``LaunchConfig``'s, ``tests/test_old_calls.py`` checks it): ``pv.simulate(plan, "1F1B", 8, dp=4)``."""

    schedule: str
    stages_per_rank: int | None
    loss_fn: Callable[..., torch.Tensor] | None
    dp: int
    cp: int
    tp: int
    ep: int
    ep_overlap: bool
    ep_delay: float
    dp_shard: bool
    tp_plan: Mapping[str, str] | None
    sequence_parallel: bool
    accumulate: int


@positional_legacy("stages_per_rank", "costs", "order", "num_stages", "optimizer_states", "cores", "forward_only",
                   "dp", "tp", "dp_bandwidth", "tp_bandwidth")
def simulate(
    plan: SplitPlan | None = None,
    config: LaunchConfig | str | None = None,
    microbatches: int | None = None,
    *,
    costs: Costs | None = None,
    options: CostOptions | None = None,
    collectives: Collectives | None = None,
    order: Sequence[Sequence[sched.Action | str]] | None = None,
    num_stages: int | None = None,
    forward_only: bool | None = None,
    cores: int | None = None,
    dp_bandwidth: float | None = None,
    tp_bandwidth: float | None = None,
    cp_bandwidth: float | None = None,
    ep_bandwidth: float | None = None,
    **given: Unpack[SimulateOptions],
) -> Timeline:
    """Simulate one step of ``plan`` as ``pv.launch`` would run it with ``config``.

    Example:
        >>> cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=8, loss_fn=pv.cross_entropy, dp=2)
        >>> pv.simulate(plan, cfg).step_time                     # the run pv.launch(plan, config=cfg) runs
        >>> pv.simulate(plan, "1F1B", 8, dp=4, tp=2, hardware="h100").meta["mesh"]        # (pp, dp, tp)

    Args:
        plan: the ``SplitPlan`` (or ``None`` with ``num_stages`` and ``costs`` for a what-if).
        config: the ``pv.LaunchConfig`` (``schedule``, ``microbatches``, ``stages_per_rank``, ``dp``, ``cp``,
            ``tp``, ``dp_shard``, ``accumulate``: the schedule that many times in a row, the replicas' reduction
            after the last; ``loss_fn``: without one the run is forward only, as ``pv.launch``'s), or a
            schedule name (then a training step: ``pv.simulate(plan, "1F1B", 8)``). Default ``LaunchConfig()``'s
            schedule and microbatches, training. Keywords named as its fields override it.
        microbatches: microbatches per step (overrides the config's).
        costs: per-stage ``Costs``; default ``pipeviz.costs.stage_costs(plan, microbatches, options=...)``.
        options: how to cost it: a ``pv.CostOptions`` (hardware, dtype, recompute, links); its fields as keywords
            (``hardware=``, ``dtype=``, ...) override it. On a ``hardware`` the processes are placed as
            ``pv.launch`` places them (``pipeviz.schedule.mesh``: pipeline rank outermost, shard innermost), node by
            node:
            a hand-off between two pipeline ranks in one node goes over ``intra_node``, else ``inter_node``; each
            group's collectives over the link it spans; each replica's microbatch is costed at its own size.
        collectives: a ``Collectives``: where the replicas' gradient reduction goes (DDP's overlap, Megatron's
            after the flush or its distributed optimizer), the gradients' dtype, overlapped tensor-parallel
            collectives, scattered hand-offs. Default: torch's (DDP, traced dtype, nothing overlapped), and with
            ``dp_shard`` (FSDP2) the distributed optimizer's reduce-scatter and all-gather (its per-layer gathers
            are not modelled).
        order: per-rank action lists (``pv.schedule.Action``s or torch's text, ``"2F0"``): a custom schedule
            instead of the schedule's own (default: ``config.order``, which ``pv.launch`` runs as it is);
            ``num_stages``: the stage count of a what-if without a plan.
        forward_only: an inference run: the schedule's forwards only, memory without gradients or optimizer
            state. Default: ``config.loss_fn is None`` for a ``LaunchConfig``, a training step for a name.
        cores: simulate the run on this many CPU cores ("as run here" on a machine with fewer cores than
            processes): at most ``cores`` actions compute at once. With replicas or shards all processes share
            them: replica 0's pipeline gets ``cores / (dp x cp x tp)`` (a fraction spread as slower cores), and an
            all-reduce holds its core, a tp collective's wait for the other shard does not. Not modelled, measured
            by ``benchmarks/accuracy/simulator_accuracy.py``: time-slicing's own cost, the cores the scheduler leaves
            idle and the work between steps: such runs measured 12-24 % longer than simulated.
        optimizer_states (a ``CostOptions`` field, as a keyword too): tensors of optimizer state per parameter for
            the memory figure (default Adam's 2).
        dp_bandwidth, tp_bandwidth, cp_bandwidth, ep_bandwidth: bytes/s of the replicas', shards', sequence
            shares' and expert-parallel groups' links (default: the pipeline's link, or the hardware's for the span
            of the group; latency from the same).

    The layout (``config.dp``, ``cp``, ``tp``):

    - ``dp`` replicas each take 1/dp of every microbatch: compute, activations and hand-off bytes scale by 1/dp.
      After its last backward each stage's gradients are averaged across the replicas (and the ``cp`` shares,
      which hold the same parameters), a ring all-reduce of its parameter bytes (``pipeviz.costs.all_reduce_time``):
      DDP's 25 MiB buckets overlapping each stage's last backward, or, under the split-backward schedules, one
      all-reduce per rank after its last action (a ``"DP"`` event), as torch's runtime does.
    - ``cp`` shares each take 1/cp of every sequence (context parallelism, as Llama 3 and torchtitan train long
      sequences): compute, activations and hand-off bytes scale by 1/cp; every attention op all-gathers its keys
      and values across the shares in its forward and reduce-scatters their gradients in its backward, on the
      link the group spans, not overlapped, each a ``"CP"`` event inside its action, as the run issues and times
      them (``pipeviz.sim.collectives.cp_exchanges``; on a CPU with what running a share op by op costs).
    - ``ep``: each MoE block's routed experts shared out over ``ep`` replicas (``pipeviz.sim.experts``): per block
      each forward and backward (or ``I``) pays two all-to-alls (``"A2A"`` events inside it, as the run issues
      them) on the group's link, the forward a count exchange (on a CPU its op-by-op run) too, compute the
      busiest owner's (``expert_imbalance``), and a rank holds 1/ep of the experts' weights (the layout
      torchtitan runs; ``pv.launch`` still holds them all, so its measured memory is higher).
    - ``tp`` shards per stage: compute divides by tp, parameters (with gradients and optimizer state) and
      activations by what the launch's layout cuts (``pipeviz.cost.sharding.tp_shares``); each forward and each
      backward (or input-grad pass) pays the collectives that layout issues (``config.tp_plan`` or
      ``default_tp_plan``, with ``config.sequence_parallel``: ``pipeviz.cost.sharding.launch_collectives``:
      all-reduces, or reduce-scatters and all-gathers, of the projections' inputs and outputs, the vocabulary's
      and the parallel loss's) on the critical path, each a ``"TP"`` event (on a CPU: ``pipeviz.sim.tensor_parallel``).

    Returns:
        A simulated ``Timeline`` (``ranks == "pipeline"``, ``mesh`` the run's); ``meta`` holds
        ``peak_activation_bytes`` and ``memory_bytes`` per rank, ``config`` (the ``LaunchConfig`` simulated),
        ``stage_costs`` (the ``Costs`` each action was priced at), ``mesh`` ``(pp, dp, tp)``, ``tp_layout``
        (``Timeline.tp_layout``: the tensor-parallel layout priced,
        ``"launch"`` or ``"megatron"``; None without tensor parallelism), and with replicas ``dp_bytes`` /
        ``dp_seconds`` / ``dp_exposed``: per rank, the gradient bytes it all-reduces, the all-reduce seconds, and
        the part of them the rank waits for (not hidden by its compute: a DDP backward's wait, the tail after its
        last action). The reduction follows the config's
        ``dp_reduce`` (``pv.launch``'s default: ``"overlap"``) unless ``collectives=`` says otherwise.

    Raises:
        MeshError: ``dp``, ``cp`` or ``tp`` not a positive int.
        ScheduleError: an invalid schedule/microbatch combination, an unknown action, or a custom order that
            deadlocks (the message names what each rank waits for).
    """
    cost_keys = CostChanges.__optional_keys__  # CostOptions' fields; the other keywords are LaunchConfig's
    cost_given: dict[str, Any] = {k: v for k, v in given.items() if k in cost_keys}
    named = isinstance(config, str)
    base = config if isinstance(config, LaunchConfig) else None
    launch_given: dict[str, Any] = {k: v for k, v in given.items() if k not in cost_keys}
    if named:
        launch_given["schedule"] = config
    if microbatches is not None:
        launch_given["microbatches"] = microbatches
    cfg = launch_config(base, **launch_given)
    if forward_only is None:  # a LaunchConfig (or a loss_fn given) says whether it trains, as pv.launch reads it
        forward_only = (base is not None or "loss_fn" in given) and cfg.loss_fn is None
    opts = CostOptions.of(options, **cost_given)
    stage_modes: tuple[str, ...] = ()
    if "recompute" not in cost_given and (options is None or options.recompute == "none"):
        # the run's own recomputation (LaunchConfig.recompute): one mode, or one per stage
        stage_modes = _recompute_modes(cfg, plan, num_stages)
        if len(set(stage_modes)) == 1:
            opts, stage_modes = replace(opts, recompute=stage_modes[0]), ()
    coll = collectives or _run_collectives(cfg)
    acts = None if order is None else sched.order_of(order)  # a user's order, text or Actions, read here once
    return _simulate(plan, cfg, forward_only, _Extras(costs, opts, coll, acts, num_stages, cores,
                                                       dp_bandwidth, tp_bandwidth, cp_bandwidth, stage_modes,
                                                       ep_bandwidth))


@functools.lru_cache(maxsize=256)  # (a deep pipeline's order holds 10^5 actions: a few MB each)
def schedule_orders(schedule: str, num_stages: int, microbatches: int,
                    stages_per_rank: int | None = None) -> tuple[tuple[sched.Action, ...], ...]:
    """``pipeviz.schedule.traits.orders``, remembered: torch's own schedule code builds the multi-stage orders, slowly
    (up to a second for a deep pipeline), and the planner, ``pv.compare`` and the Explorer ask for the same ones
    again. A schedule's own order needs no check (``check_order`` is for a custom ``order=``)."""
    return tuple(tuple(a) for a in sched.orders(schedule, num_stages, microbatches, stages_per_rank))


def _run_collectives(cfg: LaunchConfig) -> Collectives:
    """How ``pv.launch`` reduces the config's replicas, in the simulator's terms: ZeRO-1's or FSDP2's reduce-scatter
    (as Megatron-Core's distributed optimizer), the overlapped all-reduce, DDP, or one all-reduce after the step."""
    mode = dp_reduce_mode(cfg)
    return Collectives(dp_reduce="distributed" if mode in ("fsdp2", "zero1") else mode)


def _recompute_modes(cfg: LaunchConfig, plan: SplitPlan | None, num_stages: int | None) -> tuple[str, ...]:
    from pipeviz.schedule.recompute import recompute_modes

    n = plan.num_stages if plan is not None else num_stages
    if isinstance(cfg.recompute, str) or n is None:
        return (cfg.recompute,) if isinstance(cfg.recompute, str) else ()
    return recompute_modes(cfg.recompute, n)


def _mixed_costs(plan: SplitPlan, microbatches: int, opts: CostOptions, modes: Sequence[str]) -> Costs:
    """Stage costs with each stage's own recomputation mode (``LaunchConfig.recompute`` per stage)."""
    per = {m: stage_costs(plan, microbatches, options=replace(opts, recompute=m)) for m in set(modes)}
    base = per[modes[0]]

    def pick(name: str) -> tuple[Any, ...]:
        rows = [getattr(per[m], name) for m in modes]
        if not any(rows):
            return ()
        return tuple((row[i] if row else 0) for i, row in enumerate(rows))

    picked: dict[str, Any] = {f: pick(f) for f in ("forward", "backward", "activation_bytes", "recompute_bytes",
                                                   "recompute_seconds")}
    freed = tuple(per[m].input_freed[i] if per[m].input_freed else per[m].weight_fraction
                  for i, m in enumerate(modes))
    return replace(base, **picked, input_freed=freed)


@dataclass(frozen=True)
class _Extras:
    """What a simulation takes beside the run's description: how to cost it, and what-ifs."""

    costs: Costs | None
    options: CostOptions
    collectives: Collectives
    order: sched.Order | None
    num_stages: int | None
    cores: int | None
    dp_bandwidth: float | None
    tp_bandwidth: float | None
    cp_bandwidth: float | None
    stage_modes: tuple[str, ...] = ()  # per stage recomputation modes, where they differ (else options.recompute)
    ep_bandwidth: float | None = None


def _simulate(plan: SplitPlan | None, cfg: LaunchConfig, forward_only: bool, x: _Extras) -> Timeline:
    opts, coll, cores = x.options, x.collectives, x.cores
    optimizer_states = opts.optimizer_states
    microbatches, spr = cfg.microbatches, cfg.stages_per_rank
    n = plan.num_stages if plan is not None else x.num_stages
    if n is None:
        raise ValueError("simulate() needs a plan, or num_stages with costs.")
    lay = sched.layout(cfg.schedule, n, spr)
    mesh = Mesh(lay.num_ranks, cfg.dp, cfg.tp, cfg.cp, cfg.ep)
    dp, cp, tp = mesh.dp, mesh.cp, mesh.tp
    order = x.order if x.order is not None else cfg.actions()
    acts = ([list(rank_acts) for rank_acts in order] if order is not None
            else [list(rank_acts) for rank_acts in schedule_orders(lay.schedule, n, microbatches, spr)])
    if forward_only:
        acts = [[a for a in rank_acts if a.kind == sched.Kind.F] for rank_acts in acts]
    elif order is not None:
        acts = check_order(acts, lay, microbatches)  # as pv.launch checks it: rank count, rules, no deadlock
    k = 1 if forward_only else cfg.accumulate
    if k > 1:  # accumulation: the schedule k times in a row, batch b's microbatches numbered on from b x m
        acts = [[a._replace(mb=a.mb + b * microbatches) for b in range(k) for a in rank_acts] for rank_acts in acts]
    hw = opts.hw
    costs = x.costs
    per_replica = hw is not None and costs is None  # a roofline: cost one process's microbatch at its own size
    if costs is None:
        if plan is None:
            raise ValueError("simulate() without a plan needs costs=Costs(...).")
        copts = replace(opts, batch_scale=opts.batch_scale / (dp * cp)) if per_replica else opts
        costs = (_mixed_costs(plan, microbatches, copts, x.stage_modes) if x.stage_modes
                 else stage_costs(plan, microbatches, options=copts))
    if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 1):
        raise ValueError(f"cores must be a positive int or None, got {cores!r}.")
    links = _links(mesh, opts, x)
    collective, collective_back, shares, ex, tp_ex = None, None, None, None, None
    if (tp > 1 or cp > 1) and plan is not None:
        scale = opts.byte_scale(plan.graph) * opts.batch_scale
        launch = tp > 1 and coll.tp_layout == "launch"  # else Megatron's: 2 all-reduces per block, a uniform 1/tp
        sharded = sharded_modules(plan, cfg.tp_plan, tp) if launch else {}
        shares = tp_shares(plan, sharded, tp, cfg.sequence_parallel) if launch else None
        if launch:  # the collectives the launch's graph issues, forward and backward apart, each a TP action
            tp_ex = simulated_tp(plan, sharded, microbatches, mesh, links["tp"], scale, opts, cores,
                                 cfg.sequence_parallel)
            tp_s, tp_b = (tp_ex.seconds("F"), tp_ex.seconds("B")) if tp_ex else ((0.0,) * n, (0.0,) * n)
        else:
            tp_s = tp_collectives(plan, microbatches, dp * cp, tp, links["tp"], scale) if tp > 1 else (0.0,) * n
            tp_b = tp_s
        ex = simulated_cp(plan, microbatches, mesh, links["cp"], scale, opts, cores)
        cp_f, cp_b = (ex.seconds("F"), ex.seconds("B")) if ex is not None else ((0.0,) * n, (0.0,) * n)
        collective = tuple(a + b for a, b in zip(tp_s, cp_f, strict=True))
        collective_back = tuple(a + b for a, b in zip(tp_b, cp_b, strict=True)) if launch or cp > 1 else None
    costs = parallel_costs(costs, replace(mesh, dp=1, cp=1, ep=1) if per_replica else mesh, collective=collective,
                           shares=shares, collective_backward=collective_back)
    if ex is not None:  # (op by op: compute of the process's own, contended like the rest; the gathered keys kept)
        costs = replace(costs, forward=tuple(f + o for f, o in zip(costs.forward, ex.op_seconds, strict=True)),
                        activation_bytes=tuple(a + k for a, k in zip(costs.activation_bytes, ex.saved_bytes,
                                                                     strict=True)))
    costs = with_dispatch(costs, tp_ex) if tp_ex is not None else costs  # (contended like the compute)
    if coll.tp_overlap and costs.collective:
        costs = overlapped(costs)
    ep_ex = None if plan is None else simulated_ep(plan, microbatches, mesh, links["ep"],
                                                   opts.byte_scale(plan.graph) * opts.batch_scale, opts, cores,
                                                   float(cfg.ep_delay))
    if ep_ex is not None and plan is not None:  # (after tp's overlap: the experts wait for their rows)
        costs, ep_ex = with_experts(costs, plan, ep_ex, mesh.ep, opts.expert_imbalance)
    acts, pairs = simulated_pairs(cfg, lay, acts, ep_ex, forward_only, k)  # ep_overlap's F/B pairs
    # (full recomputation: the backward's recomputed forward pays the forward's collectives again; Megatron-LM:
    # 4 all-reduces per block in a recomputing backward, 2 in a forward)
    extra_backward = [c * int(opts.recompute == "full") for c in costs.collective] if costs.collective else []
    if any(extra_backward):
        costs = replace(costs, backward=tuple(b + e for b, e in zip(costs.backward, extra_backward, strict=True)))
    if costs.overhead and not costs.runtime and lay.info.multi:
        costs = replace(costs, runtime=runtime_actions(lay, costs.overhead))
    if hw is not None and costs.send_bytes:
        costs = replace(costs, comm=_placed_comm(costs, lay, mesh, opts, tp if coll.scatter_gather else 1))
    share = cores / (dp * cp * tp) if cores is not None else math.inf  # replica 0's pipeline's share of the cores
    holders = dp * cp  # the processes holding the same parameters: their gradients are averaged

    def run(c: Costs) -> tuple[list[Event], Reduction | None]:
        red = None
        if holders > 1 and not forward_only:
            red = replica_reduction(plan, acts, lay, c, holders, links["dp"], coll, opts.dtype)
        if share >= lay.num_ranks:
            return play(acts, lay, c, n, red, pairs), red
        slots = math.ceil(share)
        return play_on_cores(acts, lay, c, n, slots, slots / share, red, pairs, idle_of(tp_ex)), red

    if hw is not None and hw.contention > 1 and per_replica and cores != 1:
        # Replicas and shards compute the same actions at the same moments on the other cores: always contended.
        events, red = contended(run, costs, lay, hw.contention, mirrored=dp * cp * tp > 1)
    else:
        events, red = run(costs)
    if red is not None:
        events += red.after_step(events)
    for exchanges, kind in ((ex, "CP"), (ep_ex, "A2A"), (tp_ex, "TP")):
        events += cp_actions(events, exchanges, kind) if exchanges is not None else []
    peaks = ([max(costs.activation_bytes[s] for s in lay.stages_of(r)) for r in lay.ranks] if forward_only
             else peak_activations(acts, costs.activation_bytes, costs.weight_fraction, costs.input_freed))
    memory = memory_per_rank(None, lay.schedule, microbatches, spr, optimizer_states, costs=costs,
                             order=acts, forward_only=forward_only)
    meta: dict[str, Any] = {"peak_activation_bytes": peaks, "memory_bytes": memory, "costs": costs.source,
                            # saved activations per rank over time (what pv.player_figure shows at each instant)
                            "activation_curve": {} if forward_only else activation_curve(
                                [e for e in events if e.step == 0], costs.activation_bytes, costs.weight_fraction,
                                costs.input_freed),
                            "cores": cores, "forward_only": forward_only, "mesh": (lay.num_ranks, dp, tp),
                            "config": cfg, "stage_costs": costs,  # what each action was priced at (pre-contention)
                            "tp_layout": coll.tp_layout if tp > 1 else None, "tp_wait": tp_ex.wait if tp_ex else 0.0}
    if hw is not None:
        meta["hardware"], meta["dtype"], meta["recompute"] = hw.name, opts.dtype, opts.recompute
    if mesh.world > mesh.pp:
        meta["processes"] = [mesh.label(mesh.rank(r)) for r in lay.ranks]
    if red is not None:
        meta["dp_bytes"], meta["dp_seconds"], meta["dp_exposed"] = red.nbytes, red.seconds, red.exposed
    return Timeline(events, lay.num_ranks, n, microbatches * k, lay.schedule, source="simulated", meta=meta,
                    mesh=mesh, ranks="pipeline")


def _links(mesh: Mesh, opts: CostOptions, x: _Extras) -> dict[str, tuple[float, float]]:
    """``(bandwidth, latency)`` of each group's link: the replicas' (``"dp"``: every process holding the same
    parameters, the cp shares included), the shards' (``"tp"``) and the sequence shares' (``"cp"``). On a hardware,
    the link the group spans; else the pipeline's; a given bandwidth overrides either."""
    bw, lat = opts.link(2)
    hw = opts.hw
    out = {"dp": (bw, lat), "tp": (bw, lat), "cp": (bw, lat), "ep": (bw, lat)}
    if hw is not None:
        out["tp"] = opts.link(mesh.tp, allreduce=True)
        out["cp"] = opts.link(mesh.rank(0, cp=mesh.cp - 1) + 1, allreduce=True)
        out["dp"] = replica_link(mesh, opts)
        out["ep"] = opts.link(mesh.rank(0, dp=mesh.ep - 1, cp=mesh.cp - 1) + 1)  # replicas g·ep … (g+1)·ep − 1
    for name, given in (("dp", x.dp_bandwidth), ("tp", x.tp_bandwidth), ("cp", x.cp_bandwidth),
                        ("ep", x.ep_bandwidth)):
        if given:
            out[name] = (given, out[name][1])
    return out


def replica_link(mesh: Mesh, opts: CostOptions) -> tuple[float, float]:
    """``(bandwidth, latency)`` of the link the processes holding the same parameters (the replicas and the cp
    shares) average their gradients over, on ``opts``' hardware (``pv.simulate``'s ``"dp"`` link; the planner's
    bound prices the same one)."""
    hw = opts.hw
    if hw is None:
        return opts.link(2)
    # The replicas of one shard sit cp x tp ranks apart: a node holds devices_per_node / (cp x tp) of them,
    # each with its own NIC, and NCCL rings over all of those NICs at once (Hardware.link's rails).
    span = mesh.rank(0, dp=mesh.dp - 1, cp=mesh.cp - 1) + 1
    dbw, dlat = hw.link(span, rails=min(mesh.dp * mesh.cp, max(1, hw.devices_per_node // mesh.tp)), allreduce=True)
    return opts.bandwidth or dbw, dlat if opts.latency is None else opts.latency


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


@dataclass(frozen=True)
class ComparisonRow:
    """One schedule of a ``pv.compare``: what it simulated and the run it would launch.

    ``row.step_time``; ``row["step_time"]``, the dict form rows had before, still works (deprecated)."""

    schedule: str
    ranks: int
    stages: int
    step_time: float
    bubble: float
    memory_bytes: list[int]
    peak_activation_bytes: list[int]
    plan: SplitPlan
    config: LaunchConfig  # the LaunchConfig simulated: pv.launch(row.plan, config=row.config, ...) runs it

    def __getitem__(self, key: str) -> str | int | float | list[int] | SplitPlan | LaunchConfig:
        deprecated(f"Comparison rows are ComparisonRow objects: row.{key}, not row[{key!r}] (deprecated since "
                   "pipeviz 0.3).")
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: object = None) -> object:
        return getattr(self, key, default)


@dataclass
class Comparison:
    """What-if table over schedules (``pv.compare``): ``rows`` (``ComparisonRow``, one per schedule that runs),
    ``timelines`` by schedule, ``skipped`` with reasons."""

    rows: list[ComparisonRow]
    timelines: dict[str, Timeline]
    skipped: dict[str, str] = field(default_factory=dict)
    skipped_why: dict[str, str] = field(default_factory=dict)  # the reason alone, without the fix

    def row(self, schedule: str) -> ComparisonRow | None:
        """The row of ``schedule`` (any case), or None when it was skipped."""
        name = sched.canonical(schedule)
        return next((r for r in self.rows if r.schedule == name), None)

    def table(self) -> str:
        """One line per schedule: ranks, stages, step, bubble, peak memory per rank; then the skipped ones."""
        head = f"{'schedule':<22}{'ranks':>6}{'stages':>7}{'step':>12}{'bubble':>9}  peak memory per rank"
        lines = [head]
        for r in self.rows:
            mem = ", ".join(f"{b / 2**20:.1f}" for b in r.memory_bytes)
            lines.append(f"{r.schedule:<22}{r.ranks:>6}{r.stages:>7}{r.step_time * 1e3:>10.3f}ms"
                         f"{r.bubble:>8.0%}  [{mem}] MiB")
        lines += [f"{k:<22}skipped: {self.skipped_why.get(k, v)}" for k, v in self.skipped.items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
