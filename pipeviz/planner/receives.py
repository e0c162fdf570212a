"""An order's step with each receive charged where torch's runtime posts it (``charged_step``).

``pv.simulate`` lets a hand-off arrive ``comm`` seconds after the action that produced it, whatever the receiving
rank is doing: the transfer overlaps the receiver's compute. torch 2.13's ``_PipelineScheduleRuntime`` (which runs
every custom ``order=``, hence every synthesized schedule) does not work so: ``_add_send_recv`` lowers a compute
order by walking the ranks in lock step and appends the receiver's ``RECV_*`` to the receiver's action list at the
moment it lowers the *sender's* compute action, and ``_step_microbatches`` posts that ``irecv`` only when the
receiver's runtime reaches the ``RECV`` in its list. gloo moves a message only once both sides have posted (its
send waits for the peer's receive: ``pipeviz.schedule.comm_order``), so a receive the lowering put just before its
consumer -- behind the compute the receiver runs meanwhile -- starts its transfer only then, and the consumer waits
the whole hand-off, which the simulation hid under that compute.

``charged_step`` replays a simulated order's own action times through each rank's program as torch lowers it
(``pipeviz.schedule.comm_order.runtime_programs`` over ``pipeviz.adapter.schedules.comm_actions``: torch's own
``_add_send_recv``) with each message arriving ``comm`` after the *later* of its send's and its receive's posting.
With ``charged=False`` the same play lets it arrive ``comm`` after the send alone, which reproduces ``pv.simulate``'s
step (``tests/test_synthesize.py`` checks both). The difference is what the order loses to late receives:
``pipeviz.planner.synthesize`` ranks its finalists by the charged step (``benchmarks/accuracy/synthesized_runs.py``
measured why: docs/synthesis.md, "Runs as simulated").

Example:
    >>> tl = pv.simulate(plan, cfg.replace(order=order), options=opts)
    >>> charged_step(tl), tl.step_time          # the first >= the second; equal when no receive is late
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeviz.schedule import traits as sched
from pipeviz.schedule.comm_order import Step, programs, walk
from pipeviz.schedule.timeline import COMPUTE, Timeline

__all__ = ["charged_step", "play_programs"]

Key = tuple[int, str, int]  # the compute action whose tensor travels: (stage, "F" or "B", microbatch)


def charged_step(tl: Timeline, charged: bool = True) -> float:
    """``tl``'s step (a ``pv.simulate`` of one step, without accumulation) with each receive charged where torch's
    runtime posts it; ``charged=False``: as ``pv.simulate`` plays it (the two agree when no receive is late).

    Each action keeps the duration ``tl`` gave it (contention, overheads and collectives included); the hand-offs
    take ``tl.meta["stage_costs"].comm``. What the step adds after the last compute action (the replicas' gradient
    reduction) is kept as simulated. A custom order (on any placement) and the multi-stage schedules are lowered by
    torch's ``_add_send_recv``; GPipe and 1F1B post as their own ``_step_microbatches`` do
    (``pipeviz.schedule.comm_order.programs``).
    """
    cfg = tl.meta.get("config")
    if cfg is None or cfg.accumulate > 1 or len(tl.steps) != 1:
        return tl.step_time
    lay = sched.layout(tl.schedule, tl.num_stages, cfg.stages_per_rank)
    compute = [e for e in tl.events if e.kind in COMPUTE]
    seconds: list[dict[str, float]] = [{} for _ in range(lay.num_ranks)]
    rows: list[list[str]] = [[] for _ in range(lay.num_ranks)]
    for e in sorted(compute, key=lambda e: (e.rank, e.start)):
        seconds[e.rank][e.label] = e.duration
        rows[e.rank].append(e.label)
    # a custom order is lowered from the order played; torch's schedules by name as torch builds them
    progs = programs(tl.schedule, tl.num_stages, tl.microbatches, cfg.stages_per_rank,
                     order=rows if cfg.order is not None else None)
    ends = play_programs(progs, seconds, lay.stage_ranks, tl.meta["stage_costs"].comm, charged)
    played_span = max(ends)  # every rank starts at 0, as the simulation does
    simulated_span = max(e.end for e in compute) - min(e.start for e in compute)
    return tl.step_time + played_span - min(0.0, min(e.start for e in compute)) - simulated_span


def play_programs(progs: Sequence[Sequence[Step]], seconds: Sequence[dict[str, float]], stage_ranks: Sequence[int],
                  comm: Sequence[float], charged: bool = True) -> list[float]:
    """Per rank, the time its program ends: ``progs[r]`` is rank ``r``'s program as torch's runtime issues it
    (``pipeviz.schedule.comm_order.programs``: posts, waits, computes), ``seconds[r]`` its compute actions' seconds
    by torch's text (``{"2F0": 1.5e-3}``), ``comm[s]`` the hand-off between stages ``s`` and ``s + 1``. Every rank
    starts at 0; a message arrives ``comm`` after the later of its send's and its receive's posting (``charged``)
    or after its send's (``pv.simulate``'s rule). A wait on sends (torch's step waits on them before it returns)
    ends when they have arrived.

    Raises:
        ScheduleError: the programs cannot all finish (an order ``pv.simulate`` would have refused first).
    """
    sent: dict[Key, float] = {}
    posted: dict[Key, float] = {}
    t = [0.0] * len(progs)

    def arrival(key: Key) -> float | None:
        if key not in sent or (charged and key not in posted):
            return None
        s, kind, _ = key
        start = max(sent[key], posted[key]) if charged else sent[key]
        return start + comm[s if kind == "F" else s - 1]

    def advance(r: int, step: Step) -> bool:
        if step.op == "compute":
            t[r] += seconds[r][step.actions[0]]
        elif step.op == "post":
            for a in step.actions:
                key, is_send = _travels(a)
                (sent if is_send else posted)[key] = t[r]
        else:
            got = [arrival(_travels(a)[0]) for a in step.actions]
            if any(g is None for g in got):
                return False  # the peer has not posted its side yet
            t[r] = max([t[r], *(g for g in got if g is not None)])
        return True

    pos = walk(progs, advance)
    if any(p < len(prog) for p, prog in zip(pos, progs, strict=True)):
        raise sched.ScheduleError("The order's sends and receives cannot all complete under torch's runtime: "
                                  f"ranks stop at steps {pos} of {[len(p) for p in progs]}. Fix: simulate it with "
                                  "pv.simulate first, which names the hang.")
    return t


def _travels(action: str) -> tuple[Key, bool]:
    """The compute action whose tensor a send or receive carries, and whether it is the send."""
    kind = "SEND_F" if "SEND_F" in action else "SEND_B" if "SEND_B" in action else (
        "RECV_F" if "RECV_F" in action else "RECV_B")
    stage, mb = (int(x) for x in action.split(kind))
    if kind == "SEND_F":
        return (stage, "F", mb), True
    if kind == "SEND_B":
        return (stage, "B", mb), True
    if kind == "RECV_F":
        return (stage - 1, "F", mb), False
    return (stage + 1, "B", mb), False
