"""Learning-rate schedulers (``lr_scheduler=``: a factory around each rank's optimizer, stepped after it) and
evaluation (``eval_data=`` held-out batches every ``eval_every`` steps: a forward-only pass through the pipeline,
``run.eval_losses``), exact against the unsplit model under every schedule."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.runtime.reference import train_reference
from pipeviz.schedule import traits as schedules
from tests.models import TiedSkipBN

M = 4


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 16, (16, 4), generator=g), torch.randint(0, 16, (16, 4), generator=g))
            for _ in range(n)]


def _plan(schedule: str) -> pv.SplitPlan:
    torch.manual_seed(0)
    graph = pv.trace(TiedSkipBN(), example_args=(torch.randint(0, 16, (16, 4)),))
    return graph.split(["l1", "bn", "l2"] if schedules.info(schedule).multi else ["bn"])


def _expected(run: pv.Run, data: list[tuple[torch.Tensor, torch.Tensor]], held_out: list[tuple[torch.Tensor,
              torch.Tensor]]) -> tuple[list[float], list[float], list[tuple[int, float]]]:
    """The unsplit model's losses, learning rates and held-out losses, trained the run's way."""
    spec = run.spec
    rates: list[float] = []
    evals: list[tuple[int, float]] = []
    losses, _ = train_reference(run.plan.graph.model, (), data[0][1], loss_fn=pv.cross_entropy,
                                optimizer=spec.optimizer, microbatches=M * spec.dp, replicas=spec.dp,
                                batches=[((x,), {}, y) for x, y in data], fixups=run.plan.graph.capture.fixups,
                                lr_scheduler=spec.config.lr_scheduler, learning_rates=rates,
                                eval_batches=[((x,), {}, y) for x, y in held_out], eval_every=spec.config.eval_every,
                                eval_losses=evals, accumulate=spec.config.accumulate)
    return losses, rates, evals


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "layout"), [
    ("1F1B", {}), ("Interleaved1F1B", {}), ("ZBVZeroBubble", {}), ("DualPipeV", {}),
    ("1F1B", {"dp": 2, "accumulate": 2}), ("Interleaved1F1B", {"tp": 2, "tp_plan": {"l2": "colwise", "l3": "rowwise"}}),
    # (make compat: keeps make test within 10 minutes)
    pytest.param("GPipe", {}, marks=pytest.mark.compat), pytest.param("LoopedBFS", {}, marks=pytest.mark.compat),
    pytest.param("InterleavedZeroBubble", {}, marks=pytest.mark.compat)])
def test_scheduled_rates_and_held_out_losses_match_the_unsplit_model(schedule: str,
                                                                     layout: dict[str, object]) -> None:
    """Tied weights on two stages, a skip and BatchNorm (whose running statistics an evaluation must leave as
    training had them): every step's rate, every held-out loss and the trained parameters and buffers as the
    unsplit model's."""
    data, held_out = _batches(8), _batches(10)[8:]
    run = pv.launch(_plan(schedule), schedule, M, steps=None, data=iter(data), eval_data=held_out, eval_every=2,
                    loss_fn=pv.cross_entropy, optimizer=pv.sgd(lr=0.2), lr_scheduler=pv.warmup_cosine(2, 4),
                    **layout)
    assert run.wait(300) == "done", run.error
    steps = 8 // int(layout.get("accumulate", 1))  # type: ignore[call-overload]
    check = pv.check_numerics(run)
    assert check.ok, check
    losses, rates, evals = _expected(run, data, held_out)
    assert run.losses == pytest.approx(losses, abs=1e-5)
    assert run.learning_rates == pytest.approx(rates, abs=1e-12) and len(rates) == steps
    assert rates[:3] == pytest.approx([0.1, 0.2, 0.2]) and rates[-1] < 0.2  # warm-up, then the cosine
    assert [s for s, _ in run.eval_losses] == [s for s, _ in evals] == list(range(1, steps, 2))
    assert [v for _, v in run.eval_losses] == pytest.approx([v for _, v in evals], abs=1e-5)
    assert {e.step for e in run.events if e.kind == "EVAL"} == {s for s, _ in evals}


@pytest.mark.slow
def test_the_check_sees_a_wrong_held_out_loss_and_the_last_step_is_evaluated() -> None:
    """eval_every=None evaluates after the last step only (odd step counts too); check_numerics fails when a
    held-out loss differs from the unsplit model's."""
    data, held_out = _batches(3), _batches(5)[3:]
    run = pv.launch(_plan("1F1B"), "1F1B", M, steps=None, data=iter(data), eval_data=held_out,
                    loss_fn=pv.cross_entropy)
    assert run.wait(240) == "done", run.error
    assert [s for s, _ in run.eval_losses] == [2]
    assert pv.check_numerics(run).ok
    run.eval_losses[0] = (2, run.eval_losses[0][1] + 1e-3)
    bad = pv.check_numerics(run)
    assert not bad.ok and bad.loss_diff == pytest.approx(1e-3, rel=1e-2), bad


def test_bad_schedulers_and_evaluations_are_refused_before_any_process() -> None:
    plan = _plan("GPipe")
    x, y = _batches(1)[0]
    kw: dict[str, object] = {"inputs": (x,), "target": y, "loss_fn": pv.cross_entropy}
    with pytest.raises(pv.LaunchError, match=r"lr_scheduler must be a factory optimizer -> LRScheduler.*Fix: "
                                             r"lr_scheduler=pv.warmup_cosine"):
        pv.launch(plan, "GPipe", M, lr_scheduler=3, **kw)  # type: ignore[arg-type]
    with pytest.raises(pv.LaunchError, match=r"lr_scheduler\(optimizer\) fails on a dummy optimizer"):
        pv.launch(plan, "GPipe", M, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt), **kw)
    with pytest.raises(pv.LaunchError, match="eval_every must be a positive int"):
        pv.launch(plan, "GPipe", M, eval_data=[(x, y)], eval_every=0, **kw)
    with pytest.raises(pv.LaunchError, match="eval_every=2 was given without eval_data="):
        pv.launch(plan, "GPipe", M, eval_every=2, **kw)
    with pytest.raises(pv.LaunchError, match=r"eval_data= batch 1: inputs\[0\] is \(8, 4\) torch.int64, but the run "
                                             r"started with \(16, 4\)"):
        pv.launch(plan, "GPipe", M, eval_data=[(x, y), (x[:8], y[:8])], **kw)
    with pytest.raises(pv.LaunchError, match="without a loss_fn"):
        pv.launch(plan, "GPipe", M, inputs=(x,), eval_data=[(x, y)])
    with pytest.raises(ValueError, match=r"warmup_cosine needs 0 <= warmup <= steps"):
        pv.warmup_cosine(5, 2)
