"""Train the unsplit model exactly as a pipelined run does, to check a run's numerics against it.

Same microbatching, one loss per microbatch, gradients summed then divided by the microbatch count
(torch's ``scale_grads=True``), so a mean-reduced loss matches.

Example:
    >>> losses, state = pv.train_reference(model, inputs=(x,), target=y, loss_fn=F.cross_entropy,
    ...                                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), microbatches=4, steps=3)
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from pipeviz._compat import positional_legacy
from pipeviz.schedule.training import model_output

if TYPE_CHECKING:
    from pipeviz.runtime.checkpoint import Resume
    from pipeviz.runtime.rng import RunDraws

__all__ = ["forward_reference", "model_output", "train_reference"]


@positional_legacy("loss_fn", "optimizer", "microbatches", "steps", "input_kwargs", "fixups", "device", "batches",
                   "replicas")
def train_reference(
    model: torch.nn.Module,
    inputs: tuple[object, ...],
    target: torch.Tensor,
    *,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    microbatches: int = 1,
    steps: int = 1,
    input_kwargs: Mapping[str, object] | None = None,
    fixups: Mapping[str, object] | None = None,
    device: str | torch.device = "cpu",
    batches: Sequence[tuple[tuple[object, ...], Mapping[str, object], object]] | None = None,
    replicas: int = 1,
    draws: RunDraws | None = None,
    clip_grad_norm: float | None = None,
    grad_norms: list[float] | None = None,
    loss_reduction: str = "mean",
    accumulate: int = 1,
    lr_scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None,
    learning_rates: list[float] | None = None,
    eval_batches: Sequence[tuple[tuple[object, ...], Mapping[str, object], object]] = (),
    eval_every: int | None = None,
    eval_losses: list[tuple[int, float]] | None = None,
    resume: Resume | None = None,
    mixed_precision: torch.dtype | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train a deep copy of ``model`` on ``device``; returns (mean loss per step, final state_dict on the CPU).

    ``batches``: one ``(args, kwargs, target)`` per step (a ``data=`` run's), instead of ``inputs``,
    ``input_kwargs`` and ``target`` every step. ``replicas``: a data-parallel run's (``microbatches`` counts
    them all: each replica runs ``microbatches // replicas`` of them); the gradients are the same, and the
    buffers (running statistics) follow replica 0's microbatches only, as each replica keeps its own.
    ``draws``: a run's random draws (``pipeviz.runtime.rng.RunDraws``): dropout draws what the run's stages drew.
    ``clip_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` before each step, its norms appended to ``grad_norms``.
    ``loss_reduction`` (``LaunchConfig.loss_reduction``): ``"sum"`` and ``"token_mean"`` add up each
    microbatch's summed cross-entropy (divided, for the token mean, by the step's count of valid tokens).
    ``accumulate`` (``LaunchConfig.accumulate``): each optimizer step takes that many batches (of ``batches``, or
    the one batch again), as one batch of ``accumulate x microbatches`` microbatches; ``steps`` counts optimizer
    steps. ``lr_scheduler``: built around the optimizer, stepped after it (the rates used appended to
    ``learning_rates``). ``eval_batches``: held-out batches evaluated every ``eval_every`` steps and after the last
    (``(step, loss)`` appended to ``eval_losses``), as a run's evaluation does: microbatched alike, without
    gradients, buffers put back after. ``resume`` (a ``pipeviz.runtime.checkpoint.Resume``): the optimizer and
    scheduler start from the checkpoint's state (load the weights into ``model`` first), and the steps count on from
    its step (dropout's draws). ``mixed_precision``: the forward under ``torch.autocast`` in that dtype, the loss
    in float32 on float32 outputs, as a run's stages compute them (``LaunchConfig.mixed_precision``); in float16
    with ``torch.amp.GradScaler``'s dynamic loss scale (a step with an inf or NaN gradient skipped)."""
    model = _copy(model, fixups, device)
    opt = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1)))(list(model.parameters()))
    sched = lr_scheduler(opt) if lr_scheduler is not None else None
    first = 0
    if resume is not None:
        from pipeviz.runtime.checkpoint import load_optimizer

        named = dict(model.named_parameters(remove_duplicate=False))
        ids = {id(named[saved]): canon for canon, saved in resume.names.items() if saved in named}
        load_optimizer(resume, opt, sched, list(model.parameters()), ids)
        first = resume.step
    mean_fn = loss_fn
    # fp16: torch's own dynamic loss scale (what the run's pipeviz.runtime.loss_scale reproduces across processes)
    scaler = torch.amp.GradScaler(torch.device(device).type) if mixed_precision is torch.float16 else None
    if batches is None:
        batches = [(tuple(inputs), dict(input_kwargs or {}), target)] * (steps * accumulate)
    chunked = list(_microbatched(batches, microbatches, device))
    losses = []
    for n in range(len(chunked) // accumulate):
        group = chunked[n * accumulate:(n + 1) * accumulate]
        step = []
        if loss_reduction != "mean":
            from pipeviz.runtime.loss import IGNORE_INDEX

            valid = sum(float((tgt != IGNORE_INDEX).sum()) for _, _, tgt in group) \
                if loss_reduction == "token_mean" else 1.0
            loss_fn = functools.partial(_share_of_sum, count=max(valid, 1.0))
        for b, (arg_mbs, kw_mbs, tgt) in enumerate(group):
            for i, (a, k, t) in enumerate(zip(arg_mbs, kw_mbs, torch.tensor_split(tgt, microbatches), strict=True)):
                # (the backward too: BatchNorm's saves its running statistics, which must not change before it)
                with _buffers_of_replica_0(model, i * replicas // microbatches):
                    with draws.forward(first + n, b * microbatches + i) if draws is not None else \
                            contextlib.nullcontext(), _autocast(device, mixed_precision):
                        out = model(*a, **k)
                    loss = loss_fn(_float32(model_output(out), mixed_precision), t)
                    term = loss / (microbatches * accumulate) if loss_reduction == "mean" else loss
                    (scaler.scale(term) if scaler is not None else term).backward()
                step.append(loss.detach())
        if scaler is not None:
            scaler.unscale_(opt)
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            if grad_norms is not None:
                grad_norms.append(float(norm))
        if learning_rates is not None:
            learning_rates.append(float(opt.param_groups[0]["lr"]))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        total = torch.stack(step)
        losses.append(float(total.mean() if loss_reduction == "mean" else total.sum()))
        last = n == len(chunked) // accumulate - 1
        if eval_batches and eval_losses is not None and (
                (eval_every is not None and (n + 1) % eval_every == 0) or last):
            eval_losses.append((n, _evaluate(model, eval_batches, mean_fn, microbatches, replicas, loss_reduction,
                                             device, draws, first + n, mixed_precision)))
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _evaluate(model: torch.nn.Module, batches: Sequence[tuple[tuple[object, ...], Mapping[str, object], object]],
              loss_fn: Callable[..., torch.Tensor], microbatches: int, replicas: int, loss_reduction: str,
              device: str | torch.device, draws: RunDraws | None, step: int,
              mixed_precision: torch.dtype | None = None) -> float:
    """The held-out batches' loss, as a run's evaluation computes it (``pipeviz.runtime.steps.evaluate``)."""
    from pipeviz.runtime.loss import IGNORE_INDEX, summed_cross_entropy
    from pipeviz.runtime.rng import EVAL_SEED

    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    pieces, count = [], 0.0
    eval_draws = draws.shifted(EVAL_SEED) if draws is not None else None
    with torch.no_grad():
        for b, (arg_mbs, kw_mbs, tgt) in enumerate(_microbatched(batches, microbatches, device)):
            count += float((tgt != IGNORE_INDEX).sum())
            for i, (a, k, t) in enumerate(zip(arg_mbs, kw_mbs, torch.tensor_split(tgt, microbatches), strict=True)):
                with _buffers_of_replica_0(model, i * replicas // microbatches), (
                        eval_draws.forward(step, b * microbatches + i) if eval_draws is not None
                        else contextlib.nullcontext()), _autocast(device, mixed_precision):
                    out = model_output(model(*a, **k))
                out = _float32(out, mixed_precision)
                pieces.append(loss_fn(out, t) if loss_reduction == "mean" else summed_cross_entropy(out, t))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(saved[name])
    total = torch.stack(pieces).double()
    if loss_reduction == "mean":
        return float(total.mean())
    return float(total.sum() / max(count, 1.0)) if loss_reduction == "token_mean" else float(total.sum())


def _autocast(device: str | torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    """``torch.autocast`` on ``device``'s type in ``dtype`` (mixed precision), else nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def _float32(out: torch.Tensor | tuple[torch.Tensor, ...], dtype: torch.dtype | None,
             ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Under mixed precision the loss sees float32 outputs (as a run's last stage hands them to its loss)."""
    if dtype is None:
        return out
    if isinstance(out, tuple):
        return tuple(t.float() if t.is_floating_point() else t for t in out)
    return out.float() if out.is_floating_point() else out


def _share_of_sum(output: torch.Tensor, target: torch.Tensor, count: float) -> torch.Tensor:
    """A microbatch's summed cross-entropy over ``count`` (the step's valid tokens, or 1 for a sum)."""
    from pipeviz.runtime.loss import summed_cross_entropy

    return summed_cross_entropy(output, target) / count


@positional_legacy("microbatches", "steps", "input_kwargs", "fixups", "device", "batches", "replicas")
def forward_reference(
    model: torch.nn.Module,
    inputs: tuple[object, ...],
    *,
    microbatches: int = 1,
    steps: int = 1,
    input_kwargs: Mapping[str, object] | None = None,
    fixups: Mapping[str, object] | None = None,
    device: str | torch.device = "cpu",
    batches: Sequence[tuple[tuple[object, ...], Mapping[str, object], object]] | None = None,
    replicas: int = 1,
    draws: RunDraws | None = None,
) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Run a deep copy of ``model`` forward only, as a forward-only pipelined run does: per step, the output's
    tensor leaves for the whole batch (microbatches run one by one, joined along the batch dim, which is what
    a module in training mode such as BatchNorm needs to match); returns (leaves per step, final state_dict on
    the CPU: running statistics move in a forward too)."""
    model = _copy(model, fixups, device)
    if batches is None:
        batches = [(tuple(inputs), dict(input_kwargs or {}), None)] * steps
    outputs = []
    with torch.no_grad():
        for n, (arg_mbs, kw_mbs, _) in enumerate(_microbatched(batches, microbatches, device)):
            chunks = []
            for i, (a, k) in enumerate(zip(arg_mbs, kw_mbs, strict=True)):
                with (_buffers_of_replica_0(model, i * replicas // microbatches),
                      draws.forward(n, i) if draws is not None else contextlib.nullcontext()):
                    chunks.append([t for t in pytree.tree_leaves(model(*a, **k)) if isinstance(t, torch.Tensor)])
            outputs.append([torch.cat(parts).cpu() if parts[0].dim() else parts[-1].cpu()
                            for parts in zip(*chunks, strict=True)])
    return outputs, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _buffers_of_replica_0(model: torch.nn.Module, replica: int) -> Iterator[None]:
    """Inside the block, a forward of replica ``replica`` > 0 leaves the buffers as they were (each replica
    keeps its own running statistics; the run reports replica 0's)."""
    if replica == 0:
        yield
        return
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])


def _copy(model: torch.nn.Module, fixups: Mapping[str, object] | None, device: str | torch.device,
          ) -> torch.nn.Module:
    """A deep copy on ``device`` with the fixes the trace applied to its own copy (as the stages have them)."""
    from pipeviz.capture.export import apply_fixups

    model = copy.deepcopy(model).to(device)
    apply_fixups(model, fixups or {})
    return model


def _microbatched(batches: Sequence[tuple[tuple[object, ...], Mapping[str, object], object]], microbatches: int,
                  device: str | torch.device,
                  ) -> Iterator[tuple[list[tuple[object, ...]], list[dict[str, object]], Any]]:
    """Each step's (args chunks, kwargs chunks, target) on ``device``, split as torch's schedules split them."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    for args, kwargs, tgt in batches:
        args, kwargs, tgt = pytree.tree_map(
            lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (args, kwargs, tgt))
        arg_mbs, kw_mbs = split_args_kwargs_into_chunks(args, kwargs, microbatches)
        yield arg_mbs, kw_mbs, tgt
