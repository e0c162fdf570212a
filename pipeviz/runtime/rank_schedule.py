"""torch's schedule around a rank's stages, and the loss each microbatch computes in it: ``loss_fn`` (or the summed
cross-entropy of ``loss_reduction="sum"`` / ``"token_mean"``) times the step's factor (``STEP_SCALE``) and fp16's loss
scale (``LOSS_SCALE``), its failures located; and the forward-only schedule an evaluation runs.

Example:
    >>> schedule = build_schedule(payload, stages)      # Schedule1F1B(stages[0], n_microbatches=4, loss_fn=...)
    >>> STEP_SCALE[0] = step_scale(payload, targets, dp_group)     # before a step, when scaled_by_step(payload)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pipeviz.runtime.payloads import RankPayload
from pipeviz.runtime.stages import StepError
from pipeviz.schedule import traits as sched

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    Schedule = PipelineScheduleSingle | PipelineScheduleMulti

__all__ = ["LOSS_SCALE", "STEP_SCALE", "build_schedule", "forward_schedule", "scaled_by_step", "step_scale"]


def build_schedule(p: RankPayload, stages: list[PipelineStage]) -> Schedule:
    from torch.distributed.pipelining import schedules as torch_schedules

    loss_fn = _named_loss(_loss_scaled(_reduced(p)) if p.loss_scaling else _reduced(p), p) \
        if p.loss_fn is not None else None
    schedule: Schedule
    if p.order is not None:  # a custom order (LaunchConfig.order), run by torch's own runtime
        from pipeviz.adapter import runtime_schedule

        schedule = runtime_schedule(stages, p.order, p.microbatches, loss_fn)
    elif p.ep_overlap and sched.canonical(p.schedule) == "1F1B":  # 1F1B's pairs: the combined 1F1B
        from pipeviz.adapter.overlap_fb import paired_runtime
        from pipeviz.schedule.ep_overlap import combined_1f1b

        combined = combined_1f1b(len(p.stage_ranks), p.microbatches)
        schedule = paired_runtime(stages, [a for a, _ in combined], [set(x) for _, x in combined], p.microbatches,
                                  loss_fn)
    else:
        cls = torch_schedules.get_schedule_class(p.schedule)
        if not sched.info(p.schedule).multi:
            schedule = cls(stages[0], n_microbatches=p.microbatches, loss_fn=loss_fn)  # one stage per rank
        else:
            schedule = cls(stages, n_microbatches=p.microbatches, loss_fn=loss_fn)
    if scaled_by_step(p):  # the loss is already the step's share: no division by the microbatches
        schedule.scale_grads = False
    if p.ep_overlap:  # the F/B pairs at once, their all-to-alls hidden (pipeviz.adapter.overlap_fb)
        from pipeviz.adapter.overlap_fb import register_overlap

        register_overlap(schedule)
    return schedule


# loss_reduction "sum" / "token_mean", or accumulation: the factor this step's microbatch losses take (one rank per
# process)
STEP_SCALE = [1.0]


# fp16: the step's loss scale (pipeviz.runtime.loss_scale), by which the last stage multiplies each microbatch's loss
LOSS_SCALE = [1.0]


def _loss_scaled(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def scaled(output: object, target: object) -> torch.Tensor:
        return loss_fn(output, target) * LOSS_SCALE[0]

    return scaled


def scaled_by_step(p: RankPayload) -> bool:
    """Whether each microbatch's loss is scaled by the step (``STEP_SCALE``) instead of torch's ``scale_grads``:
    a sum or token mean, or accumulated batches (torch divides every gradient by the microbatches at the end of
    each ``schedule.step``, the earlier batches' sums too: torchtitan PR #1732's bug), or replicas averaged by
    ``dp_reduce="overlap"`` (their average starts in the stage's last backward, before torch's scaling at the
    step's end would change the gradients), or fp16's loss scaling."""
    overlapped = p.dp_reduce in ("overlap", "zero1") and p.replicas > 1 and not p.dp_shard
    # fp16's loss scale: the backward must carry the gradients at their final size (the unsplit model's, times the
    # scale), or a value that fits there overflows here (torch's scale_grads divides only at the step's end)
    return p.loss_reduction != "mean" or p.accumulate > 1 or overlapped or p.loss_scaling


def _reduced(p: RankPayload) -> Callable[..., torch.Tensor]:
    """The loss each microbatch computes: ``p.loss_fn`` under ``"mean"`` (times ``1 / (microbatches x
    accumulate)`` when accumulating); else ``summed_cross_entropy`` times this step's factor (``step_scale``)."""
    from pipeviz.runtime.loss import summed_cross_entropy

    assert p.loss_fn is not None
    mean_fn = p.loss_fn
    if not scaled_by_step(p):
        return mean_fn
    if p.loss_reduction == "mean":
        def scaled_mean(output: object, target: object) -> torch.Tensor:
            return mean_fn(output, target) * STEP_SCALE[0]

        return scaled_mean

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(output, target) * STEP_SCALE[0]

    return loss


def step_scale(p: RankPayload, targets: list[object], dp_group: ProcessGroup | None) -> float:
    """The factor of a step's microbatch losses (``targets``: its accumulated batches'): replicas' gradients are
    averaged (DDP), so ``dp`` for a sum, ``dp / valid tokens of the whole step`` (every batch's and replica's,
    counted here: one all-reduce) for a token mean, and ``1 / (microbatches x accumulate)`` for a mean (each
    replica's mean over its microbatches of every batch; the replicas' average by DDP)."""
    import torch.distributed as dist

    from pipeviz.runtime.loss import IGNORE_INDEX

    dp = p.replicas  # (dp replicas x cp shares: each a part of the step's tokens)
    if p.loss_reduction == "mean":
        return 1.0 / (p.microbatches * p.accumulate)
    if p.loss_reduction == "sum":
        return float(dp)
    count = torch.tensor([float(sum(float((t != IGNORE_INDEX).sum()) for t in targets
                                    if isinstance(t, torch.Tensor)))], dtype=torch.float64)
    if dp_group is not None:
        dist.all_reduce(count, group=dp_group)
    return dp / max(float(count.item()), 1.0)


def _named_loss(loss_fn: Callable[..., torch.Tensor], p: RankPayload) -> Callable[[object, object], torch.Tensor]:
    """``loss_fn``, whose failures say where they happened and on what (the last stage, shapes)."""
    from pipeviz.adapter import describe

    mixed = any(st.runner.autocast is not None for st in p.stages)

    def loss(output: object, target: object) -> torch.Tensor:
        if mixed:  # mixed precision: the loss in float32 on float32 logits (the reference computes it so too)
            output = _float32(output)
        try:
            return loss_fn(output, target)
        except Exception as exc:
            raise StepError(
                f"loss_fn failed on rank {p.rank} (the last stage, {len(p.stage_ranks) - 1}) on its output "
                f"{describe(output)} and target {describe(target)}: {type(exc).__name__}: {exc}. Fix: loss_fn was "
                "checked on an output like this before the launch, so look at what differs in this batch."
            ) from exc

    return loss


def _float32(x: object) -> object:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


_FORWARD_SCHEDULES: dict[int, Schedule] = {}  # per process: the forward-only schedule evaluate() built


def forward_schedule(p: RankPayload, stages: list[PipelineStage]) -> Schedule:
    """torch's runtime running every rank's forwards only, stage by stage (each rank's stages in increasing order,
    every microbatch of one before the next: whatever the placement, stage s's forwards need only stage s - 1's),
    built once."""
    from pipeviz.adapter import runtime_schedule

    key = id(stages[0])
    if key not in _FORWARD_SCHEDULES:
        order = [[sched.Action(s, sched.Kind.F, mb)
                  for s in sorted(i for i, r in enumerate(p.stage_ranks) if r == rank) for mb in range(p.microbatches)]
                 for rank in range(max(p.stage_ranks) + 1)]
        assert p.loss_fn is not None
        _FORWARD_SCHEDULES[key] = runtime_schedule(stages, order, p.microbatches, _named_loss(_reduced(p), p),
                                                   forward_only=True)
    return _FORWARD_SCHEDULES[key]
