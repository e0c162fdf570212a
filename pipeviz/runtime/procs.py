"""Rank processes: where they come from (a fork server), how they start without the caller's ``__main__``,
and the rendezvous port.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

__all__ = ["context", "free_port", "start_without_main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SPAWN_LOCK = threading.Lock()
_SERVER_LOCK = threading.Lock()


def context() -> Any:
    """Where rank processes come from: a fork server that has imported torch and pipeviz's worker once per
    session, so each launch forks ready processes instead of spawning fresh interpreters (each of which
    would import torch and torch.distributed again: seconds per rank). Started in the background on the
    first launch, while the parent builds the stages."""
    import multiprocessing.forkserver as fs

    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    with _SERVER_LOCK:
        ctx.set_forkserver_preload(["pipeviz.runtime.worker"])
        with _SPAWN_LOCK, _without_main():
            fs.ensure_running()
    return ctx


def start_without_main(proc: Any) -> None:
    """Start a rank process without re-running the caller's ``__main__`` in it.

    multiprocessing normally re-imports the parent's main script in each child, so a script without an
    ``if __name__ == "__main__"`` guard would launch again from every worker. Workers need nothing from
    it: everything arrives cloudpickled (objects from ``__main__`` by value).
    """
    with _SPAWN_LOCK, _without_main():
        proc.start()


@contextlib.contextmanager
def _without_main() -> Any:
    import multiprocessing.spawn as mp_spawn

    original = mp_spawn.get_preparation_data

    def prep(name: str) -> dict[str, Any]:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp_spawn.get_preparation_data = prep
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = original


