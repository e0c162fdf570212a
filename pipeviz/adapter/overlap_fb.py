"""Overlapped forward/backward pairs run at once (``LaunchConfig(ep_overlap=True)``): torch's
``_PipelineScheduleRuntime`` runs an ``OVERLAP_F_B`` action's two sub-actions one after the other unless a function
is registered for it (``register_custom_function``, torch 2.13-2.15); ``overlap_f_b`` runs the backward in a second
thread while the forward runs in the schedule's own, as torchtitan's ``overlap_callback`` does (its PR #1721,
``torchtitan/distributed/dual_pipe_v.py``), so the expert all-to-alls of one half wait while the other computes.

What it relies on:

- the two halves issue their expert all-to-alls over two process groups (``Team.group`` for forwards,
  ``Team.back_group`` for backwards, every rank's the same): on one group two threads' collectives could pair up in
  different orders on different ranks. Each group then sees one thread's collectives, in the order of the schedule,
  identical on the ranks of an expert-parallel group (replicas of the same stages). torchtitan instead keeps one
  group and makes the threads alternate at every dispatch and combine (a barrier); two groups need no lockstep;
- gloo's collectives and ``time.sleep`` release the GIL, and the autograd engine runs a CPU backward in the thread
  that calls it: the forward's Python (an op-by-op graph) runs while the backward's thread waits, and the reverse;
- the halves never share a tensor: the same ops on the same values as run in turn, so the run is exact
  (gradients accumulate in the backward's one thread, in the schedule's order).

Under 1F1B, ``paired_runtime`` builds the combined 1F1B's order (``pipeviz.schedule.ep_overlap.combined_1f1b``) with
its pairs as ``OVERLAP_F_B`` actions, run by the same runtime and function.

Example:
    >>> register_overlap(schedule)           # a ScheduleDualPipeV: its OVERLAP_F_B actions run by overlap_f_b
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

__all__ = ["overlap_f_b", "paired_runtime", "register_overlap"]


def paired_runtime(stages: list[Any], order: Sequence[Sequence[object]], pairs: Sequence[Collection[int]],
                   microbatches: int, loss_fn: Callable[[object, object], Any] | None) -> Any:
    """torch's ``_PipelineScheduleRuntime`` running ``order`` (per pipeline rank, actions whose ``str()`` is torch's
    text: ``"0F3"``, ``"0B1"``) with the actions at ``pairs[rank]`` and the next grouped into one ``OVERLAP_F_B``
    action each (a forward, then a full backward): the combined 1F1B (``pipeviz.schedule.ep_overlap``). torch adds
    the sends and receives (``_prepare_schedule_with_comms``: a pair's sends after it, its receives before it)."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _Action, _PipelineScheduleRuntime

    actions: dict[int, list[Any]] = {}
    for rank, acts in enumerate(order):
        parsed = [_Action.from_str(str(a)) for a in acts]
        out, i = [], 0
        while i < len(parsed):
            if i in pairs[rank]:
                out.append(_Action(-1, OVERLAP_F_B, None, (parsed[i], parsed[i + 1])))
                i += 2
            else:
                out.append(parsed[i])
                i += 1
        actions[rank] = out
    schedule = _PipelineScheduleRuntime(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    schedule._prepare_schedule_with_comms(actions)
    return schedule


def register_overlap(schedule: Any) -> None:
    """Run ``schedule``'s ``OVERLAP_F_B`` actions (a ``_PipelineScheduleRuntime``: DualPipeV's, or
    ``paired_runtime``'s) with ``overlap_f_b``.

    Raises:
        TypeError: a schedule without torch's custom functions (a single-stage schedule).
    """
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    register = getattr(schedule, "register_custom_function", None)
    if register is None:
        raise TypeError(f"{type(schedule).__name__} runs no OVERLAP_F_B actions; ep_overlap needs torch's runtime "
                        "(DualPipeV's, or paired_runtime's)")
    register(OVERLAP_F_B, overlap_f_b)


def overlap_f_b(action: Any, ctx: Any) -> None:
    """One ``OVERLAP_F_B`` action (``action.sub_actions``: a forward, then a full backward): both inputs received,
    then the backward in a new thread and the forward here, joined. torch's own steps for each half (the loss after
    a last stage's forward, a stage's output handed to the next stage on this rank, the backward counter that says
    when a stage's gradients are final) as its ``_perform_action`` runs them."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    schedule = ctx.schedule_ref
    stages = {st.stage_index: st for st in schedule._stages}
    fwd, bwd = action.sub_actions
    f_stage, f_mb = stages[fwd.stage_index], fwd.microbatch_index
    b_stage, b_mb = stages[bwd.stage_index], bwd.microbatch_index
    if not f_stage.is_first and fwd.stage_index - 1 not in stages:
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
    if not b_stage.is_last and bwd.stage_index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
    failed: list[BaseException] = []

    def backward() -> None:
        try:
            schedule._assert_unsharded(b_stage)
            loss = schedule._maybe_get_loss(b_stage, b_mb)
            schedule.backward_counter[bwd.stage_index] += 1
            last = schedule.backward_counter[bwd.stage_index] == schedule._n_microbatches
            b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)
            if bwd.stage_index - 1 in stages:
                stages[bwd.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb), b_mb)
        except BaseException as exc:  # re-raised in the schedule's thread, where the run reports it
            failed.append(exc)

    thread = threading.Thread(target=backward, name=f"pipeviz-backward-{bwd.stage_index}-{b_mb}", daemon=True)
    thread.start()
    # (if the forward fails, the backward may wait on peers that never come: the run reports the forward's error
    # and its daemon thread ends with the process)
    schedule._assert_unsharded(f_stage)
    output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb])
    schedule._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
    if fwd.stage_index + 1 in stages:
        stages[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)
    thread.join()
    if failed:
        raise failed[0]
