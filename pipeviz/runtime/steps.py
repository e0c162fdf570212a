"""A rank's steps over one ``StepContext`` (what the worker built: the payload, torch's schedule, the clock, the
optimizer, the groups): the training loop (each step's batches through the schedule, the gradients reduced and
checked, the optimizer update, evaluations), the forward-only loop, the batches of each step, and the trained
tensors under the original model's names. The schedule and its loss: ``pipeviz.runtime.rank_schedule``; the
gradients between backward and update: ``pipeviz.runtime.grads``.

Example:
    >>> ctx = StepContext(payload, build_schedule(payload, stages), clock, device, [0, 0, 0], stages=stages,
    ...                   optimizer=optimizer, params=params)
    >>> finished = train(ctx) if ctx.optimizer is not None else infer(ctx)
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pipeviz.runtime.clock import Clock
from pipeviz.runtime.grads import (
    average_replicas,
    averaged_after_step,
    clip_global_norm,
    full_tensor,
    local_tensor,
    nonfinite,
    settle_grads,
    sync_replicas,
    sync_tied,
)
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
from pipeviz.runtime.rank_schedule import LOSS_SCALE, STEP_SCALE, forward_schedule, scaled_by_step, step_scale
from pipeviz.schedule import traits as sched

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining import PipelineStage

    from pipeviz.runtime.loss_scale import LossScaler
    from pipeviz.runtime.overlap import OverlappedReduction
    from pipeviz.runtime.rank_schedule import Schedule
    from pipeviz.runtime.shapes import Shapes
    from pipeviz.runtime.zero import ZeroOne

__all__ = ["StepContext", "evaluate", "infer", "param_names", "rank_state", "train"]

# One batch's (args, kwargs, target).
Batch = tuple[tuple[object, ...], dict[str, object], object, int]  # args, kwargs, target, input shape number


@dataclass
class StepContext:
    """What a rank's steps run with, built once by the worker (``run_payload``).

    ``step_box`` is shared with the stages' timed spans: the step, its accumulated (or held-out) batch, and whether
    it evaluates. ``shapes`` holds the schedule of each input shape a ``data=`` run has sent
    (``pipeviz.runtime.shapes``): each batch runs its own shape's. A training run has an ``optimizer``; its
    ``reduction`` (``dp_reduce="overlap"`` or ``"zero1"``) is waited for before anything reads the gradients (with
    ZeRO-1 the optimizer steps on its shards, ``ZeroOne.shards``, and the whole parameters are gathered after)."""

    p: RankPayload
    schedule: Schedule
    clock: Clock
    device: torch.device
    step_box: list[int]
    stages: list[PipelineStage] = field(default_factory=list)
    shapes: Shapes | None = None
    dp_group: ProcessGroup | None = None  # this process's replicas (None: one replica)
    optimizer: torch.optim.Optimizer | None = None  # None: a forward-only run
    params: list[torch.nn.Parameter] = field(default_factory=list)
    local: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # per shared parameter, this rank's copies
    groups: dict[str, ProcessGroup | None] = field(default_factory=dict)  # per shared parameter, its holders' group
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    reduction: OverlappedReduction | ZeroOne | None = None

    @property
    def first(self) -> bool:
        """Whether this rank holds the first stage (it takes the model's inputs)."""
        return any(st.index == 0 for st in self.p.stages)

    @property
    def last(self) -> bool:
        """Whether this rank holds the last stage (it takes the targets and computes the loss)."""
        return any(st.index == len(self.p.stage_ranks) - 1 for st in self.p.stages)


def train(ctx: StepContext) -> bool:
    """Run the steps; False when a NaN or inf stopped the run (every rank stops at the same step). A step runs the
    schedule on ``p.accumulate`` batches in turn (``step_box[1]`` counts them), their gradients summed in place;
    the replicas' gradients are reduced once, in the last batch's backward (``sync_replicas``). The scheduler steps
    after each optimizer step; with ``p.eval_batches`` the held-out batches are evaluated every ``p.eval_every``
    steps and after the last (``evaluate``)."""
    return _Training(ctx).run()


class _Training:
    """One rank's training loop over its ``StepContext``: what the optimizer steps (ZeRO-1's shards or the
    parameters), fp16's loss scaler, and each part of a step."""

    def __init__(self, ctx: StepContext) -> None:
        from pipeviz.runtime.zero import ZeroOne

        assert ctx.optimizer is not None  # (a forward-only run: infer)
        self.ctx, self.p, self.optimizer = ctx, ctx.p, ctx.optimizer
        self.zero = ctx.reduction if isinstance(ctx.reduction, ZeroOne) else None
        names = param_names(ctx.p)
        # what the optimizer steps, clipping clips and the checks read: the shards under ZeRO-1, else the parameters
        self.stepped, self.names = (self.zero.shards, self.zero.names) if self.zero is not None else (ctx.params, names)
        self.tied_local = self.zero.tied(ctx.local) if self.zero is not None else ctx.local
        self.scaler: LossScaler | None = None
        if ctx.p.loss_scaling:
            from pipeviz.runtime.loss_scale import LossScaler

            self.scaler = LossScaler()

    def run(self) -> bool:
        ctx, p = self.ctx, self.p
        finished = -1
        for step, group in enumerate(_grouped(_batches(ctx), p.accumulate)):
            ctx.step_box[0] = step
            if self.scaler is not None:
                LOSS_SCALE[0] = self.scaler.scale
            losses = self._batches(group)
            self._reduce(step)
            loss, skip = self._loss(losses)
            if self._stopped(loss, step):
                return False
            self._update(step, skip)
            if ctx.last and p.coords.dp == p.coords.tp == p.coords.cp == 0:  # replica 0, shard 0 speaks for all
                ctx.clock.post(Loss(p.rank, p.coords, step, loss))
            if p.eval_batches and p.eval_every is not None and (step + 1) % p.eval_every == 0:
                evaluate(ctx, step)
            _step_end(ctx, step)
            finished = step
        if p.eval_batches and finished >= 0 and (p.eval_every is None or (finished + 1) % p.eval_every):
            evaluate(ctx, finished)  # after the last step too
        ctx.clock.flush(force=True)
        return True

    def _batches(self, group: list[Batch]) -> list[torch.Tensor]:
        """The step's accumulated batches through the schedule, each in its input shape's; returns the last stage's
        microbatch losses (empty on other ranks)."""
        ctx, p = self.ctx, self.p
        losses: list[torch.Tensor] = []
        if ctx.last and scaled_by_step(p):
            STEP_SCALE[0] = step_scale(p, [target for _, _, target, _ in group], ctx.dp_group)
        for r, (args, kwargs, target, shape) in enumerate(group):
            ctx.step_box[1] = r
            shaped: Schedule = ctx.schedule
            if shape:  # a data= batch of another shape than the first: its own stages and schedule
                assert ctx.shapes is not None
                shaped, its_stages = ctx.shapes.get(shape)
                sync_replicas(its_stages, r == len(group) - 1)
            else:
                sync_replicas(ctx.stages, r == len(group) - 1)
            call_kwargs: dict[str, Any] = dict(kwargs) if ctx.first else {}
            batch_losses: list[torch.Tensor] = []  # (torch's step clears the list it is given)
            if ctx.last:
                call_kwargs.update(target=target, losses=batch_losses)
            with _loss_parallel(p):
                shaped.step(*(args if ctx.first else ()), **call_kwargs)
            losses += batch_losses
        ctx.step_box[1] = 0
        return losses

    def _reduce(self, step: int) -> None:
        """The step's gradients made whole: laid out as their parameters, the replicas' reduced, tied copies summed."""
        ctx, p = self.ctx, self.p
        if p.tp_placements:
            settle_grads(ctx.params)
        if ctx.reduction is not None:  # every stage's average, launched when its gradients were final
            for st in ctx.stages:
                ctx.reduction.launch(st.stage_index)  # (a stage torch never told of its last backward: now)
            ctx.reduction.wait()
        elif ctx.dp_group is not None and averaged_after_step(p):
            average_replicas(ctx.params, ctx.dp_group, p.replicas, ctx.clock, p.rank, step)
        sync_tied(self.tied_local, p.tied, ctx.groups)

    def _loss(self, losses: list[torch.Tensor]) -> tuple[float, bool]:
        """The step's loss (the whole batch's: the replicas' mean), and whether fp16's unscaling found an inf or
        NaN gradient (the update is skipped)."""
        import torch.distributed as dist

        ctx, p = self.ctx, self.p
        # the step's loss: each microbatch's mean averaged ("mean"), or the pieces of the step's sum added up
        pieces = torch.stack([full_tensor(x).detach().float() for x in losses]) if ctx.last else None
        loss = 0.0 if pieces is None else float(pieces.sum() if scaled_by_step(p) else pieces.mean())
        skip = False
        if self.scaler is not None:  # fp16: every gradient divided by the scale; an inf or NaN anywhere skips the step
            loss /= LOSS_SCALE[0]
            skip = self.scaler.unscale([local_tensor(t.grad) for t in self.stepped if t.grad is not None])
        if ctx.last and ctx.dp_group is not None:  # the global batch's loss: the replicas' mean (shards agree)
            total = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(total, group=ctx.dp_group)
            loss = float(total.item()) / p.replicas
        return loss, skip

    def _stopped(self, loss: float, step: int) -> bool:
        """NaN or inf in the loss or a gradient (fp16: the scale decides) is reported; every rank learns of it and,
        with ``on_nonfinite="stop"``, stops at the same step, before its update."""
        import torch.distributed as dist

        ctx, p = self.ctx, self.p
        bad = nonfinite(loss, self.stepped if self.scaler is None else [], self.names, p, step)
        flag = torch.tensor([1.0 if bad else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank learns of it and stops at the same step
        if bad:
            ctx.clock.post(NonFinite(p.rank, p.coords, step, bad))
        if flag.item() and p.on_nonfinite == "stop":
            ctx.clock.flush(force=True)
            return True
        return False

    def _update(self, step: int, skip: bool) -> None:
        """Clip, step the optimizer (unless fp16 skips it) and the scheduler, then clear the gradients."""
        ctx, p, optimizer, zero, scaler = self.ctx, self.p, self.optimizer, self.zero, self.scaler
        if p.clip_grad_norm is not None:
            norm = clip_global_norm(p, self.stepped, self.names, p.clip_grad_norm)
            if p.rank == 0:
                ctx.clock.post(GradNorm(p.rank, p.coords, step, norm))
        if ctx.scheduler is not None and p.rank == 0:  # the rate this step updates with
            ctx.clock.post(LearningRate(p.rank, p.coords, step, float(optimizer.param_groups[0]["lr"])))
        if not skip:
            optimizer.step()
        elif p.rank == 0 and scaler is not None:
            ctx.clock.post(Phase(p.rank, p.coords, f"step {step + 1} skipped: an inf or NaN gradient at loss scale "
                                                   f"{scaler.scale:g}, which halves to {scaler.scale / 2:g} (fp16)"))
        if scaler is not None:
            scaler.update()
        if ctx.scheduler is not None:
            ctx.scheduler.step()
        if zero is not None and not skip:
            zero.gather()  # the whole parameters from the updated shards
        # gradients and optimizer state as they stand at step end (ZeRO-1: the shards, their gradients and state)
        ctx.clock.meter.count_static([*ctx.params, *(zero.shards if zero is not None else [])], optimizer)
        optimizer.zero_grad(set_to_none=True)
        if zero is not None:
            zero.zero_grad()


def _step_end(ctx: StepContext, step: int) -> None:
    """A step's end, sent: the compile time after the first, the ``StepEnd``, the events so far."""
    p = ctx.p
    _compiled_phase(p, ctx.clock, step)
    ctx.clock.post(StepEnd(p.rank, p.coords, step, time.time() - p.t0))
    ctx.clock.flush()


def evaluate(ctx: StepContext, step: int) -> None:
    """The held-out batches (``p.eval_batches``) forward through the pipeline, without gradients (torch's
    ``schedule.eval``), after step ``step``; the last stage's replica 0, shard 0 posts their loss (an ``EvalLoss``):
    the ``loss_reduction`` over every microbatch of every batch and replica. The forwards are timed as ``EVAL``
    events; the stages' buffers (running statistics, which a forward in training mode moves) are put back after,
    so training goes on as if no evaluation ran. The V-shaped schedules and a custom order evaluate through a
    forward-only order of torch's runtime (``forward_schedule``): torch 2.13-2.15's ZBV and DualPipeV fail in
    ``eval`` ("can't steal_bwd_input if this stage doesn't have backward")."""
    import torch.distributed as dist

    from pipeviz.runtime.loss import IGNORE_INDEX

    p, schedule, clock, step_box, device, dp_group = (ctx.p, ctx.schedule, ctx.clock, ctx.step_box, ctx.device,
                                                      ctx.dp_group)
    if (p.order is not None or sched.info(p.schedule).v_shape) and ctx.stages:
        schedule = forward_schedule(p, ctx.stages)

    first, last = ctx.first, ctx.last
    buffers = [b for st in p.stages for b in st.runner.stage.buffers()]
    saved = [b.detach().clone() for b in buffers]
    pieces: list[torch.Tensor] = []
    count = 0.0
    scale, STEP_SCALE[0] = STEP_SCALE[0], 1.0  # each microbatch's own mean, or its sum
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
        step_box[1], step_box[2], STEP_SCALE[0] = 0, 0, scale
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
            value[0] /= p.replicas
    loss = float(value[0] / max(float(value[1]), 1.0)) if p.loss_reduction == "token_mean" else float(value[0])
    if p.coords.dp == p.coords.tp == p.coords.cp == 0:
        clock.post(EvalLoss(p.rank, p.coords, step, loss))


def _compiled_phase(p: RankPayload, clock: Clock, step: int) -> None:
    """After the first step of a compiled run: a phase saying how long torch.compile took on this rank (its forward
    and backward graphs, dynamo's own count), which the first step's actions include."""
    if step != 0 or p.compile is None:
        return
    from torch._dynamo.utils import calculate_time_spent

    seconds = float(calculate_time_spent().get("total_wall_time", 0.0))
    clock.post(Phase(p.rank, p.coords, f"torch.compile ({p.compile}): {seconds:.1f} s compiling this rank's stages "
                                       "in step 1"))


def infer(ctx: StepContext) -> bool:
    """Forward-only steps (no loss_fn): the last stage's rank sends the whole batch's output each step (each batch
    through its input shape's schedule: ``ctx.shapes``)."""
    p, shapes, clock = ctx.p, ctx.shapes, ctx.clock
    for step, (args, kwargs, _, shape) in enumerate(_batches(ctx)):
        ctx.step_box[0] = step
        call_kwargs: dict[str, Any] = dict(kwargs) if ctx.first else {}  # the model's keyword inputs
        shaped = shapes.get(shape)[0] if shapes is not None and shape else ctx.schedule
        with torch.no_grad():
            out = shaped.step(*(args if ctx.first else ()), **call_kwargs)
        if ctx.last:
            leaves = out if isinstance(out, tuple | list) else (out,)
            buf = io.BytesIO()
            torch.save([t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in leaves], buf)
            if p.coords.tp == 0:  # the shards' outputs are the same full tensors
                clock.post(Output(p.rank, p.coords, step, buf.getvalue()))
        _step_end(ctx, step)
    clock.flush(force=True)
    return True


def _batches(ctx: StepContext) -> Iterator[Batch]:
    """Each step's (args, kwargs, target, input shape number) on the rank's device: the one batch of the payload
    ``steps`` times, or the batches the launching process streams from ``data=`` (``messages.Batch``) until it sends
    ``messages.End`` (ranks that need no data get an empty ``Batch`` each step, so every rank runs the same number
    of steps). A batch of a new shape comes with this process's stages for it: ``ctx.shapes`` builds them here."""
    p, shapes, clock = ctx.p, ctx.shapes, ctx.clock

    def moved(x: object) -> object:
        return _moved(x, ctx.device)

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
            if p.rank == 0:
                clock.post(Phase(p.rank, p.coords, f"input shape {msg.shape + 1} of the run "
                                                   f"({_shape_text(msg)}): stages built in "
                                                   f"{shapes.build_seconds[msg.shape] * 1e3:.0f} ms on rank 0"))
        yield (tuple(moved(a) for a in msg.args), {k: moved(v) for k, v in msg.kwargs.items()}, moved(msg.target),
               msg.shape)


def _shape_text(msg: BatchMessage) -> str:
    leaves = [*msg.args, *msg.kwargs.values(), msg.target]
    return ", ".join(str(tuple(t.shape)) for t in leaves if isinstance(t, torch.Tensor)) or "no data on rank 0"


def _grouped(batches: Iterator[Batch], k: int) -> Iterator[list[Batch]]:
    """The batches in groups of ``k``, one per optimizer step (a last group of fewer is left out: it cannot make
    a whole step; the feeder sends whole groups only)."""
    group: list[Batch] = []
    for b in batches:
        group.append(b)
        if len(group) == k:
            yield group
            group = []


def _moved(x: object, device: torch.device) -> object:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _loss_parallel(p: RankPayload) -> AbstractContextManager[object]:
    """torch's ``loss_parallel`` around a step whose last stage's logits are sharded by vocabulary (its forward
    and backward both run the parallel cross-entropy), else nothing."""
    if not any(st.runner.vocab_parallel_loss for st in p.stages):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def param_names(p: RankPayload) -> dict[int, str]:
    """This rank's parameters (by ``id``) -> their canonical names in the original model."""
    return {id(t): canon for st in p.stages for canon, inner in st.params.items()
            for n, t in st.runner.stage.named_parameters(remove_duplicate=False) if n == inner}


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
