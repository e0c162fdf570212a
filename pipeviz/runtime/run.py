"""``launch()`` a plan as real processes running torch's schedule, and the ``Run`` that watches them.

Example:
    >>> run = pv.launch(plan, schedule="1F1B", microbatches=8, steps=5, inputs=(x,), target=y,
    ...                 loss_fn=pv.cross_entropy, optimizer=pv.sgd(lr=0.1))      # returns at once
    >>> run.wait(timeout=60); run.losses; run.timeline(); run.state_dict()
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import os
import queue as queue_mod
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.feed import FedBatch, Feeder
from pipeviz.runtime.messages import (
    Events,
    Failed,
    Feed,
    Message,
)
from pipeviz.runtime.procs import context, server_running, start_without_main, sweep_stale, temp_prefix
from pipeviz.runtime.reducer import Reducer
from pipeviz.runtime.results import RunResults
from pipeviz.runtime.spec import LaunchSpec
from pipeviz.schedule import traits as sched
from pipeviz.schedule.timeline import COMPUTE, Event, Timeline

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event as MpEvent

    from pipeviz.runtime.payloads import Boot
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

    def __init__(self, plan: SplitPlan, spec: LaunchSpec, timeout: float, on_nonfinite: str = "stop") -> None:
        self.plan, self.spec = plan, spec
        self.schedule, self.layout = spec.schedule, spec.layout
        self.mesh = spec.mesh  # pipeline ranks × replicas; a process is known by mesh.coords(rank)
        self.microbatches, self.steps, self.timeout = spec.microbatches, spec.steps, timeout
        self.on_nonfinite = on_nonfinite
        self.status = "starting"
        self.phase = "starting"
        self.phases: list[tuple[float, str]] = []
        self._reducer = Reducer(spec.mesh.world)  # every message folded in, as Watch does (runtime.reducer)
        self.events: list[Event] = self._reducer.events
        self.losses: list[float] = self._reducer.losses
        self.grad_norms: list[float] = self._reducer.grad_norms
        self.learning_rates: list[float] = self._reducer.learning_rates
        self.eval_losses: list[tuple[int, float]] = self._reducer.eval_losses
        self.outputs: list[Any] = []
        self.error: str | None = None
        # a run stopped for no progress: where each rank was (pipeviz.schedule.hang)
        self.hang: HangReport | None = None
        self._feeder: Feeder | None = None  # a data= run's batches, streamed to the ranks (runtime.feed)
        self.nonfinite: list[tuple[int, str]] = self._reducer.nonfinite
        self.memory: dict[int, list[tuple[float, int]]] = self._reducer.memory
        self.activation_memory: dict[int, list[tuple[float, int]]] = self._reducer.activation_memory
        self.devices: list[str] = []
        self.cpus: list[tuple[int, ...]] | None = None  # each rank's cores when pinned (CPU runs)
        self.started_at = time.time()
        self.first_event_at: float | None = None
        self.weights: str | os.PathLike[str] | None = None  # the launch's weights=
        self._replica_outputs: dict[int, dict[int, Sequence[object]]] = {}  # step -> replica -> output leaves
        sweep_stale()  # what gone processes (a shut-down kernel) left
        self._state_dir = tempfile.mkdtemp(prefix=temp_prefix("state"))
        weakref.finalize(self, shutil.rmtree, self._state_dir, True)
        self._files: list[str] = []
        self._logs: dict[int, str] = {}  # rank -> its stderr file (gloo's own aborts land there)
        self._procs: list[Any] = []
        self._store: Any = None
        self._subscribers: list[Callable[[list[Event]], None]] = []
        self._status_subscribers: list[Callable[[Run], None]] = []
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._fds: list[int] = []  # payload files reserved, not yet written
        self._shipped_bytes = 0  # the model's values the ranks map (pipeviz.runtime.ship)
        # per stage, random ops in one forward (dropout): each rank seeded them per step and microbatch, so
        # check_numerics' reference can draw the same (pipeviz.runtime.rng)
        self.random_draws: tuple[int, ...] = ()
        LIVE_RUNS.add(self)

    # ----------------------------------------------------------------- public
    def subscribe(self, callback: Callable[[list[Event]], None]) -> None:
        """Call ``callback(new_events)`` from the run's monitor thread whenever events arrive
        (and once with ``[]`` when the run ends)."""
        self._subscribers.append(callback)

    def subscribe_status(self, callback: Callable[[Run], None]) -> None:
        """Call ``callback(run)`` from the run's monitor thread whenever its status, phase or step changes,
        before any event callback of the same moment (a status line can follow without waiting for a chart)."""
        self._status_subscribers.append(callback)

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
        return [p.pid for p in self._procs if p.pid is not None]

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

    # ----------------------------------------------------------------- monitor
    def _start(self, build: Callable[[], list[bytes]], boots: list[Boot]) -> None:
        self._thread = threading.Thread(target=self._monitor, args=(build, boots), daemon=True, name="pipeviz-run")
        self._thread.start()

    def _who(self, msg: Message) -> str:
        """The sender in words: ``"rank 2"``, with its coordinates when the run has replicas or shards."""
        if self.mesh.world == self.mesh.pp:
            return f"rank {msg.rank}"
        return f"rank {msg.rank} ({' '.join(f'{d}{getattr(msg.coords, d)}' for d in self.mesh.dims)})"

    def _set_phase(self, text: str) -> None:
        self.phase = text
        self.phases.append((time.time() - self.started_at, text))
        self._notify()

    def _notify(self) -> None:
        for cb in list(self._status_subscribers):
            try:
                cb(self)
            except Exception:
                import traceback

                traceback.print_exc()

    def _monitor(self, build: Callable[[], list[bytes]], boots: list[Boot]) -> None:
        procs_started: threading.Thread | None = None
        try:
            # Ranks that build their own stage (weights=, a meta model) unpickle its modules: the server imports
            # their HF code once. Other runs' ranks get generated code only, so their first launch skips it.
            first = not server_running()
            ctx = context(self.plan.graph.model if self.spec.sources is not None else None)
            if first:
                self._set_phase("starting the fork server (once per session: it imports torch, torch.distributed "
                                "and pipeviz's worker)")
            q = ctx.Queue()
            ready = ctx.Event()
            streamed = self.spec.data is not None
            feeds = [ctx.Queue(maxsize=2) for _ in boots] if streamed else [None] * len(boots)
            files = [self._reserve(f"rank{rank}", ".pkl") for rank in range(len(boots))]
            paths = [path for _, path in files]
            # The ranks start now and join the process group while the stages are built and written here; each
            # reads its payload once ``ready`` is set. (Starting blocks until the fork server is up: a thread.)
            procs_started = threading.Thread(target=self._start_procs, args=(ctx, boots, paths, q, feeds, ready),
                                             daemon=True, name="pipeviz-start")
            self._set_phase(f"starting {len(boots)} processes")
            procs_started.start()
            # torch's Pipe is traced once per plan and input shape (then cached); the model's values are written
            # into a file the ranks map (pipeviz.runtime.ship).
            self._set_phase("building the stages")
            payloads = build()
            if self._stop.is_set():
                procs_started.join()
                self._kill_all()
                return self._finish("stopped")
            # Payloads go through files: a large argument would be written into each child's start-up pipe
            # while the child imports torch, so the children would start one after another.
            for rank, ((fd, path), data) in enumerate(zip(files, payloads, strict=True)):
                self._write_payload(rank, fd, path, data)
            ready.set()
            self._set_phase(f"stages sent ({sum(map(len, payloads)) / 2**20:.1f} MiB pickled, "
                            f"{self._shipped_bytes / 2**20:.1f} MiB of values mapped)")
            procs_started.join()
            if self._start_error is not None:
                raise self._start_error
            self.status = "running"
            self._notify()
            if streamed:
                from pipeviz.runtime.payloads import shape_stages

                plan, spec = self.plan, self.spec
                self._feeder = Feeder(spec, lambda: self._stop.is_set() or self.done,
                                      lambda args, kwargs: shape_stages(plan, spec, args, kwargs), self._set_phase)
                threading.Thread(target=self._feeder.run, args=(feeds,), daemon=True, name="pipeviz-data").start()
            self._watch(q)
        except BaseException as exc:
            import traceback

            if procs_started is not None:
                procs_started.join(30)  # a start in progress finishes (or fails) before the processes are reaped
            if self.error is None:
                self.error = (str(exc) if isinstance(exc, LaunchError)
                              else f"launch failed in the parent process:\n{traceback.format_exc()}")
            self._kill_all()
            self._finish("failed" if not isinstance(exc, KeyboardInterrupt) else "stopped")

    def _start_procs(self, ctx: ForkServerContext, boots: list[Boot], paths: list[str], q: Queue[Message],
                     feeds: list[Queue[Feed]] | list[None], ready: MpEvent) -> None:
        from pipeviz.runtime import worker

        try:
            for rank, boot in enumerate(boots):
                fd, log = tempfile.mkstemp(prefix=temp_prefix(f"rank{rank}"), suffix=".log")
                os.close(fd)
                self._files.append(log)
                self._logs[rank] = log
                proc = ctx.Process(target=worker.main, args=(paths[rank], q, log, feeds[rank], boot, ready),
                                   daemon=True)
                start_without_main(proc)
                # Sent to the child at start; kept, it would keep the queue's semaphores alive (private: untyped).
                proc._args = ()  # type: ignore[attr-defined]
                self._procs.append(proc)
        except BaseException as exc:
            self._start_error = exc

    def _reserve(self, kind: str, suffix: str) -> tuple[int, str]:
        """A new temporary file, open for writing, and its path (removed when the run ends)."""
        fd, path = tempfile.mkstemp(prefix=temp_prefix(kind), suffix=suffix)
        self._files.append(path)
        self._fds.append(fd)
        return fd, path

    def _write_payload(self, rank: int, fd: int, path: str, data: bytes) -> None:
        self._fds.remove(fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise LaunchError(
                    f"No space left in {os.path.dirname(path)} for rank {rank}'s payload ({len(data) / 2**20:.1f} MiB: "
                    "its stage, weights and inputs). Fix: free some space there, or point TMPDIR at a disk with room."
                ) from exc
            raise

    def _apply(self, msg: Message) -> None:
        """Fold one message in (``runtime.reducer``) and publish what it changed."""
        with self._lock:
            up = self._reducer.apply(msg)
            if self.first_event_at is None and up.events:
                self.first_event_at = time.time()
        if up.events:
            self._publish(up.events)
        if up.phase is not None:
            self._set_phase(f"{self._who(msg)}: {up.phase}")
        if up.step is not None:
            self._set_phase(f"step {up.step}/{self.steps or '?'}")
        if up.output is not None:
            self._output(*up.output)

    def _watch(self, q: Queue[Message]) -> None:
        last_progress = time.time()
        red = self._reducer
        while True:
            if self._stop.is_set():
                self._kill_all()
                return self._finish("stopped")
            try:
                msg: Message | None = q.get(timeout=0.2)  # blocking: the parent stays off the ranks' cores
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                last_progress = time.time()
                self._apply(msg)
                continue  # drain what is queued before checking on the processes
            crashed = [r for r, p in enumerate(self._procs) if p.exitcode not in (None, 0) and r not in red.done]
            if red.errors or crashed:
                return self._fail(q)
            if red.all_done:
                for proc in self._procs:
                    proc.join(timeout=5)
                self._kill_all()
                if self._feeder is not None and self._feeder.error:
                    self.error = (f"{self._feeder.error}\nThe run stopped after the steps before it; the ranks ended "
                                  "cleanly.")
                    return self._finish("failed")
                if self.nonfinite and self.on_nonfinite == "stop":
                    step = min(s for s, _ in self.nonfinite)
                    first = [w for s, w in self.nonfinite if s == step]
                    first.sort(key=lambda w: not w.startswith("the loss"))
                    found = "; ".join(first[:4]) + (f"; and {len(first) - 4} more" if len(first) > 4 else "")
                    self.error = (f"NaN or inf in step {step}: {found}. The run was stopped before that step's "
                                  "optimizer update. Fix: a lower learning rate, gradient clipping, or inputs and "
                                  "targets without NaN/inf; launch(on_nonfinite='continue') to keep going.")
                    return self._finish("failed")
                return self._finish("done")
            if time.time() - last_progress > self.timeout:
                self.hang = self._hang_report(time.time() - last_progress)
                self.error = (f"no progress for {self.timeout:g} s (step timeout); the run was stopped. Where each "
                              f"rank was (run.hang):\n{self.hang}\nFix: raise launch(timeout=...) for slow steps, or "
                              "the cause above.")
                self._kill_all()
                return self._finish("failed")

    def _hang_report(self, idle: float) -> HangReport:
        """Where each pipeline rank is stuck (``pipeviz.schedule.hang.diagnose``), from its schedule's order and the
        actions
        replica 0's first shard reported finished in the batch it was on."""
        from pipeviz.schedule.hang import diagnose

        cfg, lay = self.spec.config, self.layout
        m = self.spec.microbatches
        orders = ([list(acts) for acts in cfg.order] if cfg.order is not None
                  else sched.orders(lay.schedule, lay.num_stages, m, cfg.stages_per_rank))
        mine = [e for e in self.events if e.kind in COMPUTE and e.rank in self._lead_processes()]
        step = max((e.step for e in mine), default=0)
        mine = [e for e in mine if e.step == step]
        batch = max((e.mb // m for e in mine), default=0)  # accumulation: the step's batches number on
        done = {(e.stage, e.kind, e.mb % m) for e in mine if e.mb // m == batch}
        return diagnose(orders, lay.stage_ranks, done, computing_for=idle)

    def _lead_processes(self) -> set[int]:
        """The processes of replica 0's first shard: one per pipeline rank."""
        mesh = self.mesh
        return {r for r in range(mesh.world) if mesh.coords(r).dp == mesh.coords(r).tp == mesh.coords(r).cp == 0}

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
        self.error = self._reducer.failure(self._where, [p.exitcode for p in self._procs])
        mismatch = self._size_mismatch()
        if mismatch:
            self.error = f"{mismatch}\n\n{self.error}"
        self._kill_all()
        self._finish("failed")

    def _size_mismatch(self) -> str | None:
        """A rank gloo killed for a message larger than its receive buffer, in words: which rank, receiving what
        from which rank (from its order and the actions finished), and the sizes. torch 2.13 + gloo measured: a
        hand-off larger than the receiving stage's buffer (built from the example's shapes) aborts the receiver
        (SIGABRT, "op.preamble.length <= op.nbytes. 40 vs 32") with no Python traceback; a smaller one is received
        silently into the front of the buffer (the forward computes on stale values; training then fails in the
        sender's backward with autograd's "Mismatch in shape")."""
        import re

        for rank, proc in enumerate(self._procs):
            if proc.exitcode is None or proc.exitcode >= 0 or rank in self._reducer.errors:
                continue
            try:
                with open(self._logs.get(rank, ""), errors="replace") as f:
                    log = f.read()[-20000:]
            except OSError:
                continue
            found = re.search(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)", log)
            if found is None:
                continue
            sent, room = int(found.group(1)), int(found.group(2))
            where = ""
            prank = self.mesh.pipeline_rank(rank)
            try:
                state = self._hang_report(0.0).ranks[prank]
            except Exception:  # the diagnosis is a courtesy here: the sizes are the finding
                state = None
            if state is not None and state.current is not None:
                s, kind, mb = sched.parse(state.current)
                src = s - 1 if kind == "F" else s + 1
                if 0 <= src < self.layout.num_stages:
                    what = "activations" if kind == "F" else "gradients"
                    # a rank killed mid-step loses its last unsent events: this is the earliest it can have been
                    where = (f" receiving stage {src}'s {what} from rank {self.layout.stage_ranks[src]}, at "
                             f"{state.current} or later (the first action it had not reported finished; it needs "
                             f"{src}{'F' if kind == 'F' else 'B'}{mb})")
            return (f"Shape mismatch between stages: {self._where(rank)} was killed by gloo{where}: {sent} bytes "
                    f"arrived for a receive buffer of {room} bytes. The receiving stage's buffers are shaped by the "
                    "example batch; this microbatch's hand-off was larger (an output whose shape depends on the "
                    "data, or batches shaped unlike the example). Fix: make each stage's output shape depend only "
                    "on the batch's shape (pad to a fixed length), or launch with batches shaped like the example.")
        return None

    def _where(self, r: int) -> str:
        """A process rank in words, with its coordinates (when the run has replicas or shards) and stages."""
        if not 0 <= r < self.mesh.world:
            return f"rank {r}"
        stages = self.layout.stages_of(self.mesh.pipeline_rank(r))
        said = [self.mesh.label(r)] if self.mesh.world > self.mesh.pp else []
        said += [f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}"] if stages else []
        return f"rank {r}" + (f" ({', '.join(said)})" if said else "")

    def _publish(self, batch: list[Event]) -> None:
        for cb in list(self._subscribers):
            try:
                cb(batch)
            except Exception:
                import traceback

                traceback.print_exc()

    def _finish(self, status: str) -> None:
        self.status = status
        self._finished.set()  # first: status subscribers see a run that is done
        self._set_phase(status)
        for cb in list(self._subscribers):
            try:
                cb([])
            except Exception:
                pass

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        end = time.time() + 2
        for proc in self._procs:
            proc.join(timeout=max(0.0, end - time.time()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        for path in self._files:  # payloads a child never got to read, and the ranks' logs
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._store = None  # the rendezvous port is free again once every rank is gone


@atexit.register
def _reap_all() -> None:
    for run in list(LIVE_RUNS):
        run._stop.set()
        run._kill_all()
        run._join_monitor()
