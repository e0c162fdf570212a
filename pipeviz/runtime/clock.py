"""A rank's clock and outbox: every action timed (on a GPU by CUDA events, read once per step), memory sampled as
each action starts and ends, and events, losses and step ends sent together at most every ``SEND_INTERVAL``
seconds (each message wakes the launching process, a notebook kernel sharing the ranks' cores).

Example:
    >>> clock = Clock(t0, None)
    >>> with clock.span(rank, stage, "F", mb, step): ...      # one Event when the action ends
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Protocol

import torch

from pipeviz.runtime.memory import MemoryMeter
from pipeviz.runtime.messages import (
    Events,
    Memory,
    Message,
)
from pipeviz.schedule.mesh import Coords
from pipeviz.schedule.timeline import Event

__all__ = ["SEND_INTERVAL", "Clock", "EventRecord", "Sink", "Span", "SpanKey"]

# An event as a tuple (rank, stage, kind, mb, start, end, step): ``timeline.Event``'s fields, built when sent.
EventRecord = tuple[int, int, str, int, float, float, int]
# What a span is known by: (rank, stage, kind, mb, step).
SpanKey = tuple[int, int, str, int, int]


class Sink(Protocol):
    """Where a rank's messages go: the launching process's queue, or an exported run's event files."""

    def put(self, msg: Message, /) -> None: ...

SEND_INTERVAL = 0.1  # seconds: live enough to watch, rare enough not to disturb the ranks


class Clock:
    """Timestamps on one clock across ranks (wall time minus the run's start), and the rank's outbox.

    On a GPU, spans are timed with CUDA events, so they mark when the work ran, not when it was queued;
    they are read at step end. Events and posted messages leave together, at most every ``SEND_INTERVAL``.
    """

    def __init__(self, t0: float, cuda: torch.device | None) -> None:
        self.t0, self.cuda = t0, cuda
        self.pending: list[tuple[SpanKey, torch.cuda.Event, torch.cuda.Event]] = []
        self.buffer: list[EventRecord] = []
        self.outbox: list[Message] = []
        self.finished: collections.deque[EventRecord] = collections.deque()  # from other threads
        self.meter = MemoryMeter(cuda)
        # the stage and microbatch of the action running now in this thread (what a tensor-parallel collective, an
        # expert all-to-all belongs to): per thread, as ep_overlap runs a forward and a backward at once
        self._running = threading.local()
        self.memory: list[tuple[float, int, int]] = []  # (time, total bytes, saved-activation bytes)
        self.sent_at = 0.0
        self.queue: Any = None
        self.rank, self.coords = -1, Coords(-1)  # the sender named in every message
        self.anchor: tuple[float, Any] | None = None
        # the outbox is sent by the rank's thread, and by ``watch_stale``'s when that thread is stuck in an action
        self.lock = threading.RLock()
        self.stopped = False  # the rank's steps are over: ``watch_stale`` sends nothing more

    @property
    def stage(self) -> int:
        return int(getattr(self._running, "stage", -1))

    @stage.setter
    def stage(self, value: int) -> None:
        self._running.stage = value

    @property
    def mb(self) -> int:
        return int(getattr(self._running, "mb", -1))

    @mb.setter
    def mb(self, value: int) -> None:
        self._running.mb = value

    def watch_stale(self, every: float = 0.3) -> None:
        """Send what the rank finished even when its own thread stops sending: a rank stuck inside an action (a
        forward that never returns, a receive that never completes) otherwise keeps its last finished actions in
        its buffer, and the hang report (``pipeviz.schedule.hang``) would place it an action too early. A daemon thread
        checks every ``every`` seconds."""

        def loop() -> None:
            while not self.stopped:
                time.sleep(every)
                with self.lock:
                    if self.stopped:
                        return
                    stale = time.time() - self.t0 - self.sent_at > every
                    if self.queue is not None and stale and (self.buffer or self.finished):
                        try:
                            self.send()
                        except Exception:  # the queue is gone: the run is over
                            return

        threading.Thread(target=loop, daemon=True, name="pipeviz-clock").start()

    def span(self, rank: int, stage: int, kind: str, mb: int, step: int) -> Span:
        return Span(self, (rank, stage, kind, mb, step))

    def record(self, event: EventRecord) -> None:
        """A host-timed event (communication waits), sent with the others."""
        with self.lock:
            self.buffer.append(event)
            if event[5] - self.sent_at > SEND_INTERVAL:
                self.send()

    def sample(self) -> None:
        """A memory sample now (``pipeviz.runtime.memory``): taken as each action starts and ends."""
        activations, total = self.meter.sample()
        with self.lock:
            self.memory.append((time.time() - self.t0, total, activations))

    def record_async(self, event: EventRecord) -> None:
        """An event timed on another thread (a communication future's callback): queued, and moved into the
        next batch by the rank's own thread, which alone touches ``buffer``."""
        self.finished.append(event)

    def post(self, msg: Message) -> None:
        """A message (loss, step end) to send with the next batch of events."""
        with self.lock:
            self.outbox.append(msg)

    def send(self) -> None:
        with self.lock:
            while self.finished:
                self.buffer.append(self.finished.popleft())
            if self.buffer:
                self.queue.put(Events(self.rank, self.coords, [Event(*e) for e in self.buffer]))
                self.buffer = []
            if self.memory:
                self.queue.put(Memory(self.rank, self.coords, self.memory))
                self.memory = []
            for msg in self.outbox:
                self.queue.put(msg)
            self.outbox.clear()
            self.sent_at = time.time() - self.t0

    def flush(self, force: bool = False) -> None:
        """At step end: read GPU timings, and send if the last send is ``SEND_INTERVAL`` old (or ``force``)."""
        if self.cuda is not None and self.pending:
            self._read_gpu_events()
        if force or time.time() - self.t0 - self.sent_at > SEND_INTERVAL:
            self.send()

    def _read_gpu_events(self) -> None:
        torch.cuda.synchronize(self.cuda)
        host, ev0 = self.anchor  # type: ignore[misc]
        for (rank, stage, kind, mb, step), a, b in self.pending:
            start = host + ev0.elapsed_time(a) / 1e3
            self.buffer.append((rank, stage, kind, mb, start, host + ev0.elapsed_time(b) / 1e3, step))
        self.pending.clear()
        self.anchor = None


class Span:
    def __init__(self, clock: Clock, key: SpanKey) -> None:
        self.clock, self.key = clock, key

    def __enter__(self) -> None:
        c = self.clock
        c.stage, c.mb = self.key[1], self.key[3]
        c.sample()
        if c.cuda is not None:
            if c.anchor is None:
                torch.cuda.synchronize(c.cuda)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                c.anchor = (time.time() - c.t0, ev)
            self.a = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.start = time.time() - c.t0

    def __exit__(self, *exc: object) -> None:
        c = self.clock
        if c.cuda is not None:
            b = torch.cuda.Event(enable_timing=True)
            b.record()
            c.pending.append((self.key, self.a, b))
            c.sample()
        else:
            rank, stage, kind, mb, step = self.key
            now = time.time() - c.t0
            with c.lock:
                c.buffer.append((rank, stage, kind, mb, self.start, now, step))
            c.sample()
            if now - c.sent_at > SEND_INTERVAL:  # batched: live, without a queue put per action
                c.send()
