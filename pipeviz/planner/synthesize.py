"""``synthesize_schedule``: find the fastest order of a plan's forwards and backwards that fits a memory limit.

torch ships seven schedules; a schedule is only an order of actions per rank (``LaunchConfig.order``), which pipeviz
simulates, checks for deadlocks and launches through torch's own runtime. This module *searches* that space:

    >>> syn = pv.synthesize_schedule(plan, pv.LaunchConfig(schedule="ZBVZeroBubble", microbatches=8,
    ...                              loss_fn=pv.cross_entropy), memory_limit=3 * 2**30)
    >>> syn.step_time, syn.timeline.meta["memory_bytes"]      # pv.simulate of the order found
    >>> run = pv.launch(plan, syn.config, inputs=(x,), target=y)   # syn.config = the config with order=syn.order
    >>> syn.to_csv("schedule.csv")                               # torch's _load_csv format (torchtitan takes it)

Method: a **list scheduler with a priority search**. One schedule is built by playing the ranks forward in time,
as the simulator does: whenever a rank is free it picks, among the actions whose inputs have arrived, by a
*policy* (backward before forward, the weight-grad pass ``W`` deferred until it is due or fills an idle gap, the
deeper or the shallower stage first, a microbatch admitted onto a rank only while the memory rule leaves room for
all of its stages there, at most so many microbatches in flight). The search runs a grid of such policies (both
placements, looped and V-shaped, where the stages allow), then refines the best per rank (how many ``W`` a rank
keeps pending, how many microbatches it admits), each candidate played exactly by the same rules as
``pipeviz.sim.engine.play`` and read by the one memory rule (``pipeviz.cost.memory.peak_activations``). torch's own
orders for the same placement, and the one-microbatch-at-a-time order (the least memory any order needs), join the
pool. The best candidates are then simulated by ``pv.simulate`` itself, which also plays their sends and receives as
torch's runtime lowers them (``pipeviz.schedule.comm_order``): the answer is the fastest that plays without a
deadlock and whose ``memory_bytes`` stay within the limit, "fastest" by its step with each receive charged where
torch's runtime posts it (``pipeviz.planner.receives.charged_step``; ``Synthesis.charged_step``): the runtime posts
some receives only just before their consumer, so their hand-offs cannot hide under compute as ``pv.simulate``
lets them, and a launched order follows that step (docs/synthesis.md, "Runs as simulated").

Why this method: the ranks' idle time comes from waiting on each other, which a list scheduler sees directly, and
the known good schedules are such greedy rules (1F1B, ZB-H1 and ZB-H2 are "backward first, defer W" under
different memory windows; Qi et al. built ZB's automatic schedules with the same kind of heuristic), so a small
grid over the rules contains them; every candidate costs one pass over the actions (milliseconds), so a few hundred
fit in an interactive second, where a MILP over the same decisions (OptPipe's approach) needs a solver dependency and
grows quickly with ranks x microbatches.
The search is not exhaustive: what it guarantees is that torch's orders are in the pool (the answer's step, its
receives charged as posted, is never above any torch schedule's that fits, charged alike) and that an order exists
whenever the limit is at least the smallest feasible one (``MemoryLimitError`` names it otherwise). On the
textbook costs it recovers ZB-H1, ZB-H2, ZB-V and V-Half at their memory (and beats ZB-H2's rule where ``W`` is
cheaper than ``I``); V-Min only with the wider, slower search (``list_schedule.Search.widen``, docs/synthesis.md).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeviz.cost.memory import static_memory
from pipeviz.cost.model import Costs
from pipeviz.cost.options import CostOptions
from pipeviz.plan.split import SplitPlan
from pipeviz.planner.list_schedule import (
    KINDS,
    Candidate,
    Search,
    build_problem,
    sequential,
    spr_arg,
    torch_names,
    torch_orders,
)
from pipeviz.planner.receives import charged_step
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig, launch_config
from pipeviz.schedule.timeline import Timeline
from pipeviz.sim.collectives import Collectives
from pipeviz.sim.simulate import simulate

__all__ = ["PLACEMENTS", "MemoryLimitError", "Synthesis", "smallest_limit", "synthesize_schedule"]

PLACEMENTS = ("auto", "loop", "v")
_FINALISTS = 8  # at most this many candidates simulated by pv.simulate (with the comm-order check)


class MemoryLimitError(sched.ScheduleError):
    """No order of the plan fits ``memory_limit``: ``smallest`` is the least limit any order fits (bytes per rank)."""

    def __init__(self, message: str, smallest: int) -> None:
        super().__init__(message)
        self.smallest = smallest


@dataclass(frozen=True)
class Synthesis:
    """A synthesized schedule: ``order`` (per pipeline rank, ``Action``s; ``to_csv`` writes torch's text) and
    ``timeline`` (its ``pv.simulate``); ``config`` launches it (the given config with ``order``, and the schedule
    whose placement the order uses: ``pv.launch(plan, syn.config, ...)``). ``baselines``: torch's schedules on the
    same ranks, simulated by name; ``fits``: those within the limit. ``policy``: the rule that built the order (or
    the torch schedule whose order won); ``evaluated``: candidate orders played. ``charged_step``: the order's step
    with each receive charged where torch's runtime posts it (``pipeviz.planner.receives``), what the order was
    chosen by; ``charged_baselines`` the same for torch's schedules: the order's is never above theirs where they
    fit."""

    order: tuple[tuple[sched.Action, ...], ...]
    timeline: Timeline
    config: LaunchConfig
    memory_limit: int | None
    placement: str
    policy: str
    baselines: dict[str, Timeline] = field(default_factory=dict)
    evaluated: int = 0
    charged_step: float = 0.0

    @property
    def step_time(self) -> float:
        return self.timeline.step_time

    @property
    def charged_baselines(self) -> dict[str, float]:
        """Per torch schedule, its step with each receive charged where torch's runtime posts it."""
        return {k: charged_step(t) for k, t in self.baselines.items()}

    @property
    def memory_bytes(self) -> list[int]:
        """Per rank, the bytes the memory rule says the order holds at its peak."""
        return list(self.timeline.meta["memory_bytes"])

    @property
    def fits(self) -> dict[str, Timeline]:
        """The baselines within the memory limit (all of them without one)."""
        lim = self.memory_limit
        return {k: t for k, t in self.baselines.items() if lim is None or max(t.meta["memory_bytes"]) <= lim}

    def to_csv(self, path: str | Path) -> Path:
        """Write the order as torch's schedule CSV (``_PipelineScheduleRuntime._load_csv``, format
        ``"compute_only"``: one row per rank, one action per cell, ``0F0``), which torchtitan's
        ``pipeline_parallel_schedule_csv`` takes. Returns the path."""
        out = Path(path)
        with out.open("w", newline="") as fh:
            csv.writer(fh).writerows([str(a) for a in row] for row in self.order)
        return out

    def table(self) -> str:
        """The synthesized order beside each torch schedule: step, the step with receives charged where torch's
        runtime posts them ("as posted", what the order was chosen by), and peak memory per rank."""
        def line(name: str, tl: Timeline, note: str = "") -> str:
            mem = ", ".join(_bytes(b) for b in tl.meta["memory_bytes"])
            return f"{name:<24}{_secs(tl.step_time):>12}{_secs(charged_step(tl)):>13}  [{mem}]{note}"

        lim = "no limit" if self.memory_limit is None else f"limit {_bytes(self.memory_limit)} per rank"
        rows = [f"{'schedule':<24}{'step':>12}{'as posted':>13}  memory per rank ({lim})",
                line(f"synthesized ({self.placement})", self.timeline)]
        rows += [line(k, t, "" if k in self.fits else "  over the limit") for k, t in self.baselines.items()]
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def smallest_limit(problem_or_costs: Costs, layout: sched.Layout, optimizer_states: int = 2) -> int:
    """The least ``memory_limit`` (bytes per rank) any order of ``layout`` fits: each rank's weights, gradients,
    optimizer state and buffers, plus one microbatch's activations on every stage it holds (a microbatch's forward
    reaches the last stage before any of its backwards can run, so those are alive at once in every order), plus
    what recomputation rebuilds; reached by running one microbatch at a time."""
    c = problem_or_costs
    rebuilt = c.recompute_bytes or (0,) * len(c.forward)
    return max(static_memory(c, st, optimizer_states) + max(rebuilt[s] for s in st)
               + sum(c.activation_bytes[s] for s in st) for st in (layout.stages_of(r) for r in layout.ranks))


# ------------------------------------------------------------------------------------------- the front door
def synthesize_schedule(
    plan: SplitPlan | None, config: LaunchConfig | str | None = None, memory_limit: float | None = None, *,
    options: CostOptions | None = None, collectives: Collectives | None = None, placement: str = "auto",
    split_backward: bool | None = None, costs: Costs | None = None,
) -> Synthesis:
    """The fastest order found for ``plan`` under ``config`` within ``memory_limit`` bytes per rank.

    Example:
        >>> cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=8, loss_fn=pv.cross_entropy)
        >>> syn = pv.synthesize_schedule(plan, cfg, memory_limit=2 * 2**30)
        >>> print(syn.table())                       # beside torch's schedules on the same ranks
        >>> run = pv.launch(plan, syn.config, inputs=(x,), target=y)
        >>> syn.to_csv("zb_custom.csv")

    Args:
        plan: the ``SplitPlan`` (or None for a what-if with ``costs``, as ``pv.simulate``).
        config: the ``pv.LaunchConfig`` (or a schedule's name): its microbatches, its stages per rank, and the
            rest of the run as ``pv.simulate`` reads it. Its schedule only places the stages (one per rank, looped,
            or V-shaped).
        memory_limit: bytes per rank, in the one memory rule (``pv.simulate(...).meta["memory_bytes"]``: weights,
            gradients, optimizer state, buffers and the live activations of the order); None: no limit.
        options, collectives: how it is costed (``pv.CostOptions``, ``Collectives``), as ``pv.simulate`` takes them.
        placement: ``"auto"`` (with 2 stages per rank both ``"loop"``, as Interleaved1F1B places them, and ``"v"``,
            as ZBVZeroBubble does; else the config's), ``"loop"`` or ``"v"``.
        split_backward: allow input-grad / weight-grad passes (``I``/``W``); default: unless the config refuses
            them (``compile``, ``dp_reduce="ddp"``).
        costs: per-stage ``pv.Costs`` of a what-if without a plan (``pv.Costs.uniform(4)``: 4 stages).

    Returns:
        A ``Synthesis``: ``order``, ``timeline``, ``config`` (launchable with a ``loss_fn``), ``baselines``, and
        ``charged_step``: the step with each receive charged where torch's runtime posts it, which the order was
        chosen by (``timeline.step_time`` is ``pv.simulate``'s; equal where no receive is posted late).

    Raises:
        MemoryLimitError: no order fits the limit; ``err.smallest`` (also in the message) is the least that does.
        ScheduleError: an unknown placement, or one the stage count cannot take.
    """
    cfg = launch_config(config)
    if plan is None and costs is None:
        raise ValueError("synthesize_schedule() needs a plan, or costs=pv.Costs(...) for a what-if without one.")
    n = plan.num_stages if plan is not None else len(costs.forward)  # type: ignore[union-attr]
    limit = None if memory_limit is None else _check_limit(memory_limit)
    split = split_backward if split_backward is not None else not (cfg.compile or cfg.dp_reduce == "ddp")

    def sim(c: LaunchConfig) -> Timeline:  # a training step, as pv.launch would run it
        return simulate(plan, c, options=options, collectives=collectives, costs=costs,
                        num_stages=None if plan is not None else n, forward_only=False)

    states = (options or CostOptions()).optimizer_states
    problems, baselines, smallest = [], {}, {}
    for name, spr in _placements(cfg, n, placement):
        pcfg = cfg.replace(schedule=name, stages_per_rank=spr_arg(name, spr), order=None)
        probe = sim(pcfg)  # the placement's own schedule: what every action on this placement is priced at
        lay, pcosts = pcfg.layout(n), probe.meta["stage_costs"]
        smallest[name] = smallest_limit(pcosts, lay, states)
        p = build_problem(pcosts, lay, "v" if lay.info.v_shape else "loop", cfg.microbatches, limit, split, states)
        baselines.update({t: probe if t == name else sim(pcfg.replace(schedule=t, stages_per_rank=spr_arg(t, spr)))
                          for t in torch_names(p)})
        if limit is None or limit >= smallest[name]:
            problems.append((p, pcfg))
    if not problems:
        raise _too_small(limit or 0, smallest, n, cfg.microbatches)
    pool: list[Candidate] = []
    evaluated = 0
    for p, _ in problems:
        search = Search(p)
        for name, order in torch_orders(p).items():
            search.consider(order, f"torch's {name} order")
        search.consider(sequential(p), "one microbatch at a time (the least memory)")
        ranked = search.run()
        evaluated += search.evaluated
        # every torch order too: the answer's step as its receives are posted is never above theirs
        pool += ranked[:_FINALISTS] + [c for c in ranked[_FINALISTS:] if c.policy.startswith("torch's")]
    return _finish(pool, {p.placement: c for p, c in problems}, sim, limit, baselines, evaluated)


def _finish(pool: list[Candidate], cfgs: dict[str, LaunchConfig], sim: Callable[[LaunchConfig], Timeline],
            limit: int | None, baselines: dict[str, Timeline], evaluated: int) -> Synthesis:
    """The candidates simulated by ``pv.simulate`` (which plays their sends and receives as torch's runtime will
    and refuses a deadlock), fastest first by the search's own play: the fastest within the limit wins, by its step
    with each receive charged where torch's runtime posts it (``pipeviz.planner.receives.charged_step``: a launched
    order follows that one, not the simulated step, where their receives differ). Both only add to the search's
    play (replicas' reductions, shared cores, late receives), so once the best charged step is no longer than the
    next candidate's played one, no later candidate can win."""
    best: tuple[float, int, float, Timeline, Candidate, LaunchConfig] | None = None
    tried = 0
    ranked = sorted(pool, key=lambda c: (c.step, c.peak))
    # torch's own orders are tried however many candidates before them fail: the answer is never slower
    for cand in ranked + [c for c in ranked if c.policy.startswith("torch's")]:
        if best is not None and (best[0] <= cand.step * (1 + 1e-9)
                                 or (tried >= _FINALISTS and not cand.policy.startswith("torch's"))):
            continue
        acts = tuple(tuple(sched.Action(s, sched.Kind(KINDS[k]), m) for s, k, m in row) for row in cand.order)
        cfg = cfgs[cand.problem.placement].replace(order=acts)
        tried += 1
        try:
            tl = sim(cfg)
        except sched.ScheduleError:
            continue  # its communication order would hang under torch's runtime
        mem = max(tl.meta["memory_bytes"])
        if (limit is not None and mem > limit) or (best is not None and tl.step_time > best[0]):
            continue  # over the limit, or slower than the best already (charging its receives only adds)
        charged = charged_step(tl)
        # ties (several orders share a step) go to the one whose simulated step is least, then the least memory
        if best is None or (charged, tl.step_time, mem) < (best[0], best[2], best[1]):
            best = (charged, mem, tl.step_time, tl, cand, cfg)
    if best is None:  # pragma: no cover (the one-at-a-time order always fits and plays)
        raise sched.ScheduleError("No synthesized order passed pv.simulate's checks.")
    charged, _, _, tl, cand, cfg = best
    order = cfg.actions()
    assert order is not None
    return Synthesis(tuple(tuple(r) for r in order), tl, cfg, limit, cand.problem.placement, cand.policy,
                     baselines, evaluated, charged)


def _secs(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def _bytes(n: float) -> str:
    """Bytes in IEC units with 2 decimals: a limit and a peak a few KiB apart stay apart."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _check_limit(limit: float) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0 or math.isinf(limit):
        raise ValueError(f"memory_limit must be a positive number of bytes per rank, or None; got {limit!r}. Fix: "
                         "memory_limit=2 * 2**30 for 2 GiB.")
    return math.floor(limit)


def _placements(cfg: LaunchConfig, n: int, placement: str) -> list[tuple[str, int]]:
    """(schedule placing the stages, stages per rank) for each placement tried: the config's own schedule where it
    places them so and torch accepts its microbatches, else LoopedBFS (looped) or ZBVZeroBubble (V-shaped), whose
    rules take any microbatch count."""
    if placement not in PLACEMENTS:
        raise sched.ScheduleError(f"Unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}.")
    lay = cfg.layout(n)
    spr = lay.stages_per_rank
    wanted = [placement] if placement != "auto" else (["loop", "v"] if spr == 2 else ["loop"])
    if "v" in wanted and spr != 2:
        raise sched.ScheduleError(f"A V-shaped placement needs exactly 2 stages per rank; the config places {spr} "
                                  f"({n} stages on {lay.num_ranks} ranks). Fix: placement='loop', or "
                                  "stages_per_rank=2.")
    out = []
    for kind in wanted:
        own = lay.info.v_shape == (kind == "v")
        try:
            if own:
                sched.check_microbatches(lay.schedule, n, cfg.microbatches, cfg.stages_per_rank)
        except sched.ScheduleError:
            own = False
        out.append((lay.schedule if own else ("ZBVZeroBubble" if kind == "v" else "LoopedBFS"), spr))
    return out


def _too_small(limit: int, smallest: dict[str, int], n: int, microbatches: int) -> MemoryLimitError:
    name, need = min(smallest.items(), key=lambda kv: kv[1])
    return MemoryLimitError(
        f"No order of {n} stages x {microbatches} microbatches fits memory_limit={limit:,} bytes per rank: even one "
        f"microbatch at a time needs {need:,} bytes ({need / 2**20:.2f} MiB) on its fullest rank ({name}'s "
        f"placement: weights, gradients, optimizer state, buffers and one microbatch's activations on each of its "
        f"stages). Smallest feasible limit: {need:,} bytes. Fix: memory_limit >= {need:,}, more microbatches (smaller "
        "ones), more stages, or recompute='full'.", need)
