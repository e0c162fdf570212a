"""``balance()``: the contiguous split that minimises the slowest stage, optimally, under a memory limit.

Exact dynamic programming over contiguous partitions (the linear-partition problem): O(stages x layers^2).
``compare()`` simulates a plan under every schedule on the same number of ranks: a schedule with v stages per
rank gets a split into ranks x v stages balanced the same way.

Example:
    >>> plan = pv.balance(graph, num_stages=4)                       # by time (measured or FLOP-estimated)
    >>> plan = pv.balance(graph, 4, by="params", memory_limit=2**30, schedule="1F1B", microbatches=8)
    >>> plan = pv.balance(graph, 8, hardware="h100", dtype="bfloat16", recompute="full")
    >>> print(pv.compare(plan, microbatches=8).table())               # 4 ranks in every row
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Unpack

from pipeviz._compat import deprecated, positional_legacy
from pipeviz.capture.view import GraphView
from pipeviz.cost.memory import in_flight
from pipeviz.cost.model import layer_activation_bytes, layer_times
from pipeviz.cost.options import CostChanges, CostOptions
from pipeviz.cost.rule import stage_bytes
from pipeviz.plan.errors import PlanError
from pipeviz.plan.split import SplitPlan
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig
from pipeviz.schedule.training import cross_entropy
from pipeviz.schedule.traits import ScheduleError
from pipeviz.sim.simulate import Comparison, ComparisonRow, simulate

if TYPE_CHECKING:


    from pipeviz.cost.model import Costs
    from pipeviz.sim.collectives import Collectives


__all__ = ["BY", "balance", "compare", "layer_costs", "optimal_partitions", "partition", "slowest_stage"]


class CompareOptions(CostChanges, total=False):
    """``pv.compare``'s other keywords: ``CostOptions``' fields (``CostChanges``), and ``pv.simulate``'s own
    (``forward_only``, ``cores``, ...). The run's own settings (``dp``, ``tp``, ``loss_fn``, ``order``, ...) come in
    ``config``, a ``LaunchConfig``: ``pv.compare(plan, config=pv.LaunchConfig(dp=2, tp=2))``."""

    costs: Costs | None
    collectives: Collectives | None
    num_stages: int | None
    forward_only: bool | None
    cores: int | None
    dp_bandwidth: float | None
    tp_bandwidth: float | None
    cp_bandwidth: float | None


BY = ("time", "flops", "params")
_RUN_FIELDS = ("loss_fn", "dp", "cp", "tp", "dp_shard", "tp_plan", "order")  # LaunchConfig's, once compare()'s too


GroupExtra = Callable[[int, int, int], float]  # (group j, first item a, end b) -> memory the group adds as a whole


def partition(costs: Sequence[float], k: int, memory: Sequence[Sequence[float]] | None = None,
              limit: float | None = None, extra: GroupExtra | None = None) -> list[int] | None:
    """Split ``costs`` into ``k`` contiguous non-empty groups minimising the largest group sum.

    ``memory[j][i]`` is layer ``i``'s memory if it sits in group ``j`` (groups can differ: in-flight
    activations depend on the stage's place in the schedule); each group's memory sum, plus ``extra(j, a, b)``
    for a group of items ``[a, b)`` (what depends on where the group starts: the copies of saved tensors it
    received), must stay <= ``limit``.
    Ties are broken towards the split with the smallest sum of squared group costs (the evenest).

    Returns:
        The index of the last item of each group but the last (a split after each), or None if no split
        fits the limit.
    """
    n = len(costs)
    if not 1 <= k <= n:
        return None
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    mem_pre = None
    if memory is not None:
        mem_pre = []
        for row in memory:
            acc = [0.0]
            for v in row:
                acc.append(acc[-1] + v)
            mem_pre.append(acc)
    inf = (float("inf"), float("inf"))
    # best[j][i]: (max group cost, sum of squares) for items [0, i) in j+1 groups; cut[j][i]: start of last group.
    best = [[inf] * (n + 1) for _ in range(k)]
    cut = [[-1] * (n + 1) for _ in range(k)]
    def over(j: int, a: int, b: int) -> bool:
        if mem_pre is None or limit is None:
            return False
        return mem_pre[j][b] - mem_pre[j][a] + (extra(j, a, b) if extra is not None else 0.0) > limit

    for i in range(1, n + 1):
        if not over(0, 0, i):
            c = pre[i]
            best[0][i] = (c, c * c)
    for j in range(1, k):
        for i in range(j + 1, n + 1):
            for t in range(j, i):  # last group is [t, i)
                prev = best[j - 1][t]
                if prev == inf:
                    continue
                if over(j, t, i):
                    continue
                c = pre[i] - pre[t]
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[j][i]:
                    best[j][i], cut[j][i] = cand, t
    if best[k - 1][n] == inf:
        return None
    ends, i = [], n
    for j in range(k - 1, 0, -1):
        i = cut[j][i]
        ends.append(i - 1)
    return sorted(ends)


def optimal_partitions(costs: Sequence[float], k: int, memory: Sequence[Sequence[float]] | None = None,
                       limit: float | None = None, cap: int = 64, extra: GroupExtra | None = None) -> list[list[int]]:
    """Every split of ``costs`` into ``k`` groups whose largest group equals the optimum (``partition``'s),
    up to ``cap`` of them, evenest first; each as the index of the last item of each group but the last."""
    best = partition(costs, k, memory, limit, extra)
    if best is None:
        return []
    n = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    groups = [0, *[e + 1 for e in best], n]
    bound = max(pre[b] - pre[a] for a, b in itertools.pairwise(groups))
    bound += 1e-9 * max(1.0, abs(bound))

    def fits(j: int, a: int, b: int) -> bool:
        if memory is None or limit is None:
            return True
        return sum(memory[j][a:b]) + (extra(j, a, b) if extra is not None else 0.0) <= limit

    # feasible[j][i]: items [i, n) split into k - j groups, each within the bound (and the memory limit)
    feasible = [[False] * (n + 1) for _ in range(k + 1)]
    feasible[k][n] = True
    for j in range(k - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            feasible[j][i] = any(pre[e] - pre[i] <= bound and fits(j, i, e) and feasible[j + 1][e]
                                 for e in range(i + 1, n - (k - j - 1) + 1))
    out: list[list[int]] = []

    def walk(j: int, i: int, ends: list[int]) -> None:
        if len(out) >= cap:
            return
        if j == k - 1:
            if pre[n] - pre[i] <= bound and fits(j, i, n):
                out.append(list(ends))
            return
        for e in range(i + 1, n - (k - j - 1) + 1):
            if pre[e] - pre[i] <= bound and fits(j, i, e) and feasible[j + 1][e]:
                walk(j + 1, e, [*ends, e - 1])

    walk(0, 0, [])

    def spread(ends: list[int]) -> float:
        cuts = [0, *[e + 1 for e in ends], n]
        return sum((pre[b] - pre[a]) ** 2 for a, b in itertools.pairwise(cuts))

    return sorted(out, key=spread) or [best]


def slowest_stage(plan: SplitPlan, by: str = "time", options: CostOptions | None = None) -> tuple[float, float]:
    """The plan's slowest stage and the best slowest stage any split into as many stages reaches, in the
    per-layer costs ``by`` uses: ``(slowest, optimum)``. The preview's verdict compares the two."""
    graph = plan.graph
    costs = layer_costs(graph, by, options)
    pos = {n: i for i, n in enumerate(graph.layer_names)}
    slowest = max(sum(costs[pos[n]] for n in s.layers) for s in plan.stages)
    ends = partition(costs, plan.num_stages)
    if ends is None:
        return slowest, slowest
    cuts = [0, *[e + 1 for e in ends], len(costs)]
    optimum = max(sum(costs[a:b]) for a, b in itertools.pairwise(cuts))
    return slowest, optimum


def layer_costs(graph: GraphView, by: str = "time", options: CostOptions | None = None) -> list[float]:
    """Per-layer cost for balancing: forward + backward seconds (``pipeviz.costs.layer_times``: measured on a
    graph with a ``pv.profile`` attached, else a roofline on ``options.hardware``, else from FLOPs; with
    ``options.recompute``'s extra forward work), FLOPs, or parameter counts."""
    if by not in BY:
        raise ValueError(f"Unknown balance criterion by={by!r}; valid: {', '.join(BY)}.")
    if by == "params":
        return [float(layer.params) for layer in graph.layers]
    if by == "flops":
        return [float(layer.flops) for layer in graph.layers]
    fwd, bwd, _ = layer_times(graph, options=options)
    return [f + b for f, b in zip(fwd, bwd, strict=True)]


@positional_legacy("by", "memory_limit", "schedule", "microbatches", "stages_per_rank", "optimizer_states")
def balance(
    graph: GraphView, num_stages: int, *, by: str = "time", memory_limit: float | None = None,
    schedule: str | None = None, microbatches: int = 1, stages_per_rank: int = 1,
    options: CostOptions | None = None, **cost: Unpack[CostChanges],
) -> SplitPlan:
    """The contiguous split of ``graph`` into ``num_stages`` stages that minimises the slowest stage.

    Optimal for the chosen per-layer costs (exhaustive dynamic programming, checked against brute force),
    never an empty stage. Among splits tied at the optimum, with a ``schedule`` the one whose simulated step
    is shortest, else the evenest.

    Args:
        graph: the traced graph.
        num_stages: total stages (with ``stages_per_rank`` = v > 1: ranks x v virtual stages).
        by: ``"time"`` (measured by ``pv.profile`` if run, else FLOP-proportional), ``"flops"``, ``"params"``.
        memory_limit: bytes per rank, in ``pipeviz.costs``' model (the figure the preview and ``simulate``
            show): parameters x (2 + optimizer_states), buffers, and activations of the microbatches in flight
            under ``schedule`` (default GPipe: all of them; 1F1B: p - stage). With v stages per rank each stage
            gets limit / v.
        schedule, microbatches: for the in-flight activation count.
        options, cost: the cost model's settings, a ``pv.CostOptions`` and/or its fields as keywords (``hardware``,
            ``dtype``, ``recompute``, ``optimizer_states``: default Adam's 2), the same ``pv.simulate`` takes: times
            on a ``Hardware``'s roofline, activations kept under recomputation.

    Raises:
        PlanError: more stages than layers, or no split fits the limit (the message gives the smallest
            limit that fits).
    """
    opts = CostOptions.of(options, **cost)
    layers = graph.layers
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PlanError(f"num_stages must be a positive int, got {num_stages!r}.")
    if num_stages > len(layers):
        raise PlanError(
            f"Cannot balance {len(layers)} layers into {num_stages} non-empty stages. Valid: 1 to {len(layers)}; "
            "or go finer first (graph.expand(name) / pv.trace(..., depth=N))."
        )
    # A split can follow only some layers (never inside a no_grad / autocast block, never before glue alone):
    # the layers between two such places are one block for the partition.
    blocks = _blocks(graph)
    if num_stages > len(blocks):
        stuck = [b for b in blocks if len(b) > 1]
        raise PlanError(
            f"Cannot balance {len(layers)} layers into {num_stages} stages: a split can follow only {len(blocks) - 1} "
            f"of them ({', '.join('+'.join(layers[i].name for i in b) for b in stuck[:3])} run as one). Valid: 1 to "
            f"{len(blocks)}; or go finer first (graph.expand(name))."
        )
    costs = _summed(layer_costs(graph, by, opts), blocks)
    memory = None
    limit = None
    extra: GroupExtra | None = None
    if memory_limit is not None:
        # pipeviz.costs' formula, layer by layer: a stage's memory is the sum over its layers.
        limit = memory_limit / max(1, stages_per_rank)
        flying = in_flight(schedule or "GPipe", num_stages, microbatches, stages_per_rank if schedule else None)
        kept = layer_activation_bytes(graph, opts)
        memory = [
            _summed([stage_bytes(layer.param_bytes, layer.buffer_bytes,
                                  act * opts.batch_scale / microbatches * flying[j], opts.optimizer_states)
                     for layer, act in zip(layers, kept, strict=True)], blocks)
            for j in range(num_stages)
        ]
        if opts.recompute != "full":  # (full recomputation keeps the received input once: in the layer's figure)
            received = _received_saved(graph, blocks)
            scale = opts.byte_scale(graph) * opts.batch_scale / microbatches

            def extra(j: int, a: int, b: int) -> float:
                return received(a, b) * scale * flying[j]
    candidates = [[blocks[e][-1] for e in ends]
                  for ends in optimal_partitions(costs, num_stages, memory, limit, extra=extra)]
    ends = candidates[0] if candidates else None
    if schedule is not None and len(candidates) > 1:
        # Splits tied at the optimum can still differ in the step the schedule gives them (where the bubble
        # falls, what crosses each boundary): take the one with the shortest simulated step.
        ends = _fastest(graph, candidates, schedule, microbatches, stages_per_rank, opts)
    if ends is None:
        # The smallest feasible limit: the same optimal partition with memory as the cost.
        assert memory is not None
        lo, hi = 0.0, sum(max(row) for row in zip(*memory, strict=True))
        for _ in range(60):
            mid = (lo + hi) / 2
            if partition([0.0] * len(blocks), num_stages, memory, mid, extra) is None:
                lo = mid
            else:
                hi = mid
        need = hi * max(1, stages_per_rank)
        raise PlanError(
            f"No split into {num_stages} stages fits memory_limit={memory_limit:,.0f} bytes per rank"
            f"{f' under {schedule}' if schedule else ''}. The smallest limit that fits is about {need:,.0f} bytes "
            f"({need / 2**20:.1f} MiB). Fix: raise memory_limit, use more stages, or a schedule with fewer "
            "microbatches in flight (1F1B instead of GPipe)."
        )
    return SplitPlan.from_stages(graph, _groups(graph, ends))


def _fastest(graph: GraphView, candidates: list[list[int]], schedule: str, microbatches: int,
             stages_per_rank: int, options: CostOptions) -> list[int]:
    best, best_time = candidates[0], float("inf")
    for ends in candidates:
        plan = SplitPlan.from_stages(graph, _groups(graph, ends))
        try:
            step = simulate(plan, schedule, microbatches, stages_per_rank=None if stages_per_rank == 1
                            else stages_per_rank, options=options).step_time
        except ScheduleError:  # this schedule cannot run such a plan: the evenest split stands
            return candidates[0]
        if step < best_time - 1e-12:
            best, best_time = ends, step
    return best


def _received_saved(graph: GraphView, blocks: list[list[int]]) -> Callable[[int, int], float]:
    """``received(a, b)``: the bytes a stage of blocks ``[a, b)`` saves of tensors an earlier stage saved too
    (``SplitPlan.received_saved_bytes``, each (tensor, stage) once), for the example batch: the part of a stage's
    memory that depends on where it starts. An op between two layers counts with the layer before it."""
    idx = graph.index
    block_of_layer = {layer: k for k, b in enumerate(blocks) for layer in b}

    def block(op: int) -> int:
        return block_of_layer[max(0, bisect.bisect_right(idx.layer_first, op) - 1)]

    entries = sorted((block(op), block(first), (first, slot), nbytes) for op, first, slot, nbytes in idx.resaved)
    table: dict[tuple[int, int], float] = {}
    for a in range(len(blocks)):
        seen: set[tuple[int, int]] = set()
        total = 0.0
        pending = [(at, key, nbytes) for at, source, key, nbytes in entries if source < a <= at]
        pos = 0
        for b in range(a + 1, len(blocks) + 1):
            while pos < len(pending) and pending[pos][0] < b:
                _, key, nbytes = pending[pos]
                if key not in seen:
                    seen.add(key)
                    total += nbytes
                pos += 1
            table[a, b] = total
    return lambda a, b: table[a, b]


def _blocks(graph: GraphView) -> list[list[int]]:
    """Layer indices grouped so that a split can follow each group but the last."""
    out: list[list[int]] = [[]]
    names = graph.layer_names
    for i, name in enumerate(names):
        out[-1].append(i)
        if i < len(names) - 1 and graph.can_split_after(name):
            out.append([])
    return out


def _summed(values: Sequence[float], blocks: list[list[int]]) -> list[float]:
    return [sum(values[i] for i in b) for b in blocks]


def _groups(graph: GraphView, ends: list[int]) -> list[list[str]]:
    names = list(graph.layer_names)
    out, start = [], 0
    for e in [*ends, len(names) - 1]:
        out.append(names[start:e + 1])
        start = e + 1
    return out


@positional_legacy("stages_per_rank")
def compare(plan: SplitPlan, schedules: Sequence[str] | None = None, microbatches: int = 8, *,
            stages_per_rank: int | None = None, by: str = "time", config: LaunchConfig | None = None,
            options: CostOptions | None = None, **simulate_options: Unpack[CompareOptions]) -> Comparison:
    """Simulate ``plan`` under several schedules (default: all 7) on the same number of devices, and tabulate
    step time, bubble and memory.

    The plan's stage count is the rank count ``p`` of every row: one-stage-per-rank schedules (GPipe, 1F1B) run
    ``plan`` itself; a schedule with ``v`` stages per rank (``stages_per_rank``, default 2) runs a split of the
    plan's graph into ``p x v`` stages balanced the same way (``pv.balance(graph, p * v, by=by)`` with the same
    cost options), so each row answers "which schedule on these p devices". Rows give ``ranks`` and ``stages``
    (and the ``plan`` they ran, with the ``config`` that launches it: ``pv.launch(row.plan, config=row.config,
    ...)``).

    Schedules that cannot run (more stages than the graph has layers, a microbatch count the schedule refuses)
    are listed in ``skipped`` with the reason; with ``forward_only=True`` (an inference run) the V-shaped ones too,
    as torch's cannot run without a backward.

    Example:
        >>> cmp = pv.compare(plan, microbatches=8, hardware="h100")
        >>> [(r.schedule, r.ranks, r.stages) for r in cmp.rows]

    Args:
        plan: the split; its stage count is the number of ranks.
        schedules: schedule names (case-insensitive); default all.
        microbatches: per step.
        stages_per_rank: for the multi-stage schedules (default: each schedule's, ``ScheduleInfo``).
        by: how the multi-stage splits are balanced (``pv.balance``'s ``by``).
        config: the rest of the run (``dp``, ``cp``, ``tp``, ``loss_fn``: without one, forward only), as
            ``pv.launch`` takes it; each row's schedule, microbatches and stages per rank replace its own.
        options: cost options (a ``pv.CostOptions``); its fields ``hardware``, ``dtype`` and ``recompute`` may come
            as keywords too.
        simulate_options: the rest of ``pv.simulate``'s keywords (``forward_only``, ``cores``, ...). The run's
            settings as keywords (``dp=``, ``tp=``, ``loss_fn=``, ...) are deprecated: they belong in ``config``.
    """
    given: dict[str, Any] = dict(simulate_options)
    run = {k: given.pop(k) for k in _RUN_FIELDS if k in given}  # pipeviz 0.4's keywords: the config's fields
    opts = CostOptions.of(options, **{k: given.pop(k) for k in CostChanges.__optional_keys__ if k in given})
    ranks = plan.num_stages
    base = config or LaunchConfig(loss_fn=cross_entropy)  # a training run unless the config says otherwise
    if run:
        deprecated(f"pv.compare(..., {', '.join(f'{k}=' for k in run)}): the run's settings come in its config: "
                   f"pv.compare(plan, config=pv.LaunchConfig({', '.join(f'{k}=...' for k in run)}, ...)).")
        base = base.replace(**run)
    forward_only = given.pop("forward_only", None)
    forward_only = base.loss_fn is None if forward_only is None else forward_only
    given["forward_only"] = forward_only  # each row's simulation: training or forward only
    rows, tls, skipped, why = [], {}, {}, {}
    splits: dict[int, SplitPlan | PlanError] = {}
    for name in schedules or sched.ALL:
        trait = sched.info(name)
        canon = trait.name
        if forward_only and not trait.forward_only:
            why[canon] = f"{canon} cannot run forward only (torch 2.13's V-shaped schedules need a backward)"
            skipped[canon] = why[canon] + "."
            continue
        v = 1 if not trait.multi else stages_per_rank or trait.stages_per_rank
        run_plan = plan
        if v > 1:
            if v not in splits:
                try:
                    splits[v] = balance(plan.graph, ranks * v, by=by, options=opts)
                except PlanError as exc:
                    splits[v] = exc
            split = splits[v]
            if isinstance(split, SplitPlan):
                run_plan = split
            else:
                why[canon] = (f"{canon} on {ranks} ranks needs {ranks * v} stages ({v} per rank): the graph has "
                              f"{len(plan.graph.layer_names)} layers")
                skipped[canon] = f"{why[canon]}. Fix: a finer graph (graph.expand(name)) or fewer ranks."
                continue
        cfg = base.replace(schedule=canon, microbatches=microbatches, stages_per_rank=None if v == 1 else v,
                           order=None)  # each row its schedule's own order (a config's custom one is not theirs)
        try:
            tl = simulate(run_plan, cfg, options=opts, **given)
        except ScheduleError as exc:
            skipped[canon] = str(exc)
            why[canon] = str(exc)
            continue
        tls[canon] = tl
        rows.append(ComparisonRow(canon, tl.num_ranks, run_plan.num_stages, tl.step_time, tl.bubble_fraction,
                                  tl.meta["memory_bytes"], tl.meta["peak_activation_bytes"], run_plan, cfg))
    return Comparison(rows, tls, skipped, why)
