"""torch's ``Pipe`` graph, its schedules' blocking waits and action orders, and ``pipeline()`` over inlined regions."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

if TYPE_CHECKING:
    from torch import distributed as dist
    from torch.distributed.pipelining import Pipe, PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.export import ExportedProgram


def split_graph(pipe: Pipe) -> fx.Graph:
    """The top-level graph of torch's ``Pipe``: placeholders, one ``call_module`` per stage, the output."""
    graph = getattr(getattr(pipe, "split_gm", None), "graph", None)
    if not isinstance(graph, fx.Graph):
        raise RuntimeError("torch's Pipe has no split_gm graph any more; pipeviz needs updating for this torch.")
    return graph


@contextlib.contextmanager
def timed_waits(record: Callable[[float, float], None], threshold: float = 1e-4) -> Iterator[None]:
    """Inside the block, ``record(start, end)`` (wall clock) every blocking wait of torch's schedules on
    batched sends and receives that lasts more than ``threshold`` seconds."""
    import time

    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p

    def timed(work: list[dist.Work]) -> object:
        if not work:  # torch waits on empty lists too: nothing to time
            return original(work)
        start = time.time()
        out = original(work)
        end = time.time()
        if end - start > threshold:
            record(start, end)
        return out

    schedules._wait_batch_p2p = timed
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


def schedule_actions(schedule: str, num_ranks: int, num_stages: int,
                     microbatches: int) -> list[list[tuple[int, str, int]]]:
    """Per-rank compute actions, ``(stage, kind, microbatch)`` with a kind among ``F``, ``B``, ``I``, ``W``, of a
    multi-stage torch schedule, as its constructor lays them out in ``pipeline_order`` (overlapped F/B pairs of
    DualPipeV in run order). ``pipeviz.schedule.traits.orders`` makes them ``Action``s."""
    from unittest import mock

    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.pipelining.stage import PipelineStage

    # torch builds pipeline_order from a few stage attributes; a spec'd stand-in is enough (torch's own
    # _schedule_visualizer does the same).
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, num_ranks, None, num_stages
    sched = get_schedule_class(schedule)([stage] * (num_stages // num_ranks), microbatches)
    out: list[list[tuple[int, str, int]]] = []
    for rank in range(num_ranks):
        acts: list[tuple[int, str, int]] = []
        for action in sched.pipeline_order[rank]:
            if action is None:
                continue
            for a in getattr(action, "sub_actions", None) or [action]:
                kind = a.computation_type.value if hasattr(a.computation_type, "value") else str(a.computation_type)
                if kind in ("F", "B", "I", "W"):
                    acts.append((a.stage_index, kind, a.microbatch_index))
        out.append(acts)
    return out


def comm_actions(order: Sequence[Sequence[object]] | None, stage_ranks: Sequence[int], microbatches: int,
                 schedule: str | None = None) -> list[list[str]]:
    """Per-rank actions with the sends and receives torch's multi-stage runtime (``_PipelineScheduleRuntime``)
    issues, in its text form (``"0F1"``, ``"0SEND_F1"``, ``"1RECV_F1"``): a custom compute ``order`` (actions whose
    ``str()`` is torch's text, as ``pipeviz.schedule.traits.Action``'s) lowered by
    torch's own ``_add_send_recv`` (what ``runtime_schedule`` runs), or, with ``order=None``, the
    ``pipeline_order_with_comms`` torch's ``schedule`` class builds. An overlapped pair (DualPipeV's
    ``OVERLAP_F_B``) is given as its sub-actions in order; gradient reductions and FSDP unshards are left out (no
    point-to-point traffic)."""
    from unittest import mock

    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining.stage import PipelineStage

    num_ranks, num_stages = max(stage_ranks) + 1, len(stage_ranks)
    if order is not None:
        compute = {rank: [ts._Action.from_str(str(a)) for a in acts] for rank, acts in enumerate(order)}
        lowered = ts._add_send_recv(compute, stage_to_rank=lambda s: stage_ranks[s], num_stages=num_stages)
    else:
        assert schedule is not None
        # as schedule_actions: torch builds its orders from a few stage attributes of a stand-in
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, num_ranks, None, num_stages
        built = ts.get_schedule_class(schedule)([stage] * (num_stages // num_ranks), microbatches)
        lowered = built.pipeline_order_with_comms
    kinds = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
    out: list[list[str]] = []
    for rank in range(num_ranks):
        acts: list[str] = []
        for action in lowered.get(rank, []):
            for a in (action.sub_actions or [action]) if action is not None else []:
                kind = a.computation_type.value
                if kind in kinds:
                    acts.append(f"{a.stage_index}{kind}{a.microbatch_index}")
        out.append(acts)
    return out


def runtime_schedule(stages: list[PipelineStage], order: Sequence[Sequence[object]], microbatches: int,
                     loss_fn: Callable[[object, object], torch.Tensor] | None,
                     forward_only: bool = False) -> _PipelineScheduleRuntime:
    """torch's own multi-stage runtime (``_PipelineScheduleRuntime``) running a custom compute order: one list of
    actions per pipeline rank (``pipeviz.schedule.traits.Action``s, or anything whose ``str()`` is torch's text:
    ``"1F0"``, ``"0I2"``), every rank's; torch adds the sends, receives and gradient
    reductions (``_prepare_schedule_with_comms``, as it does for the schedules it builds itself) and places the
    stages where the order runs them.

    ``forward_only``: an order of forwards alone, for ``schedule.eval`` (an evaluation of a training run whose
    own schedule cannot run forward only): torch 2.13-2.15's ``_validate_schedule`` demands every microbatch's
    backward even then, so its check is replaced, while this schedule is built, by the stage placement the
    order gives."""
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

    # torch's own text is the edge between the two notations: its _Action reads it
    actions = {rank: [_Action.from_str(str(a)) for a in acts] for rank, acts in enumerate(order)}
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    if not forward_only:
        schedule._prepare_schedule_with_comms(actions)
        return schedule
    placed = {a.stage_index: rank for rank, acts in actions.items() for a in acts}
    checked = torch_schedules._validate_schedule
    torch_schedules._validate_schedule = lambda *_a, **_k: placed
    try:
        schedule._prepare_schedule_with_comms(actions)
    finally:
        torch_schedules._validate_schedule = checked
    return schedule


@contextlib.contextmanager
def regions_inlined() -> Iterator[None]:
    """Inside the block, torch's ``pipeline()`` splits a graph whose grad-mode / autocast regions are inlined and
    whose non-tensor constants are held in modules (``pipeviz.adapter.regions``): torch 2.13–2.15 lose those regions'
    bodies when they split the exported graph, and refuse a constant that is not a tensor."""
    from torch.distributed.pipelining._IR import Pipe

    from pipeviz.adapter.hf_layerdrop import decided_layerdrop
    from pipeviz.adapter.hf_moe import exportable_moe
    from pipeviz.adapter.regions import hold_constants, inline_regions

    original = Pipe.__dict__["_trace_with_export"]

    def trace(mod: nn.Module, example_args: tuple[object, ...],
              example_kwargs: dict[str, object] | None = None) -> ExportedProgram:
        # transformers 4.x's MoE loops (pipeviz.adapter.hf_moe) and LayerDrop checks (pipeviz.adapter.hf_layerdrop)
        with exportable_moe(), decided_layerdrop():
            ep = original.__func__(mod, example_args, example_kwargs)
        inline_regions(ep.graph_module)
        hold_constants(ep.graph_module)
        return ep

    Pipe._trace_with_export = staticmethod(trace)  # type: ignore[method-assign]  # patched for the block only
    try:
        yield
    finally:
        Pipe._trace_with_export = original  # type: ignore[method-assign]  # torch's own, put back


def overlap_pairs(schedule: str, num_ranks: int, num_stages: int, microbatches: int) -> list[tuple[int, list[int]]]:
    """Per rank, (the number of its compute actions, the positions among them of each overlapped pair's forward):
    torch's ``OVERLAP_F_B`` actions of ``schedule``'s ``pipeline_order`` (a forward, then a full backward: DualPipeV),
    counted as ``schedule_actions`` lays the actions out."""
    from unittest import mock

    from torch.distributed.pipelining.schedules import OVERLAP_F_B, get_schedule_class
    from torch.distributed.pipelining.stage import PipelineStage

    # (as schedule_actions: torch builds its orders from a few stage attributes of a stand-in)
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, num_ranks, None, num_stages
    built = get_schedule_class(schedule)([stage] * (num_stages // num_ranks), microbatches)
    out = []
    for rank in range(num_ranks):
        count, positions = 0, []
        for action in built.pipeline_order[rank]:
            if action is None:
                continue
            if action.computation_type == OVERLAP_F_B and action.sub_actions:
                positions.append(count)
            for a in action.sub_actions or [action]:
                if a.computation_type.value in ("F", "B", "I", "W"):
                    count += 1
        out.append((count, positions))
    return out
