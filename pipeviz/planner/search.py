"""``plan_cluster()``: the whole training layout for a GPU count, a global batch and a memory budget, ranked.

A layout is pipeline x data x context x tensor parallel degrees (``pp x dp x cp x tp = gpus``, tensor parallelism
within a node), a schedule with its stages per rank, a microbatch size (hence the microbatch count) and a recomputation
mode. Every option is priced by the one cost model (``pipeviz.costs`` on a ``pv.Hardware``) and simulated by
``pv.simulate``; only options that fit the memory are kept.

Example:
    >>> cp = pv.plan_cluster(graph, gpus=64, hardware="h100", global_batch=512)
    >>> print(cp.table())
    >>> best = cp.rows[0]; best.pp, best.dp, best.tp, best.schedule, best.microbatches
    >>> pv.simulate(best.plan, best.config, options=best.options, collectives=best.collectives)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipeviz._compat import positional_legacy
from pipeviz.capture.view import GraphView
from pipeviz.cost.comm import cp_collectives, tp_collectives
from pipeviz.cost.machine import Hardware
from pipeviz.cost.machine import hardware as find_hardware
from pipeviz.cost.memory import memory_per_rank, static_memory
from pipeviz.cost.model import Costs, parallel_costs, stage_costs
from pipeviz.cost.options import RECOMPUTE, CostOptions
from pipeviz.cost.roofline import op_table
from pipeviz.plan.errors import PlanError
from pipeviz.plan.split import SplitPlan
from pipeviz.planner.balance import balance
from pipeviz.planner.cluster import ClusterPlan, LayoutOption
from pipeviz.schedule import traits as sched
from pipeviz.schedule.mesh import Mesh, check_degree
from pipeviz.sim.simulate import Collectives, simulate

__all__ = ["ClusterPlan", "LayoutOption", "plan_cluster"]  # the first two: pipeviz.planner.cluster


@positional_legacy("global_batch", "seq_len", "memory_limit", "schedules", "recompute", "dtype")
def plan_cluster(
    graph: GraphView, gpus: int, hardware: Hardware | str, *, global_batch: int, seq_len: int | None = None,
    memory_limit: float | None = None, schedules: Sequence[str] | None = None,
    recompute: Sequence[str] | str | None = None, dtype: str | None = "bfloat16",
    tp: Sequence[int] | None = None, cp: Sequence[int] | None = None, microbatch_sizes: Sequence[int] | None = None,
    stages_per_rank: Sequence[int] = (2,), optimizer_states: int = 2, top: int = 10, max_actions: int = 40_000,
    collectives: Collectives | None = None, dp_reduce: Sequence[str] | str | None = None,
) -> ClusterPlan:
    """Rank every layout of ``gpus`` devices for training ``graph``'s model, fastest first; only those that fit.

    Searched: tensor-parallel degree ``tp`` (powers of two up to a node, dividing ``gpus``), context-parallel
    degree ``cp`` (long sequences), pipeline ranks ``pp`` (divisors of ``gpus / (tp x cp)`` up to the number of
    places the graph can be split), ``dp = gpus / (pp x cp x tp)``
    (dividing the global batch), every schedule (multi-stage ones with ``stages_per_rank``), microbatch sizes
    (powers of two dividing the per-replica batch, up to 64), and the recomputation modes. Each option's split
    is ``pv.balance``'s optimum into ``pp x v`` stages on the hardware's roofline (exact, by dynamic
    programming); its step and memory are ``pv.simulate``'s (ranks placed node by node, as ``pv.simulate``
    documents), with ``m`` microbatches simulated exactly up to ``6 x pp``; beyond, from two simulations at
    ``4 x pp`` and ``6 x pp`` microbatches (counts every schedule accepts), extrapolated linearly in the
    microbatch count for the step, the busy time and the memory: a pipeline past its warm-up adds the same time
    per microbatch, GPipe's activations grow linearly and the others' saturate. Checked against full simulations
    of 16 x pp microbatches on uneven stages with fast and slow links: exact for all seven schedules but
    Interleaved1F1B on 2 ranks (0.5 % short). Such rows say ``extrapolated``.

    Bound (why the ranking is exact): the ``top`` rows are the true best ``top`` options of the search space.
    An option is dropped unsimulated only when a lower bound already rules it out: its memory lower bound
    (parameters, gradients, optimizer state and one microbatch's activations of the rank's stages) exceeds the
    limit, or its step lower bound (the busiest rank's compute, ``microbatches x sum of F + B`` over its
    stages, plus the forwards before its first stage and, without a split backward, the backwards after its
    last; no communication) is slower than the ``top``-th best simulated step. Options are simulated in order of
    that lower bound.

    Sequence length: costs are scaled from the traced example by tokens (``global_batch x seq_len`` over the
    example's), which is exact for everything but attention's quadratic part; trace at the target sequence
    length for that (``pipeviz plan`` does). A model on the meta device is planned without weights.

    Example:
        >>> from pipeviz import zoo
        >>> graph, seq = zoo.planning_graph("llama-3-8b")    # on the meta device, at 8192 tokens
        >>> print(pv.plan_cluster(graph, gpus=64, hardware="h100", global_batch=512).table())

    Args:
        graph: the traced model (``pv.trace``; meta-device models work).
        gpus: devices in all.
        hardware: a ``pv.Hardware`` or preset name (``pv.HARDWARE``).
        global_batch: sequences per training step (all replicas together).
        seq_len: tokens per sequence (default: the traced example's dim 1).
        memory_limit: bytes per device (default the hardware's memory).
        schedules: schedule names to consider (default all of torch's).
        recompute: modes to consider (default all three).
        dtype: the training dtype (the peak used, activation bytes).
        tp: tensor-parallel degrees to consider (default powers of two up to ``devices_per_node``).
        cp: context-parallel degrees to consider: each sequence split over ``cp`` devices (compute, activations
            and hand-offs / cp; every attention op all-gathers its keys and values across them, as ``pv.simulate``
            prices it). Default: 1, plus the powers of two up to 16 that leave each share at least 8,192 tokens
            (long sequences only: 1 alone at 8k).
        microbatch_sizes: sequences per microbatch to consider (default powers of two up to 64).
        stages_per_rank: for the multi-stage schedules.
        optimizer_states: tensors of optimizer state per parameter (Adam: 2).
        top: rows kept (and proven best).
        max_actions: the most schedule actions one option's simulations may take (``stages x microbatches x 2``,
            x 3 with a split backward, twice when extrapolated): a longer one (a very deep pipeline on many
            microbatches: each costs seconds here, torch's own schedule code builds its order) is left out and
            counted in ``too_long``; the rows are then the best of the rest.
        collectives: how the run does its collectives (``pipeviz.sim.simulate.Collectives``: where the replicas'
            gradient reduction goes, its dtype, tensor-parallel overlap, scattered hand-offs), for every option;
            default torch's (DDP). E.g. ``Collectives(dp_reduce="distributed", grad_dtype="float32",
            tp_overlap=True, scatter_gather=True)`` for Megatron-Core. Its ``tp_layout`` is set to
            ``"megatron"``: a cluster's run shards every block's attention and MLP and the vocabulary.
        dp_reduce: how the replicas' gradients may be reduced, searched as a dimension of the layout
            (``Collectives.dp_reduce``: ``"ddp"``, ``"overlap"``, ``"after_flush"``, ``"distributed"``); each row
            says its own and the seconds of it the step waits for (``exposed_reduction``). Default: the
            ``collectives``' own when given, else ``("ddp", "overlap")``: torch's DDP and ``pv.launch``'s default.

    Returns:
        A ``ClusterPlan``; ``.rows`` best first, ``.table()`` as text.

    Raises:
        ValueError: a non-positive ``gpus`` / ``global_batch``, a ``tp`` wider than a node, an unknown hardware,
            dtype, schedule or mode.
    """
    hw = find_hardware(hardware)
    for name, value in (("gpus", gpus), ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    dt = hw.dtype(dtype)
    # a cluster's run shards as Megatron-LM does (every block's attention and MLP, the vocabulary): the rows'
    # simulations cost that layout, as the bounds below do
    reductions = ([dp_reduce] if isinstance(dp_reduce, str) else list(dp_reduce) if dp_reduce is not None
                  else [collectives.dp_reduce] if collectives is not None else ["ddp", "overlap"])
    collectives = replace(collectives or Collectives(), tp_layout="megatron")
    for red in reductions:
        replace(collectives, dp_reduce=red)  # validates the name
    limit = int(memory_limit if memory_limit is not None else hw.memory_bytes)
    names = [sched.canonical(s) for s in (schedules or sched.ALL)]
    modes = [recompute] if isinstance(recompute, str) else list(recompute or RECOMPUTE)
    for mode in modes:
        CostOptions(recompute=mode)  # validates the name
    ex_batch = graph.batch_size or 1
    ex_seq = _example_seq_len(graph)
    seq = seq_len or ex_seq
    per_token = seq / ex_seq / ex_batch  # one sequence of seq tokens, relative to the traced example batch
    notes = []
    if seq != ex_seq:
        notes.append(f"Costs scaled from the traced {ex_seq} tokens to {seq} by tokens (attention's quadratic part "
                     "is not rescaled): trace at the target length to include it.")
    blocks = _split_blocks(graph)
    base = CostOptions(hardware=hw, dtype=dt, optimizer_states=optimizer_states)
    plans: dict[int, SplitPlan | None] = {}
    costs_cache: dict[tuple[int, int, str], Costs] = {}

    def plan_for(n: int) -> SplitPlan | None:
        if n not in plans:
            try:
                plans[n] = balance(graph, n, options=base)
            except PlanError:
                plans[n] = None
        return plans[n]

    def costs_for(n: int, b: int, mode: str) -> Costs:
        key = (n, b, mode)
        if key not in costs_cache:
            plan = plans[n]
            assert plan is not None
            costs_cache[key] = stage_costs(plan, 1, options=replace(base, recompute=mode, batch_scale=b * per_token))
        return costs_cache[key]

    rank_cache: dict[tuple[int, int, str, int, int], Costs] = {}

    def rank_costs(n: int, b: int, mode: str, t: int, c: int = 1) -> Costs:
        """One device's costs per microbatch of ``b`` sequences: its shard of each stage and its share of each
        sequence, with the shards' all-reduces and the shares' key/value gathers (``pv.simulate``'s)."""
        key = (n, b, mode, t, c)
        if key not in rank_cache:
            plan = plans[n]
            assert plan is not None
            mesh = Mesh(1, 1, t, c)
            coll = None
            scale = base.byte_scale(plan.graph) * b * per_token
            if t > 1 or c > 1:
                tp_s = (tp_collectives(plan, 1, c, t, base.link(t, allreduce=True), scale) if t > 1
                        else (0.0,) * n)
                cp_s = (cp_collectives(plan, 1, mesh, base.link(mesh.rank(0, cp=c - 1) + 1, allreduce=True),
                                       scale) if c > 1 else (0.0,) * n)
                coll = tuple(x + y for x, y in zip(tp_s, cp_s, strict=True))
            rank_cache[key] = parallel_costs(costs_for(n, b, mode), mesh, collective=coll)
        return rank_cache[key]

    # Selective recomputation drops attention's stored scores; a fused attention (SDPA) stores none, so there it
    # is "none" again: one of the two is enough.
    if "selective" in modes and "none" in modes and _no_scores(graph, base):
        modes.remove("selective")
        notes.append("selective recomputation = none here: the model's attention is fused (no stored scores).")

    tps = list(tp) if tp is not None else [t for t in (1, 2, 4, 8, 16) if t <= hw.devices_per_node]
    wide = [t for t in tps if not isinstance(t, int) or t < 1 or t > hw.devices_per_node]
    if wide:
        raise ValueError(f"tp={wide} not within one node of {hw.name} ({hw.devices_per_node} devices): tensor "
                         f"parallelism talks at every layer and stays on the node's link. Fix: tp values from 1 to "
                         f"{hw.devices_per_node}.")
    cps = list(cp) if cp is not None else [1, *(c for c in (2, 4, 8, 16) if seq % c == 0 and seq // c >= 8192)]
    for c in cps:
        check_degree("cp", c)
    if any(c > 1 for c in cps):
        notes.append("Context parallelism (cp > 1): keys and values all-gathered per attention op, not overlapped.")
    candidates: list[tuple[float, tuple[Any, ...]]] = []
    considered = pruned = 0
    # Model FLOPs: forward + backward (2x), no recomputation; attention's too where torch's counter missed them.
    model_flops = 3 * max(graph.total_flops, sum(op_table(graph.capture).flops)) * per_token * global_batch
    for t, c in [(t, c) for t in tps for c in cps]:
        if gpus % (t * c):
            continue
        for pp in [d for d in range(1, gpus // (t * c) + 1) if (gpus // (t * c)) % d == 0 and d <= len(blocks)]:
            dp = gpus // (t * c * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            sizes = [b for b in (microbatch_sizes or [2**i for i in range(7)]) if per_replica % b == 0]
            for name in names:
                trait = sched.SCHEDULES[name]
                vs = [1] if not trait.multi else [v for v in stages_per_rank if pp > 1 and pp * v <= len(blocks)]
                if trait.v_shape:
                    vs = [v for v in vs if v == trait.stages_per_rank]
                if pp == 1 and name != "1F1B":
                    continue  # one stage: every schedule is the same sequence of forwards and backwards
                for v in vs:
                    n = pp * v
                    if plan_for(n) is None:
                        continue
                    for b in sizes:
                        m = per_replica // b
                        try:
                            sched.check_microbatches(name, n, m, v if v > 1 else None)
                        except sched.ScheduleError:
                            continue
                        for mode, red in [(mo, r) for mo in modes for r in (reductions if dp > 1 else reductions[:1])]:
                            considered += 1
                            rc = rank_costs(n, b, mode, t, c)
                            lay = sched.layout(name, n, v if v > 1 else None)
                            work = _step_bound(rc, lay, m)
                            mem_lb = max(static_memory(rc, lay.stages_of(r), optimizer_states)
                                         + max(rc.activation_bytes[s] for s in lay.stages_of(r))
                                         for r in lay.ranks)
                            if mem_lb > limit:
                                pruned += 1
                                continue
                            candidates.append((work, (t, c, pp, dp, name, v, b, m, mode, red)))
    candidates.sort(key=lambda c: c[0])
    rows: list[LayoutOption] = []
    simulated = too_big = too_long = 0
    for bound, (t, c, pp, dp, name, v, b, m, mode, red) in candidates:
        if len(rows) >= top and bound > rows[top - 1].step_time:
            pruned += 1
            continue
        if _actions(name, pp, v, m) > max_actions:
            too_long += 1
            continue
        plan = plans[pp * v]
        assert plan is not None
        if _memory(rank_costs(pp * v, b, mode, t, c), name, pp * v, m, v, optimizer_states, limit) > limit:
            too_big += 1
            continue
        opts = replace(base, recompute=mode, batch_scale=b * per_token * dp * m)
        row = LayoutOption(
            pp=pp, dp=dp, tp=t, cp=c, schedule=name, stages_per_rank=v, microbatch_size=b, microbatches=m,
            recompute=mode, plan=plan, step_time=0.0, tokens_per_s=0.0, tflops_per_gpu=0.0, mfu=0.0, bubble=0.0,
            peak_memory=0, options=opts, collectives=replace(collectives, dp_reduce=red))
        step, busy, memory, extrapolated, exposed = _simulate(row)
        simulated += 1
        rows.append(replace(row, step_time=step, tokens_per_s=global_batch * seq / step,
                            tflops_per_gpu=model_flops / step / gpus / 1e12,
                            mfu=model_flops / step / gpus / hw.peak(dt),
                            bubble=max(0.0, 1 - busy / (pp * step)), peak_memory=int(memory),
                            extrapolated=extrapolated, exposed_reduction=exposed))
        rows.sort(key=lambda r: r.step_time)
    return ClusterPlan(tuple(rows[:top]), hw, gpus, global_batch, seq, dt, limit, considered, simulated, pruned,
                       too_big, too_long, tuple(notes))


def _simulate(row: LayoutOption) -> tuple[float, float, float, bool, float]:
    """(step seconds, busy seconds summed over pipeline ranks, peak bytes per device, extrapolated, the reduction's
    exposed seconds) of the row's own ``config`` (``pv.simulate``, as a user reproduces it; the exposed reduction,
    a step's end, is the longer simulation's when extrapolated)."""
    plan, name, m, v = row.plan, row.schedule, row.microbatches, row.stages_per_rank
    n = plan.num_stages
    spr = v if v > 1 else None

    exposed = [0.0]

    def run(count: int) -> tuple[float, float, float]:
        # batch_scale is the whole step's; with fewer microbatches each keeps its size.
        o = replace(row.options, batch_scale=row.options.batch_scale * count / m)
        tl = simulate(plan, row.config.replace(microbatches=count), options=o, order=_orders(name, n, count, spr),
                      collectives=row.collectives)
        start = min(e.start for e in tl.events)
        step = max(e.end for e in tl.events) - start
        busy = sum(e.duration for e in tl.events if e.kind in ("F", "B", "I", "W"))
        exposed[0] = max(tl.meta.get("dp_exposed") or [0.0])
        return step, busy, float(max(tl.meta["memory_bytes"]))

    m1, m2 = _extrapolated_from(n // v)
    if m <= m2:
        return (*run(m), False, exposed[0])
    a, b = run(m1), run(m2)
    k = (m - m2) / (m2 - m1)
    return (b[0] + k * (b[0] - a[0]), b[1] + k * (b[1] - a[1]), b[2] + k * (b[2] - a[2]), True, exposed[0])


def _actions(name: str, pp: int, v: int, m: int) -> int:
    """Schedule actions the simulations of one option take (see ``max_actions``)."""
    m1, m2 = _extrapolated_from(pp)
    per = pp * v * (3 if sched.SCHEDULES[name].split_backward else 2)
    return per * (m if m <= m2 else m1 + m2)


def _memory(c: Costs, name: str, n: int, m: int, v: int, optimizer_states: int, limit: float) -> float:
    """Peak bytes per device (``pipeviz.costs.memory_per_rank``), extrapolated past ``6 x pp`` microbatches as the
    step is (see ``plan_cluster``). Activations in flight never fall as microbatches are added, so a count past
    ``4 x pp`` that already overflows at ``4 x pp`` is over ``limit`` without building its own order (torch's
    code builds the multi-stage orders, slowly): that smaller figure is returned."""
    spr = v if v > 1 else None
    m1, m2 = _extrapolated_from(n // v)

    def at(count: int) -> float:
        return float(max(memory_per_rank(None, name, count, spr, optimizer_states, costs=c,
                                         order=_orders(name, n, count, spr))))

    if m <= m1:
        return at(m)
    a = at(m1)
    if a > limit:
        return a
    if m <= m2:
        return at(m)
    b = at(m2)
    return b + (m - m2) / (m2 - m1) * (b - a)


def _extrapolated_from(pp: int) -> tuple[int, int]:
    """The two microbatch counts a long pipeline is extrapolated from: ``4 x pp`` and ``6 x pp`` (multiples of
    pp, accepted by every schedule, past the warm-up: with ``2 x pp`` and ``3 x pp`` a LoopedBFS or ZB-V
    pipeline on slow links was still settling, up to 18 % off)."""
    return 4 * pp, 6 * pp


def _step_bound(c: Costs, lay: sched.Layout, m: int) -> float:
    """A lower bound on the step: for each rank, its first input cannot arrive before microbatch 0's forwards
    (and hand-offs) through the stages before it, it computes ``m x`` its stages' forward and backward, and
    (schedules without a split backward) the stages before it still run their last backward after its own. The
    hand-offs are priced on the intra-node link (the fastest), the replicas' all-reduce is left out: both only
    add."""
    best = 0.0
    for r in lay.ranks:
        stages = lay.stages_of(r)
        first = min(stages)
        head = sum(c.duration(s, "F") + c.comm[s] for s in range(first))
        tail = 0.0
        if not lay.info.split_backward:
            tail = sum(c.duration(s, "B") + c.comm[s] for s in range(first))
        best = max(best, head + m * sum(c.duration(s, "F") + c.duration(s, "B") for s in stages) + tail)
    return best


@functools.lru_cache(maxsize=4096)
def _orders(name: str, n: int, m: int, spr: int | None) -> tuple[tuple[str, ...], ...]:
    """``sched.orders``, cached: torch's own schedule code builds the multi-stage ones, slowly."""
    return tuple(tuple(a) for a in sched.orders(name, n, m, spr))


def _split_blocks(graph: GraphView) -> list[int]:
    """Indices of the layers a split can follow (plus the last): how many stages the graph allows."""
    names = graph.layer_names
    return [i for i, n in enumerate(names) if i == len(names) - 1 or graph.can_split_after(n)]


def _example_seq_len(graph: GraphView) -> int:
    import torch

    # Token ids (integers) of shape (batch, seq, ...): their dim 1; any other input (features) is one "token".
    for x in [*graph.example_args, *graph.example_kwargs.values()]:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point():
            return int(x.shape[1])
    return 1


def _no_scores(graph: GraphView, opts: CostOptions) -> bool:
    from pipeviz.cost.model import selective_saves_nothing

    return selective_saves_nothing(graph, opts)
