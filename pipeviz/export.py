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
from typing import Any

import torch

from pipeviz.plan import SplitPlan
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


def export_torchrun(
    plan: SplitPlan, path: str | os.PathLike[str], schedule: str = "1F1B", microbatches: int = 8, steps: int = 1,
    inputs: tuple[Any, ...] | None = None, target: torch.Tensor | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    input_kwargs: dict[str, Any] | None = None, stages_per_rank: int | None = None, events_dir: str | None = None,
    timeout: float = 600.0, dp: int = 1,
) -> Path:
    """Write a torchrun script that trains ``plan`` with ``schedule`` (and its payload beside it).

    Everything is validated here, as ``pv.launch`` validates, before a script exists. The script
    uses NCCL when every rank has its own GPU (``LOCAL_RANK``), else gloo (CPU or a shared GPU). ``dp``:
    data-parallel replicas, laid out as ``pv.launch(..., dp=)`` lays them out (``pv.Mesh``: pipeline ranks ×
    replicas processes in all, ranks numbered pp-major, so ``--nproc-per-node`` replicas of a stage can share
    a host).

    Returns:
        The script's path. Its payload is ``<script>.payload.pkl``; events go to ``<script stem>_events/``.
    """
    import cloudpickle

    from pipeviz.capture import _batch_size
    from pipeviz.runtime.spec import _with_inputs, share, validate_launch
    from pipeviz.runtime.stages import build_stages, tied_ranks

    spec = validate_launch(plan, schedule, microbatches, steps, inputs, input_kwargs, target, loss_fn, optimizer,
                           stages_per_rank, timeout, dp=dp)
    script = Path(path)
    payload = script.with_suffix(".payload.pkl")
    events = events_dir or f"{script.stem}_events"
    batch = _batch_size(spec.args, spec.kwargs) or 1
    args0, kwargs0 = share((spec.args, spec.kwargs), 0, dp, batch)
    stages = build_stages(_with_inputs(plan, args0, kwargs0), microbatches)
    job = {
        "stages": stages, "tied": tied_ranks(stages, spec.layout.stage_ranks), "schedule": spec.schedule,
        "stage_ranks": spec.layout.stage_ranks, "microbatches": microbatches, "steps": steps,
        "loss_fn": spec.loss_fn, "optimizer": spec.optimizer, "args": spec.args, "kwargs": spec.kwargs,
        "target": spec.target, "timeout": timeout, "dp": dp,
    }
    payload.write_bytes(cloudpickle.dumps(job))
    from pipeviz.version import __version__

    mesh = spec.mesh
    layout = f" x {dp} replicas" if dp > 1 else ""
    summary = (f"{type(plan.graph.model).__name__}, {plan.num_stages} stages on {spec.layout.num_ranks} ranks{layout}, "
               f"{spec.schedule}, {microbatches} microbatches, {steps} steps")
    script.write_text(_SCRIPT.format(version=__version__, summary=summary, ranks=mesh.world,
                                     name=script.name, events=events, payload=payload.name))
    script.chmod(0o755)
    return script


class _JsonLines:
    """The worker's message sink under torchrun: one JSON line per message, flushed as it comes."""

    def __init__(self, folder: str, rank: int) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder, self.rank = folder, rank
        self.f = open(os.path.join(folder, f"rank{rank}.jsonl"), "w", buffering=1)

    def put(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "events":
            for e in msg[1]:
                self.f.write(json.dumps({"event": list(e)}) + "\n")
        elif kind == "state":
            Path(self.folder, f"state_rank{self.rank}.pt").write_bytes(msg[2])
            self.f.write(json.dumps({"state": f"state_rank{self.rank}.pt"}) + "\n")
        else:
            self.f.write(json.dumps({kind: list(msg[1:])}) + "\n")

    def close(self) -> None:
        self.f.close()

    def join_thread(self) -> None:
        pass


def run_rank(payload_path: str, events_dir: str) -> int:
    """Entry point of an exported script: run this process's rank from torchrun's environment."""
    import traceback
    import warnings

    import cloudpickle

    from pipeviz.capture import _batch_size
    from pipeviz.mesh import Mesh
    from pipeviz.runtime.spec import resolve_devices, share
    from pipeviz.runtime.stages import rank_stages
    from pipeviz.runtime.worker import RankPayload, _run

    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    sink = _JsonLines(events_dir, rank)
    try:
        with open(payload_path, "rb") as f:
            job = cloudpickle.loads(f.read())
        mesh = Mesh(pp=max(job["stage_ranks"]) + 1, dp=job.get("dp", 1))
        if world != mesh.world:
            raise SystemExit(f"This plan needs {mesh.world} ranks ({mesh.pp} pipeline ranks x {mesh.dp} replicas); "
                             f"torchrun started {world}. Fix: --nproc-per-node x --nnodes = {mesh.world}.")
        pp, replica, _ = mesh.coords(rank)
        args, kwargs, target = share((job["args"], job["kwargs"], job["target"]), replica, mesh.dp,
                                     _batch_size(job["args"], job["kwargs"]) or 1)
        local_gpus = torch.cuda.device_count()
        if local_gpus:
            devices, backend, compute = resolve_devices([f"cuda:{local % local_gpus}"] * world, world)
            if local_gpus <= local:  # fewer GPUs than local ranks: share them over host memory
                devices, backend, compute = ["cpu"] * world, "gloo", [f"cuda:{local % local_gpus}"] * world
        else:
            devices, backend, compute = ["cpu"] * world, "gloo", [None] * world
        ranks_of = job["stage_ranks"]
        first, last = ranks_of[0] == pp, ranks_of[-1] == pp
        payload = RankPayload(
            rank=rank, world=world, port=0, backend=backend, device=devices[rank], compute_device=compute[rank],
            schedule=job["schedule"], stage_ranks=ranks_of, microbatches=job["microbatches"],
            steps=job["steps"], stages=rank_stages(job["stages"], ranks_of, pp), tied=job["tied"],
            loss_fn=job["loss_fn"], optimizer=job["optimizer"], args=args if first else (),
            kwargs=kwargs if first else {}, target=target if last else None, t0=-1.0,
            parent_pid=os.getppid(), timeout_s=job["timeout"],
            threads=max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))),
            init_method="env://", mesh=mesh if mesh.dp > 1 else None,
        )
        _run(payload, sink)
        sink.put(("done", rank))
        return 0
    except BaseException:
        sink.put(("error", rank, traceback.format_exc()))
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
                    msg = json.loads(line)
                    if "event" in msg:
                        new.append(Event(*msg["event"]))
                    elif "loss" in msg:
                        self.losses.append(msg["loss"][1])
                    elif "step" in msg:
                        self._steps[rank] = msg["step"][1] + 1
                        self.step = min(self._steps.values())
                    elif "done" in msg:
                        self._done.add(rank)
                    elif "error" in msg:
                        self.error = f"rank {rank} failed:\n{msg['error'][1]}"
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

