"""One reducer of a run's messages (``pipeviz.runtime.messages``), shared by ``pv.launch``'s ``Run`` (a queue) and
``pv.watch``'s ``Watch`` (an exported run's JSON-lines files): every kind of message handled the same way in both,
and the failure report (the root cause first, its consequences after) written once.

Example:
    >>> r = Reducer(world=4)
    >>> update = r.apply(msg)          # a Message: events, losses, memory, steps, phases, state, failures
    >>> r.events, r.losses, r.step, r.failure(exit_codes=[0, -9, 0, 0], where=mesh.label)
"""

from __future__ import annotations

import io
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pipeviz.runtime.messages import (
    Done,
    EvalLoss,
    Events,
    ExpertTokens,
    Failed,
    GradNorm,
    LearningRate,
    Loss,
    Memory,
    Message,
    NonFinite,
    OptimState,
    Output,
    Phase,
    State,
    StepEnd,
)
from pipeviz.schedule.timeline import Event

__all__ = ["PEER_GONE", "Reducer", "Update"]

# Errors a rank sees when a peer went away first: consequences, not causes.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator",
             "Connection refused", "connection closed")


@dataclass
class Update:
    """What one message changed, for the owner to publish: new events, a phase line, the step, an output."""

    events: list[Event] = field(default_factory=list)
    phase: str | None = None
    step: int | None = None  # the step every process has finished, when it moved
    output: tuple[int, int, list[torch.Tensor]] | None = None  # (step, replica, the output's leaves)


class ExpertLoad(NamedTuple):
    """The tokens one replica routed to each expert of one MoE block (``block``: the experts' module) in one forward:
    ``counts[e]`` for expert ``e`` (``run.expert_tokens``, expert parallelism)."""

    step: int
    stage: int
    block: str
    mb: int
    replica: int
    counts: tuple[int, ...]


class Reducer:
    """What a run's messages have said so far: events, losses, memory per process, steps, phases, NaN/inf found,
    trained tensors, which processes ended and which failed (``world``: the processes expected, when known).

    Attributes:
        events, losses: as ``pv.Run``'s.
        memory, activation_memory: per process rank, ``(time, bytes)`` samples.
        nonfinite: ``(step, what)`` pairs.
        step: steps every process has finished; ``step_ends``: each step's end on its slowest process.
        done: processes that ended cleanly; ``errors``: per process, ``(summary, traceback, log tail)``.
        state_files, state: process ranks' trained tensors (replica 0, shard 0); ``replica_files``: other replicas'.
    """

    def __init__(self, world: int | None = None) -> None:
        self.world = world
        self.events: list[Event] = []
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.learning_rates: list[float] = []
        self.eval_losses: list[tuple[int, float]] = []
        self.expert_tokens: list[ExpertLoad] = []
        self.memory: dict[int, list[tuple[float, int]]] = {}
        self.activation_memory: dict[int, list[tuple[float, int]]] = {}
        self.nonfinite: list[tuple[int, str]] = []
        self.finished: dict[int, int] = {}  # process rank -> steps it finished
        self.step_ends: dict[int, float] = {}
        self.step = 0
        self.done: set[int] = set()
        self.errors: dict[int, tuple[str, str, str]] = {}
        self.state: dict[str, torch.Tensor] = {}
        self.state_files: list[str] = []
        self.replica_files: dict[int, list[str]] = {}
        self.optim: dict[str, dict[str, torch.Tensor]] = {}  # a training run's optimizer state, by canonical name
        self.trainer: dict[str, Any] = {}  # the optimizer's class and groups, the scheduler's state (process 0)

    def apply(self, msg: Message) -> Update:
        """Fold ``msg`` in; returns what changed."""
        up = Update()
        if isinstance(msg, Events):  # workers batch them (SEND_INTERVAL, 0.1 s)
            up.events = list(msg.events)
            self.events.extend(up.events)
        elif isinstance(msg, Memory):
            self.memory.setdefault(msg.rank, []).extend((t, total) for t, total, _ in msg.samples)
            self.activation_memory.setdefault(msg.rank, []).extend((t, act) for t, _, act in msg.samples)
        elif isinstance(msg, Loss):  # one per step: the global batch's, from replica 0's shard 0
            self.losses.append(msg.value)
        elif isinstance(msg, GradNorm):  # one per step, from process 0, when the run clips
            self.grad_norms.append(msg.value)
        elif isinstance(msg, LearningRate):  # one per step, from process 0, with an lr_scheduler
            self.learning_rates.append(msg.value)
        elif isinstance(msg, ExpertTokens):  # expert parallelism: per forward and MoE block, from every process
            self.expert_tokens.append(ExpertLoad(msg.step, msg.stage, msg.block, msg.mb, msg.coords.dp,
                                                 tuple(msg.counts)))
        elif isinstance(msg, EvalLoss):  # after every eval_every steps, with eval_data=
            self.eval_losses.append((msg.step, msg.value))
        elif isinstance(msg, Output):
            up.output = (msg.step, msg.coords.dp, torch.load(io.BytesIO(msg.data)))
        elif isinstance(msg, StepEnd):
            self.finished[msg.rank] = msg.step + 1
            self.step_ends[msg.step] = max(self.step_ends.get(msg.step, 0.0), msg.time)
            ranks = range(self.world) if self.world is not None else self.finished
            step = min(self.finished.get(r, 0) for r in ranks)
            if step != self.step:
                self.step = up.step = step
        elif isinstance(msg, Phase):
            up.phase = msg.text
        elif isinstance(msg, NonFinite):
            self.nonfinite.extend((msg.step, what) for what in msg.what)
        elif isinstance(msg, State):
            self._state(msg)
        elif isinstance(msg, OptimState):
            got = torch.load(msg.data if isinstance(msg.data, str) else io.BytesIO(msg.data), weights_only=False)
            self.optim.update(got["tensors"])
            self.trainer.update({k: v for k, v in got.items() if k != "tensors"})
        elif isinstance(msg, Done):
            self.done.add(msg.rank)
        elif isinstance(msg, Failed):
            self.errors.setdefault(msg.rank, (msg.summary, msg.traceback, msg.log_tail))
        return up

    def _state(self, msg: State) -> None:
        replica = msg.coords.dp
        if msg.coords.tp or msg.coords.cp:
            return  # a tensor-parallel shard (or a sequence share) gathered the same whole tensors as shard 0
        if replica:
            if isinstance(msg.data, str):
                self.replica_files.setdefault(replica, []).append(msg.data)
            return  # a replica's tensors through the queue (no state folder): replica 0's stand
        if isinstance(msg.data, str):
            self.state_files.append(msg.data)
        else:
            self.state.update(torch.load(io.BytesIO(msg.data)))

    @property
    def all_done(self) -> bool:
        return self.world is not None and len(self.done) >= self.world

    def failure(self, where: Callable[[int], str], exit_codes: Sequence[int | None] = ()) -> str:
        """The failure in words, the root cause first: a process killed by a signal, else the first real error
        (one failure makes its neighbours fail too: their connections drop), then a process that died without a
        report; the processes that failed in consequence after. ``where(rank)`` names a process rank (its
        coordinates and stages); ``exit_codes``: per process rank, when they are known."""
        causes: list[tuple[int, str]] = []
        for r, code in enumerate(exit_codes):
            if code is not None and code < 0:
                causes.append((r, f"{where(r)} died (killed by signal {signal.Signals(-code).name}) without a "
                                  "Python traceback."))
        real = [r for r, (s, tb, _) in self.errors.items() if not any(c in s or c in tb for c in PEER_GONE)]
        consequences = [r for r in self.errors if r not in real]
        for r in real:
            summary, tb, log = self.errors[r]
            text = f"{where(r)} failed in step {self.finished.get(r, 0)}: {summary}\n\n{tb.rstrip()}"
            if log.strip():
                text += f"\n\ntorch's log on rank {r} (last lines):\n{log.rstrip()}"
            causes.append((r, text))
        for r, code in enumerate(exit_codes):
            if code is not None and code > 0 and r not in self.errors:
                causes.append((r, f"{where(r)} died (exit code {code}) without a Python traceback."))
        if not causes and consequences:  # only peers-went-away errors: the first one is all there is
            r = consequences.pop(0)
            summary, tb, _ = self.errors[r]
            causes.append((r, f"{where(r)} failed in step {self.finished.get(r, 0)}: {summary}\n\n{tb.rstrip()}"))
        error = causes[0][1] if causes else "a rank failed without a report."
        others = [where(r) for r, _ in causes[1:]] + [where(r) for r in consequences]
        if others:
            error += f"\n\nAs a consequence, {', '.join(others)} failed too (their peers went away)."
        return error
