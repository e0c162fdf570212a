"""``check_numerics``: does a pipelined run train exactly like the unsplit model?

The one check every part of pipeviz uses (the CLI, the Explorer, the notebooks, the benchmarks, the tests):
the unsplit model is trained the same way (``pv.train_reference``: same batches, microbatching and loss
scaling) and compared with the run's losses and trained parameters and buffers, with one tolerance.

Example:
    >>> run = pv.launch(plan, "1F1B", 4, 3, inputs=(x,), target=y, loss_fn=pv.cross_entropy)
    >>> run.wait(); check = pv.check_numerics(run)
    >>> check.ok, check.loss_diff, check.param_diff
    (True, 0.0, 3.7e-09)
    >>> print(check)        # one line: verdict, differences, tolerance
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from pipeviz._compat import positional_legacy
from pipeviz.runtime.rng import RunDraws

if TYPE_CHECKING:
    from pipeviz.runtime.feed import FedBatch
    from pipeviz.runtime.run import Run
    from pipeviz.runtime.spec import LaunchSpec

__all__ = ["MIXED_TOLERANCE", "MIXED_TP_TOLERANCE", "TOLERANCE", "NumericsCheck", "check_numerics"]

TOLERANCE = 1e-5  # float32: what summing the same numbers in another order can change
# Under mixed precision the unsplit model in eager can take another code path than its trace: transformers' SDPA
# attention without a mask runs grouped-query attention inside the kernel (``enable_gqa``), where the traced graph
# materialises the mask and repeats the keys and values (``repeat_kv``), so their gradients are summed over the
# head group in bfloat16 there (measured on zoo.llama(), 2 stages, SGD 0.1: parameters 3.7e-5 apart after one step,
# the next loss 6.7e-5; the stages against the whole model exported by torch.export: 0.0, bit for bit). The
# default tolerance is bfloat16's and float16's share of that: their unit roundoffs are 2^-8 and 2^-11.
MIXED_TOLERANCE = {"bf16": 2e-4, "bfloat16": 2e-4, "fp16": 5e-5, "float16": 5e-5}
# Tensor parallelism under mixed precision rounds more: each shard's partial product of a row-wise layer is rounded to
# bf16/fp16 before the all-reduce sums them, where the unsplit model rounds the whole sum once, so activations differ
# by an ulp and the loss by a share of it (exact in float32: 1e-5 holds there). Found by pipeviz fuzz; measured on
# the zoo's skip, mlp and transformer, HF GPT-2 and Llama, tp=2, 1-2 steps, 36 runs: |Δloss| up to 6.1e-4 in bf16
# and 1.3e-4 in fp16 (tp=1: 0 and the same bits). The tolerance is half the unit roundoff (2^-9, 2^-12).
MIXED_TP_TOLERANCE = {"bf16": 2e-3, "bfloat16": 2e-3, "fp16": 2.5e-4, "float16": 2.5e-4}


@dataclass(frozen=True)
class NumericsCheck:
    """The result of ``check_numerics``.

    Attributes:
        ok: every loss and every parameter and buffer within ``tolerance``, and as many steps.
        loss_diff: the largest absolute loss difference over the steps (``ok`` bounds it by ``tolerance`` times
            the loss where the loss is above 1: a summed loss rounds at its own size).
        param_diff: the largest absolute difference over every parameter and buffer element (a forward-only
            run: over its buffers, what a forward changes; ``tensors`` then counts them).
        worst: the name of the tensor with that largest difference.
        steps: steps compared; tensors: tensors compared; tolerance: the bound used.
        output_diff: a forward-only run's (no ``loss_fn``): the largest absolute difference between
            ``run.outputs`` and the unsplit model's outputs over every step and output tensor (``loss_diff`` is
            then NaN: there is no loss); ``None`` for a training run.
        note: what the comparison could not make alike, with the fix (random draws: dropout), or how it did.
    """

    ok: bool
    loss_diff: float
    param_diff: float
    worst: str
    steps: int
    tensors: int
    tolerance: float
    output_diff: float | None = None
    note: str = ""

    def __str__(self) -> str:
        verdict = "matches" if self.ok else "DIFFERS from"
        note = f". {self.note}" if self.note else ""
        if self.output_diff is not None:
            buffers = (f"max |Δbuffer| {self.param_diff:.1e} over {self.tensors} buffers (worst: {self.worst})"
                       if self.tensors else "no buffers to compare")
            return (f"numerics: the forward-only run {verdict} the unsplit model run the same way: max |Δoutput| "
                    f"{self.output_diff:.1e} over {self.steps} steps, {buffers} (tolerance {self.tolerance:g}){note}")
        return (f"numerics: the run {verdict} the unsplit model trained the same way: max |Δloss| "
                f"{self.loss_diff:.1e} over {self.steps} steps, max |Δparam| {self.param_diff:.1e} over "
                f"{self.tensors} tensors (worst: {self.worst or '-'}; tolerance {self.tolerance:g}){note}")


REFERENCES = ("same microbatching", "whole batch")


@positional_legacy("tolerance", "device", "reference")
def check_numerics(run: Run, *, tolerance: float | None = None, device: str | torch.device = "cpu",
                   reference: str = "same microbatching") -> NumericsCheck:
    """Train the unsplit model as ``run`` trained its pipeline and compare.

    ``reference="whole batch"`` trains it instead on each step's whole batch at once with the loss the batch
    means: ``pv.cross_entropy``'s mean over every valid token of the step (target not -100). A run whose
    ``loss_reduction`` is ``"mean"`` averages each microbatch's own mean, which weighs a token of a microbatch
    with few valid tokens more: the check then says by how much it differs, and the fix
    (``loss_reduction="token_mean"``). A model with batch statistics (BatchNorm) or dropout differs on the whole
    batch in any case (its statistics and random draws follow the microbatches): check those with dropout 0.

    A forward-only run (no ``loss_fn``) is compared the same way: the unsplit model runs forward on the same
    batches and microbatches, and ``run.outputs`` is compared with its outputs (``output_diff``), and the
    run's buffers (running statistics) with its own.

    Args:
        run: a finished ``pv.Run`` (``run.wait()`` first).
        tolerance: the largest absolute difference accepted (default 1e-5, float32; under ``mixed_precision``
            2e-4 for bf16 and 5e-5 for fp16, ``MIXED_TOLERANCE``: the model in eager may round along another
            code path than its trace, whose stages pipeviz runs; with ``tp`` > 1, 2e-3 and 2.5e-4,
            ``MIXED_TP_TOLERANCE``: each shard rounds its partial sums before the all-reduce; see there).
        device: where the unsplit model trains.
        reference: ``"same microbatching"`` (default) or ``"whole batch"``.

    Raises:
        RuntimeError: the run has not finished successfully.
    """
    from pipeviz.runtime.reference import train_reference

    if run.status != "done":
        raise RuntimeError(f"check_numerics() needs a finished run; status is {run.status!r}. Fix: run.wait().")
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {', '.join(map(repr, REFERENCES))}, got {reference!r}.")
    spec, graph = run.spec, run.plan.graph
    if tolerance is None:
        mp = spec.config.mixed_precision
        tolerance = TOLERANCE if mp is None else (MIXED_TP_TOLERANCE if spec.tp > 1 else MIXED_TOLERANCE).get(
            mp, TOLERANCE)
    if spec.data is not None and run.batches is None:
        raise RuntimeError("check_numerics() needs the batches a data= run trained on; this run's were over "
                           "256 MiB, so it did not keep them. Fix: check a shorter run (steps=...).")
    k = spec.config.accumulate
    done = len(run.losses) if spec.loss_fn is not None else len(run.outputs)  # steps the run finished
    batches = run.batches[:done * k] if run.batches is not None else None
    model = graph.model
    if spec.sources is not None:  # weights= or a meta model: the values the ranks started from
        from pipeviz.capture.weights import materialize

        model = materialize(model, run.weights, spec.init_seed)
    draws = RunDraws(spec.init_seed, run.random_draws) if any(run.random_draws) else None
    if spec.loss_fn is None:
        check = _check_outputs(run, model, batches, tolerance, device, draws)
    else:
        assert spec.target is not None  # a training run's (validate_launch)
        whole = reference == "whole batch"
        from pipeviz.schedule.training import cross_entropy

        reduction = ("token_mean" if spec.loss_fn is cross_entropy else "mean") if whole else \
            spec.config.loss_reduction
        ref_rates: list[float] = []
        ref_evals: list[tuple[int, float]] = []
        ref_losses, ref_state = train_reference(
            model, spec.args, spec.target, loss_fn=spec.loss_fn, optimizer=spec.optimizer,
            microbatches=1 if whole else spec.microbatches * spec.dp,
            steps=spec.steps or len(run.losses), input_kwargs=spec.kwargs or None, fixups=graph.capture.fixups,
            device=device, batches=batches, replicas=1 if whole else spec.dp, draws=draws,
            clip_grad_norm=spec.config.clip_grad_norm, loss_reduction=reduction, accumulate=k,
            lr_scheduler=spec.config.lr_scheduler, learning_rates=ref_rates, eval_batches=spec.eval_batches,
            eval_every=spec.config.eval_every, eval_losses=ref_evals, resume=spec.resume,
            mixed_precision=_mixed(spec))

        check = compare_to_reference(run.losses, run.state_dict(), ref_losses, ref_state, tolerance)
        if ref_evals or run.eval_losses:  # the held-out losses count as losses (after the same steps)
            d_eval = max((abs(a - b) for (_, a), (_, b) in zip(run.eval_losses, ref_evals, strict=False)),
                         default=float("inf"))
            same = [s for s, _ in run.eval_losses] == [s for s, _ in ref_evals]
            check = replace(check, ok=check.ok and same and d_eval <= tolerance,
                            loss_diff=max(check.loss_diff, d_eval) if same else float("inf"))
        if whole and not check.ok and spec.config.loss_reduction == "mean" and spec.loss_fn is cross_entropy:
            check = replace(check, note=(
                f"Trained on the whole batch with its mean over every valid token, the unsplit model's losses "
                f"differ by up to {check.loss_diff:.2e} and its parameters by {check.param_diff:.2e}: the run "
                f"averages each of its {spec.microbatches * spec.dp} microbatches' own means, which weighs a token "
                "of a microbatch with fewer valid tokens (target not -100) more. Fix: "
                "loss_reduction='token_mean' (the sum over valid tokens over their count in the whole step)"))
    return replace(check, note=_randomness(run, draws, device)) if draws is not None else check


def _mixed(spec: LaunchSpec) -> torch.dtype | None:
    from pipeviz.runtime.spec import MIXED_PRECISION

    mp = spec.config.mixed_precision
    return MIXED_PRECISION[mp] if mp is not None else None


def _randomness(run: Run, draws: RunDraws, device: str | torch.device) -> str:
    """What the check says of a model that draws random numbers (dropout in training mode)."""
    n = sum(draws.per_stage)
    what = f"The model draws random numbers ({n} random ops per forward: dropout or the like)"
    fix = ("Fix: model.eval(), or dropout 0 in its config, for a check that compares computation only; "
           "training keeps dropout")
    if not draws.aligned:
        return (f"{what}, but the unsplit model's forward met {draws.seen} where the stages met {n} (code the trace "
                f"did not see?), so its draws could not be lined up and the differences include chance. {fix}")
    on = {torch.device(d).type for d in run.devices}
    if on != {torch.device(device).type}:
        return (f"{what}; the run drew them on {'/'.join(sorted(on))} and the reference on "
                f"{torch.device(device).type}, whose generators differ, so the differences include chance. Fix: "
                f"check_numerics(run, device=...) on the run's device type")
    return (f"{what}; each stage's forward was seeded per step and microbatch and the unsplit model drew the "
            "same numbers (pipeviz.runtime.rng), so dropout stays on and the comparison is exact")


def _check_outputs(run: Run, model: torch.nn.Module, batches: list[FedBatch] | None, tolerance: float,
                   device: str | torch.device, draws: RunDraws | None) -> NumericsCheck:
    """A forward-only run against the unsplit model run forward the same way."""
    from torch.utils import _pytree as pytree

    from pipeviz.runtime.reference import forward_reference

    spec = run.spec
    want, ref_state = forward_reference(model, spec.args, microbatches=spec.microbatches * spec.dp,
                                        steps=spec.steps or len(run.outputs), input_kwargs=spec.kwargs or None,
                                        fixups=run.plan.graph.capture.fixups, device=device, batches=batches,
                                        replicas=spec.dp, draws=draws)
    d_out = 0.0
    for got, ref in zip(run.outputs, want, strict=False):
        leaves = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
        if len(leaves) != len(ref) or any(a.shape != b.shape for a, b in zip(leaves, ref, strict=True)):
            d_out = float("inf")  # another structure than the model's output
            continue
        for a, b in zip(leaves, ref, strict=True):
            if b.numel():
                d_out = max(d_out, float((a.double() - b.double()).abs().max()))
    # what a forward changes: the buffers (running statistics); parameters stay as they were
    buffers = {name for name, _ in model.named_buffers()}
    check = compare_to_reference([], run.state_dict(), [], {k: v for k, v in ref_state.items() if k in buffers},
                                 tolerance)
    ok = len(run.outputs) == len(want) and d_out <= tolerance and check.param_diff <= tolerance
    return NumericsCheck(ok, float("nan"), check.param_diff, check.worst, len(want), check.tensors, tolerance,
                         output_diff=d_out)


def compare_to_reference(losses: list[float], state: dict[str, torch.Tensor], ref_losses: list[float],
            ref_state: dict[str, torch.Tensor], tolerance: float = TOLERANCE) -> NumericsCheck:
    """Compare a run's losses and state with the reference's (what ``check_numerics`` returns)."""
    d_loss = max((abs(a - b) for a, b in zip(losses, ref_losses, strict=False)), default=float("nan"))
    diffs: dict[str, float] = {}
    for name, want in ref_state.items():
        got: Any = state.get(name)
        if got is None:
            diffs[name] = float("inf")
        elif want.numel():
            diffs[name] = float((got.detach().double().cpu() - want.double()).abs().max())
    worst = max(diffs, key=diffs.__getitem__) if diffs else ""
    d_param = diffs.get(worst, 0.0)
    # A loss is compared relative to its size where it is above 1: a summed loss (loss_reduction="sum": hundreds,
    # one per token) rounds at its own magnitude in float32 (found by pipeviz fuzz: GPT-2, tp=2, sum, 1.5e-5 apart
    # on a loss in the hundreds, 2.4e-7 in the parameters); a mean loss near 1 keeps the absolute bound.
    losses_ok = all(abs(a - b) <= tolerance * max(1.0, abs(b)) for a, b in zip(losses, ref_losses, strict=False))
    ok = len(losses) == len(ref_losses) and losses_ok and not math.isnan(d_loss) and d_param <= tolerance
    return NumericsCheck(ok, d_loss, d_param, worst, len(ref_losses), len(diffs), tolerance)
