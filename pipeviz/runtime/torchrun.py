"""The entry point of an exported torchrun script (``pv.export_torchrun``): one process of the run, started by
torchrun, its messages written as JSON lines into the run's event folder (what ``pv.watch`` reads).

Example (the script's body):
    >>> from pipeviz.runtime.torchrun import run_rank
    >>> sys.exit(run_rank("train_pp.payload.pkl", "train_pp_events"))
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from pipeviz.runtime.messages import Done, Failed, Message, State
from pipeviz.schedule.mesh import DIMS, Coords

__all__ = ["run_rank"]


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

    from pipeviz.runtime.devices import resolve_devices
    from pipeviz.runtime.payloads import rank_payload
    from pipeviz.runtime.worker import run_payload

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
            raise SystemExit(f"This plan needs {mesh.world} processes ({mesh.describe()}); torchrun started {world}. "
                             f"Fix: --nproc-per-node x --nnodes = {mesh.world}.")
        local_gpus = torch.cuda.device_count()
        if local_gpus:
            devices, backend, compute = resolve_devices([f"cuda:{local % local_gpus}"] * world, world)
            if local_gpus <= local:  # fewer GPUs than local ranks: share them over host memory
                devices, backend, compute = ["cpu"] * world, "gloo", [f"cuda:{local % local_gpus}"] * world
        else:
            devices, backend, compute = ["cpu"] * world, "gloo", [None] * world
        payload = rank_payload(
            spec, job["stages"], job["tied"], rank, sources=job.get("sources"), backend=backend, device=devices[rank],
            compute=compute[rank],
            parent_pid=os.getppid(), timeout=spec.config.timeout, init_method="env://",
            threads=max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))),
        )
        coords = payload.coords
        if rank == 0:  # what pv.watch needs to know the run's processes before each has written
            Path(events_dir, "layout.json").write_text(json.dumps(
                {"world": mesh.world, "mesh": dict(zip(DIMS, mesh.degrees, strict=True)),
                 "stages": spec.layout.num_stages, "microbatches": spec.microbatches, "schedule": spec.schedule,
                 "steps": spec.steps}))
        run_payload(payload, sink)
        sink.put(Done(rank, coords))
        return 0
    except BaseException as exc:
        sink.put(Failed(rank, coords, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        traceback.print_exc()
        return 1
    finally:
        sink.close()
