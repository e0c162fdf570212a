"""A ``data=`` run's batches, streamed to its ranks while the run goes (``pv.launch(..., data=loader)``).

Each step the next batch is checked against the first (the same inputs and dtypes), cut into each replica's share,
and sent to every process as a ``messages.Batch``: the inputs to the first stage's ranks, the target to the last
stage's, an empty one to the others (every rank runs the same number of steps); then ``messages.End``. A batch of
a shape the run has not met (another sequence length or batch size) is traced first (``restage``: every process's
stages for that shape, sent with the batch; ``pipeviz.runtime.shapes``), at most ``MAX_SHAPES`` shapes a run.
With ``accumulate`` = k a step's k batches are sent once all k are read (a last step short of k
batches is left out: ``left_out``).

Example:
    >>> feeder = Feeder(spec, stopped=lambda: run.done,
    ...                 restage=lambda args, kwargs: shape_stages(plan, spec, args, kwargs))
    >>> threading.Thread(target=feeder.run, args=(queues,)).start()   # one queue per process
    >>> feeder.error, feeder.batches
"""

from __future__ import annotations

import queue as queue_mod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeviz.capture.export import batch_size_of
from pipeviz.errors import LaunchError
from pipeviz.runtime.batches import data_batch, like_first, share
from pipeviz.runtime.messages import Batch, End, Feed
from pipeviz.runtime.spec import FedBatch, LaunchSpec

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

__all__ = ["FedBatch", "Feeder"]


_KEEP_BATCHES = 256 * 2**20  # a data= run keeps its batches (for check_numerics) up to this many bytes
MAX_SHAPES = 32  # input shapes a data= run traces its stages for (each a trace in this process, stages per rank)


def _tensors(tree: object) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class Feeder:
    """Streams ``spec.data``'s batches to the ranks' queues (``run``, on a thread of its own); ``error`` names a
    batch that failed (the run then fails), ``batches`` keeps them for ``pv.check_numerics`` while small."""

    def __init__(self, spec: LaunchSpec, stopped: Callable[[], bool],
                 restage: Callable[[tuple[object, ...], dict[str, object]], list[bytes]] | None = None,
                 said: Callable[[str], None] | None = None) -> None:
        self.spec, self.stopped, self.restage, self.said = spec, stopped, restage, said
        self.error: str | None = None
        self.batches: list[FedBatch] | None = None
        self.left_out = 0
        # input shapes met (signature -> number, 0 the first batch's) and the seconds each new one took to trace
        self.shapes: dict[object, int] = {_shape_key(spec.args, spec.kwargs): 0}
        self.trace_seconds: list[float] = []
        self._new: dict[int, list[bytes]] = {}  # a new shape's stages per process, sent with its first batch

    def run(self, feeds: Sequence[Queue[Feed]]) -> None:
        spec = self.spec
        k = spec.config.accumulate
        batch: tuple[Any, Any, Any] | None = (spec.args, spec.kwargs, spec.target)
        kept: list[tuple[Any, Any, Any]] | None = []
        size = 0
        n = 0  # batches read
        group: list[FedBatch] = []  # an optimizer step's batches (accumulate): sent once all are read
        while (spec.steps is None or n < spec.steps * k) and not self.stopped():
            if batch is None:
                try:
                    item = next(spec.data)
                except StopIteration:
                    break
                except Exception as exc:  # the user's iterable failed: the run fails, naming the batch
                    self.error = f"data= raised at batch {n}: {type(exc).__name__}: {exc}"
                    break
                try:
                    batch = like_first(data_batch(item, n, spec.training), spec, n, same_shapes=self.restage is None)
                    self._shape_of(batch, n)
                except LaunchError as exc:
                    self.error = str(exc)
                    break
            group.append(batch)
            if kept is not None:
                size += sum(t.numel() * t.element_size() for t in _tensors(batch))
                if size <= _KEEP_BATCHES:  # for check_numerics, while they are small
                    kept.append(batch)
                else:
                    kept = None
            n += 1
            batch = None
            if len(group) == k:
                for b in group:
                    if not self._send(feeds, b):
                        return
                self.batches = kept
                group = []
        self.left_out = len(group)  # a last step's batches short of accumulate: not trained
        for feed in feeds:
            self._put(feed, End())

    def _shape_of(self, batch: FedBatch, n: int) -> None:
        """Number the batch's input shape; a new one is traced now (its stages sent with its first batch)."""
        import time

        key = _shape_key(batch[0], batch[1])
        if key in self.shapes or self.restage is None:
            return
        if len(self.shapes) >= MAX_SHAPES:
            raise LaunchError(f"data= batch {n} is the {len(self.shapes) + 1}th input shape of this run; each new "
                              f"shape traces the model again (this run's took {sum(self.trace_seconds):.1f} s in all), "
                              f"and a run takes at most {MAX_SHAPES}. Fix: pad the batches to a few lengths (buckets, "
                              "pipeviz.planner.lengths.buckets chooses them) or pack sequences to one length.")
        t = time.perf_counter()
        self._new[len(self.shapes)] = self.restage(tuple(batch[0]), dict(batch[1] or {}))
        self.trace_seconds.append(time.perf_counter() - t)
        self.shapes[key] = len(self.shapes)
        if self.said is not None:
            from pipeviz.runtime.payloads import payload_shapes

            shape = payload_shapes(batch[0], batch[1])
            self.said(f"input shape {len(self.shapes)} ({shape}) at data= batch {n}: the stages "
                      f"traced for it in {self.trace_seconds[-1]:.2f} s")

    def _send(self, feeds: Sequence[Queue[Feed]], batch: FedBatch) -> bool:
        """One batch to every process: each replica its share, the inputs to the first stage's ranks, the target
        to the last stage's, an empty message to the others; a new shape's first batch with its stages."""
        spec = self.spec
        shape = self.shapes.get(_shape_key(batch[0], batch[1]), 0)
        stages = self._new.pop(shape, None)
        mesh, lay = spec.mesh, spec.layout
        first_rank, last_rank = lay.stage_ranks[0], lay.stage_ranks[-1]
        size_of = batch_size_of(batch[0], batch[1]) or 1
        for rank, feed in enumerate(feeds):
            c = mesh.coords(rank)  # each replica its share of the batch
            args, kwargs, target = share(batch, c.dp, mesh.dp, size_of)
            msg = Batch(args if c.pp == first_rank else (), kwargs if c.pp == first_rank else {},
                        target if c.pp == last_rank else None, shape, stages[rank] if stages else None)
            if not self._put(feed, msg):
                return False
        return True

    def _put(self, feed: Queue[Feed], msg: Feed) -> bool:
        while not self.stopped():
            try:
                feed.put(msg, timeout=0.2)
                return True
            except queue_mod.Full:
                continue
        return False


def _shape_key(args: tuple[object, ...], kwargs: Mapping[str, object] | None) -> object:
    """What a traced Pipe depends on in a batch's inputs (``payloads.shape_signature``)."""
    from pipeviz.runtime.payloads import shape_signature

    return shape_signature((tuple(args), dict(kwargs or {})))
