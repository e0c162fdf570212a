"""``pv.watch``: follow an exported run (``pv.export_torchrun``) live from its event folder, with the same reducer
of messages ``pv.launch``'s ``Run`` uses (``pipeviz.runtime.reducer``): every kind of message handled as a run's.

Example:
    >>> w = pv.watch("train_pp_events")             # rank<R>.jsonl files written by the torchrun processes
    >>> w.events, w.losses, w.phase, w.timeline(); pv.TimelineView(w)
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeviz.runtime.messages import Message
from pipeviz.runtime.reducer import Reducer
from pipeviz.schedule.mesh import Mesh
from pipeviz.schedule.timeline import Event, Timeline

__all__ = ["Watch", "watch"]


class Watch:
    """Live view of an exported run's event folder (what ``pv.watch`` returns).

    Satisfies ``pv.Live``, the one interface the views use (as ``pv.Run`` does): ``events``, ``losses``,
    ``status``, ``done``, ``step``, ``error``, ``subscribe``, ``wait()``, ``timeline()``, ``stop()``; and like a
    ``Run``: ``phase`` / ``phases``, ``memory`` / ``activation_memory`` per process, ``nonfinite``, ``outputs``
    (a forward-only run's output leaves per step, replica 0's first), ``state_files`` (each process's trained
    tensors), ``mesh`` (from the ``layout.json`` rank 0 writes) and the failure named root cause first.
    """

    def __init__(self, folder: str | os.PathLike[str], poll: float = 0.2, timeout: float | None = None) -> None:
        self.folder = Path(folder)
        self._reducer = Reducer()
        self.events: list[Event] = self._reducer.events
        self.losses: list[float] = self._reducer.losses
        self.grad_norms: list[float] = self._reducer.grad_norms
        self.learning_rates: list[float] = self._reducer.learning_rates
        self.eval_losses: list[tuple[int, float]] = self._reducer.eval_losses
        self.expert_tokens = self._reducer.expert_tokens  # (expert parallelism: tokens per expert per forward)
        self.memory = self._reducer.memory
        self.activation_memory = self._reducer.activation_memory
        self.nonfinite = self._reducer.nonfinite
        self.outputs: dict[int, dict[int, list[Any]]] = {}  # step -> replica -> output leaves
        self.phase = "waiting for the ranks"
        self.phases: list[tuple[float, str]] = []
        self.error: str | None = None
        self.status = "running"
        self.steps: int | None = None
        self.mesh: Mesh | None = None
        self._layout: dict[str, Any] = {}
        self._started = time.time()
        self._offsets: dict[str, int] = {}
        self._subscribers: list[Callable[[list[Event]], None]] = []
        self._stop = threading.Event()
        self._poll, self._timeout = poll, timeout
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pipeviz-watch")
        self._thread.start()

    @property
    def step(self) -> int:
        """Steps every process has finished (every process of the run, once ``layout.json`` names them)."""
        return self._reducer.step

    @property
    def state_files(self) -> list[str]:
        return [str(self.folder / f) for f in self._reducer.state_files]

    @property
    def done(self) -> bool:
        return self.status in ("done", "failed", "stopped")

    def subscribe(self, callback: Callable[[list[Event]], None]) -> None:
        self._subscribers.append(callback)

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(5)
        if not self.done:
            self.status = "stopped"
        return self.status

    def wait(self, timeout: float | None = None) -> str:
        self._thread.join(timeout)
        return self.status

    def timeline(self) -> Timeline:
        lay = self._layout
        ranks = self.mesh.world if self.mesh is not None else max((e.rank for e in self.events), default=-1) + 1
        stages = lay.get("stages") or max((e.stage for e in self.events), default=-1) + 1
        mbs = lay.get("microbatches") or max((e.mb for e in self.events), default=-1) + 1
        meta: dict[str, Any] = {"memory": {r: list(s) for r, s in self.memory.items()},
                                "activation_memory": {r: list(s) for r, s in self.activation_memory.items()}}
        if self.mesh is not None and self.mesh.world > self.mesh.pp:
            meta["processes"] = [self.mesh.label(r) for r in range(self.mesh.world)]
        return Timeline(list(self.events), ranks, stages, mbs, lay.get("schedule", "torchrun"), source="measured",
                        meta=meta, mesh=self.mesh)

    def _read_layout(self) -> None:
        path = self.folder / "layout.json"
        if self.mesh is not None or not path.exists():
            return
        try:
            lay = json.loads(path.read_text())
        except (OSError, ValueError):  # being written: read it next time
            return
        self._layout, self.mesh, self.steps = lay, Mesh(**lay["mesh"]), lay.get("steps")
        self._reducer.world = self.mesh.world

    def poll(self) -> list[Event]:
        """Read what the rank files gained since the last poll; returns the new events."""
        self._read_layout()
        new: list[Event] = []
        for path in sorted(self.folder.glob("rank*.jsonl")):
            with open(path) as f:
                f.seek(self._offsets.get(path.name, 0))
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):  # a line still being written: read it next time
                        break
                    self._offsets[path.name] = f.tell()
                    up = self._reducer.apply(Message.from_json(json.loads(line)))
                    new.extend(up.events)
                    if up.phase is not None:
                        self._phase(f"rank {path.stem[4:]}: {up.phase}")
                    if up.step is not None:
                        self._phase(f"step {up.step}/{self.steps or '?'}")
                    if up.output is not None:
                        step, replica, leaves = up.output
                        self.outputs.setdefault(step, {})[replica] = leaves
        if new:
            for cb in list(self._subscribers):
                cb(new)
        return new

    def _phase(self, text: str) -> None:
        self.phase = text
        self.phases.append((time.time() - self._started, text))

    def _where(self, rank: int) -> str:
        if self.mesh is None or not 0 <= rank < self.mesh.world:
            return f"rank {rank}"
        return f"rank {rank} ({self.mesh.label(rank)})" if self.mesh.world > self.mesh.pp else f"rank {rank}"

    def _loop(self) -> None:
        start = time.time()
        red = self._reducer
        while not self._stop.is_set():
            self.poll()
            if red.errors:
                time.sleep(self._poll)  # the others' reports (their peers went away) come a moment later
                self.poll()
                self.error = red.failure(self._where)
                self.status = "failed"
                break
            n = red.world or len(list(self.folder.glob("rank*.jsonl")))
            if n and len(red.done) >= n:
                self.status = "done"
                break
            if self._timeout is not None and time.time() - start > self._timeout:
                self.status = "stopped"
                break
            time.sleep(self._poll)
        self.poll()
        self._phase(self.status)
        for cb in list(self._subscribers):
            cb([])


def watch(folder: str | os.PathLike[str], poll: float = 0.2, timeout: float | None = None) -> Watch:
    """Follow an exported run's event folder live; ``pv.TimelineView(pv.watch(folder))`` draws it."""
    return Watch(folder, poll, timeout)
