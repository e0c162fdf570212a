"""Batches that change shape (another sequence length or batch size in ``data=``): one set of torch stages and one
schedule per input shape, all over the same parameters and buffers.

torch's pipeline has static shapes: ``pipeline()`` traces the model with one example (torch.export bakes its sizes
into the graph), and each ``PipelineStage`` allocates its receive buffers from its example inputs. So a batch of a
new shape is traced again in the launching process (``payloads.shape_stages``, cached per shape), each process
receives its stages for it with that batch (their tensors on the meta device), binds them to the parameters and
buffers it already trains (``rebind``), and builds torch's stages and schedule for it once (``Shapes.add``). The
optimizer, gradient reduction and every check see one set of parameters whatever the shape; a step runs the
schedule of its batch's shape. What it costs, measured by ``tests/test_shapes.py`` and reported in the run's phases:
one trace per new shape in the launching process, and one stage build per process.

Example:
    >>> shapes = Shapes(schedule, stages, build)      # shape 0: the first batch's
    >>> shapes.add(1, blob)                           # a Batch with .stages: this process's stages for shape 1
    >>> schedule, stages = shapes.get(1)
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from pipeviz.runtime.stages import RankStage

    Schedule = PipelineScheduleSingle | PipelineScheduleMulti

__all__ = ["Shapes", "rebind"]


def _set(module: torch.nn.Module, name: str, value: torch.Tensor, param: bool) -> None:
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    table = module._parameters if param else module._buffers
    table[leaf] = value  # type: ignore[assignment]


def rebind(new: list[RankStage], old: list[RankStage]) -> None:
    """Make ``new``'s stages (traced for another shape, their tensors on the meta device) hold ``old``'s parameters
    and buffers, the same objects, by canonical name: one optimizer, one set of gradients, one BatchNorm statistic.

    Raises:
        RuntimeError: the stages differ (another plan), or a tensor is left unbound.
    """
    by_index = {st.index: st for st in old}
    for st in new:
        was = by_index.get(st.index)
        if was is None or set(st.params) != set(was.params) or set(st.buffers) != set(was.buffers):
            raise RuntimeError(f"stage {st.index} traced for a new shape holds other tensors than the running one")
        mod, old_mod = st.runner.stage, was.runner.stage
        old_params = dict(old_mod.named_parameters(remove_duplicate=False))
        old_buffers = dict(old_mod.named_buffers(remove_duplicate=False))
        for canon, inner in st.params.items():
            _set(mod, inner, old_params[was.params[canon]], True)
        for canon, inner in st.buffers.items():
            _set(mod, inner, old_buffers[was.buffers[canon]], False)
        left = [n for n, t in [*mod.named_parameters(), *mod.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"stage {st.index} traced for a new shape left {left[:3]} unbound")


class Shapes:
    """The schedule (and torch's stages) of each input shape a process has met; ``build`` makes them for a new
    shape's ``RankStage`` list, returning the schedule, the stages, and the seconds it took."""

    def __init__(self, schedule: Schedule, stages: list[PipelineStage],
                 build: Callable[[list[RankStage]], tuple[Schedule, list[PipelineStage]]] | None = None) -> None:
        self._by: dict[int, tuple[Schedule, list[PipelineStage]]] = {0: (schedule, stages)}
        self._build = build
        self.build_seconds: dict[int, float] = {}

    def add(self, shape: int, blob: bytes) -> None:
        """Shape ``shape``'s stages, as the launching process sent them (``payloads.shape_stages``)."""
        if self._build is None:
            raise RuntimeError("this run takes batches of one shape only")
        t = time.perf_counter()
        self._by[shape] = self._build(pickle.loads(blob))
        self.build_seconds[shape] = time.perf_counter() - t

    def get(self, shape: int) -> tuple[Schedule, list[PipelineStage]]:
        """The schedule and stages of ``shape`` (0: the first batch's)."""
        return self._by[shape]

    def __len__(self) -> int:
        return len(self._by)
