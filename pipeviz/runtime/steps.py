"""A rank's steps: torch's schedule built around its stages, the training loop (losses, shared gradients summed,
replicas averaged, NaN/inf found before the update, the optimizer) and the forward-only loop, the batches of each
step, and the trained tensors under the original model's names.

Example:
    >>> schedule = build_schedule(payload, stages)
    >>> finished = train(payload, schedule, optimizer, params, local, groups, clock, step_box, device, dp_group)
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from pipeviz.runtime.clock import Clock
from pipeviz.runtime.messages import Batch as BatchMessage
from pipeviz.runtime.messages import (
    End,
    EvalLoss,
    GradNorm,
    LearningRate,
    Loss,
    NonFinite,
    Output,
    Phase,
    StepEnd,
)
from pipeviz.runtime.payloads import RankPayload
from pipeviz.runtime.stages import StepError
from pipeviz.schedule import traits as sched

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from pipeviz.runtime.overlap import OverlappedReduction
    from pipeviz.runtime.shapes import Shapes
    from pipeviz.runtime.zero import ZeroOne

    Schedule = PipelineScheduleSingle | PipelineScheduleMulti

__all__ = ["average_replicas", "averaged_after_step", "build_schedule", "infer", "local_tensor", "rank_state", "train"]


def build_schedule(p: RankPayload, stages: list[PipelineStage]) -> Schedule:
    from torch.distributed.pipelining import schedules as torch_schedules

    loss_fn = _named_loss(_loss_scaled(_reduced(p)) if p.loss_scaling else _reduced(p), p) \
        if p.loss_fn is not None else None
    schedule: Schedule
    if p.order is not None:  # a custom order (LaunchConfig.order), run by torch's own runtime
        from pipeviz.adapter import runtime_schedule

        schedule = runtime_schedule(stages, p.order, p.microbatches, loss_fn)
    else:
        cls = torch_schedules.get_schedule_class(p.schedule)
        if not sched.info(p.schedule).multi:
            schedule = cls(stages[0], n_microbatches=p.microbatches, loss_fn=loss_fn)  # one stage per rank
        else:
            schedule = cls(stages, n_microbatches=p.microbatches, loss_fn=loss_fn)
    if _scaled(p):  # the loss is already the step's share: no division by the microbatches
        schedule.scale_grads = False
    return schedule


# loss_reduction "sum" / "token_mean", or accumulation: the factor this step's microbatch losses take (one rank per
# process)
_STEP_SCALE = [1.0]

# fp16: the step's loss scale (pipeviz.runtime.loss_scale), by which the last stage multiplies each microbatch's loss
_LOSS_SCALE = [1.0]


def _loss_scaled(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def scaled(output: object, target: object) -> torch.Tensor:
        return loss_fn(output, target) * _LOSS_SCALE[0]

    return scaled


# One batch's (args, kwargs, target).
Batch = tuple[tuple[object, ...], dict[str, object], object, int]  # args, kwargs, target, input shape number


def _scaled(p: RankPayload) -> bool:
    """Whether each microbatch's loss is scaled by the step (``_STEP_SCALE``) instead of torch's ``scale_grads``:
    a sum or token mean, or accumulated batches (torch divides every gradient by the microbatches at the end of
    each ``schedule.step``, the earlier batches' sums too: torchtitan PR #1732's bug), or replicas averaged by
    ``dp_reduce="overlap"`` (their average starts in the stage's last backward, before torch's scaling at the
    step's end would change the gradients), or fp16's loss scaling."""
    overlapped = p.dp_reduce in ("overlap", "zero1") and p.mesh is not None and p.mesh.dp > 1 and not p.dp_shard
    # fp16's loss scale: the backward must carry the gradients at their final size (the unsplit model's, times the
    # scale), or a value that fits there overflows here (torch's scale_grads divides only at the step's end)
    return p.loss_reduction != "mean" or p.accumulate > 1 or overlapped or p.loss_scaling


def _reduced(p: RankPayload) -> Callable[..., torch.Tensor]:
    """The loss each microbatch computes: ``p.loss_fn`` under ``"mean"`` (times ``1 / (microbatches x
    accumulate)`` when accumulating); else ``summed_cross_entropy`` times this step's factor (``_step_scale``)."""
    from pipeviz.runtime.loss import summed_cross_entropy

    assert p.loss_fn is not None
    mean_fn = p.loss_fn
    if not _scaled(p):
        return mean_fn
    if p.loss_reduction == "mean":
        def scaled_mean(output: object, target: object) -> torch.Tensor:
            return mean_fn(output, target) * _STEP_SCALE[0]

        return scaled_mean

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(output, target) * _STEP_SCALE[0]

    return loss


def _step_scale(p: RankPayload, targets: list[object], dp_group: ProcessGroup | None) -> float:
    """The factor of a step's microbatch losses (``targets``: its accumulated batches'): replicas' gradients are
    averaged (DDP), so ``dp`` for a sum, ``dp / valid tokens of the whole step`` (every batch's and replica's,
    counted here: one all-reduce) for a token mean, and ``1 / (microbatches x accumulate)`` for a mean (each
    replica's mean over its microbatches of every batch; the replicas' average by DDP)."""
    import torch.distributed as dist

    from pipeviz.runtime.loss import IGNORE_INDEX

    dp = p.mesh.dp if p.mesh is not None else 1
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


def train(p: RankPayload, schedule: Schedule, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
          local: dict[str, list[torch.Tensor]], groups: dict[str, ProcessGroup | None], clock: Clock,
          step_box: list[int], device: torch.device, dp_group: ProcessGroup | None = None,
          stages: list[PipelineStage] | None = None,
          scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
          reduction: OverlappedReduction | ZeroOne | None = None, shapes: Shapes | None = None) -> bool:
    """Run the steps; False when a NaN or inf stopped the run (every rank stops at the same step). A step runs the
    schedule on ``p.accumulate`` batches in turn (``step_box[1]`` counts them), their gradients summed in place;
    the replicas' gradients are reduced once, in the last batch's backward (``sync_replicas``). ``scheduler`` steps
    after each optimizer step; ``reduction`` (``dp_reduce="overlap"`` or ``"zero1"``) is waited for before anything
    reads the gradients (with ZeRO-1 the optimizer steps on its shards, ``ZeroOne.shards``, and the whole parameters
    are gathered after); with ``p.eval_batches`` the held-out batches are evaluated every ``p.eval_every``
    steps and after the last (``evaluate``). ``shapes`` holds the schedule of each input shape a ``data=`` run
    has sent (``pipeviz.runtime.shapes``): each batch runs its own shape's."""
    import torch.distributed as dist

    first = any(st.index == 0 for st in p.stages)
    last = any(st.index == len(p.stage_ranks) - 1 for st in p.stages)
    # One process reports the loss: replica 0's shard 0 (the other replicas averaged into it, the shards agree).
    reports = p.coords.dp == p.coords.tp == p.coords.cp == 0  # replica 0, shard 0, share 0 speaks for all
    names = param_names(p)
    from pipeviz.runtime.zero import ZeroOne

    zero = reduction if isinstance(reduction, ZeroOne) else None
    # what the optimizer steps, clipping clips and the checks read: the shards under ZeRO-1, else the parameters
    stepped, stepped_names = (zero.shards, zero.names) if zero is not None else (params, names)
    tied_local = zero.tied(local) if zero is not None else local
    finished = -1
    scaler = None
    if p.loss_scaling:
        from pipeviz.runtime.loss_scale import LossScaler

        scaler = LossScaler()
    for step, group in enumerate(_grouped(_batches(p, device, shapes, clock), p.accumulate)):
        step_box[0] = step
        if scaler is not None:
            _LOSS_SCALE[0] = scaler.scale
        losses: list[torch.Tensor] = []
        if last and _scaled(p):
            _STEP_SCALE[0] = _step_scale(p, [target for _, _, target, _ in group], dp_group)
        for r, (args, kwargs, target, shape) in enumerate(group):
            step_box[1] = r
            shaped: Schedule = schedule
            if shape:  # a data= batch of another shape than the first: its own stages and schedule
                assert shapes is not None
                shaped, its_stages = shapes.get(shape)
                sync_replicas(its_stages, r == len(group) - 1)
            else:
                sync_replicas(stages or [], r == len(group) - 1)
            call_kwargs: dict[str, Any] = dict(kwargs) if first else {}
            batch_losses: list[torch.Tensor] = []  # (torch's step clears the list it is given)
            if last:
                call_kwargs.update(target=target, losses=batch_losses)
            with _loss_parallel(p):
                shaped.step(*(args if first else ()), **call_kwargs)
            losses += batch_losses
        step_box[1] = 0
        if p.tp_placements:
            _settle_grads(params)
        if reduction is not None:  # every stage's average, launched when its gradients were final
            for st in stages or []:
                reduction.launch(st.stage_index)  # (a stage torch never told of its last backward: now)
            reduction.wait()
        elif dp_group is not None and averaged_after_step(p):
            average_replicas(params, dp_group, p.mesh.dp, clock, p.rank, step)
        _sync_tied(tied_local, p.tied, groups)
        # the step's loss: each microbatch's mean averaged ("mean"), or the pieces of the step's sum added up
        pieces = torch.stack([full_tensor(x).detach().float() for x in losses]) if last else None
        loss = 0.0 if pieces is None else float(pieces.sum() if _scaled(p) else pieces.mean())
        skip = False
        if scaler is not None:  # fp16: every gradient divided by the scale; an inf or NaN anywhere skips the step
            loss /= _LOSS_SCALE[0]
            skip = scaler.unscale([local_tensor(t.grad) for t in stepped if t.grad is not None])
        if last and dp_group is not None:  # the global batch's loss: the replicas' mean (shards agree)
            total = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(total, group=dp_group)
            loss = float(total.item()) / p.mesh.dp
        bad = _nonfinite(loss, stepped if scaler is None else [], stepped_names, p, step)  # (fp16: the scale decides)
        flag = torch.tensor([1.0 if bad else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank learns of it and stops at the same step
        if bad:
            clock.post(NonFinite(p.rank, p.coords, step, bad))
        if flag.item() and p.on_nonfinite == "stop":
            clock.flush(force=True)
            return False
        if p.clip_grad_norm is not None:
            norm = clip_global_norm(p, stepped, stepped_names, p.clip_grad_norm)
            if p.rank == 0:
                clock.post(GradNorm(p.rank, p.coords, step, norm))
        if scheduler is not None and p.rank == 0:  # the rate this step updates with
            clock.post(LearningRate(p.rank, p.coords, step, float(optimizer.param_groups[0]["lr"])))
        if not skip:
            optimizer.step()
        elif p.rank == 0 and scaler is not None:
            clock.post(Phase(p.rank, p.coords, f"step {step + 1} skipped: an inf or NaN gradient at loss scale "
                                               f"{scaler.scale:g}, which halves to {scaler.scale / 2:g} (fp16)"))
        if scaler is not None:
            scaler.update()
        if scheduler is not None:
            scheduler.step()
        if zero is not None and not skip:
            zero.gather()  # the whole parameters from the updated shards
        # gradients and optimizer state as they stand at step end (ZeRO-1: the shards, their gradients and state)
        clock.meter.count_static([*params, *(zero.shards if zero is not None else [])], optimizer)
        optimizer.zero_grad(set_to_none=True)
        if zero is not None:
            zero.zero_grad()
        if last and reports:
            clock.post(Loss(p.rank, p.coords, step, loss))
        if p.eval_batches and p.eval_every is not None and (step + 1) % p.eval_every == 0:
            evaluate(p, schedule, clock, step_box, device, dp_group, step, stages)
        _compiled_phase(p, clock, step)
        clock.post(StepEnd(p.rank, p.coords, step, time.time() - p.t0))
        clock.flush()
        finished = step
    if p.eval_batches and finished >= 0 and (p.eval_every is None or (finished + 1) % p.eval_every):
        evaluate(p, schedule, clock, step_box, device, dp_group, finished, stages)  # after the last step too
    clock.flush(force=True)
    return True


def _compiled_phase(p: RankPayload, clock: Clock, step: int) -> None:
    """After the first step of a compiled run: a phase saying how long torch.compile took on this rank (its forward
    and backward graphs, dynamo's own count), which the first step's actions include."""
    if step != 0 or p.compile is None:
        return
    from torch._dynamo.utils import calculate_time_spent

    seconds = float(calculate_time_spent().get("total_wall_time", 0.0))
    clock.post(Phase(p.rank, p.coords, f"torch.compile ({p.compile}): {seconds:.1f} s compiling this rank's stages "
                                       "in step 1"))


def evaluate(p: RankPayload, schedule: Schedule, clock: Clock, step_box: list[int], device: torch.device,
             dp_group: ProcessGroup | None, step: int, stages: list[PipelineStage] | None = None) -> None:
    """The held-out batches (``p.eval_batches``) forward through the pipeline, without gradients (torch's
    ``schedule.eval``), after step ``step``; the last stage's replica 0, shard 0 posts their loss (an ``EvalLoss``):
    the ``loss_reduction`` over every microbatch of every batch and replica. The forwards are timed as ``EVAL``
    events; the stages' buffers (running statistics, which a forward in training mode moves) are put back after,
    so training goes on as if no evaluation ran. The V-shaped schedules and a custom order evaluate through a
    forward-only order of torch's runtime (``_forward_schedule``): torch 2.13-2.15's ZBV and DualPipeV fail in
    ``eval`` ("can't steal_bwd_input if this stage doesn't have backward")."""
    import torch.distributed as dist

    from pipeviz.runtime.loss import IGNORE_INDEX

    if (p.order is not None or sched.info(p.schedule).v_shape) and stages is not None:
        schedule = _forward_schedule(p, stages)

    first = any(st.index == 0 for st in p.stages)
    last = any(st.index == len(p.stage_ranks) - 1 for st in p.stages)
    buffers = [b for st in p.stages for b in st.runner.stage.buffers()]
    saved = [b.detach().clone() for b in buffers]
    pieces: list[torch.Tensor] = []
    count = 0.0
    scale, _STEP_SCALE[0] = _STEP_SCALE[0], 1.0  # each microbatch's own mean, or its sum
    step_box[2] = 1
    try:
        for i, (args, kwargs, target) in enumerate(p.eval_batches):
            step_box[1] = i
            call_kwargs: dict[str, Any] = {k: _moved(v, device) for k, v in kwargs.items()} if first else {}
            batch_losses: list[torch.Tensor] = []
            if last:
                call_kwargs.update(target=_moved(target, device), losses=batch_losses)
                count += float((target != IGNORE_INDEX).sum()) if isinstance(target, torch.Tensor) else 0.0
            with torch.no_grad(), _loss_parallel(p):
                schedule.eval(*(tuple(_moved(a, device) for a in args) if first else ()), **call_kwargs)
            pieces += batch_losses
    finally:
        step_box[1], step_box[2], _STEP_SCALE[0] = 0, 0, scale
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)
    if not last:
        return
    total = torch.stack([full_tensor(x).detach().double() for x in pieces])
    value = torch.tensor([float(total.mean() if p.loss_reduction == "mean" else total.sum()), count],
                         dtype=torch.float64)
    if dp_group is not None:  # the replicas' shares: means averaged, sums and token counts added
        dist.all_reduce(value, group=dp_group)
        if p.loss_reduction == "mean":
            value[0] /= p.mesh.dp
    loss = float(value[0] / max(float(value[1]), 1.0)) if p.loss_reduction == "token_mean" else float(value[0])
    if p.coords.dp == p.coords.tp == p.coords.cp == 0:
        clock.post(EvalLoss(p.rank, p.coords, step, loss))


_FORWARD_SCHEDULES: dict[int, Schedule] = {}  # per process: the forward-only schedule evaluate() built


def _forward_schedule(p: RankPayload, stages: list[PipelineStage]) -> Schedule:
    """torch's runtime running every rank's forwards only, stage by stage (each rank's stages in increasing order,
    every microbatch of one before the next: whatever the placement, stage s's forwards need only stage s - 1's),
    built once."""
    from pipeviz.adapter import runtime_schedule

    key = id(stages[0])
    if key not in _FORWARD_SCHEDULES:
        order = [[f"{s}F{mb}" for s in sorted(i for i, r in enumerate(p.stage_ranks) if r == rank)
                  for mb in range(p.microbatches)] for rank in range(max(p.stage_ranks) + 1)]
        assert p.loss_fn is not None
        _FORWARD_SCHEDULES[key] = runtime_schedule(stages, order, p.microbatches, _named_loss(_reduced(p), p),
                                                   forward_only=True)
    return _FORWARD_SCHEDULES[key]


def _moved(x: object, device: torch.device) -> object:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def param_names(p: RankPayload) -> dict[int, str]:
    """This rank's parameters (by ``id``) -> their canonical names in the original model."""
    return {id(t): canon for st in p.stages for canon, inner in st.params.items()
            for n, t in st.runner.stage.named_parameters(remove_duplicate=False) if n == inner}


def _grouped(batches: Iterator[Batch], k: int) -> Iterator[list[Batch]]:
    """The batches in groups of ``k``, one per optimizer step (a last group of fewer is left out: it cannot make
    a whole step; the feeder sends whole groups only)."""
    group: list[Batch] = []
    for b in batches:
        group.append(b)
        if len(group) == k:
            yield group
            group = []


def sync_replicas(stages: list[PipelineStage], sync: bool) -> None:
    """Whether the replicas' gradients are reduced in this schedule step's last backward (DDP's all-reduce,
    FSDP2's reduce-scatter): only in a step's last accumulated batch, so each reduction carries the sum of the
    step's batches, as DDP's ``no_sync`` accumulation does (``adapter.stage``'s ``sync_replicas`` flag)."""
    for st in stages:
        st.sync_replicas = sync  # type: ignore[attr-defined]


def _batches(p: RankPayload, device: torch.device, shapes: Shapes | None = None,
             clock: Clock | None = None) -> Iterator[Batch]:
    """Each step's (args, kwargs, target, input shape number) on ``device``: the one batch of the payload ``steps``
    times, or the batches the launching process streams from ``data=`` (``messages.Batch``) until it sends
    ``messages.End`` (ranks that need no data get an empty ``Batch`` each step, so every rank runs the same number
    of steps). A batch of a new shape comes with this process's stages for it: ``shapes`` builds them here."""
    def moved(x: object) -> object:
        return x.to(device) if isinstance(x, torch.Tensor) else x

    if p.data is None:
        args, kwargs, target = tuple(moved(a) for a in p.args), {k: moved(v) for k, v in p.kwargs.items()}, \
            moved(p.target)
        for _ in range((p.steps or 0) * p.accumulate):
            yield args, kwargs, target, 0
        return
    while True:
        msg = p.data.get(timeout=p.timeout_s)
        if isinstance(msg, End):
            return
        if msg.stages is not None:
            if shapes is None:
                raise RuntimeError("a batch of another shape reached a process that takes one shape only")
            shapes.add(msg.shape, msg.stages)
            if clock is not None and p.rank == 0:
                clock.post(Phase(p.rank, p.coords, f"input shape {msg.shape + 1} of the run "
                                                   f"({_shape_text(msg)}): stages built in "
                                                   f"{shapes.build_seconds[msg.shape] * 1e3:.0f} ms on rank 0"))
        yield (tuple(moved(a) for a in msg.args), {k: moved(v) for k, v in msg.kwargs.items()}, moved(msg.target),
               msg.shape)


def _shape_text(msg: BatchMessage) -> str:
    leaves = [*msg.args, *msg.kwargs.values(), msg.target]
    return ", ".join(str(tuple(t.shape)) for t in leaves if isinstance(t, torch.Tensor)) or "no data on rank 0"


def infer(p: RankPayload, schedule: Schedule, clock: Clock, step_box: list[int], device: torch.device,
          shapes: Shapes | None = None) -> bool:
    """Forward-only steps (no loss_fn): the last stage's rank sends the whole batch's output each step (each batch
    through its input shape's schedule: ``shapes``)."""
    first = any(st.index == 0 for st in p.stages)
    last = any(st.index == len(p.stage_ranks) - 1 for st in p.stages)
    for step, (args, kwargs, _, shape) in enumerate(_batches(p, device, shapes, clock)):
        step_box[0] = step
        call_kwargs: dict[str, Any] = dict(kwargs) if first else {}  # the model's keyword inputs
        shaped = shapes.get(shape)[0] if shapes is not None and shape else schedule
        with torch.no_grad():
            out = shaped.step(*(args if first else ()), **call_kwargs)
        if last:
            leaves = out if isinstance(out, tuple | list) else (out,)
            buf = io.BytesIO()
            torch.save([t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in leaves], buf)
            if p.coords.tp == 0:  # the shards' outputs are the same full tensors
                clock.post(Output(p.rank, p.coords, step, buf.getvalue()))
        _compiled_phase(p, clock, step)
        clock.post(StepEnd(p.rank, p.coords, step, time.time() - p.t0))
        clock.flush()
    clock.flush(force=True)
    return True


def _nonfinite(loss: float, params: list[torch.nn.Parameter], names: dict[int, str], p: RankPayload,
               step: int) -> list[str]:
    """What is NaN or inf on this rank after a step's backward: the loss, and each gradient (by name)."""
    import math

    stages = ", ".join(str(s.index) for s in p.stages)
    found = []
    if not math.isfinite(loss):
        found.append(f"the loss is {loss} (step {step}, rank {p.rank}, stage {stages})")
    grads = [local_tensor(t.grad) for t in params if t.grad is not None]
    if grads and not bool(torch.isfinite(torch.stack([g.detach().float().sum() for g in grads])).all()):
        for t in params:
            if t.grad is not None and not bool(torch.isfinite(local_tensor(t.grad)).all()):
                kind = "nan" if bool(torch.isnan(local_tensor(t.grad)).any()) else "inf"
                found.append(f"the gradient of {names.get(id(t), '?')!r} holds {kind} (step {step}, rank {p.rank}, "
                             f"stage {stages})")
    return found


def rank_state(p: RankPayload, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors this rank's stages own, on the CPU, under the original model's canonical names (copies
    unless ``copy=False``: written to a file at once, they need none)."""
    state: dict[str, torch.Tensor] = {}
    for st in p.stages:
        mod = st.runner.stage
        named = {**dict(mod.named_parameters(remove_duplicate=False)),
                 **dict(mod.named_buffers(remove_duplicate=False))}
        inner = {**st.params, **st.buffers}
        for canon in st.reports:
            value = named[inner[canon]].detach()
            full = getattr(value, "full_tensor", None)
            t = (full() if callable(full) else value).cpu()  # a shard gathers its stage's whole tensor
            state[canon] = t.clone() if copy else t
    return state


def averaged_after_step(p: RankPayload) -> bool:
    """Whether replicas average their gradients in one all-reduce after the step (``average_replicas``):
    ``dp_reduce="after_flush"`` (the default under tensor parallelism: DDP does not take DTensor parameters)."""
    return not p.dp_shard and p.dp_reduce == "after_flush"


def average_replicas(params: list[torch.nn.Parameter], group: ProcessGroup | None, replicas: int, clock: Clock,
                     rank: int, step: int) -> None:
    """Average this rank's gradients across its replicas in one all-reduce (timed as a ``DP`` action): for
    the schedules whose split backward DDP's reducer cannot follow (see ``_stages``)."""
    import torch.distributed as dist

    grads = [local_tensor(t.grad) for t in params if t.grad is not None]
    if not grads:
        return
    with clock.span(rank, -1, "DP", -1, step), torch.no_grad():
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat /= replicas
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(reduced)


def clip_global_norm(p: RankPayload, params: list[torch.nn.Parameter], names: dict[int, str],
                     max_norm: float) -> float:
    """Clip every gradient of the run by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does on the
    unsplit model (``max_norm / (norm + 1e-6)``, at most 1); returns the norm before clipping, the same on every
    process. Each parameter is counted once over the whole run: a shared (tied) one on the lowest pipeline rank
    holding a copy, a replicated tensor-parallel one on shard 0, a replica's on replica 0 (DDP left them equal;
    FSDP2's shards each count theirs), a sharded one on every shard (its local part)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    me = p.mesh.coords(p.rank) if p.mesh is not None else None
    total = torch.zeros((), dtype=torch.float64)
    counted: set[str] = set()
    for t in params:
        g = t.grad
        if g is None:
            continue
        canon = names.get(id(t), "")
        if canon in p.tied:
            if canon in counted or (me is not None and min(p.tied[canon]) != me.pp) or (
                    me is None and min(p.tied[canon]) != p.rank):
                continue
            counted.add(canon)
        over_dp = not p.dp_shard and p.dp_reduce != "zero1"  # replicas hold equal gradients, unless sharded
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            if any(pl.is_replicate() and mesh.get_local_rank(i) != 0 for i, pl in enumerate(g.placements)):
                continue
        if over_dp and me is not None and me.dp != 0:
            continue
        total += local_tensor(g).detach().double().pow(2).sum().cpu()
    dist.all_reduce(total)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for t in params:
                if t.grad is not None:
                    local_tensor(t.grad).mul_(coef)
    return norm


def _settle_grads(params: list[torch.nn.Parameter]) -> None:
    """Each tensor-parallel gradient laid out as its parameter is, once, before anything reads it. Under sequence
    parallelism a replicated weight that saw only this shard's tokens (a norm's) has partial sums for a gradient:
    all-reduced here once, as Megatron-LM does its sequence-parallel norms' (left to the optimizer, DTensor would
    all-reduce it in every op that reads it). Any other gradient whose layout DTensor chose differently from its
    parameter's is laid out as the parameter here, so a tied copy on another stage, sharded alike, sums with it
    shard by shard (a row-sharded embedding's gradient came out whole before ``vocab_parallel_embedding``: GPT-2's
    tied sync then mismatched sizes in gloo)."""
    from torch.distributed.tensor import DTensor

    for t in params:
        g = t.grad
        if isinstance(g, DTensor) and isinstance(t, DTensor) and tuple(g.placements) != tuple(t.placements):
            t.grad = g.redistribute(placements=t.placements)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor as the whole tensor (a vocabulary-parallel loss: replicated), else the tensor itself."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _loss_parallel(p: RankPayload) -> AbstractContextManager[object]:
    """torch's ``loss_parallel`` around a step whose last stage's logits are sharded by vocabulary (its forward
    and backward both run the parallel cross-entropy), else nothing."""
    if not any(st.runner.vocab_parallel_loss for st in p.stages):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a tensor-parallel gradient), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _sync_tied(local: dict[str, list[torch.Tensor]], tied: dict[str, list[int]],
               groups: dict[str, ProcessGroup | None]) -> None:
    """Sum the gradients of every copy of a shared parameter (on this rank, then across the ranks holding
    one), then give each copy the sum (as DeepSpeed does for tied weights): copies stay identical and take
    one update, like the unsplit model's one tensor."""
    import torch.distributed as dist

    for canon in sorted(tied):
        copies = local.get(canon, [])
        if not copies:
            continue
        for c in copies:
            if c.grad is None:
                c.grad = torch.zeros_like(c)
        # A tensor-parallel copy's local part (tied: replicated); every copy has a gradient by now.
        grads = [local_tensor(c.grad) for c in copies if c.grad is not None]
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if groups.get(canon) is not None:
            dist.all_reduce(total, group=groups[canon])
        with torch.no_grad():
            for g in grads:
                g.copy_(total)
