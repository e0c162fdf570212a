"""Rank processes: where they come from (a fork server), how they start without the caller's ``__main__``,
and the rendezvous they meet at.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext
    from multiprocessing.process import BaseProcess

    import torch.distributed as dist
    from torch import nn

__all__ = ["context", "free_port", "preload_modules", "rendezvous", "server_running", "start_without_main",
           "sweep_stale", "temp_prefix"]


def free_port() -> int:
    """A port free right now (for tools that must be handed a number, such as torchrun's --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous(world_size: int, timeout: float) -> dist.TCPStore:
    """A ``TCPStore`` this process owns, on a port the OS picked and this process keeps: the ranks join it,
    so no other process can take the port between choosing it and the ranks connecting."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=max(timeout, 30.0)))


_SPAWN_LOCK = threading.Lock()
_SERVER_LOCK = threading.Lock()
_PRELOAD: set[str] = set()


def context(model: nn.Module | None = None) -> ForkServerContext:
    """Where rank processes come from: a fork server that has imported torch and pipeviz's worker once per
    session, so each launch forks ready processes instead of spawning fresh interpreters (each of which
    would import torch and torch.distributed again: seconds per rank). Started in the background on the
    first launch, while the parent builds the stages.

    ``model``: given when the ranks will build their own stages from its modules (a meta model, ``weights=``):
    the HF modelling modules it is built from are imported by the server too (``preload_modules``) when it
    starts, as importing transformers takes seconds per rank. (Measured with a 2-layer Llama from a
    checkpoint: ranks ready 0.1–0.3 s after they start, instead of 1.6–1.8 s.)"""
    import multiprocessing.forkserver as fs

    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    with _SERVER_LOCK:
        # What the server imports when it starts (the first launch, or a restart after it died).
        _PRELOAD.update(preload_modules(model))
        ctx.set_forkserver_preload(["pipeviz.runtime.worker", *sorted(_PRELOAD)])
        with _SPAWN_LOCK, _without_main():
            fs.ensure_running()
    return ctx


def server_running() -> bool:
    """Whether this process's fork server is up (its first start imports torch: seconds)."""
    import multiprocessing.forkserver as fs

    server = fs._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def preload_modules(model: nn.Module | None) -> list[str]:
    """The transformers modules ``model``'s classes come from (``transformers.models.llama.modeling_llama``,
    ...), if the caller has imported them. Only these: importing a user's own module in the fork server could
    run its top-level code there."""
    if model is None:
        return []
    names = sorted({type(m).__module__ for m in model.modules()})
    return [n for n in names if n.split(".")[0] == "transformers" and n in sys.modules]


TEMP_NAME = re.compile(r"^pipeviz-(?:state|values|rank\d+)-(\d+)-")  # what temp_prefix() names: kind, owner pid


def temp_prefix(kind: str) -> str:
    """The prefix of a launch's temporary file or folder (``state``, ``rank0``, ...), with the launching
    process's pid, so that ``sweep_stale`` can tell when its owner is gone."""
    return f"pipeviz-{kind}-{os.getpid()}-"


def sweep_stale(folder: str | None = None) -> list[str]:
    """Remove the temporary files and folders of launching processes that are gone; returns what it removed.

    A run removes its own when it ends and, for what it keeps (its trained tensors), when it is collected or its
    process exits. A process that never reaches its exit handlers leaves them: a Jupyter kernel that is shut
    down or restarted, a killed script. Each launch sweeps up after such processes."""
    removed: list[str] = []
    if folder is None:  # the temporary folder, and /dev/shm for the values files (pipeviz.runtime.ship)
        for where in dict.fromkeys([tempfile.gettempdir(), "/dev/shm"]):
            if os.path.isdir(where):
                removed += sweep_stale(where)
        return removed
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = TEMP_NAME.match(name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        path = os.path.join(folder, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except OSError:  # another user's, or another sweep was first
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, but is not ours to signal
        return True
    return True


def start_without_main(proc: BaseProcess) -> None:
    """Start a rank process without re-running the caller's ``__main__`` in it.

    multiprocessing normally re-imports the parent's main script in each child, so a script without an
    ``if __name__ == "__main__"`` guard would launch again from every worker. Workers need nothing from
    it: everything arrives cloudpickled (objects from ``__main__`` by value).
    """
    with _SPAWN_LOCK, _without_main():
        proc.start()


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    import multiprocessing.spawn as mp_spawn

    original = mp_spawn.get_preparation_data

    def prep(name: str) -> dict[str, object]:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp_spawn.get_preparation_data = prep
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = original


