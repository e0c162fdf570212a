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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from pipeviz._compat import positional_legacy
from pipeviz.capture.view import GraphView
from pipeviz.cost.machine import Hardware
from pipeviz.cost.machine import hardware as find_hardware
from pipeviz.cost.memory import memory_per_rank
from pipeviz.cost.model import Costs
from pipeviz.cost.options import RECOMPUTE, CostOptions
from pipeviz.cost.roofline import op_table
from pipeviz.planner.cluster import ClusterPlan, LayoutOption, SearchOption, SearchPricing
from pipeviz.planner.experts import ep_degrees
from pipeviz.schedule import traits as sched
from pipeviz.schedule.mesh import check_degree
from pipeviz.sim.simulate import Collectives, schedule_orders, simulate

__all__ = ["ClusterPlan", "LayoutOption", "plan_cluster"]  # the first two: pipeviz.planner.cluster


@positional_legacy("global_batch", "seq_len", "memory_limit", "schedules", "recompute", "dtype")
def plan_cluster(
    graph: GraphView, gpus: int, hardware: Hardware | str, *, global_batch: int, seq_len: int | None = None,
    memory_limit: float | None = None, schedules: Sequence[str] | None = None,
    recompute: Sequence[str] | str | None = None, dtype: str | None = "bfloat16",
    tp: Sequence[int] | None = None, cp: Sequence[int] | None = None, microbatch_sizes: Sequence[int] | None = None,
    stages_per_rank: Sequence[int] = (2,), optimizer_states: int = 2, top: int = 10, max_actions: int = 40_000,
    collectives: Collectives | None = None, dp_reduce: Sequence[str] | str | None = None,
    ep: Sequence[int] | None = None,
) -> ClusterPlan:
    """Rank every layout of ``gpus`` devices for training ``graph``'s model, fastest first; only those that fit.

    Searched: tensor-parallel degree ``tp`` (powers of two up to a node, dividing ``gpus``), context-parallel
    degree ``cp`` (long sequences), pipeline ranks ``pp`` (divisors of ``gpus / (tp x cp)`` up to the number of
    places the graph can be split), ``dp = gpus / (pp x cp x tp)``
    (dividing the global batch), for a mixture-of-experts model the expert-parallel degree ``ep`` (divisors of the
    routed experts' count that divide ``dp x cp``: carved out of those ranks, as torchtitan and Megatron-LM carve
    it), every schedule (multi-stage ones with ``stages_per_rank``), microbatch sizes
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
    limit, or its step lower bound is slower than the ``top``-th best simulated step. The step bound, per rank: the
    forwards before its first stage, then ``microbatches x`` its stages' F + B (F + I + W where the schedule
    splits every backward, each pass paying the recomputation), then the larger of the backwards after its last
    stage (without a split backward) and the least its replicas' gradient reduction still adds after its last
    action (``pipeviz.sim.collectives.reduction_floor``); hand-offs on the fastest link. Options are simulated in order
    of that bound, and stop once the next bound is slower than the ``top``-th row. An option that passes the
    bounds is checked against the memory limit at ``2 x pp`` microbatches first (a cheap order: activations in
    flight do not fall as microbatches are added past it), then at its own count. Its memory is computed once
    for all its reductions, and torch's schedule orders once per schedule, stage and microbatch count
    (``pipeviz.sim.simulate.schedule_orders``).

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
            ``"megatron"``: a cluster's run shards every block's attention and MLP and the vocabulary, the
            layout ``pv.launch(..., tp=K)`` runs by default.
        dp_reduce: how the replicas' gradients may be reduced, searched as a dimension of the layout
            (``Collectives.dp_reduce``: ``"ddp"``, ``"overlap"``, ``"after_flush"``, ``"distributed"``); each row
            says its own and the seconds of it the step waits for (``exposed_reduction``). Default: the
            ``collectives``' own when given, else ``("ddp", "overlap")``: torch's DDP and ``pv.launch``'s default.
        ep: expert-parallel degrees to consider (``pipeviz.planner.experts.ep_degrees``): default every divisor
            of the routed experts' count for a model with routed experts (listed or transformers' fused experts),
            1 for a dense one. Each layout takes those dividing its ``dp x cp``. Priced as ``pv.simulate`` prices
            ``LaunchConfig(ep=...)`` (``pipeviz.sim.experts``): two all-to-alls per MoE block in every forward and
            backward on the link the group spans (not overlapped with compute), the busiest owner's compute
            (``CostOptions.expert_imbalance``, 1.0: balanced routing), 1/ep of the experts' weights, gradients and
            optimizer state per rank.

    Returns:
        A ``ClusterPlan``; ``.rows`` best first, ``.table()`` as text.

    Raises:
        ValueError: a non-positive ``gpus`` / ``global_batch``, a ``tp`` wider than a node, an unknown hardware,
            dtype, schedule or mode; an ``ep`` that does not divide the routed experts' count, or ep > 1 on a dense
            model (naming the value and the valid ones).
    """
    search, space = _ask(graph, gpus, hardware, global_batch, seq_len, memory_limit, schedules, recompute, dtype,
                         tp, cp, microbatch_sizes, stages_per_rank, optimizer_states, collectives, dp_reduce, ep)
    candidates, considered, pruned = _candidates(search, space)
    rows, counts = _rank(search, space, candidates, top, max_actions)
    return ClusterPlan(tuple(rows[:top]), search.hw, gpus, global_batch, space.seq, search.dtype, search.limit,
                       considered, counts["simulated"], pruned + counts["pruned"], counts["too_big"],
                       counts["too_long"], tuple(space.notes), search.collectives.tp_layout)


@dataclass
class _Space:
    """The values searched (``plan_cluster``'s arguments, resolved and checked) and the notes on them."""

    gpus: int
    global_batch: int
    seq: int
    names: list[str]
    modes: list[str]
    reductions: list[str]
    tps: list[int]
    cps: list[int]
    microbatch_sizes: Sequence[int] | None
    stages_per_rank: Sequence[int]
    blocks: int
    notes: list[str]
    eps: list[int]


def _ask(graph: GraphView, gpus: int, hardware: Hardware | str, global_batch: int, seq_len: int | None,
         memory_limit: float | None, schedules: Sequence[str] | None, recompute: Sequence[str] | str | None,
         dtype: str | None, tp: Sequence[int] | None, cp: Sequence[int] | None,
         microbatch_sizes: Sequence[int] | None, stages_per_rank: Sequence[int], optimizer_states: int,
         collectives: Collectives | None, dp_reduce: Sequence[str] | str | None,
         ep: Sequence[int] | None = None) -> tuple[SearchPricing, _Space]:
    """``plan_cluster``'s arguments checked and resolved (the errors it documents are raised here)."""
    hw = find_hardware(hardware)
    for name, value in (("gpus", gpus), ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    dt = hw.dtype(dtype)
    # a cluster's run shards as Megatron-LM does (every block's attention and MLP, the vocabulary): the rows'
    # simulations cost that layout, as the bounds do
    reductions = ([dp_reduce] if isinstance(dp_reduce, str) else list(dp_reduce) if dp_reduce is not None
                  else [collectives.dp_reduce] if collectives is not None else ["ddp", "overlap"])
    collectives = replace(collectives or Collectives(), tp_layout="megatron")
    for red in reductions:
        replace(collectives, dp_reduce=red)  # validates the name
    names = [sched.canonical(s) for s in (schedules or sched.ALL)]
    modes = [recompute] if isinstance(recompute, str) else list(recompute or RECOMPUTE)
    for mode in modes:
        CostOptions(recompute=mode)  # validates the name
    ex_seq = _example_seq_len(graph)
    seq = seq_len or ex_seq
    notes = []
    if seq != ex_seq:
        notes.append(f"Costs scaled from the traced {ex_seq} tokens to {seq} by tokens (attention's quadratic part "
                     "is not rescaled): trace at the target length to include it.")
    base = CostOptions(hardware=hw, dtype=dt, optimizer_states=optimizer_states)
    limit = int(memory_limit if memory_limit is not None else hw.memory_bytes)
    # one sequence of seq tokens, relative to the traced example batch
    search = SearchPricing(graph, hw, dt, base, seq / ex_seq / (graph.batch_size or 1), limit, optimizer_states,
                     collectives)
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
    eps = ep_degrees(graph, ep)
    if any(e > 1 for e in eps):
        notes.append("Expert parallelism (ep > 1): two all-to-alls per MoE block in each forward and backward, not "
                     "overlapped with compute; routing balanced (expert_imbalance="
                     f"{base.expert_imbalance:g}); 1/ep of the experts' weights, grads and optimizer state per rank.")
    return search, _Space(gpus, global_batch, seq, names, modes, reductions, tps, cps, microbatch_sizes,
                          stages_per_rank, len(_split_blocks(graph)), notes, eps)


def _layouts(search: SearchPricing, space: _Space) -> Iterator[SearchOption]:
    """Every option of the search space whose split exists and whose microbatch count the schedule accepts."""
    for t, c in [(t, c) for t in space.tps for c in space.cps]:
        if space.gpus % (t * c):
            continue
        rest = space.gpus // (t * c)
        for pp in [d for d in range(1, rest + 1) if rest % d == 0 and d <= space.blocks]:
            dp = rest // pp
            if space.global_batch % dp:
                continue
            per_replica = space.global_batch // dp
            sizes = [b for b in (space.microbatch_sizes or [2**i for i in range(7)]) if per_replica % b == 0]
            for name in space.names:
                if pp == 1 and name != "1F1B":
                    continue  # one stage: every schedule is the same sequence of forwards and backwards
                trait = sched.SCHEDULES[name]
                vs = [1] if not trait.multi else [v for v in space.stages_per_rank if pp > 1 and pp * v <= space.blocks]
                for v in [v for v in vs if not trait.v_shape or v == trait.stages_per_rank]:
                    if search.plan(pp * v) is None:
                        continue
                    for b in sizes:
                        m = per_replica // b
                        try:
                            sched.check_microbatches(name, pp * v, m, v if v > 1 else None)
                        except sched.ScheduleError:
                            continue
                        for mode, e in [(mode, e) for mode in space.modes for e in space.eps if (dp * c) % e == 0]:
                            for red in space.reductions if dp > 1 else space.reductions[:1]:
                                yield SearchOption(t, c, pp, dp, name, v, b, m, mode, red, e)


def _candidates(search: SearchPricing, space: _Space) -> tuple[list[tuple[float, SearchOption]], int, int]:
    """The options with their step's lower bound, in its order, less those whose memory lower bound is over the
    limit; how many were considered and how many that bound dropped."""
    out: list[tuple[float, SearchOption]] = []
    considered = pruned = 0
    compute: dict[tuple[object, ...], tuple[list[float], list[float]]] = {}
    for o in _layouts(search, space):
        considered += 1
        if search.memory_bound(o.tp, o.cp, o.pp, o.schedule, o.v, o.b, o.mode, o.ep) > search.limit:
            pruned += 1
            continue
        key = o.key
        if key not in compute:
            compute[key] = _step_bound(search.device_costs(o.stages, o.b, o.mode, o.tp, o.cp, o.ep), o.layout, o.m)
        busy, tail = compute[key]
        floors = search.reduction_floors(*o[:7], o.mode, o.reduce, o.ep)
        # (a hair below: the simulation adds the same seconds in another order, and a bound must never exceed it)
        bound = max(b + max(t, f) for b, t, f in zip(busy, tail, floors, strict=True)) * (1 - 1e-9)
        out.append((bound, o))
    out.sort(key=lambda c: c[0])
    return out, considered, pruned


def _rank(search: SearchPricing, space: _Space, candidates: list[tuple[float, SearchOption]], top: int,
          max_actions: int) -> tuple[list[LayoutOption], dict[str, int]]:
    """Simulate the candidates in their bound's order until the ``top``-th best step is below the next bound; the
    rows fastest first, and how many were simulated, pruned, over the memory limit, too long to simulate."""
    # Model FLOPs: forward + backward (2x), no recomputation; attention's too where torch's counter missed them.
    graph = search.graph
    model_flops = 3 * max(graph.total_flops, sum(op_table(graph.capture).flops)) * search.per_token * space.global_batch
    rows: list[LayoutOption] = []
    counts = dict.fromkeys(("simulated", "pruned", "too_big", "too_long"), 0)
    for i, (bound, o) in enumerate(candidates):
        if len(rows) >= top and bound > rows[top - 1].step_time:
            counts["pruned"] += len(candidates) - i  # sorted: every later bound is larger still
            break
        if _actions(o.schedule, o.pp, o.v, o.m) > max_actions:
            counts["too_long"] += 1
            continue
        if _peak(search, o) > search.limit:
            counts["too_big"] += 1
            continue
        plan = search.plan(o.stages)
        assert plan is not None
        opts = replace(search.base, recompute=o.mode, batch_scale=o.b * search.per_token * o.dp * o.m)
        row = LayoutOption(
            pp=o.pp, dp=o.dp, tp=o.tp, cp=o.cp, schedule=o.schedule, stages_per_rank=o.v, microbatch_size=o.b,
            microbatches=o.m, recompute=o.mode, plan=plan, step_time=0.0, tokens_per_s=0.0, tflops_per_gpu=0.0,
            mfu=0.0, bubble=0.0, peak_memory=0, options=opts, ep=o.ep,
            collectives=replace(search.collectives, dp_reduce=o.reduce))
        step, busy, memory, extrapolated, exposed = _simulate(row)
        counts["simulated"] += 1
        rows.append(replace(row, step_time=step, tokens_per_s=space.global_batch * space.seq / step,
                            tflops_per_gpu=model_flops / step / space.gpus / 1e12,
                            mfu=model_flops / step / space.gpus / search.hw.peak(search.dtype),
                            bubble=max(0.0, 1 - busy / (o.pp * step)), peak_memory=int(memory),
                            extrapolated=extrapolated, exposed_reduction=exposed))
        rows.sort(key=lambda r: r.step_time)
    return rows, counts


def _peak(search: SearchPricing, o: SearchOption) -> float:
    """The option's peak bytes per device (``_memory``), once per layout: the reduction does not change it."""
    key = o.key
    if key not in search.memory:
        search.memory[key] = _memory(search.device_costs(o.stages, o.b, o.mode, o.tp, o.cp, o.ep), o.schedule, o.stages,
                                     o.m, o.v, search.optimizer_states, search.limit)
    return search.memory[key]


def _simulate(row: LayoutOption) -> tuple[float, float, float, bool, float]:
    """(step seconds, busy seconds summed over pipeline ranks, peak bytes per device, extrapolated, the reduction's
    exposed seconds) of the row's own ``config`` (``pv.simulate``, as a user reproduces it; the exposed reduction,
    a step's end, is the longer simulation's when extrapolated)."""
    plan, m, v = row.plan, row.microbatches, row.stages_per_rank
    n = plan.num_stages
    exposed = [0.0]

    def run(count: int) -> tuple[float, float, float]:
        # batch_scale is the whole step's; with fewer microbatches each keeps its size.
        o = replace(row.options, batch_scale=row.options.batch_scale * count / m)
        tl = simulate(plan, row.config.replace(microbatches=count), options=o, collectives=row.collectives)
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
    step is (see ``plan_cluster``). Activations in flight do not fall as microbatches are added past ``2 x pp``, so
    an option that already overflows with ``2 x pp`` (``_fewer``) is over ``limit`` without building its own order
    (torch's code builds the multi-stage orders, slowly: a second for a deep pipeline): that smaller figure is
    returned."""
    spr = v if v > 1 else None
    m1, m2 = _extrapolated_from(n // v)

    def at(count: int) -> float:
        return float(max(memory_per_rank(None, name, count, spr, optimizer_states, costs=c,
                                         order=_orders(name, n, count, spr))))

    fewer = _fewer(name, n, m, spr)
    if fewer < m and (low := at(fewer)) > limit:
        return low
    if m <= m2:
        return at(m)
    a, b = at(m1), at(m2)
    return b + (m - m2) / (m2 - m1) * (b - a)


def _fewer(name: str, n: int, m: int, spr: int | None) -> int:
    """``2 x pp`` microbatches when fewer than ``m`` and the schedule accepts them, else ``m``: the cheap order whose
    peak memory bounds ``m``'s from below (torch's multi-stage schedules; the single-stage ones are built here at
    once, and GPipe keeps every microbatch). A multiple of pp: from ``pp + 1`` an interleaved schedule's warm-up
    can hold more than with ``2 x pp`` (``tests/test_planner_search.py`` checks the counts it relies on)."""
    fewer = 2 * (n // (spr or 1))
    if not sched.SCHEDULES[name].multi or fewer >= m:
        return m
    try:
        sched.check_microbatches(name, n, fewer, spr)
    except sched.ScheduleError:
        return m
    return fewer


def _extrapolated_from(pp: int) -> tuple[int, int]:
    """The two microbatch counts a long pipeline is extrapolated from: ``4 x pp`` and ``6 x pp`` (multiples of
    pp, accepted by every schedule, past the warm-up: with ``2 x pp`` and ``3 x pp`` a LoopedBFS or ZB-V
    pipeline on slow links was still settling, up to 18 % off)."""
    return 4 * pp, 6 * pp


def _step_bound(c: Costs, lay: sched.Layout, m: int) -> tuple[list[float], list[float]]:
    """Per rank, a lower bound on when its last action ends (``busy``) and on how long the step goes on after
    it (``tail``): its first input cannot arrive before microbatch 0's forwards (and hand-offs) through the stages
    before it, and it computes ``m x`` its stages' forward and backward (an input-grad and a weight-grad pass
    where the schedule splits every backward: each pays the recomputation, ``Costs.recompute_seconds``); and
    (schedules without a split backward) the stages before it still run their last backward after its own. The
    hand-offs are priced on the intra-node link (the fastest), the replicas' reduction is left out (``plan_cluster``
    adds its floor): both only add."""
    split = _always_split(lay.schedule)
    busy, tail = [], []
    for r in lay.ranks:
        stages = lay.stages_of(r)
        first = min(stages)
        head = sum(c.duration(s, "F") + c.comm[s] for s in range(first))
        work = sum(c.duration(s, "F") + (c.duration(s, "I") + c.duration(s, "W") if split else c.duration(s, "B"))
                   for s in stages)
        busy.append(head + m * work)
        tail.append(0.0 if lay.info.split_backward else sum(c.duration(s, "B") + c.comm[s] for s in range(first)))
    return busy, tail


@functools.cache
def _always_split(name: str) -> bool:
    """Whether ``name`` runs every backward as an input-grad and a weight-grad pass (the zero-bubble schedules; not
    DualPipeV, whose overlapped pairs run whole backwards): read off a small order of the schedule."""
    if not sched.info(name).split_backward:
        return False
    spr = sched.info(name).stages_per_rank
    n = 4 * (spr or 1)
    kinds = {a.kind for rank in sched.orders(name, n, 2 * n, spr) for a in rank}
    return "B" not in kinds


def _orders(name: str, n: int, m: int, spr: int | None) -> tuple[tuple[sched.Action, ...], ...]:
    """``sched.orders``, cached (``pv.simulate``'s cache: the rows' simulations build the same orders)."""
    return schedule_orders(name, n, m, spr)


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
