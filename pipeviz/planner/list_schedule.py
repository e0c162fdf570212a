"""The search behind ``pipeviz.planner.synthesize``: one placement's problem (``Problem``), the list scheduler that
builds an order from a rule (``Policy``, ``ListScheduler``), the exact play of an order (``replay``: the rules of
``pipeviz.sim.engine.play`` and of ``pipeviz.cost.memory.peak_activations``), and the priority search over rules
(``Search``). Orders here are per-rank lists of ``(stage, kind, microbatch)`` ints; torch's text (``"2I3"``) is
``pipeviz.planner.synthesize``'s edge.

Example:
    >>> p = build_problem(costs, layout, "loop", microbatches=8, limit=None, split=True, optimizer_states=2)
    >>> best = Search(p).run()[0]          # the fastest order found that fits, as a Candidate
    >>> replay(p, best.order)              # (step, per-rank activation peaks)
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeviz.cost.memory import static_memory
from pipeviz.cost.model import Costs
from pipeviz.schedule import traits as sched

__all__ = ["KINDS", "Candidate", "ListScheduler", "Order", "Policy", "Problem", "Search", "build_problem", "merged",
           "replay", "sequential", "spr_arg", "torch_names", "torch_orders"]

FWD, BWD, IGRAD, WGRAD = 0, 1, 2, 3  # action kinds as ints inside the search; torch's letters at the edges
KINDS = "FBIW"
Order = list[list[tuple[int, int, int]]]  # per rank: (stage, kind, microbatch)


# ------------------------------------------------------------------------------------------- the problem
@dataclass(frozen=True)
class Problem:
    """One placement's search problem: per stage its rank, action times and activation bytes; per rank the activation
    bytes the limit leaves (``inf`` without one) and one microbatch's bytes over its stages."""

    placement: str
    schedule: str  # the torch schedule whose layout places the stages this way (the launch's)
    spr: int
    ranks: tuple[int, ...]
    stages: tuple[tuple[int, ...], ...]
    microbatches: int
    dur: tuple[tuple[float, ...], ...]  # per stage: F, B, I, W seconds
    comm: tuple[float, ...]
    act: tuple[float, ...]
    at_input: tuple[float, ...]  # share of act an I frees (the rest at W)
    budget: tuple[float, ...]
    need: tuple[float, ...]
    split: bool

    @property
    def n(self) -> int:
        return len(self.ranks)

    @property
    def num_ranks(self) -> int:
        return len(self.stages)


def build_problem(costs: Costs, lay: sched.Layout, placement: str, microbatches: int, limit: int | None, split: bool,
             optimizer_states: int) -> Problem:
    n = lay.num_stages
    stages = tuple(tuple(lay.stages_of(r)) for r in lay.ranks)
    rebuilt = costs.recompute_bytes or (0,) * n
    act = tuple(float(a) for a in costs.activation_bytes)
    budget = tuple(math.inf if limit is None else
                   limit - static_memory(costs, st, optimizer_states) - max(rebuilt[s] for s in st) for st in stages)
    comm = tuple(0.0 if lay.stage_ranks[s] == lay.stage_ranks[s + 1] else costs.comm[s] for s in range(n - 1))
    dur = tuple(tuple(costs.duration(s, k) for k in KINDS) for s in range(n))
    at_input = tuple(costs.input_freed) if costs.input_freed else (costs.weight_fraction,) * n
    return Problem(placement, lay.schedule, lay.stages_per_rank, lay.stage_ranks, stages, microbatches,
                    dur, comm, act, at_input, budget, tuple(sum(act[s] for s in st) for st in stages), split)


# ------------------------------------------------------------------------------------------- one schedule
@dataclass(frozen=True)
class Policy:
    """The rule a list-scheduled order follows (see the module docstring).

    Attributes:
        split: backwards as an input-grad ``I`` and a weight-grad ``W`` (zero bubble), else whole ``B``.
        lag: per rank, the ``W`` passes it keeps pending; one more falls due and runs before the next forward.
        fill: a pending ``W`` runs whenever nothing else is ready (else only when due, when memory needs it, or at
            the end).
        deep_f, deep_b: among ready forwards (backwards) on a rank, the later stage first (depth-first, as
            Interleaved1F1B) or the earlier (breadth-first, as LoopedBFS).
        cap: per rank, the most microbatches in flight (forward begun, backward not done) on it; empty: no cap.
        sigma: the share of the memory headroom above one microbatch's activations a rank may fill with forwards.
        reserve: room a microbatch entering a rank must leave for activations on the rank's later stages:
            ``"one"`` (one microbatch's: the oldest in flight can always run its next forward, so no memory deadlock
            with 2 stages per rank), ``"all"`` (every admitted microbatch's, deadlock-free for any count) or
            ``"none"`` (a rank full of first-chunk forwards can deadlock: such a candidate is dropped).
        bwd_first: a ready backward before a ready forward (1F1B's rule), else forward first.
        patience: wait for a backward that arrives within this share of the action the rank would start instead
            (0: never wait while something can run).
    """

    split: bool
    lag: tuple[float, ...]
    fill: bool = True
    deep_f: bool = True
    deep_b: bool = True
    cap: tuple[float, ...] = ()
    sigma: float = 1.0
    reserve: str = "one"
    bwd_first: bool = True
    patience: float = 0.0

    def describe(self) -> str:
        lag = "" if not self.split else f", W pending per rank {_short(self.lag)}" + (", W fills gaps" * self.fill)
        cap = f", in flight per rank {_short(self.cap)}" if self.cap else ""
        mem = f", {self.sigma:.0%} of the memory headroom" if self.sigma < 1 else ""
        first = "backward" if self.bwd_first else "forward"
        depth = f", forwards {'depth' if self.deep_f else 'breadth'}-first"
        return f"list schedule: {first} first{', I/W split' if self.split else ''}{lag}{cap}{mem}{depth}"


def _short(values: Sequence[float]) -> str:
    return "[" + ", ".join("inf" if math.isinf(v) else str(int(v)) for v in values) + "]"


class ListScheduler:
    """Builds one order: ranks play forward in time; the rank that can start something earliest picks, among its
    actions whose inputs have arrived by then, by the policy (microbatches in order on every stage)."""

    def __init__(self, p: Problem, pol: Policy) -> None:
        n, m, ranks = p.n, p.microbatches, p.num_ranks
        self.p, self.pol = p, pol
        self.nf, self.nb = [0] * n, [0] * n
        self.tf = [[0.0] * m for _ in range(n)]
        self.tb = [[0.0] * m for _ in range(n)]
        self.free, self.live, self.resv = [0.0] * ranks, [0.0] * ranks, [0.0] * ranks
        self.inflight, self.fb_left = [0] * ranks, [2 * m * len(st) for st in p.stages]
        self.wq: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
        self.limit = [b if math.isinf(b) else nd + pol.sigma * (b - nd) for b, nd in zip(p.budget, p.need, strict=True)]
        self.cap = pol.cap or (math.inf,) * ranks
        self.fpref = [sorted(st, reverse=pol.deep_f) for st in p.stages]
        self.bpref = [sorted(st, reverse=pol.deep_b) for st in p.stages]
        self.out: Order = [[] for _ in range(ranks)]

    def run(self) -> Order | None:
        p = self.p
        picks = [self.pick(r) for r in range(p.num_ranks)]
        when = [math.inf if pk is None else pk[0] for pk in picks]
        for _ in range(sum(len(st) for st in p.stages) * p.microbatches * (3 if self.pol.split else 2)):
            t = min(when)
            if math.isinf(t):
                return None  # every rank waits: the policy ran into a memory deadlock
            best = when.index(t)
            _, s, k, m = picks[best]  # type: ignore[misc]
            self.apply(best, t, s, k, m)
            touched = [best]
            if k == FWD and s + 1 < p.n:
                touched.append(p.ranks[s + 1])
            elif k != WGRAD and s > 0:
                touched.append(p.ranks[s - 1])
            for q in touched:
                pk = picks[q] = self.pick(q)
                when[q] = math.inf if pk is None else pk[0]
        return self.out

    def admits(self, r: int, s: int) -> bool:
        """May rank ``r`` run stage ``s``'s next forward now (in-flight cap, memory rule)?"""
        p, pol = self.p, self.pol
        if s != p.stages[r][0]:  # a microbatch already on the rank (with "all", its room reserved when it entered)
            return pol.reserve == "all" or self.live[r] + p.act[s] <= self.limit[r] + 1e-6
        if self.inflight[r] >= self.cap[r]:
            return False
        room = p.act[s] if pol.reserve == "none" else p.need[r]
        return self.live[r] + self.resv[r] + room <= self.limit[r] + 1e-6

    def pick(self, r: int) -> tuple[float, int, int, int] | None:
        """Rank ``r``'s next action and its start: ``(start, stage, kind, microbatch)``; None: nothing it may run
        until another rank finishes something."""
        p, pol, last = self.p, self.pol, self.p.n - 1
        nf, nb, tf, tb, comm = self.nf, self.nb, self.tf, self.tb, p.comm
        soonest = math.inf
        bs: list[tuple[float, int, int]] = []  # ready backwards, in the policy's preference
        for s in self.bpref[r]:
            m = nb[s]
            if m < nf[s]:
                if s == last:
                    ready = tf[s][m]
                elif nb[s + 1] > m:
                    ready = tb[s + 1][m] + comm[s]
                    if tf[s][m] > ready:
                        ready = tf[s][m]
                else:
                    continue
                bs.append((ready, s, m))
                if ready < soonest:
                    soonest = ready
        fs: list[tuple[float, int, int]] = []
        blocked = False
        for s in self.fpref[r]:
            m = nf[s]
            if m < p.microbatches and (s == 0 or nf[s - 1] > m):
                if self.admits(r, s):
                    ready = 0.0 if s == 0 else tf[s - 1][m] + comm[s - 1]
                    fs.append((ready, s, m))
                    if ready < soonest:
                        soonest = ready
                else:
                    blocked = True
        wq, t = self.wq[r], self.free[r]
        forced = len(wq) > pol.lag[r]
        w_ok = bool(wq) and (pol.fill or forced or blocked or self.fb_left[r] == 0)
        if not w_ok and soonest == math.inf:
            return None
        if soonest > t and not w_ok:
            t = soonest
        back = fwd = w = None
        for ready, s, m in bs:
            if ready <= t:
                back = (t, s, IGRAD if pol.split else BWD, m)
                break
        for ready, s, m in fs:
            if ready <= t:
                fwd = (t, s, FWD, m)
                break
        if w_ok:
            w = (t, wq[0][0], WGRAD, wq[0][1])
        due = w if forced else None
        choice = ((back or due or fwd or w) if pol.bwd_first else (due or fwd or back or w))
        if pol.patience and back is None and bs:
            soon, s, m = min(bs)  # a backward already under way downstream: its gradient lands then
            if soon < t + pol.patience * p.dur[choice[1]][choice[2]]:  # type: ignore[index]
                return (soon, s, IGRAD if pol.split else BWD, m)
        return choice

    def apply(self, r: int, t: float, s: int, k: int, m: int) -> None:
        p = self.p
        end = t + p.dur[s][k]
        self.free[r] = end
        self.out[r].append((s, k, m))
        entry = s == p.stages[r][0]
        if k == FWD:
            self.nf[s] += 1
            self.tf[s][m] = end
            self.live[r] += p.act[s]
            self.fb_left[r] -= 1
            self.inflight[r] += entry
            if self.pol.reserve == "all":
                self.resv[r] += p.need[r] - p.act[s] if entry else -p.act[s]
        elif k == WGRAD:
            self.wq[r].popleft()
            self.live[r] -= p.act[s] * (1 - p.at_input[s])
        else:
            self.nb[s] += 1
            self.tb[s][m] = end
            self.fb_left[r] -= 1
            self.inflight[r] -= entry
            self.live[r] -= p.act[s] * (1 if k == BWD else p.at_input[s])
            if k == IGRAD:
                self.wq[r].append((s, m))


def merged(p: Problem, order: Order) -> Order:
    """An ``I`` followed at once by its own ``W`` becomes one ``B`` where no other rank waits on the ``I`` (stage 0,
    or the stage before on the same rank): the same moments, one action less (and under recomputation one
    recomputed forward less)."""
    out: Order = []
    for r, acts in enumerate(order):
        row: list[tuple[int, int, int]] = []
        for a in acts:
            if (a[1] == WGRAD and row and row[-1] == (a[0], IGRAD, a[2])
                    and (a[0] == 0 or p.ranks[a[0] - 1] == r)):
                row[-1] = (a[0], BWD, a[2])
            else:
                row.append(a)
        out.append(row)
    return out


def replay(p: Problem, order: Order) -> tuple[float, list[float]] | None:
    """``order`` played as ``pipeviz.sim.engine.play`` plays it (each action once its rank is free and its input has
    arrived): the step, and per rank the peak of live activations (``peak_activations``' rule); None: deadlock."""
    n = p.n
    tf: dict[tuple[int, int], float] = {}
    tb: dict[tuple[int, int], float] = {}
    ti: dict[tuple[int, int], float] = {}
    pos, free = [0] * len(order), [0.0] * len(order)
    left = sum(len(a) for a in order)
    while left:
        moved = False
        for r, acts in enumerate(order):
            while pos[r] < len(acts):
                s, k, m = acts[pos[r]]
                if k == FWD:
                    ready = 0.0 if s == 0 else (tf[s - 1, m] + p.comm[s - 1] if (s - 1, m) in tf else None)
                elif k == WGRAD:
                    ready = ti.get((s, m))
                elif s == n - 1:
                    ready = tf.get((s, m))
                else:
                    ready = tb[s + 1, m] + p.comm[s] if (s + 1, m) in tb and (s, m) in tf else None
                if ready is None:
                    break
                end = free[r] = max(free[r], ready) + p.dur[s][k]
                if k != WGRAD:  # a forward, or the backward (I or B) the stage before waits on
                    (tf if k == FWD else tb)[s, m] = end
                if k == IGRAD:
                    ti[s, m] = end
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            return None
    return max(free), peaks(p, order)


def peaks(p: Problem, order: Order) -> list[float]:
    peaks = []
    for acts in order:
        live = peak = 0.0
        for s, k, _ in acts:
            if k == FWD:
                live += p.act[s]
                peak = max(peak, live)
            else:
                live -= p.act[s] * (1 if k == BWD else p.at_input[s] if k == IGRAD else 1 - p.at_input[s])
        peaks.append(peak)
    return peaks


def sequential(p: Problem) -> Order:
    """One microbatch at a time through every stage and back: the least memory any order needs."""
    out: Order = [[] for _ in range(p.num_ranks)]
    for m in range(p.microbatches):
        for s in range(p.n):
            out[p.ranks[s]].append((s, FWD, m))
        for s in reversed(range(p.n)):
            out[p.ranks[s]].append((s, BWD, m))
    return out


# ------------------------------------------------------------------------------------------- the search
@dataclass
class Candidate:
    step: float
    peak: float  # the largest share of a rank's activation budget used (0 without a limit)
    order: Order
    policy: str
    problem: Problem


class Search:
    """The priority search over one placement: a grid of policies, variants of the best, then per-rank refinement."""

    def __init__(self, p: Problem) -> None:
        self.p = p
        self.seen: dict[tuple[tuple[tuple[int, int, int], ...], ...], Candidate] = {}
        self.evaluated = 0

    def evaluate(self, pol: Policy) -> float:
        """Build and play ``pol``'s order; keep it when it fits. Returns its step (inf: deadlocked or over)."""
        self.evaluated += 1
        order = ListScheduler(self.p, pol).run()
        return math.inf if order is None else self.consider(merged(self.p, order), pol.describe())

    def consider(self, order: Order, policy: str) -> float:
        key = tuple(tuple(a) for a in order)
        if key in self.seen:
            return self.seen[key].step
        played = replay(self.p, order)
        if played is None:
            return math.inf
        step, peaks = played
        use = max((pk / b if b > 0 else (0.0 if pk <= 0 else math.inf)) if not math.isinf(b) else 0.0
                  for pk, b in zip(peaks, self.p.budget, strict=True))
        if use > 1 + 1e-9:
            return math.inf
        self.seen[key] = Candidate(step, use, order, policy, self.p)
        return step

    def run(self) -> list[Candidate]:
        p = self.p
        grid = policies(p)
        scored = sorted(((self.evaluate(pol), i) for i, pol in enumerate(grid)))
        best: list[tuple[float, Policy]] = []
        for _, i in scored[:3]:
            best += [(self.evaluate(v), v) for v in variants(p, grid[i])]
        best.sort(key=lambda x: x[0])
        for _, pol in best[:2]:
            self.refine(pol)
        return sorted(self.seen.values(), key=lambda c: (c.step, c.peak))

    def refine(self, pol: Policy) -> None:
        """Coordinate descent, rank by rank, on how many ``W`` a rank keeps pending and how many microbatches it
        admits: each change kept when the step shrinks."""
        step = self.evaluate(pol)
        for _ in range(2):
            improved = False
            for r in range(self.p.num_ranks):
                for name in ("lag", "cap"):
                    vec = list(getattr(pol, name))
                    if not vec or math.isinf(vec[r]) or (name == "lag" and not pol.split):
                        continue
                    for delta in (-1, 1):
                        if vec[r] + delta < (0 if name == "lag" else 1):
                            continue
                        moved = tuple(v + delta * (q == r) for q, v in enumerate(vec))
                        trial = replace(pol, lag=moved) if name == "lag" else replace(pol, cap=moved)
                        got = self.evaluate(trial)
                        if got < step - 1e-12:
                            pol, step, improved = trial, got, True
                            break
            if not improved:
                return


    def widen(self, restarts: int, seed: int = 0) -> list[Candidate]:
        """A wider search than ``run``'s (seconds to a minute, not interactive): ``restarts`` local searches, each
        from a random rule (per-rank ``W`` lags and in-flight caps, either order of backward and forward, any memory
        reserve and patience) moved one step at a time (a rank's lag or cap by one, one switch) while the step
        shrinks. It reaches V-Min's point (docs/synthesis.md), which ``run``'s grid misses. Seeded: repeatable."""
        rng, ranks = random.Random(seed), self.p.num_ranks
        split = self.p.split
        for _ in range(restarts):
            pol = Policy(split, tuple(float(rng.choice([0, 1, 2, 3, 4, math.inf])) for _ in range(ranks)),
                         rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5,
                         tuple(float(rng.randint(1, 2 * ranks)) for _ in range(ranks)), rng.choice([1.0, 0.9, 0.75]),
                         rng.choice(["one", "all", "none"]), rng.random() < 0.5, rng.choice([0.0, 0.0, 0.5, 1.0, 2.0]))
            step, moved = self.evaluate(pol), True
            while moved:
                moved = False
                for trial in _neighbours(pol, ranks):
                    got = self.evaluate(trial)
                    if got < step - 1e-12:
                        pol, step, moved = trial, got, True
                        break
        return sorted(self.seen.values(), key=lambda c: (c.step, c.peak))


def _neighbours(pol: Policy, ranks: int) -> list[Policy]:
    out = []
    for r in range(ranks):
        for d in (-1, 1):
            if not math.isinf(pol.lag[r]) and pol.lag[r] + d >= 0:
                out.append(replace(pol, lag=tuple(v + d * (q == r) for q, v in enumerate(pol.lag))))
            if not math.isinf(pol.cap[r]) and pol.cap[r] + d >= 1:
                out.append(replace(pol, cap=tuple(v + d * (q == r) for q, v in enumerate(pol.cap))))
    out += [replace(pol, fill=not pol.fill), replace(pol, deep_f=not pol.deep_f), replace(pol, deep_b=not pol.deep_b),
            replace(pol, bwd_first=not pol.bwd_first)]
    return (out + [replace(pol, reserve=rs) for rs in ("one", "all", "none")]
            + [replace(pol, patience=pt) for pt in (0.0, 0.5, 1.0, 2.0)])


def policies(p: Problem) -> list[Policy]:
    ranks = p.num_ranks
    deep = [(True, True), (False, False), (True, False), (False, True)] if p.spr > 1 else [(True, True)]
    never = (math.inf,) * ranks
    out = [Policy(False, never, deep_f=df, deep_b=db) for df, db in deep]
    if p.split:
        lags = [never, tuple(float(r) for r in range(ranks)), tuple(2.0 * r for r in range(ranks)), (0.0,) * ranks]
        out += [Policy(True, lag, fill, df, db) for lag in lags for fill in (True, False) for df, db in deep]
    return out


def variants(p: Problem, pol: Policy) -> list[Policy]:
    """``pol`` under other memory windows: in-flight caps (1F1B's p - r, and wider), a share of the headroom, with
    and without reserving a microbatch's later stages, forward first."""
    ranks = p.num_ranks
    limited = not all(math.isinf(b) for b in p.budget)
    caps = [(), *(tuple(float(math.ceil(c * (ranks - r) * p.spr)) for r in range(ranks)) for c in (0.5, 1.0, 1.5))]
    sigmas, reserves = ((1.0, 0.75, 0.5), ("one", "all", "none")) if limited else ((1.0,), ("one",))
    out = [replace(pol, cap=cap, sigma=sg, reserve=rs) for cap in caps for sg in sigmas for rs in reserves]
    return (out + [replace(pol, bwd_first=False, cap=cap) for cap in caps[1:]]
            + [replace(pol, patience=pt) for pt in (0.5, 1.0)])


def torch_orders(p: Problem) -> dict[str, Order]:
    """torch's schedules that place the stages as ``p`` does, as orders (the pool's floor)."""
    out: dict[str, Order] = {}
    for name in torch_names(p):
        acts = sched.orders(name, p.n, p.microbatches, spr_arg(name, p.spr))
        out[name] = [[(a.stage, KINDS.index(a.kind), a.mb) for a in row] for row in acts]
    return out


def torch_names(p: Problem) -> list[str]:
    names = []
    for name in sched.ALL:
        info = sched.info(name)
        if (info.split_backward and not p.split) or (not info.multi and p.spr != 1):
            continue
        try:
            lay = sched.layout(name, p.n, spr_arg(name, p.spr))
            sched.check_microbatches(name, p.n, p.microbatches, spr_arg(name, p.spr))
        except sched.ScheduleError:
            continue
        if lay.stage_ranks == p.ranks:
            names.append(name)
    return names


def spr_arg(name: str, spr: int) -> int | None:
    return spr if sched.info(name).multi else None
