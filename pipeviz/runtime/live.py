"""``Live``: what a view needs from a run it follows — a ``pv.Run`` (processes started by ``pv.launch``) and a
``Watch`` (``pv.watch``) (an exported torchrun job's event files) both satisfy it, and the views use nothing else.

Example:
    >>> isinstance(run, pv.Live), isinstance(pv.watch("train_events"), pv.Live)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from pipeviz.schedule.timeline import Event, Timeline

__all__ = ["Live"]


@runtime_checkable
class Live(Protocol):
    """A run being followed: its status and events so far, live callbacks, and its timeline."""

    status: str  # "starting" | "running" | "done" | "failed" | "stopped"
    events: list[Event]
    losses: list[float]
    error: str | None
    steps: int | None

    @property
    def step(self) -> int: ...

    @property
    def done(self) -> bool: ...

    def subscribe(self, callback: Callable[[list[Event]], None]) -> None: ...

    def wait(self, timeout: float | None = None) -> str: ...

    def stop(self) -> str: ...

    def timeline(self) -> Timeline: ...
