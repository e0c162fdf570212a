"""Scale out: export a plan to a torchrun script for many hosts, and watch its per-rank event files.

Example:
    >>> pv.export_torchrun(plan, "train_pp.py", schedule="1F1B", microbatches=8, steps=100,
    ...                    inputs=(x,), target=y, loss_fn=F.cross_entropy)
    $ torchrun --nproc-per-node 4 train_pp.py                                   # one host
    $ torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 --master-port 29500 train_pp.py
    >>> w = pv.watch("train_pp_events")            # live: w.events, w.losses, w.timeline(), TimelineView(w)

The script trains exactly as ``pv.launch`` does (same stages, relays, tied-gradient sums, schedule, and
numerics); every host needs pipeviz installed and the ``.payload.pkl`` file written next to the script.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Unpack

import torch

from pipeviz._compat import positional_legacy
from pipeviz.mesh import Coords
from pipeviz.plan import SplitPlan
from pipeviz.runtime.config import UNSET, LaunchConfig, LaunchOptions, launch_config
from pipeviz.runtime.messages import Done, Events, Failed, Loss, Memory, Message, State, StepEnd
from pipeviz.timeline import Event, Timeline

_SCRIPT = '''#!/usr/bin/env python
"""Pipeline-parallel training exported by pipeviz {version}: {summary}.

Run with torchrun, one process per rank ({ranks} ranks):
    torchrun --nproc-per-node {ranks} {name}
    torchrun --nnodes N --node-rank I --nproc-per-node K --master-addr HOST --master-port PORT {name}
Each rank writes JSON lines to {events}/rank<R>.jsonl (events, losses, step ends); pipeviz.watch(folder)
shows them live. Needs pipeviz on every host and {payload} next to this script.
"""
import os
import sys

from pipeviz.export import run_rank

__all__ = ["Watch", "export_torchrun", "run_rank", "watch"]


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    events = os.environ.get("PIPEVIZ_EVENTS", os.path.join(here, {events!r}))
    sys.exit(run_rank(os.path.join(here, {payload!r}), events))
'''


@positional_legacy("microbatches", "steps")
def export_torchrun(
    plan: SplitPlan, path: str | os.PathLike[str], schedule: str = UNSET, *, microbatches: int = UNSET,
    steps: int = UNSET, inputs: tuple[Any, ...] | None = None, target: torch.Tensor | None = None,
    input_kwargs: dict[str, Any] | None = None, events_dir: str | None = None, config: LaunchConfig | None = None,
    **options: Unpack[LaunchOptions],
) -> Path:
    """Write a torchrun script that trains ``plan`` as ``pv.launch`` would (and its payload beside it).

    Takes the one launch configuration ``pv.launch`` takes (``config=pv.LaunchConfig(...)`` and/or its fields as
    keywords, the same defaults), and everything is validated here, as ``pv.launch`` validates, before a script
    exists. The script uses NCCL when every process has its own GPU (``LOCAL_RANK``), else gloo (CPU or a shared
    GPU). With ``dp`` replicas and ``tp`` shards the processes are laid out as ``pv.launch`` lays them out
    (``pv.Mesh``: pipeline ranks × replicas × shards, numbered pp-major then dp then tp, so a host's
    ``--nproc-per-node`` consecutive ranks hold a stage's shards and replicas).

    Example:
        >>> cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=100, loss_fn=pv.cross_entropy, dp=2)
        >>> pv.export_torchrun(plan, "train.py", config=cfg, inputs=(x,), target=y)

    Returns:
        The script's path. Its payload is ``<script>.payload.pkl``; events go to ``<script stem>_events/``.

    Raises:
        LaunchError, ScheduleError, PlanError: what ``pv.launch`` would refuse, and ``devices`` other than
        ``"auto"`` (torchrun gives each process its ``LOCAL_RANK`` GPU).
    """
    import cloudpickle

    from pipeviz.runtime.payloads import spec_stages
    from pipeviz.runtime.spec import LaunchError, validate_launch

    cfg = launch_config(config, schedule=schedule, microbatches=microbatches, steps=steps, **options)
    if cfg.devices != "auto":
        raise LaunchError(f"devices={cfg.devices!r} cannot be exported: under torchrun each process takes its "
                          "LOCAL_RANK GPU (or the CPU without GPUs). Fix: devices='auto' (the default).")
    spec = validate_launch(plan, cfg, inputs=inputs, input_kwargs=input_kwargs, target=target)
    script = Path(path)
    payload = script.with_suffix(".payload.pkl")
    events = events_dir or f"{script.stem}_events"
    stages, tied = spec_stages(plan, spec)
    payload.write_bytes(cloudpickle.dumps({"spec": spec, "stages": stages, "tied": tied}))
    from pipeviz.version import __version__

    mesh = spec.mesh
    layout = "".join(f" x {n} {what}" for n, what in ((mesh.dp, "replicas"), (mesh.tp, "shards")) if n > 1)
    summary = (f"{type(plan.graph.model).__name__}, {plan.num_stages} stages on {spec.layout.num_ranks} ranks{layout}, "
               f"{spec.schedule}, {spec.microbatches} microbatches, {spec.steps} steps")
    script.write_text(_SCRIPT.format(version=__version__, summary=summary, ranks=mesh.world,
                                     name=script.name, events=events, payload=payload.name))
    script.chmod(0o755)
    return script


class _JsonLines:
    """The worker's message sink under torchrun: one JSON line per message (``Message.to_json``), flushed as it
    comes; a rank's trained tensors go to a file beside it."""

    def __init__(self, folder: str, rank: int) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder, self.rank = folder, rank
        self.f = open(os.path.join(folder, f"rank{rank}.jsonl"), "w", buffering=1)

    def put(self, msg: Message) -> None:
        if isinstance(msg, State) and isinstance(msg.data, bytes):
            Path(self.folder, f"state_rank{self.rank}.pt").write_bytes(msg.data)
            msg = State(msg.rank, msg.coords, f"state_rank{self.rank}.pt")
        self.f.write(json.dumps(msg.to_json()) + "\n")

    def close(self) -> None:
        self.f.close()

    def join_thread(self) -> None:
        pass


def run_rank(payload_path: str, events_dir: str) -> int:
    """Entry point of an exported script: run this process's rank from torchrun's environment."""
    import traceback
    import warnings

    import cloudpickle

    from pipeviz.runtime.payloads import rank_payload
    from pipeviz.runtime.spec import resolve_devices
    from pipeviz.runtime.worker import _run

    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    sink = _JsonLines(events_dir, rank)
    coords = Coords(-1)  # known once the payload is read
    try:
        with open(payload_path, "rb") as f:
            job = cloudpickle.loads(f.read())
        spec = job["spec"]
        mesh = spec.mesh
        if world != mesh.world:
            raise SystemExit(f"This plan needs {mesh.world} processes ({mesh.pp} pipeline ranks x {mesh.dp} replicas "
                             f"x {mesh.tp} shards); torchrun started {world}. Fix: --nproc-per-node x --nnodes = "
                             f"{mesh.world}.")
        local_gpus = torch.cuda.device_count()
        if local_gpus:
            devices, backend, compute = resolve_devices([f"cuda:{local % local_gpus}"] * world, world)
            if local_gpus <= local:  # fewer GPUs than local ranks: share them over host memory
                devices, backend, compute = ["cpu"] * world, "gloo", [f"cuda:{local % local_gpus}"] * world
        else:
            devices, backend, compute = ["cpu"] * world, "gloo", [None] * world
        payload = rank_payload(
            spec, job["stages"], job["tied"], rank, backend=backend, device=devices[rank], compute=compute[rank],
            parent_pid=os.getppid(), timeout=spec.config.timeout, init_method="env://",
            threads=max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))),
        )
        coords = payload.coords
        _run(payload, sink)
        sink.put(Done(rank, coords))
        return 0
    except BaseException as exc:
        sink.put(Failed(rank, coords, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        traceback.print_exc()
        return 1
    finally:
        sink.close()


class Watch:
    """Live view of an exported run's event folder (what ``pv.watch`` returns).

    Satisfies ``pv.Live``, the one interface the views use (as ``pv.Run`` does): ``events``, ``losses``,
    ``status``, ``done``, ``step``, ``error``, ``subscribe``, ``wait()``, ``timeline()``, ``stop()``.
    """

    def __init__(self, folder: str | os.PathLike[str], poll: float = 0.2, timeout: float | None = None) -> None:
        self.folder = Path(folder)
        self.events: list[Event] = []
        self.losses: list[float] = []
        self.memory: dict[int, list[tuple[float, int]]] = {}  # per rank: (time, bytes), as ``Run.memory``
        self.error: str | None = None
        self.status = "running"
        self.step = 0
        self.steps: int | None = None
        self._offsets: dict[str, int] = {}
        self._done: set[int] = set()
        self._steps: dict[int, int] = {}
        self._subscribers: list[Callable[[list[Event]], None]] = []
        self._stop = threading.Event()
        self._poll, self._timeout = poll, timeout
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pipeviz-watch")
        self._thread.start()

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
        ranks = max((e.rank for e in self.events), default=-1) + 1
        stages = max((e.stage for e in self.events), default=-1) + 1
        mbs = max((e.mb for e in self.events), default=-1) + 1
        return Timeline(list(self.events), ranks, stages, mbs, "torchrun", source="measured")

    def poll(self) -> list[Event]:
        """Read what the rank files gained since the last poll; returns the new events."""
        new: list[Event] = []
        for path in sorted(self.folder.glob("rank*.jsonl")):
            rank = int(path.stem[4:])
            with open(path) as f:
                f.seek(self._offsets.get(path.name, 0))
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):  # a line still being written: read it next time
                        break
                    self._offsets[path.name] = f.tell()
                    msg = Message.from_json(json.loads(line))
                    if isinstance(msg, Events):
                        new.extend(Event(*e) for e in msg.events)
                    elif isinstance(msg, Loss):
                        self.losses.append(msg.value)
                    elif isinstance(msg, Memory):
                        self.memory.setdefault(rank, []).extend((t, total) for t, total, _ in msg.samples)
                    elif isinstance(msg, StepEnd):
                        self._steps[rank] = msg.step + 1
                        self.step = min(self._steps.values())
                    elif isinstance(msg, Done):
                        self._done.add(rank)
                    elif isinstance(msg, Failed):
                        self.error = f"rank {rank} failed:\n{msg.traceback}"
        if new:
            self.events.extend(new)
            for cb in list(self._subscribers):
                cb(new)
        return new

    def _loop(self) -> None:
        start = time.time()
        while not self._stop.is_set():
            self.poll()
            if self.error:
                self.status = "failed"
                break
            n = len(list(self.folder.glob("rank*.jsonl")))
            if n and len(self._done) == n:
                self.status = "done"
                break
            if self._timeout is not None and time.time() - start > self._timeout:
                self.status = "stopped"
                break
            time.sleep(self._poll)
        self.poll()
        for cb in list(self._subscribers):
            cb([])


def watch(folder: str | os.PathLike[str], poll: float = 0.2, timeout: float | None = None) -> Watch:
    """Follow an exported run's event folder live; ``pv.TimelineView(pv.watch(folder))`` draws it."""
    return Watch(folder, poll, timeout)

