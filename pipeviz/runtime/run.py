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
import io
import itertools
import os
import queue as queue_mod
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Unpack

import torch

from pipeviz._compat import positional_legacy
from pipeviz.capture import _batch_size
from pipeviz.plan import SplitPlan
from pipeviz.runtime.config import UNSET, LaunchConfig, LaunchOptions, launch_config
from pipeviz.runtime.messages import (
    Done,
    Events,
    Failed,
    Loss,
    Memory,
    Message,
    NonFinite,
    Output,
    Phase,
    State,
    StepEnd,
)
from pipeviz.runtime.payloads import rank_boots, rank_payloads
from pipeviz.runtime.procs import context, rendezvous, server_running, start_without_main, sweep_stale, temp_prefix
from pipeviz.runtime.spec import (
    LaunchError,
    LaunchSpec,
    check_weights,
    cpu_sets,
    resolve_devices,
    share,
    validate_launch,
)
from pipeviz.timeline import Event, Timeline

__all__ = ["Run", "launch"]

_LIVE: weakref.WeakSet[Run] = weakref.WeakSet()
# Errors a rank sees when a peer went away first: consequences, not causes.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator",
              "Connection refused", "connection closed")


class Run:
    """A pipelined training run in background processes. Returned by ``launch``; never built by hand.

    Attributes:
        status: ``"starting"``, ``"running"``, ``"done"``, ``"failed"`` or ``"stopped"``.
        phase: what the run is doing now, in words (``"building the stages"``, ``"starting 3 processes"``,
            ``"rank 1: stage 1 ready"``, ``"step 2/5"``); ``phases`` lists every phase with its time.
        events: ``Event`` list, growing while the run goes.
        losses: mean loss per finished step (the loss of each microbatch, averaged).
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
        self.events: list[Event] = []
        self.losses: list[float] = []
        self.outputs: list[Any] = []
        self.batches: list[tuple[tuple[Any, ...], dict[str, Any], Any]] | None = None  # data= runs, for numerics
        self.error: str | None = None
        self._data_error: str | None = None
        self.nonfinite: list[tuple[int, str]] = []
        self.memory: dict[int, list[tuple[float, int]]] = {}
        self.activation_memory: dict[int, list[tuple[float, int]]] = {}
        self.step = 0
        self.devices: list[str] = []
        self.cpus: list[tuple[int, ...]] | None = None  # each rank's cores when pinned (CPU runs)
        self.started_at = time.time()
        self.first_event_at: float | None = None
        self._state: dict[str, torch.Tensor] = {}
        self.weights: str | os.PathLike[str] | None = None  # the launch's weights=
        self._state_files: list[str] = []  # each rank's trained tensors (read lazily, memory-mapped)
        self._replica_files: dict[int, list[str]] = {}  # replicas > 0: their trained tensors, to check agreement
        self._replica_outputs: dict[int, dict[int, list[Any]]] = {}  # step -> replica -> output leaves
        sweep_stale()  # what gone processes (a shut-down kernel) left
        self._state_dir = tempfile.mkdtemp(prefix=temp_prefix("state"))
        weakref.finalize(self, shutil.rmtree, self._state_dir, True)
        self._step_ends: dict[int, float] = {}
        self._files: list[str] = []
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
        _LIVE.add(self)

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
    def step_walltimes(self) -> list[float]:
        """Wall-clock seconds of each finished step after the first: from one step's end on the slowest
        rank to the next's (optimizer and tied-gradient sync included)."""
        ends = [self._step_ends[s] for s in sorted(self._step_ends)]
        return [b - a for a, b in itertools.pairwise(ends)]

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
        return Timeline(events, self.mesh.world, self.layout.num_stages, self.microbatches, self.schedule,
                        source="measured", meta=meta, mesh=self.mesh)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Trained parameters and buffers gathered from all stages, keyed by the original model's names
        (every alias of a tied tensor, so ``model.load_state_dict(run.state_dict())`` works). With replicas
        (``dp > 1``) these are replica 0's, after checking that every replica holds the same parameters (their
        buffers, such as running statistics, are each replica's own, as under DDP without buffer broadcast).

        Raises:
            RuntimeError: the run has not finished, or two replicas' parameters differ (naming the tensor)."""
        if self.status != "done":
            raise RuntimeError(f"state_dict() needs a finished run; status is {self.status!r}. Fix: run.wait().")
        self._check_replicas()
        aliases = self.plan.graph.capture.aliases
        keys = set(self.plan.graph.model.state_dict())
        out: dict[str, torch.Tensor] = {}
        for canon, value in self._trained().items():
            for name in aliases.get(canon, (canon,)):
                if name in keys:
                    out[name] = value
        return out

    def _check_replicas(self) -> None:
        if not self._replica_files:
            return
        mine = self._trained()
        params = set(self.plan.graph.capture.param_numel) - self.plan.graph.capture.buffers
        for replica, files in sorted(self._replica_files.items()):
            for path in files:
                for name, value in torch.load(path, mmap=True, weights_only=True).items():
                    if name in params and not torch.equal(value, mine[name]):
                        diff = float((value.double() - mine[name].double()).abs().max())
                        raise RuntimeError(f"Replica {replica}'s {name!r} differs from replica 0's by {diff:.1e}: "
                                           "the replicas did not take the same updates. Please report.")

    def _trained(self) -> dict[str, torch.Tensor]:
        out = dict(self._state)
        for path in sorted(self._state_files):  # memory-mapped: pages are read when used
            out.update(torch.load(path, mmap=True, weights_only=True))
        return out

    def save(self, path: str | os.PathLike[str]) -> list[str]:
        """Write the trained parameters and persistent buffers as safetensors under the original names
        (each tied tensor once, as HF saves it): a path ending in ``.safetensors`` gets one file; any other
        path a folder with one shard per rank and ``model.safetensors.index.json`` (HF ``save_pretrained``'s
        layout, which ``weights=`` and ``from_pretrained`` read; no process holds the whole model while it
        is written; an HF model's ``config.json`` and ``generation_config.json`` too). Returns the files
        written."""
        from pipeviz.weights import save_state

        if self.status != "done":
            raise RuntimeError(f"save() needs a finished run; status is {self.status!r}. Fix: run.wait().")
        aliases = self.plan.graph.capture.aliases
        keys = set(self.plan.graph.model.state_dict())

        def named(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = {}
            for canon, value in part.items():
                name = next((n for n in aliases.get(canon, (canon,)) if n in keys), None)
                if name is not None:  # a non-persistent buffer (inv_freq) is not saved, as in the model's
                    out[name] = value
            return out

        if os.fspath(path).endswith(".safetensors"):
            return save_state([named(self._trained())], path)
        parts = ([named(torch.load(f, mmap=True, weights_only=True)) for f in sorted(self._state_files)]
                 if self._state_files else [named(self._trained())])
        written = save_state(parts, path)
        model = self.plan.graph.model
        for attr in ("config", "generation_config"):  # an HF model: from_pretrained(path) reads the folder as is
            saver = getattr(getattr(model, attr, None), "save_pretrained", None)
            if callable(saver):
                saver(os.fspath(path))
                written.append(os.path.join(os.fspath(path), f"{attr}.json"))
        return written

    def _output(self, step: int, replica: int, leaves: list[Any]) -> None:
        """A forward-only step's output from one replica's last stage; the step's output is the replicas'
        outputs joined along the batch dim, replica 0's share first."""
        parts = self._replica_outputs.setdefault(step, {})
        parts[replica] = leaves
        if len(parts) < self.mesh.dp:
            return
        del self._replica_outputs[step]
        joined = [torch.cat(ls) if isinstance(ls[0], torch.Tensor) and ls[0].dim() else ls[0]
                  for ls in zip(*(parts[r] for r in range(self.mesh.dp)), strict=True)]
        self.outputs.append(self._structured(joined))

    def _structured(self, leaves: list[Any]) -> Any:
        """A forward-only step's output leaves back in the model's output structure (an HF ModelOutput, a
        tuple, a tensor), on the CPU."""
        from torch.utils import _pytree as pytree

        spec = self.plan.graph.capture.out_spec
        if spec is not None and spec.num_leaves == len(leaves):
            return pytree.tree_unflatten(leaves, spec)
        return leaves[0] if len(leaves) == 1 else tuple(leaves)

    def __repr__(self) -> str:
        return (f"Run({self.schedule}, {self.layout.num_stages} stages on {self.layout.num_ranks} ranks, "
                f"status={self.status!r}, step {self.step}/{self.steps}, {len(self.events)} events)")

    # ----------------------------------------------------------------- monitor
    def _start(self, build: Callable[[], list[bytes]], boots: list[Any]) -> None:
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

    def _monitor(self, build: Callable[[], list[bytes]], boots: list[Any]) -> None:
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
                threading.Thread(target=self._feed, args=(feeds,), daemon=True, name="pipeviz-data").start()
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

    def _start_procs(self, ctx: Any, boots: list[Any], paths: list[str], q: Any, feeds: list[Any],
                     ready: Any) -> None:
        from pipeviz.runtime import worker

        try:
            for rank, boot in enumerate(boots):
                fd, log = tempfile.mkstemp(prefix=temp_prefix(f"rank{rank}"), suffix=".log")
                os.close(fd)
                self._files.append(log)
                proc = ctx.Process(target=worker.main, args=(paths[rank], q, log, feeds[rank], boot, ready),
                                   daemon=True)
                start_without_main(proc)
                proc._args = ()  # sent to the child at start; kept, it would keep the queue's semaphores alive
                self._procs.append(proc)
        except BaseException as exc:
            self._start_error = exc

    def _feed(self, feeds: list[Any]) -> None:
        """Stream ``data=`` batches to the ranks as the run goes: the first stage's rank gets the inputs, the
        last stage's the target, every other rank a bare "go"; then "end" (after ``steps`` batches, when the
        iterable runs out, or at a bad batch, which fails the run naming it)."""
        from pipeviz.runtime.spec import data_batch

        spec, lay = self.spec, self.layout
        first_rank, last_rank = lay.stage_ranks[0], lay.stage_ranks[-1]
        batch: tuple[Any, Any, Any] | None = (spec.args, spec.kwargs, spec.target)
        kept: list[tuple[Any, Any, Any]] | None = []
        size = 0
        step = 0
        while (self.steps is None or step < self.steps) and not self._stop.is_set() and not self.done:
            if batch is None:
                try:
                    item = next(spec.data)
                except StopIteration:
                    break
                except Exception as exc:  # the user's iterable failed: the run fails, naming the batch
                    self._data_error = f"data= raised at batch {step}: {type(exc).__name__}: {exc}"
                    break
                try:
                    batch = _like_first(data_batch(item, step, spec.training), spec, step)
                except LaunchError as exc:
                    self._data_error = str(exc)
                    break
            size_of = _batch_size(batch[0], batch[1]) or 1
            for rank, feed in enumerate(feeds):
                c = self.mesh.coords(rank)  # each replica its share of the batch
                pp, replica = c.pp, c.dp
                args, kwargs, target = share(batch, replica, self.mesh.dp, size_of)
                msg = ("batch", args if pp == first_rank else (), kwargs if pp == first_rank else {},
                       target if pp == last_rank else None)
                if not self._put(feed, msg):
                    return
            if kept is not None:
                size += sum(t.numel() * t.element_size() for t in _tensors(batch))
                if size <= _KEEP_BATCHES:  # for check_numerics, while they are small
                    kept.append(batch)
                else:
                    kept = None
            self.batches = kept
            step += 1
            batch = None
        for feed in feeds:
            self._put(feed, ("end", None, None, None))

    def _put(self, feed: Any, msg: tuple[Any, ...]) -> bool:
        while not self._stop.is_set() and not self.done:
            try:
                feed.put(msg, timeout=0.2)
                return True
            except queue_mod.Full:
                continue
        return False

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

    def _watch(self, q: Any) -> None:
        done: set[int] = set()
        last_progress = time.time()
        world = len(self._procs)
        finished_steps: dict[int, int] = {}
        errors: dict[int, tuple[str, str, str]] = {}
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
                if isinstance(msg, Events):  # workers batch them (SEND_INTERVAL, 0.1 s)
                    self._publish([Event(*e) for e in msg.events])
                elif isinstance(msg, Memory):
                    self.memory.setdefault(msg.rank, []).extend((t, total) for t, total, _ in msg.samples)
                    self.activation_memory.setdefault(msg.rank, []).extend((t, act) for t, _, act in msg.samples)
                elif isinstance(msg, Loss):  # one per step: the global batch's, from replica 0's shard 0
                    self.losses.append(msg.value)
                elif isinstance(msg, Output):
                    self._output(msg.step, msg.coords.dp, torch.load(io.BytesIO(msg.data)))
                elif isinstance(msg, StepEnd):
                    finished_steps[msg.rank] = msg.step + 1
                    self._step_ends[msg.step] = max(self._step_ends.get(msg.step, 0.0), msg.time)
                    step = min(finished_steps.get(r, 0) for r in range(world))
                    if step != self.step:
                        self.step = step
                        self._set_phase(f"step {step}/{self.steps or '?'}")
                elif isinstance(msg, Phase):
                    self._set_phase(f"{self._who(msg)}: {msg.text}")
                elif isinstance(msg, NonFinite):
                    self.nonfinite.extend((msg.step, what) for what in msg.what)
                elif isinstance(msg, State):
                    replica = msg.coords.dp
                    if msg.coords.tp:
                        pass  # a tensor-parallel shard gathered the same whole tensors as shard 0
                    elif replica and isinstance(msg.data, str):
                        self._replica_files.setdefault(replica, []).append(msg.data)
                    elif replica:
                        pass  # a replica's tensors through the queue (no state folder): replica 0's stand
                    elif isinstance(msg.data, str):
                        self._state_files.append(msg.data)
                    else:
                        self._state.update(torch.load(io.BytesIO(msg.data)))
                elif isinstance(msg, Done):
                    done.add(msg.rank)
                elif isinstance(msg, Failed):
                    errors[msg.rank] = (msg.summary, msg.traceback, msg.log_tail)
                continue  # drain what is queued before checking on the processes
            crashed = [r for r, p in enumerate(self._procs) if p.exitcode not in (None, 0) and r not in done]
            if errors or crashed:
                return self._fail(q, errors, finished_steps)
            if len(done) == world:
                for proc in self._procs:
                    proc.join(timeout=5)
                self._kill_all()
                if self._data_error:
                    self.error = (f"{self._data_error}\nThe run stopped after the steps before it; the ranks ended "
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
                self.error = (f"no progress for {self.timeout:g} s (step timeout); the run was stopped. Fix: raise "
                              "launch(timeout=...) for slow steps, or look for a hang (a rank waiting for another).")
                self._kill_all()
                return self._finish("failed")

    def _fail(self, q: Any, errors: dict[int, tuple[str, str, str]], steps: dict[int, int]) -> None:
        """Name the root cause: one failure makes its neighbours fail too (their connections drop), so
        collect for a moment, then report a rank killed by a signal first, else the first real error; the
        consequences come after."""
        end = time.time() + 0.5
        while time.time() < end:
            try:
                msg = q.get(timeout=0.05)
            except queue_mod.Empty:
                continue
            if isinstance(msg, Failed):
                errors.setdefault(msg.rank, (msg.summary, msg.traceback, msg.log_tail))
            elif isinstance(msg, Events):
                self._publish([Event(*e) for e in msg.events])

        def where(r: int) -> str:
            """A process rank in words, with its coordinates (when the run has replicas or shards) and stages."""
            if not 0 <= r < self.mesh.world:
                return f"rank {r}"
            stages = self.layout.stages_of(self.mesh.pipeline_rank(r))
            said = [self.mesh.label(r)] if self.mesh.world > self.mesh.pp else []
            said += [f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}"] if stages else []
            return f"rank {r}" + (f" ({', '.join(said)})" if said else "")

        causes: list[tuple[int, str]] = []  # (process rank, what happened to it)
        for r, proc in enumerate(self._procs):
            code = proc.exitcode
            if code is not None and code < 0:
                causes.append((r, f"{where(r)} died (killed by signal {signal.Signals(-code).name}) without a Python "
                                  "traceback."))
        real = [r for r, (s, tb, _) in errors.items() if not any(c in s or c in tb for c in _PEER_GONE)]
        consequences = [r for r in errors if r not in real]
        for r in real:
            summary, tb, log = errors[r]
            text = f"{where(r)} failed in step {steps.get(r, 0)}: {summary}\n\n{tb.rstrip()}"
            if log.strip():
                text += f"\n\ntorch's log on rank {r} (last lines):\n{log.rstrip()}"
            causes.append((r, text))
        for r, proc in enumerate(self._procs):
            if proc.exitcode is not None and proc.exitcode > 0 and r not in errors:
                causes.append((r, f"{where(r)} died (exit code {proc.exitcode}) without a Python traceback."))
        if not causes and consequences:  # only peers-went-away errors: the first one is all there is
            r = consequences.pop(0)
            causes.append((r, f"{where(r)} failed in step {steps.get(r, 0)}: {errors[r][0]}\n\n"
                              f"{errors[r][1].rstrip()}"))
        self.error = causes[0][1] if causes else "a rank failed without a report."
        others = [where(r) for r, _ in causes[1:]] + [where(r) for r in consequences]
        if others:
            self.error += f"\n\nAs a consequence, {', '.join(others)} failed too (their peers went away)."
        self._kill_all()
        self._finish("failed")

    def _publish(self, batch: list[Event]) -> None:
        with self._lock:
            if self.first_event_at is None and batch:
                self.first_event_at = time.time()
            self.events.extend(batch)
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


_KEEP_BATCHES = 256 * 2**20  # a data= run keeps its batches (for check_numerics) up to this many bytes


def _tensors(tree: Any) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _like_first(batch: tuple[Any, Any, Any], spec: LaunchSpec, step: int) -> tuple[Any, Any, Any]:
    """A data= batch as (args, kwargs, target), checked against the first batch: the pipeline's shapes are
    fixed by it (torch's stages have static shapes)."""
    inputs, kwargs, target = batch
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs) if isinstance(inputs, tuple | list) \
        else None
    if args is None:
        raise LaunchError(f"data= batch {step}: inputs is a {type(inputs).__name__}; expected a tensor or a tuple or "
                          "list of tensors, like the first batch.")
    kwargs = dict(kwargs or {})
    pairs = [(f"inputs[{i}]", a, e) for i, (a, e) in enumerate(zip(args, spec.args, strict=False))]
    pairs += [(f"input_kwargs[{k!r}]", kwargs.get(k), v) for k, v in spec.kwargs.items()]
    if spec.target is not None:
        pairs.append(("target", target, spec.target))
    if len(args) != len(spec.args) or set(kwargs) != set(spec.kwargs):
        raise LaunchError(f"data= batch {step} has other inputs than the first batch ({len(args)} positional, "
                          f"keywords {sorted(kwargs)}; the first: {len(spec.args)}, {sorted(spec.kwargs)}).")
    for label, got, want in pairs:
        if not isinstance(want, torch.Tensor):
            continue
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            shown = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise LaunchError(
                f"data= batch {step}: {label} is {shown}, but the run started with {tuple(want.shape)} {want.dtype}: "
                "a pipeline's shapes are fixed by its first batch (and the batch must split into the "
                f"{spec.microbatches} microbatches). Fix: equal batches, e.g. DataLoader(..., drop_last=True).")
    return args, {k: kwargs[k] for k in spec.kwargs}, target


@atexit.register
def _reap_all() -> None:
    for run in list(_LIVE):
        run._stop.set()
        run._kill_all()
        run._join_monitor()


@positional_legacy("steps")
def launch(
    plan: SplitPlan,
    schedule: str = UNSET,
    microbatches: int = UNSET,
    *,
    steps: int | None = UNSET,
    inputs: tuple[Any, ...] | Any = None,
    input_kwargs: dict[str, Any] | None = None,
    target: Any = None,
    data: Any = None,
    weights: str | os.PathLike[str] | None = None,
    config: LaunchConfig | None = None,
    **options: Unpack[LaunchOptions],
) -> Run:
    """Start the plan's stages as processes running torch's ``schedule``; returns a ``Run`` at once.

    One process per rank, joining a rendezvous the calling process holds open (no port race). The stages
    are built here once; each rank receives only its own. Every forward, backward, input-grad and
    weight-grad action streams back as an ``Event``. Skip connections are relayed stage by stage and shared
    weights' gradients are summed across the stages holding them, so the run trains like the unsplit model
    (same microbatching, mean loss per microbatch).

    How to run is one ``pv.LaunchConfig`` (``config=``), the same object ``pv.export_torchrun``, the CLI and the
    Explorer take, or its fields as keywords (they override ``config``'s); ``schedule``, ``microbatches`` and
    ``steps`` may also come first, by position. Defaults: ``LaunchConfig()``'s.

    Example:
        >>> run = pv.launch(plan, "1F1B", 4, 3, inputs=(x,), target=y, loss_fn=pv.cross_entropy)
        >>> run = pv.launch(plan, config=pv.LaunchConfig(schedule="GPipe", dp=2, loss_fn=pv.cross_entropy),
        ...                 inputs=(x,), target=y)

    Args:
        plan: the ``SplitPlan``.
        schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV.
        microbatches: microbatches per step; must divide the batch.
        steps: optimizer steps (``None`` with ``data``: until it runs out).
        inputs / input_kwargs: the full batch (defaults: the graph's example inputs): a tensor or a tuple or
            list of them, each like the traced example (same dtype, same shape after the batch dim).
        target: the full batch of targets, passed to ``loss_fn(output, target)`` per microbatch.
            ``output`` is the model's output (its only tensor; for HF models the logits).
        loss_fn: mean-reduced loss returning a scalar tensor (tried once on a sample before launching).
            Without one the run is forward only: ``run.outputs[step]`` is the model's output for the batch.
        data: instead of ``inputs``/``target``: any iterable (a ``DataLoader`` too) whose next batch each step
            takes, streamed to the ranks that need it while the run goes: ``(inputs, target)`` pairs or
            ``{"inputs": ..., "target": ..., <keyword input>: ...}`` mappings (forward only: the inputs
            alone). Every batch has the first one's shapes. The run ends after ``steps`` or when it runs out.
        weights: a safetensors checkpoint (a ``.safetensors`` file, or a folder of shards with
            ``model.safetensors.index.json``, as HF ``save_pretrained`` and ``run.save`` write): each rank reads
            only its own stage's tensors, and no process is sent the model's values. The model may be on the
            meta device. Missing tensors and shapes that differ are named before any process starts.
        init_seed: a meta model without ``weights``: each rank initialises its own tensors with their
            modules' initialisers (HF ``_init_weights``, else ``reset_parameters``), seeded per module by this
            and the module's name (``pv.materialize(model, seed=init_seed)`` builds the same whole model).
        optimizer: ``params -> torch.optim.Optimizer`` (default ``pv.sgd(lr=0.1)``), built on every rank.
        devices: ``"auto"``, ``"cpu"``, ``"cuda"`` or one device per rank.
        stages_per_rank: for multi-stage schedules (default 2).
        timeout: seconds without progress before the run is declared hung and stopped.
        pin_cpus: on the CPU, give each rank its own cores (``run.cpus``) when there are enough and no
            other run of this process is going: its compute and gloo's threads then never wait behind
            another rank's (README, "What pipeviz fixes", has the measured gain).
        on_nonfinite: a NaN or inf loss or gradient: ``"stop"`` (the run fails before that step's update,
            naming the step, rank, stage and tensor) or ``"continue"`` (recorded in ``run.nonfinite``).
        dp: data-parallel replicas of the pipeline (``pv.Mesh(pp, dp)``: pp × dp processes). Each replica trains
            on its contiguous 1/dp of every batch (cut into ``microbatches``); torch's
            ``DistributedDataParallel`` on each stage averages the gradients across replicas in the last
            backward of a step, so the run trains like the unsplit model on the whole batch. ``run.losses`` is
            the whole batch's loss; ``run.state_dict()`` is replica 0's, checked equal to the others'.
        dp_shard: with ``dp`` > 1, each stage sharded across the replicas by torch's FSDP2 ``fully_shard``
            (parameters, gradients and optimizer state: 1/dp per process) instead of replicated under DDP.
        tp: tensor-parallel shards of every stage (pp × dp × tp processes): each stage's projections sharded with
            DTensor (``pipeviz.runtime.tensor_parallel``), column-wise then row-wise.
        tp_plan: ``{module name: "colwise" | "rowwise"}`` for ``nn.Linear`` modules; default: Megatron's MLP rule
            (in each stage, a Linear feeding the next Linear's input is column-wise, that one row-wise).

    Raises:
        LaunchError, ScheduleError, PlanError: before any process starts, naming the bad value and the fix.
    """
    cfg = launch_config(config, schedule=schedule, microbatches=microbatches, steps=steps, **options)
    spec = validate_launch(plan, cfg, inputs=inputs, input_kwargs=input_kwargs, target=target, data=data)
    spec.sources, spec.init_seed = check_weights(plan, weights, cfg.init_seed), cfg.init_seed
    world = spec.mesh.world
    stage_devices, backend, compute = resolve_devices(cfg.devices, world)
    on_cpu = all(d == "cpu" for d in stage_devices) and not any(compute)
    # Two runs at once would be pinned to the same cores: the second one is left to the scheduler.
    alone = not any(r.status in ("starting", "running") for r in list(_LIVE))
    threads, cpus = cpu_sets(world, cfg.pin_cpus and on_cpu and alone)

    run = Run(plan, spec, cfg.timeout, cfg.on_nonfinite)
    run.weights = weights
    run.devices = [c or d for c, d in zip(compute, stage_devices, strict=True)]
    run.cpus = cpus
    t0 = run.started_at
    run._store = rendezvous(world, cfg.timeout)
    port = run._store.port

    def build() -> list[bytes]:
        blobs, shipment = rank_payloads(plan, spec, stage_devices, compute, backend, port, t0, cfg.timeout, threads,
                                        cpus, run._state_dir, values_prefix=temp_prefix("values"))
        if shipment.path:  # the ranks map it; removed when the run ends (the mappings outlive the name)
            run._files.append(shipment.path)
        run._shipped_bytes = shipment.nbytes
        return blobs

    run._start(build, rank_boots(spec, stage_devices, compute, backend, port, t0, cfg.timeout, threads, cpus))
    return run
