"""What a pipeline that stopped making progress is stuck on (``diagnose``): per rank, the last action it finished
and the one it is in, whom that one waits for, the cycle if ranks wait on each other, and the likely cause.

A rank runs its actions in its schedule's order (torch's, or a custom ``order=``). Its next action after the last
one it finished needs data from other ranks: a forward the previous stage's forward of the same microbatch, a
backward its own forward and the next stage's backward, a weight-grad pass its input-grad pass. If one of those has
not finished on the rank that holds it, the rank is blocked receiving it from that rank; if all have, the rank is
inside the action itself (computing, or stuck in its own code or a collective). Following "waits for" from rank to
rank ends at a rank that computes (the one to look at) or closes a cycle (a deadlock: the orders wait on each other).

Example:
    >>> report = diagnose(pv.schedule.orders("1F1B", 2, 4), [0, 1], {(0, "F", 0), (1, "F", 0)})
    >>> print(report)      # rank 1 is in 1B0 ...; rank 0 waits for rank 1's 1B0 (a receive) ...
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from pipeviz.schedule import traits as sched

__all__ = ["HangReport", "RankState", "diagnose"]

Done = tuple[int, str, int]  # (stage, kind, microbatch) of a finished action


@dataclass(frozen=True)
class RankState:
    """One pipeline rank when the run stopped.

    Attributes:
        rank: the pipeline rank.
        last: the last action of its order it finished (torch's notation, ``"1F3"``), None before its first.
        current: the action it is in (the next in its order), None when it finished every action of the step.
        waits_on: the rank whose action ``current`` needs and that has not finished it (None: it needs nothing
            unfinished, so the rank is inside ``current`` itself).
        waits_for: that action (``"2B1"``).
        what: the state in words.
    """

    rank: int
    last: str | None
    current: str | None
    waits_on: int | None
    waits_for: str | None
    what: str


@dataclass(frozen=True)
class HangReport:
    """``diagnose``'s answer: every rank's state, the cycle of ranks waiting on each other (empty: none) and the
    likely cause with the fix."""

    ranks: list[RankState]
    cycle: list[int] = field(default_factory=list)
    cause: str = ""

    def __str__(self) -> str:
        lines = [f"  rank {r.rank}: {r.what}" for r in self.ranks]
        cycle = (" Ranks " + " -> ".join(map(str, [*self.cycle, self.cycle[0]])) + " wait on each other."
                 if self.cycle else "")
        cause = self.cause[:1].upper() + self.cause[1:]
        return "\n".join([*lines, f"  Likely cause:{cycle} {cause}"])


def _needs(s: int, kind: str, mb: int, n: int) -> list[Done]:
    if kind == "F":
        return [(s - 1, "F", mb)] if s > 0 else []
    if kind == "W":
        return [(s, "I", mb)]
    needs = [(s, "F", mb)]
    if s < n - 1:
        needs.append((s + 1, "B", mb))
    return needs


def _finished(done: Collection[Done], need: Done) -> bool:
    s, kind, mb = need
    return need in done or (kind == "B" and (s, "I", mb) in done)  # a split backward's input-grad pass hands on


def diagnose(orders: Sequence[Sequence[sched.Action | str]], stage_ranks: Sequence[int], done: Collection[Done],
             computing_for: float | None = None) -> HangReport:
    """The state of a stuck step: ``orders`` (one list of ``Action``s per pipeline rank: what
    ``pv.schedule.orders`` gives, or a custom order, ``LaunchConfig.actions()``), ``stage_ranks`` (the rank
    holding each stage) and the actions finished in the step, as ``(stage, kind, microbatch)``. ``computing_for``:
    seconds since the last progress, said of a rank inside its own action."""
    n = len(stage_ranks)
    states: list[RankState] = []
    for rank, acts in enumerate(orders):
        parsed = [sched.action(a) for a in acts]  # Actions as they are (text, as a user may give it, read)
        pos = 0
        while pos < len(parsed) and (parsed[pos].stage, parsed[pos].kind, parsed[pos].mb) in done:
            pos += 1
        last = str(parsed[pos - 1]) if pos else None
        if pos == len(parsed):
            states.append(RankState(rank, last, None, None, None, f"finished its {len(parsed)} actions of the step "
                                    f"(last {last}); waits at the step's end for the others"))
            continue
        cur = parsed[pos]
        missing = [need for need in _needs(cur.stage, cur.kind, cur.mb, n) if not _finished(done, need)]
        after = f"after {last}" if last else "before its first action"
        if not missing:
            how = f" for {computing_for:.1f} s" if computing_for is not None else ""
            states.append(RankState(rank, last, str(cur), None, None,
                                    f"is in {cur} ({after}): every input it needs has arrived, so it has been "
                                    f"computing{how} or is stuck inside it (its own code, a lock, a collective)"))
            continue
        ms, mk, mmb = missing[0]
        peer = stage_ranks[ms]
        need = str(sched.Action(ms, sched.Kind(mk), mmb))
        verb = "forward" if mk == "F" else "backward"
        if peer == rank:
            what = (f"is at {cur} ({after}), which needs its own {need}, later in its order: its order cannot run "
                    "(an action before what it needs)")
        else:
            direction = "activations" if mk == "F" else "gradients"
            what = (f"is blocked in {cur} ({after}), receiving the {direction} of stage {ms}'s {verb} of "
                    f"microbatch {mmb} ({need}) from rank {peer}")
        states.append(RankState(rank, last, str(cur), peer, need, what))
    cycle = find_cycle(states)
    return HangReport(states, cycle, _cause(states, cycle))


def find_cycle(states: list[RankState]) -> list[int]:
    by_rank = {s.rank: s for s in states}
    for start in by_rank:
        seen: list[int] = []
        r: int | None = start
        while r is not None and r not in seen:
            seen.append(r)
            r = by_rank[r].waits_on if r in by_rank else None
        if r is not None:
            return seen[seen.index(r):]
    return []


def _cause(states: list[RankState], cycle: list[int]) -> str:
    if cycle:
        return ("the ranks' orders deadlock: each waits for an action the next has not reached. Fix: reorder the "
                "custom order (pv.simulate(plan, cfg) plays it and names the deadlock), or give the schedule the "
                "microbatches it needs (pv.schedules.check_microbatches).")
    stuck = [s for s in states if s.current is not None and s.waits_on is None]
    waiting = [s for s in states if s.waits_on is not None]
    if stuck:
        names = ", ".join(f"rank {s.rank} in {s.current}" for s in stuck)
        return (f"{names}: the others wait on it. A stage's computation (or a loss, or a custom op) runs longer than "
                "the timeout or never returns. Fix: look at that stage's code for a loop, a lock or a sleep; raise "
                "launch(timeout=...) if it is only slow.")
    if waiting:
        peers = sorted({s.waits_on for s in waiting if s.waits_on is not None})
        return (f"rank(s) {', '.join(map(str, peers))} finished what the others wait for, but it never arrived: "
                "a hand-off of another shape or dtype than the receiving stage expects, or a process that died. "
                "Fix: batches shaped like the traced example; run.error of the other ranks.")
    return "every rank finished its actions: the step is stuck after them (the optimizer, a gradient reduction)."
