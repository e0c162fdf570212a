"""A schedule's communication order, checked for deadlock before launch (``check_comms``).

``pipeviz.sim.engine.check_order`` plays a compute order with sends that never block. A real run does not: every
rank posts its sends and receives in an order of its own, and blocks waiting on some of them. gloo sends only into
a receive the peer has posted (measured here: a 16-byte ``isend().wait()`` returns only when the peer posts its
``irecv``, 2 s later), and gloo and NCCL match a pair of ranks' messages in the order they were posted. So this
module plays each rank's *program* (post a send or receive, wait on posted ones, compute) as the runtime issues it:

- torch's multi-stage runtime (``_PipelineScheduleRuntime``: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
  ZBVZeroBubble, DualPipeV, and every custom ``order=``): its ``pipeline_order_with_comms`` (``SEND_F``/``RECV_F``/
  ``SEND_B``/``RECV_B`` actions post, a compute action waits on the receive it consumes, the step's end waits on
  every send);
- ``ScheduleGPipe`` and ``Schedule1F1B``: their ``_step_microbatches`` as torch 2.13 writes them, batched
  send+receive pairs included (``fwd_send_bwd_recv``: both posted, both waited on);
- a hand-made order with communication actions (torch's ``compute_comms`` format): ``check_comm_order``.

A deadlock is refused with the ``HangReport`` a launch that hung on it would give (``pipeviz.schedule.hang``): per rank
the
last compute action, the send or receive it is blocked in, the peer and the action that peer has not posted, and
the cycle. Messages a pair of ranks would match out of order (a receive taking another microbatch's tensor) are
refused too.

Example:
    >>> check_comms("Interleaved1F1B", num_stages=4, microbatches=4)      # torch's own order: passes
    >>> check_comm_order([["0F0", "0RECV_B0", "0B0", "0SEND_F0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]], (0, 1))
    Traceback (most recent call last):
    pipeviz.schedule.traits.ScheduleError: The communication order deadlocks: ... rank 0 is blocked after 0F0 waiting to
    receive ... from rank 1 ... Ranks 0 -> 1 -> 0 wait on each other ...
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pipeviz.schedule import traits as sched
from pipeviz.schedule.hang import HangReport, RankState, find_cycle

__all__ = ["COMM_KINDS", "Step", "check_comm_order", "check_comms", "check_order_comms", "check_schedule_comms",
           "programs", "runtime_programs", "walk"]

COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class Step(NamedTuple):
    """One step of a rank's program: ``op`` is ``"post"`` (start sends / receives, never blocks), ``"wait"`` (block
    until each of ``actions`` is matched by the peer) or ``"compute"`` (one compute action)."""

    op: str
    actions: tuple[str, ...]

    def __str__(self) -> str:
        return (self.actions[0] if self.op == "compute" else f"{self.op}({', '.join(self.actions)})")


def _parse(text: str) -> tuple[int, str, int]:
    m = _ACTION.match(text)
    if m is None:
        raise sched.ScheduleError(f"Not an action: {text!r}; expected <stage><kind><microbatch> with a kind among "
                                  f"{', '.join((*sched.KINDS, *COMM_KINDS))}, such as '2F0' or '1RECV_F3'.")
    return int(m.group(1)), m.group(2), int(m.group(3))


def _channel(action: str, ranks: Sequence[int]) -> tuple[int, int, tuple[int, str, int]]:
    """(sending rank, receiving rank, the compute action whose tensor travels) of a send or receive."""
    s, kind, mb = _parse(action)
    n = len(ranks)
    other = s + 1 if kind in ("SEND_F", "RECV_B") else s - 1
    if not 0 <= other < n:
        raise sched.ScheduleError(f"{action}: stage {s} has no stage {other} to "
                                  f"{'send to' if kind.startswith('SEND') else 'receive from'} ({n} stages).")
    if kind == "SEND_F":
        return ranks[s], ranks[s + 1], (s, "F", mb)
    if kind == "SEND_B":
        return ranks[s], ranks[s - 1], (s, "B", mb)
    if kind == "RECV_F":
        return ranks[s - 1], ranks[s], (s - 1, "F", mb)
    return ranks[s + 1], ranks[s], (s + 1, "B", mb)


def runtime_programs(comm_order: Sequence[Sequence[str]], ranks: Sequence[int]) -> list[list[Step]]:
    """Each rank's program under torch's ``_PipelineScheduleRuntime`` running ``comm_order`` (actions in torch's
    text, sends and receives included): a send or receive action posts; a forward waits on the receive of its
    input when the stage before lives on another rank, a backward (``B``/``I``) on the gradient when the stage after
    does; the step's end waits on every send."""
    n = len(ranks)
    out: list[list[Step]] = []
    for rank, acts in enumerate(comm_order):
        steps: list[Step] = []
        sends: list[str] = []
        for a in acts:
            s, kind, mb = _parse(a)
            if kind in COMM_KINDS:
                steps.append(Step("post", (a,)))
                if kind.startswith("SEND"):
                    sends.append(a)
                continue
            if kind == "F" and s > 0 and ranks[s - 1] != rank:
                steps.append(Step("wait", (f"{s}RECV_F{mb}",)))
            elif kind in ("B", "I") and s < n - 1 and ranks[s + 1] != rank:
                steps.append(Step("wait", (f"{s}RECV_B{mb}",)))
            steps.append(Step("compute", (a,)))
        if sends:
            steps.append(Step("wait", tuple(sends)))
        out.append(steps)
    return out


def _gpipe(s: int, n: int, m: int) -> list[Step]:
    # torch 2.13's ScheduleGPipe._step_microbatches: receive (waited at once), forward, send (waited after all
    # forwards); the same for the backwards.
    steps: list[Step] = []
    for kind, recv, send, has_recv, has_send in (("F", "RECV_F", "SEND_F", s > 0, s < n - 1),
                                                 ("B", "RECV_B", "SEND_B", s < n - 1, s > 0)):
        sends: list[str] = []
        for i in range(m):
            if has_recv:
                steps += [Step("post", (f"{s}{recv}{i}",)), Step("wait", (f"{s}{recv}{i}",))]
            steps.append(Step("compute", (f"{s}{kind}{i}",)))
            if has_send:
                steps.append(Step("post", (f"{s}{send}{i}",)))
                sends.append(f"{s}{send}{i}")
        if sends:
            steps.append(Step("wait", tuple(sends)))
    return steps


def _one_f_one_b(s: int, n: int, m: int) -> list[Step]:
    # torch 2.13's Schedule1F1B._step_microbatches, line for line: the warm-up forwards (each send waited on before
    # the next is fired, the last kept back), then each backward's gradient received together with the kept-back
    # forward send (one batch, waited on), each forward's input together with the backward's send, the drain.
    steps: list[Step] = []

    def ops(kind: str, i: int) -> list[str]:
        has = {"RECV_F": s > 0, "SEND_F": s < n - 1, "RECV_B": s < n - 1, "SEND_B": s > 0}[kind]
        return [f"{s}{kind}{i}"] if has else []

    def post(acts: list[str]) -> None:
        if acts:
            steps.append(Step("post", tuple(acts)))

    def wait(acts: list[str]) -> None:
        if acts:
            steps.append(Step("wait", tuple(acts)))

    warm = min(m, n - s)
    f = b = 0
    send_work: list[str] = []
    fwd_sends: list[str] = []
    for _ in range(warm):
        post(ops("RECV_F", f))
        wait(ops("RECV_F", f))
        steps.append(Step("compute", (f"{s}F{f}",)))
        wait(send_work)
        send_work = []
        fwd_sends = ops("SEND_F", f)
        if f != warm - 1:
            post(fwd_sends)
            send_work = fwd_sends
        f += 1
    while True:
        batch = fwd_sends + ops("RECV_B", b)
        post(batch)
        wait(batch)
        steps.append(Step("compute", (f"{s}B{b}",)))
        bwd_sends = ops("SEND_B", b)
        b += 1
        if f == m:
            break
        batch = bwd_sends + ops("RECV_F", f)
        post(batch)
        wait(batch)
        steps.append(Step("compute", (f"{s}F{f}",)))
        fwd_sends = ops("SEND_F", f)
        f += 1
    post(bwd_sends)
    send_work = bwd_sends
    while b < m:
        post(ops("RECV_B", b))
        wait(ops("RECV_B", b))
        steps.append(Step("compute", (f"{s}B{b}",)))
        wait(send_work)
        send_work = ops("SEND_B", b)
        post(send_work)
        b += 1
    wait(send_work)
    return steps


def programs(schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None,
             order: Sequence[Sequence[sched.Action | str]] | None = None) -> list[list[Step]]:
    """Each pipeline rank's program (posts, waits, computes) as torch's runtime issues it for ``schedule``, or for
    a custom compute ``order`` (always run by torch's ``_PipelineScheduleRuntime``, which adds the sends and
    receives itself)."""
    from pipeviz.adapter.schedules import comm_actions

    lay = sched.layout(schedule, num_stages, stages_per_rank)
    if order is not None:
        return runtime_programs(comm_actions(order, lay.stage_ranks, microbatches), lay.stage_ranks)
    sched.check_microbatches(lay.schedule, num_stages, microbatches, stages_per_rank)
    if lay.schedule == "GPipe":
        return [_gpipe(s, num_stages, microbatches) for s in range(num_stages)]
    if lay.schedule == "1F1B":
        return [_one_f_one_b(s, num_stages, microbatches) for s in range(num_stages)]
    acts = comm_actions(None, lay.stage_ranks, microbatches, lay.schedule)
    return runtime_programs(acts, lay.stage_ranks)


def check_comms(schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None,
                order: Sequence[Sequence[sched.Action | str]] | None = None) -> None:
    """Play ``schedule``'s communication order (or a custom ``order``'s, as torch lowers it) and refuse a deadlock.

    Raises:
        ScheduleError: the order deadlocks (``err.report``: the ``HangReport`` of the hang it would be) or matches
            a pair's messages out of order.
    """
    lay = sched.layout(schedule, num_stages, stages_per_rank)
    _play(programs(schedule, num_stages, microbatches, stages_per_rank, order), lay.stage_ranks)


@functools.lru_cache(maxsize=256)
def check_schedule_comms(schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None) -> None:
    """``check_comms`` for one of torch's schedules, remembered per layout: ``validate_launch`` calls it for every
    launch and every Explorer control change, and a layout that played once plays again (up to 77 ms for 16
    stages x 64 microbatches). A refusal is not remembered: it raises again, with its report."""
    check_comms(schedule, num_stages, microbatches, stages_per_rank)


def check_order_comms(order: Sequence[Sequence[sched.Action]], stage_ranks: Sequence[int], microbatches: int) -> None:
    """A custom compute ``order`` (``LaunchConfig.order``) lowered to sends and receives as torch's runtime lowers
    it, played (``check_comms``). Called by ``pipeviz.sim.engine.check_order`` once the compute order plays.

    Raises:
        ScheduleError: as ``check_comms``.
    """
    from pipeviz.adapter.schedules import comm_actions

    _play(runtime_programs(comm_actions(order, stage_ranks, microbatches), stage_ranks), stage_ranks)


def check_comm_order(comm_order: Sequence[Sequence[str]], stage_ranks: Sequence[int]) -> None:
    """Check a hand-made order with its sends and receives (torch's ``compute_comms`` format, what
    ``get_schedule_ops(with_comms=True)`` prints: ``"0F0"``, ``"0SEND_F0"``, ``"1RECV_F0"``), one list per pipeline
    rank, as torch's ``_PipelineScheduleRuntime`` would run it. ``stage_ranks[s]``: the rank holding stage ``s``.

    Raises:
        ScheduleError: a deadlock (``err.report``, a ``HangReport``), a compute action run before the receive it
            consumes was posted, or messages matched out of order; the message names ranks, peers and actions.
    """
    for rank, acts in enumerate(comm_order):
        for a in acts:
            s, _, _ = _parse(a)
            if not 0 <= s < len(stage_ranks) or stage_ranks[s] != rank:
                raise sched.ScheduleError(f"rank {rank}: {a} belongs to stage {s}, which lives on rank "
                                          f"{stage_ranks[s] if 0 <= s < len(stage_ranks) else '(none)'}.")
    _play(runtime_programs(comm_order, stage_ranks), stage_ranks)


def _words(action: str) -> str:
    """What travels in a send or receive: ``1RECV_B0`` -> "stage 2's gradients of microbatch 0"."""
    s, kind, mb = _parse(action)
    source = s + 1 if kind == "RECV_B" else s - 1 if kind == "RECV_F" else s
    return f"stage {source}'s {'activations' if kind.endswith('F') else 'gradients'} of microbatch {mb}"


def _counterpart(action: str, ranks: Sequence[int]) -> str:
    """The peer's action that matches ``action``: a send's receive, a receive's send."""
    _, _, (s, kind, mb) = _channel(action, ranks)
    if _parse(action)[1].startswith("SEND"):
        return f"{s + 1 if kind == 'F' else s - 1}RECV_{kind}{mb}"
    return f"{s}SEND_{kind}{mb}"


def walk(progs: Sequence[Sequence[Step]], advance: Callable[[int, Step], bool]) -> list[int]:
    """Run every rank's program as far as it goes: ``advance(rank, step)`` carries a step out, or returns False
    while it must wait (a peer has not posted its side); rank after rank, until no rank moves. Returns each rank's
    position: a rank short of its program's end is stuck there."""
    pos = [0] * len(progs)
    progressed = True
    while progressed:
        progressed = False
        for rank, prog in enumerate(progs):
            while pos[rank] < len(prog) and advance(rank, prog[pos[rank]]):
                pos[rank] += 1
                progressed = True
    return pos


def _play(progs: list[list[Step]], ranks: Sequence[int]) -> None:
    sends: dict[tuple[int, int], list[tuple[tuple[int, str, int], str]]] = {}
    recvs: dict[tuple[int, int], list[tuple[tuple[int, str, int], str]]] = {}
    where: dict[str, tuple[tuple[int, int], int, bool]] = {}  # posted action -> (channel, index, is a send)

    def matched(a: str) -> bool:
        ch, k, is_send = where[a]
        return len((recvs if is_send else sends).get(ch, [])) > k

    def advance(rank: int, step: Step) -> bool:
        if step.op == "post":
            for a in step.actions:
                src, dst, key = _channel(a, ranks)
                is_send = _parse(a)[1].startswith("SEND")
                mine, theirs = (sends, recvs) if is_send else (recvs, sends)
                lst = mine.setdefault((src, dst), [])
                k = len(lst)
                lst.append((key, a))
                where[a] = ((src, dst), k, is_send)
                other = theirs.get((src, dst), [])
                if len(other) > k and other[k][0] != key:
                    raise _mismatch(a, other[k][1], k, src, dst)
        elif step.op == "wait":
            missing = [a for a in step.actions if a not in where]
            if missing:
                raise sched.ScheduleError(
                    f"rank {rank}: waits on {missing[0]} before posting it: torch's runtime refuses a compute "
                    f"action whose receive was not posted ('Computing ... before receiving input'). Fix: put "
                    f"{missing[0]} before the action that consumes it.")
            if not all(matched(a) for a in step.actions):
                return False
        else:
            for a in step.actions:
                if _parse(a)[1] in COMM_KINDS:  # a compute step holds compute actions only
                    raise sched.ScheduleError(f"rank {rank}: {a} is not a compute action.")
        return True

    pos = walk(progs, advance)
    if any(p < len(prog) for p, prog in zip(pos, progs, strict=True)):
        report = _report(progs, ranks, pos, where, sends, recvs)
        err = sched.ScheduleError(
            "The communication order deadlocks: every rank that has not finished waits on a send or receive its "
            "peer has not posted. A launch would hang here:\n" + str(report))
        err.report = report
        raise err


def _mismatch(a: str, b: str, k: int, src: int, dst: int) -> sched.ScheduleError:
    send, recv = (a, b) if _parse(a)[1].startswith("SEND") else (b, a)
    return sched.ScheduleError(
        f"Messages from rank {src} to rank {dst} would be matched out of order: the {k + 1}. send, {send} "
        f"({_words(send)}), would land in the {k + 1}. receive, {recv} (expecting {_words(recv)}): gloo and NCCL "
        f"match a pair's messages in the order they are posted, so the receiver would compute on another "
        f"microbatch's tensor (or, shaped differently, fail). Fix: post rank {dst}'s receives from rank {src} in the "
        f"order rank {src} sends.")


def _report(progs: list[list[Step]], ranks: Sequence[int], pos: list[int],
            where: dict[str, tuple[tuple[int, int], int, bool]],
            sends: dict[tuple[int, int], list[tuple[tuple[int, str, int], str]]],
            recvs: dict[tuple[int, int], list[tuple[tuple[int, str, int], str]]]) -> HangReport:
    states: list[RankState] = []
    for rank, prog in enumerate(progs):
        done = [s.actions[0] for s in prog[:pos[rank]] if s.op == "compute"]
        last = done[-1] if done else None
        if pos[rank] == len(prog):
            states.append(RankState(rank, last, None, None, None, f"finished its step (last {last})"))
            continue
        step = prog[pos[rank]]
        nxt = next((s.actions[0] for s in prog[pos[rank]:] if s.op == "compute"), None)
        for a in step.actions:
            ch, k, is_send = where[a]
            if len((recvs if is_send else sends).get(ch, [])) <= k:
                break
        peer = ch[1] if is_send else ch[0]
        theirs = _counterpart(a, ranks)
        at = " and ".join([*([f"after {last}"] if last else []), f"before {nxt}" if nxt else "at the step's end"])
        if is_send:
            what = (f"is blocked {at}, sending {_words(a)} ({a}) to rank {peer}, which has not posted the "
                    f"matching receive {theirs} (a send completes only into a posted receive)")
        else:
            what = (f"is blocked {at}, receiving {_words(a)} ({a}) from rank {peer}, which has not posted "
                    f"its send {theirs}")
        states.append(RankState(rank, last, a, peer, theirs, what))
    cycle = find_cycle(states)
    cause = ("the communication orders deadlock: a rank waits on a receive (or a send) before it posts what its peer "
             "waits on. Fix: post each send right after the compute action that produces it, and wait on a receive "
             "only in the action that consumes it (torch's _add_send_recv does both for a compute-only order).")
    return HangReport(states, cycle, cause)
