"""A run's progress as its messages arrive: each folded into the one reducer (``pipeviz.runtime.reducer``, which
``Watch`` uses too), new events handed to the event subscribers, and the phase (what the run is doing now, in
words) kept with its time and told to the status subscribers.

Example:
    >>> monitor = Monitor(run, world=4, who=lambda msg: f"rank {msg.rank}", steps=5)
    >>> monitor.subscribe(lambda events: print(len(events)))
    >>> update = monitor.apply(msg)              # events published, "rank 1: stage 1 ready", "step 2/5"
    >>> monitor.reducer.losses, monitor.phases
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Generic, TypeVar

from pipeviz.runtime.messages import Message
from pipeviz.runtime.reducer import Reducer, Update
from pipeviz.schedule.timeline import Event

__all__ = ["Monitor"]

S = TypeVar("S")


class Monitor(Generic[S]):
    """The progress of one run, whose ``subject`` (the ``Run``) status subscribers are called with.

    Attributes:
        reducer: every message folded in; its lists are the run's ``events``, ``losses``, ... (read under ``lock``).
        phase, phases: the phase now, and every phase with its time since ``started_at``.
        first_event_at: when the first event arrived (wall-clock seconds), None before.
    """

    def __init__(self, subject: S, world: int, who: Callable[[Message], str], steps: int | None) -> None:
        self.subject = subject
        self.reducer = Reducer(world)
        self.lock = threading.Lock()
        self.started_at = time.time()
        self.phase = "starting"
        self.phases: list[tuple[float, str]] = []
        self.first_event_at: float | None = None
        self._who, self._steps = who, steps
        self._subscribers: list[Callable[[list[Event]], None]] = []
        self._status_subscribers: list[Callable[[S], None]] = []

    def subscribe(self, callback: Callable[[list[Event]], None]) -> None:
        self._subscribers.append(callback)

    def subscribe_status(self, callback: Callable[[S], None]) -> None:
        self._status_subscribers.append(callback)

    def apply(self, msg: Message) -> Update:
        """Fold one message in and publish what it changed (events, the sender's phase, the step); returns the
        update (a forward-only step's output is the caller's to keep)."""
        with self.lock:
            up = self.reducer.apply(msg)
            if self.first_event_at is None and up.events:
                self.first_event_at = time.time()
        if up.events:
            self.publish(up.events)
        if up.phase is not None:
            self.set_phase(f"{self._who(msg)}: {up.phase}")
        if up.step is not None:
            self.set_phase(f"step {up.step}/{self._steps or '?'}")
        return up

    def set_phase(self, text: str) -> None:
        self.phase = text
        self.phases.append((time.time() - self.started_at, text))
        self.notify()

    def notify(self) -> None:
        """Call every status subscriber with the subject (a failing one is printed, never stops the run)."""
        for cb in list(self._status_subscribers):
            try:
                cb(self.subject)
            except Exception:
                traceback.print_exc()

    def publish(self, batch: list[Event]) -> None:
        for cb in list(self._subscribers):
            try:
                cb(batch)
            except Exception:
                traceback.print_exc()

    def end(self) -> None:
        """The run ended: every event subscriber is called once with ``[]`` (its errors ignored)."""
        for cb in list(self._subscribers):
            try:
                cb([])
            except Exception:
                pass
