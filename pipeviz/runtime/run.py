"""The ``Run`` that ``pv.launch`` returns: its public face (status, events, losses, ``wait``, ``stop``,
``timeline``; the results: ``pipeviz.runtime.results``) and the thread that drives it, delegating to three
cooperating parts: the ``Monitor`` (messages folded in, events and phases published), the ``Supervisor`` (the
processes and their files, crashes, reaping) and the ``Diagnosis`` (failures and hangs in words).

Example:
    >>> run = pv.launch(plan, schedule="1F1B", microbatches=8, steps=5, inputs=(x,), target=y,
    ...                 loss_fn=pv.cross_entropy, optimizer=pv.sgd(lr=0.1))      # returns at once
    >>> run.wait(timeout=60); run.losses; run.timeline(); run.state_dict()
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue as queue_mod
import shutil
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.diagnosis import Diagnosis
from pipeviz.runtime.feed import FedBatch, Feeder
from pipeviz.runtime.messages import Events, Failed, Feed, Message
from pipeviz.runtime.monitor import Monitor
from pipeviz.runtime.procs import context, server_running, sweep_stale, temp_prefix
from pipeviz.runtime.results import RunResults
from pipeviz.runtime.spec import LaunchSpec
from pipeviz.runtime.supervision import Supervisor
from pipeviz.schedule.timeline import Event, Timeline

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from pipeviz.runtime.payloads import Boot
    from pipeviz.runtime.reducer import ExpertLoad
    from pipeviz.schedule.hang import HangReport

__all__ = ["Run"]

LIVE_RUNS: weakref.WeakSet[Run] = weakref.WeakSet()


class Run(RunResults):
    """A pipelined training run in background processes. Returned by ``launch``; never built by hand.

    Attributes:
        status: ``"starting"``, ``"running"``, ``"done"``, ``"failed"`` or ``"stopped"``.
        phase: what the run is doing now, in words (``"building the stages"``, ``"starting 3 processes"``,
            ``"rank 1: stage 1 ready"``, ``"step 2/5"``); ``phases`` lists every phase with its time.
        events: ``Event`` list, growing while the run goes.
        losses: the loss of each finished step (each microbatch's loss averaged, over every accumulated batch; or
            the ``loss_reduction``'s sum or token mean).
        grad_norms: with ``clip_grad_norm``, the global norm of each step's gradients (every stage, replica and
            shard together) before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it on the unsplit model.
        learning_rates: with ``lr_scheduler``, the learning rate each step updated with.
        eval_losses: with ``eval_data=``, ``(step, loss)``: the loss over the held-out batches after that step
            (0-based; every ``eval_every`` steps and after the last).
        expert_tokens: with ``ep`` > 1, per training forward and MoE block, the tokens a replica routed to each
            expert (``ExpertLoad``: step, stage, block, mb, replica, counts): the load imbalance.
        outputs: a forward-only run's (no ``loss_fn``) output for the whole batch at each step, in the model's
            output structure, on the CPU (microbatches joined back along the batch dim).
        error: for a failed run, the root cause first (which rank and stage, what failed, on what), then its
            traceback, the ranks that failed in consequence, and the end of the failing rank's torch log.
        nonfinite: NaN or inf found in a loss or gradient: ``(step, what)`` pairs (the run stops at the first
            unless launched with ``on_nonfinite="continue"``).
        step: steps finished by every rank.
        memory: per process rank, ``(time, bytes)`` samples of its memory, taken as each action starts and ends
            (``pipeviz.runtime.memory``): on the CPU the tensors saved for backward plus parameters, gradients
            and optimizer state; on a GPU ``torch.cuda.memory_allocated``.
        activation_memory: per process rank, ``(time, bytes)`` samples of the tensors saved for backward alone
            (what ``pv.simulate``'s ``peak_activation_bytes`` predicts).
    """

    def __init__(self, plan: SplitPlan, spec: LaunchSpec, *, timeout: float, on_nonfinite: str = "stop") -> None:
        self.plan, self.spec = plan, spec
        self.schedule, self.layout = spec.schedule, spec.layout
        self.mesh = spec.mesh  # pipeline ranks × replicas; a process is known by mesh.coords(rank)
        self.microbatches, self.steps, self.timeout = spec.microbatches, spec.steps, timeout
        self.on_nonfinite = on_nonfinite
        self.status = "starting"
        self._diagnosis = Diagnosis(spec)
        self._monitor: Monitor[Run] = Monitor(self, spec.mesh.world, self._diagnosis.who, spec.steps)
        self._supervisor = Supervisor()
        self.started_at = self._monitor.started_at
        # every message folded in, as Watch does (runtime.reducer): the run's lists are the reducer's
        self._reducer = self._monitor.reducer
        self._lock = self._monitor.lock
        self.events: list[Event] = self._reducer.events
        self.losses: list[float] = self._reducer.losses
        self.grad_norms: list[float] = self._reducer.grad_norms
        self.learning_rates: list[float] = self._reducer.learning_rates
        self.eval_losses: list[tuple[int, float]] = self._reducer.eval_losses
        self.expert_tokens: list[ExpertLoad] = self._reducer.expert_tokens
        self.nonfinite: list[tuple[int, str]] = self._reducer.nonfinite
        self.memory: dict[int, list[tuple[float, int]]] = self._reducer.memory
        self.activation_memory: dict[int, list[tuple[float, int]]] = self._reducer.activation_memory
        self.outputs: list[Any] = []
        self.error: str | None = None
        # a run stopped for no progress: where each rank was (pipeviz.schedule.hang)
        self.hang: HangReport | None = None
        self._feeder: Feeder | None = None  # a data= run's batches, streamed to the ranks (runtime.feed)
        self.devices: list[str] = []
        self.cpus: list[tuple[int, ...]] | None = None  # each rank's cores when pinned (CPU runs)
        self.weights: str | os.PathLike[str] | None = None  # the launch's weights=
        self._replica_outputs: dict[int, dict[int, Sequence[object]]] = {}  # step -> replica -> output leaves
        sweep_stale()  # what gone processes (a shut-down kernel) left
        self._state_dir = tempfile.mkdtemp(prefix=temp_prefix("state"))
        weakref.finalize(self, shutil.rmtree, self._state_dir, True)
        # the supervisor's lists, shared: a launch adds the shipped values' file
        self._files, self._procs = self._supervisor.files, self._supervisor.procs
        self._store: Any = None  # the rendezvous the ranks join (held open by this process until they are gone)
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._shipped_bytes = 0  # the model's values the ranks map (pipeviz.runtime.ship)
        # per stage, random ops in one forward (dropout): each rank seeded them per step and microbatch, so
        # check_numerics' reference can draw the same (pipeviz.runtime.rng)
        self.random_draws: tuple[int, ...] = ()
        LIVE_RUNS.add(self)

    # ----------------------------------------------------------------- public
    def subscribe(self, callback: Callable[[list[Event]], None]) -> None:
        """Call ``callback(new_events)`` from the run's monitor thread whenever events arrive
        (and once with ``[]`` when the run ends)."""
        self._monitor.subscribe(callback)

    def subscribe_status(self, callback: Callable[[Run], None]) -> None:
        """Call ``callback(run)`` from the run's monitor thread whenever its status, phase or step changes,
        before any event callback of the same moment (a status line can follow without waiting for a chart)."""
        self._monitor.subscribe_status(callback)

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends or ``timeout`` seconds pass; returns the status.
        Ctrl-C (KeyboardInterrupt) stops the run, then re-raises."""
        end = None if timeout is None else time.time() + timeout
        try:
            # Short slices: an interrupt (Ctrl-C, a notebook's stop button) is seen within 0.1 s.
            while not self._finished.is_set() and (end is None or time.time() < end):
                self._finished.wait(0.1 if end is None else max(0.0, min(0.1, end - time.time())))
        except KeyboardInterrupt:
            self.stop()
            raise
        if self._finished.is_set():
            self._join_monitor()
        return self.status

    def stop(self, timeout: float = 5.0) -> str:
        """Stop every process (within ``timeout`` seconds) and mark the run ``stopped``."""
        end = time.time() + timeout
        if not self._finished.is_set():
            self._stop.set()
            self._finished.wait(timeout)
            if not self._finished.is_set():  # the monitor is stuck; reap here
                self._kill_all()
        self._join_monitor(max(0.1, end - time.time()))  # within the same timeout
        return self.status

    def _join_monitor(self, timeout: float = 2.0) -> None:
        # The monitor thread marks the run finished a moment before it exits. Wait for the exit: a daemon
        # thread still unwinding when the interpreter shuts down can hold the last reference to the plan
        # (the thread's arguments), and freeing torch tensors with Python hooks there aborts the process.
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def phase(self) -> str:
        """What the run is doing now, in words (``"building the stages"``, ``"step 2/5"``)."""
        return self._monitor.phase

    @property
    def phases(self) -> list[tuple[float, str]]:
        """Every phase so far, with its time in seconds since the run started."""
        return self._monitor.phases

    @property
    def first_event_at(self) -> float | None:
        """When the first event arrived (wall-clock seconds); None before."""
        return self._monitor.first_event_at

    @property
    def step(self) -> int:
        """Steps finished by every process."""
        return self._reducer.step

    @property
    def step_walltimes(self) -> list[float]:
        """Wall-clock seconds of each finished step after the first: from one step's end on the slowest
        rank to the next's (optimizer and tied-gradient sync included)."""
        ends = [self._reducer.step_ends[s] for s in sorted(self._reducer.step_ends)]
        return [b - a for a, b in itertools.pairwise(ends)]

    @property
    def input_shapes(self) -> int:
        """How many input shapes a ``data=`` run has met (each traced once: ``pipeviz.runtime.shapes``); 1 else."""
        return len(self._feeder.shapes) if self._feeder is not None else 1

    @property
    def batches(self) -> list[FedBatch] | None:
        """A ``data=`` run's batches so far (for ``pv.check_numerics``), while they are small; else None."""
        return self._feeder.batches if self._feeder is not None else None

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def pids(self) -> list[int]:
        return self._supervisor.pids

    def timeline(self) -> Timeline:
        """The measured ``Timeline`` so far."""
        with self._lock:
            events = list(self.events)
        meta: dict[str, Any] = {"devices": self.devices, "memory": {r: list(s) for r, s in self.memory.items()},
                                "activation_memory": {r: list(s) for r, s in self.activation_memory.items()}}
        if self.mesh.world > self.mesh.pp:
            meta["processes"] = [self.mesh.label(r) for r in range(self.mesh.world)]
        # an accumulated step's batches are numbered on: accumulate x microbatches per step
        return Timeline(events, self.mesh.world, self.layout.num_stages,
                        self.microbatches * self.spec.config.accumulate, self.schedule, source="measured", meta=meta,
                        mesh=self.mesh)

    def __repr__(self) -> str:
        return (f"Run({self.schedule}, {self.layout.num_stages} stages on {self.layout.num_ranks} ranks, "
                f"status={self.status!r}, step {self.step}/{self.steps}, {len(self.events)} events)")

    # ----------------------------------------------------------------- the run's thread
    def _start(self, build: Callable[[], list[bytes]], boots: list[Boot]) -> None:
        self._thread = threading.Thread(target=self._drive, args=(build, boots), daemon=True, name="pipeviz-run")
        self._thread.start()

    def _drive(self, build: Callable[[], list[bytes]], boots: list[Boot]) -> None:
        """Start the processes, build and send their stages, then watch them until the run ends."""
        sup, phase = self._supervisor, self._monitor.set_phase
        procs_started: threading.Thread | None = None
        try:
            # Ranks that build their own stage (weights=, a meta model) unpickle its modules: the server imports
            # their HF code once. Other runs' ranks get generated code only, so their first launch skips it.
            first = not server_running()
            ctx = context(self.plan.graph.model if self.spec.sources is not None else None)
            if first:
                phase("starting the fork server (once per session: it imports torch, torch.distributed and pipeviz's "
                      "worker)")
            q = ctx.Queue()
            ready = ctx.Event()
            streamed = self.spec.data is not None
            feeds = [ctx.Queue(maxsize=2) for _ in boots] if streamed else [None] * len(boots)
            files = [sup.reserve(f"rank{rank}", ".pkl") for rank in range(len(boots))]
            # The ranks start now and join the process group while the stages are built and written here; each
            # reads its payload once ``ready`` is set. (Starting blocks until the fork server is up: a thread.)
            procs_started = threading.Thread(target=sup.start, args=(ctx, boots, [p for _, p in files], q, feeds,
                                                                     ready), daemon=True, name="pipeviz-start")
            phase(f"starting {len(boots)} processes")
            procs_started.start()
            # torch's Pipe is traced once per plan and input shape (then cached); the model's values are written
            # into a file the ranks map (pipeviz.runtime.ship).
            phase("building the stages")
            payloads = build()
            if self._stop.is_set():
                procs_started.join()
                self._kill_all()
                return self._finish("stopped")
            # Payloads go through files: a large argument would be written into each child's start-up pipe
            # while the child imports torch, so the children would start one after another.
            for rank, ((fd, path), data) in enumerate(zip(files, payloads, strict=True)):
                sup.write_payload(rank, fd, path, data)
            ready.set()
            phase(f"stages sent ({sum(map(len, payloads)) / 2**20:.1f} MiB pickled, "
                  f"{self._shipped_bytes / 2**20:.1f} MiB of values mapped)")
            procs_started.join()
            if sup.start_error is not None:
                raise sup.start_error
            self.status = "running"
            self._monitor.notify()
            if streamed:
                self._stream(feeds)
            self._watch(q)
        except BaseException as exc:
            if procs_started is not None:
                procs_started.join(30)  # a start in progress finishes (or fails) before the processes are reaped
            if self.error is None:
                self.error = (str(exc) if isinstance(exc, LaunchError)
                              else f"launch failed in the parent process:\n{traceback.format_exc()}")
            self._kill_all()
            self._finish("failed" if not isinstance(exc, KeyboardInterrupt) else "stopped")

    def _stream(self, feeds: Sequence[Queue[Feed] | None]) -> None:
        """A data= run: its batches go to the ranks from a thread of their own (``runtime.feed``)."""
        from pipeviz.runtime.payloads import shape_stages

        plan, spec = self.plan, self.spec
        self._feeder = Feeder(spec, lambda: self._stop.is_set() or self.done,
                              lambda args, kwargs: shape_stages(plan, spec, args, kwargs), self._monitor.set_phase)
        threading.Thread(target=self._feeder.run, args=(feeds,), daemon=True, name="pipeviz-data").start()

    def _apply(self, msg: Message) -> None:
        """Fold one message in (``runtime.monitor``); a forward-only step's output is kept."""
        up = self._monitor.apply(msg)
        if up.output is not None:
            self._output(*up.output)

    def _watch(self, q: Queue[Message]) -> None:
        """Read the ranks' messages until every rank is done, one failed or crashed, or none was heard from for
        ``timeout`` seconds."""
        sup, red = self._supervisor, self._reducer
        sup.heard()
        while True:
            if self._stop.is_set():
                self._kill_all()
                return self._finish("stopped")
            try:
                msg: Message | None = q.get(timeout=0.2)  # blocking: the parent stays off the ranks' cores
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                sup.heard()
                self._apply(msg)
                continue  # drain what is queued before checking on the processes
            if red.errors or sup.crashed(red.done):
                return self._fail(q)
            if red.all_done:
                return self._end()
            if sup.idle() > self.timeout:
                self.hang = self._diagnosis.hang(self.events, sup.idle())
                self.error = self._diagnosis.hang_error(self.timeout, self.hang)
                self._kill_all()
                return self._finish("failed")

    def _end(self) -> None:
        """Every rank is done: the run is done, unless the data feed failed or a step found NaN or inf."""
        self._supervisor.join(timeout=5)
        self._kill_all()
        if self._feeder is not None and self._feeder.error:
            self.error = f"{self._feeder.error}\nThe run stopped after the steps before it; the ranks ended cleanly."
            return self._finish("failed")
        if self.nonfinite and self.on_nonfinite == "stop":
            self.error = self._diagnosis.nonfinite(self.nonfinite)
            return self._finish("failed")
        return self._finish("done")

    def _fail(self, q: Queue[Message]) -> None:
        """Name the root cause (``Reducer.failure``): one failure makes its neighbours fail too, so collect what
        the others report for a moment first."""
        end = time.time() + 0.5
        while time.time() < end:
            try:
                msg = q.get(timeout=0.05)
            except queue_mod.Empty:
                continue
            if isinstance(msg, Failed | Events):
                self._apply(msg)
        sup = self._supervisor
        self.error = self._reducer.failure(self._diagnosis.where, sup.exitcodes)
        killed = [r for r, code in enumerate(sup.exitcodes) if code is not None and code < 0]
        mismatch = self._diagnosis.size_mismatch(sup.exitcodes, {r: sup.log(r) for r in killed}, self._reducer.errors,
                                                 self.events)
        if mismatch:
            self.error = f"{mismatch}\n\n{self.error}"
        self._kill_all()
        self._finish("failed")

    def _finish(self, status: str) -> None:
        self.status = status
        self._finished.set()  # first: status subscribers see a run that is done
        self._monitor.set_phase(status)
        self._monitor.end()

    def _kill_all(self) -> None:
        self._supervisor.kill_all()
        self._store = None  # the rendezvous port is free again once every rank is gone


@atexit.register
def _reap_all() -> None:
    for run in list(LIVE_RUNS):
        run._stop.set()
        run._kill_all()
        run._join_monitor()
