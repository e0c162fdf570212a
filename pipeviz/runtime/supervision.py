"""A run's processes, supervised: started one per rank (through the fork server), their temporary files (payloads
and logs) kept and removed, a crash seen, the time since the ranks were last heard from (the step timeout), and
every process reaped (terminated, then killed) when the run ends.

Example:
    >>> sup = Supervisor()
    >>> fd, path = sup.reserve("rank0", ".pkl"); sup.write_payload(0, fd, path, payload)
    >>> sup.start(ctx, boots, [path], queue, [None], ready)
    >>> sup.crashed(done=set()), sup.idle(); sup.kill_all()
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import time
from collections.abc import Container
from typing import TYPE_CHECKING, Any

from pipeviz.errors import LaunchError
from pipeviz.runtime.procs import start_without_main, temp_prefix

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event as MpEvent

    from pipeviz.runtime.messages import Feed, Message
    from pipeviz.runtime.payloads import Boot

__all__ = ["Supervisor"]


class Supervisor:
    """The processes of one run and the files they use. ``procs`` and ``files`` are lists the run shares (a
    launch adds the shipped values' file; tests read them): they are only ever appended to or cleared."""

    def __init__(self) -> None:
        self.procs: list[Any] = []  # multiprocessing Process objects, by rank
        self.files: list[str] = []  # payloads, the ranks' logs, the shipped values: removed when the run ends
        self.logs: dict[int, str] = {}  # rank -> its stderr file (gloo's own aborts land there)
        self.start_error: BaseException | None = None  # what stopped ``start``, raised by the run's thread
        self.last_heard = time.time()
        self._fds: list[int] = []  # payload files reserved, not yet written

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def start(self, ctx: ForkServerContext, boots: list[Boot], paths: list[str], q: Queue[Message],
              feeds: list[Queue[Feed]] | list[None], ready: MpEvent) -> None:
        """Start one process per rank, each reading its payload from ``paths[rank]`` once ``ready`` is set. Runs
        in a thread of its own (starting blocks until the fork server is up): a failure is kept in
        ``start_error``."""
        from pipeviz.runtime import worker

        try:
            for rank, boot in enumerate(boots):
                fd, log = tempfile.mkstemp(prefix=temp_prefix(f"rank{rank}"), suffix=".log")
                os.close(fd)
                self.files.append(log)
                self.logs[rank] = log
                proc = ctx.Process(target=worker.main, args=(paths[rank], q, log, feeds[rank], boot, ready),
                                   daemon=True)
                start_without_main(proc)
                # Sent to the child at start; kept, it would keep the queue's semaphores alive (private: untyped).
                proc._args = ()  # type: ignore[attr-defined]
                self.procs.append(proc)
        except BaseException as exc:
            self.start_error = exc

    def reserve(self, kind: str, suffix: str) -> tuple[int, str]:
        """A new temporary file, open for writing, and its path (removed when the run ends)."""
        fd, path = tempfile.mkstemp(prefix=temp_prefix(kind), suffix=suffix)
        self.files.append(path)
        self._fds.append(fd)
        return fd, path

    def write_payload(self, rank: int, fd: int, path: str, data: bytes) -> None:
        """Write rank ``rank``'s payload into the file ``reserve`` opened; a full disk is named with the fix."""
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

    def heard(self) -> None:
        """A message arrived from a rank: the run made progress."""
        self.last_heard = time.time()

    def idle(self) -> float:
        """Seconds since a rank was last heard from (``heard``)."""
        return time.time() - self.last_heard

    def crashed(self, done: Container[int]) -> list[int]:
        """The ranks whose process ended with an error before reporting itself done."""
        return [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0) and r not in done]

    def log(self, rank: int, chars: int = 20000) -> str | None:
        """The end of rank ``rank``'s stderr file (torch's and gloo's own lines); None when it cannot be read."""
        try:
            with open(self.logs.get(rank, ""), errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return None

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for each process to exit on its own."""
        for proc in self.procs:
            proc.join(timeout=timeout)

    def kill_all(self) -> None:
        """Terminate every process (kill those still alive after 2 s), then close and remove the run's files."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        end = time.time() + 2
        for proc in self.procs:
            proc.join(timeout=max(0.0, end - time.time()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        for path in self.files:  # payloads a child never got to read, and the ranks' logs
            with contextlib.suppress(OSError):
                os.unlink(path)
