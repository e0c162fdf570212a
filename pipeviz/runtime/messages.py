"""The messages a rank process sends to whoever watches it (``pv.launch``'s ``Run`` over a queue, an exported
script's JSON-lines files read by ``pv.watch``): typed, each carrying its sender's rank and mesh coordinates.

Example:
    >>> msg = Loss(rank=3, coords=Coords(1, 1, 0), step=0, value=2.3)
    >>> Message.from_json(msg.to_json()) == msg
    True
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeviz.schedule.mesh import Coords
from pipeviz.schedule.timeline import Event

__all__ = ["Batch", "Done", "End", "EvalLoss", "Events", "ExpertTokens", "Failed", "Feed", "GradNorm", "LearningRate",
           "Loss", "Memory", "Message", "NonFinite", "OptimState", "Output", "Phase", "State", "StepEnd"]


@dataclass(frozen=True)
class Message:
    """What every message says about its sender: the process ``rank`` and its ``coords`` (pipeline rank,
    replica, shard)."""

    rank: int
    coords: Coords
    kinds: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        Message.kinds[cls.__name__] = cls

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict (bytes as base64, events as lists); ``Message.from_json`` reads it back."""
        out: dict[str, object] = {"type": type(self).__name__}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bytes):
                value = {"base64": base64.b64encode(value).decode()}
            elif f.name == "events":
                value = [list(dataclasses.astuple(e)) for e in value]
            elif f.name == "samples":
                value = [list(e) for e in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @staticmethod
    def from_json(data: dict[str, Any]) -> Message:
        """The message ``to_json`` wrote.

        Raises:
            ValueError: an unknown message type (a file from another pipeviz version).
        """
        kind = Message.kinds.get(data.get("type", ""))
        if kind is None:
            raise ValueError(f"Unknown message type {data.get('type')!r}; valid: {', '.join(sorted(Message.kinds))}.")
        values = {k: v for k, v in data.items() if k != "type"}
        for k, v in values.items():
            if isinstance(v, dict) and "base64" in v:
                values[k] = base64.b64decode(v["base64"])
        values["coords"] = Coords(*values["coords"])
        if "events" in values:
            values["events"] = [Event(*e) for e in values["events"]]
        if "samples" in values:
            values["samples"] = [tuple(e) for e in values["samples"]]
        return kind(**values)


@dataclass(frozen=True)
class Phase(Message):
    """Start-up progress ("stages 0, 3 ready")."""

    text: str


@dataclass(frozen=True)
class Events(Message):
    """A batch of timed actions (``pv.Event``: process rank, stage, kind, microbatch, start, end, step)."""

    events: list[Event]


@dataclass(frozen=True)
class ExpertTokens(Message):
    """Expert parallelism: the tokens this process routed to each expert of MoE block ``block`` (the experts'
    module) in one forward of stage ``stage``, microbatch ``mb`` of step ``step`` (its replica's numbering)."""

    step: int
    stage: int
    mb: int
    block: str
    counts: list[int]


@dataclass(frozen=True)
class Memory(Message):
    """Memory samples ``(time, total bytes, saved-activation bytes)`` (``pipeviz.runtime.memory``)."""

    samples: list[tuple[float, int, int]]


@dataclass(frozen=True)
class Loss(Message):
    """The loss of step ``step``: the whole (global) batch's, sent by one process (replica 0's shard 0 of the
    last stage)."""

    step: int
    value: float


@dataclass(frozen=True)
class Output(Message):
    """A forward-only step's output (``torch.save``d list of tensors) of the sender's replica."""

    step: int
    data: bytes


@dataclass(frozen=True)
class StepEnd(Message):
    """The sender finished step ``step`` at ``time`` seconds after the run's start."""

    step: int
    time: float


@dataclass(frozen=True)
class GradNorm(Message):
    """The global norm of step ``step``'s gradients (every stage, replica and shard together), before clipping:
    sent by process 0 when the run clips (``clip_grad_norm``)."""

    step: int
    value: float


@dataclass(frozen=True)
class LearningRate(Message):
    """The learning rate step ``step`` updated with (its optimizer's first parameter group's): sent by process 0
    when the run has an ``lr_scheduler``."""

    step: int
    value: float


@dataclass(frozen=True)
class EvalLoss(Message):
    """The loss over the held-out batches (``eval_data=``) after step ``step``: sent by the last stage's replica
    0, shard 0."""

    step: int
    value: float


@dataclass(frozen=True)
class NonFinite(Message):
    """NaN or inf found in step ``step``: what (the loss, a gradient) and where."""

    step: int
    what: list[str]


@dataclass(frozen=True)
class State(Message):
    """The sender's trained tensors under the original model's names: ``torch.save``d bytes, or the path of a
    file holding them."""

    data: bytes | str


@dataclass(frozen=True)
class OptimState(Message):
    """The sender's optimizer state (``runtime.checkpoint.gathered_optimizer_state``: whole tensors by canonical
    name) with, from process 0, the optimizer's class, its groups' hyperparameters and the scheduler's state:
    ``torch.save``d bytes, or the path of a file holding them."""

    data: bytes | str


@dataclass(frozen=True)
class Done(Message):
    """The sender ended cleanly."""


@dataclass(frozen=True)
class Failed(Message):
    """The sender failed: a one-line summary, the traceback, and the tail of its log."""

    summary: str
    traceback: str
    log_tail: str = ""


# ------------------------------------------------------------------- the other way: launching process -> a rank
@dataclass(frozen=True)
class Batch:
    """A ``data=`` run's next batch for one process: the inputs on the first stage's ranks (else empty), the target
    on the last stage's (else None); every rank gets one per step, so all run the same number of steps.

    ``shape`` numbers the batch's input shapes in the order the run met them (0: the first batch's); the first batch
    of a new shape carries ``stages``, this process's stages traced for it (``pipeviz.runtime.shapes``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any
    shape: int = 0
    stages: bytes | None = None


@dataclass(frozen=True)
class End:
    """No more batches: the rank's steps are over."""


Feed = Batch | End
