"""Gradient clipping by global norm (``clip_grad_norm``) across every stage, replica and shard: the norm is the
unsplit model's ``torch.nn.utils.clip_grad_norm_`` (each parameter counted once: tied weights, replicas and
replicated shards too), every gradient scaled by the same factor, ``run.grad_norms`` one norm per step."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from tests.models import TiedSkipBN

CLIP = 0.05  # far under these models' norms (0.3-2): every step clips


def _unsplit_norms(run: pv.Run) -> list[float]:
    """The unsplit model's norms, trained the run's way (``pv.train_reference`` with the same clipping)."""
    spec = run.spec
    assert spec.target is not None and spec.loss_fn is not None
    norms: list[float] = []
    pv.train_reference(run.plan.graph.model, spec.args, spec.target, loss_fn=spec.loss_fn, optimizer=spec.optimizer,
                       microbatches=spec.microbatches * spec.dp, steps=len(run.losses), replicas=spec.dp,
                       fixups=run.plan.graph.capture.fixups, clip_grad_norm=CLIP, grad_norms=norms)
    return norms


def _tied_skip_bn() -> tuple[pv.SplitPlan, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TiedSkipBN()
    ids, target = torch.randint(0, 16, (16, 4)), torch.randint(0, 16, (16, 4))
    return pv.trace(model, example_args=(ids,)).split(["l1", "bn", "l2"]), ids, target


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "layout"), [
    ("1F1B", {}), ("Interleaved1F1B", {}), ("ZBVZeroBubble", {}), ("1F1B", {"dp": 2}),
    ("Interleaved1F1B", {"tp": 2, "tp_plan": {"l2": "colwise", "l3": "rowwise"}}),
    *[pytest.param(s, {}, marks=(pytest.mark.compat, pytest.mark.coverage))
      for s in ("GPipe", "LoopedBFS", "InterleavedZeroBubble", "DualPipeV")]])
def test_clipping_by_global_norm_trains_like_clip_grad_norm_on_the_unsplit_model(
        schedule: str, layout: dict[str, object]) -> None:
    """Tied weights on two stages, a skip and BatchNorm; one and several stages per rank, a split backward,
    replicas, shards: the same norm and the same update as the unsplit model's."""
    plan, ids, target = _tied_skip_bn()
    if schedule in ("1F1B", "GPipe"):
        plan = plan.graph.split(["bn"])
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), clip_grad_norm=CLIP, **layout)
    assert run.wait(240) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok and check.param_diff <= 1e-5, check
    expected = _unsplit_norms(run)
    assert len(run.grad_norms) == 2 and all(n > 5 * CLIP for n in expected), (run.grad_norms, expected)
    assert run.grad_norms == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_without_clipping_the_unsplit_model_would_differ() -> None:
    """The check above can fail: the same run unclipped is not what the clipped unsplit model trains."""
    plan, ids, target = _tied_skip_bn()
    plan = plan.graph.split(["bn"])
    run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1))
    assert run.wait(240) == "done", run.error
    assert run.grad_norms == []
    _, clipped = pv.train_reference(plan.graph.model, (ids,), target, loss_fn=pv.cross_entropy, microbatches=4,
                                    steps=2, clip_grad_norm=CLIP)
    state = run.state_dict()
    assert max(float((state[k] - v).abs().max()) for k, v in clipped.items() if v.is_floating_point()) > 1e-3


def test_a_clip_that_cannot_work_is_refused_before_any_process() -> None:
    plan, ids, target = _tied_skip_bn()
    kw = {"inputs": (ids,), "target": target, "loss_fn": pv.cross_entropy}
    for bad in (0, -1.0, float("inf"), True, "1.0"):
        with pytest.raises(pv.LaunchError, match=r"clip_grad_norm must be a positive number .* got .*Fix: "
                                                 r"clip_grad_norm=1.0, or None"):
            pv.launch(plan, "GPipe", 4, steps=1, clip_grad_norm=bad, **kw)
    with pytest.raises(pv.LaunchError, match="clip_grad_norm= was given without a loss_fn"):
        pv.launch(plan, "GPipe", 4, steps=1, inputs=(ids,), clip_grad_norm=1.0)
