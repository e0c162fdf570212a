"""Gradient accumulation (``accumulate=k``): each optimizer step runs the schedule on k batches, their gradients
summed, then one clip and one optimizer step: exactly the unsplit model trained on the k batches as one batch.
torch's ``scale_grads`` divides every gradient at the end of each ``schedule.step`` (the earlier batches' too:
torchtitan PR #1732), so pipeviz scales each microbatch's loss instead; replicas reduce once per step."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.runtime.numerics import compare_to_reference
from pipeviz.schedule import traits as schedules
from tests.models import TiedSkipBN

K = 2  # batches per optimizer step
M = 4  # microbatches per batch


def _batches(n: int, pad: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n batches of 16 sequences of 4 tokens; with ``pad`` sequence r of batch b has 1 + r (b + 1) % 4 valid
    targets (the rest -100): microbatches and batches hold different counts of valid tokens (40, 32, 40, 28)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for b in range(n):
        ids, target = torch.randint(0, 16, (16, 4), generator=g), torch.randint(0, 16, (16, 4), generator=g)
        if pad:
            for r in range(16):
                target[r, 1 + r * (b + 1) % 4:] = -100
        out.append((ids, target))
    return out


def _plan(schedule: str) -> pv.SplitPlan:
    torch.manual_seed(0)
    graph = pv.trace(TiedSkipBN(), example_args=(torch.randint(0, 16, (16, 4)),))
    return graph.split(["l1", "bn", "l2"] if schedules.info(schedule).multi else ["bn"])


def _as_one(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[tuple[object, ...], dict[str, object],
                                                                             object]]:
    """Each step's k batches joined into one batch (what accumulation must equal)."""
    return [((torch.cat([b[0] for b in batches[i:i + K]]),), {}, torch.cat([b[1] for b in batches[i:i + K]]))
            for i in range(0, len(batches), K)]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "layout"), [
    ("1F1B", {}), ("Interleaved1F1B", {}), ("ZBVZeroBubble", {}), ("DualPipeV", {}), ("1F1B", {"dp": 2}),
    ("GPipe", {"dp": 2, "dp_shard": True}),
    ("Interleaved1F1B", {"tp": 2, "tp_plan": {"l2": "colwise", "l3": "rowwise"}, "clip_grad_norm": 0.05}),
    pytest.param("LoopedBFS", {}, marks=(pytest.mark.compat, pytest.mark.coverage)),
    pytest.param("InterleavedZeroBubble", {}, marks=(pytest.mark.compat, pytest.mark.coverage))])
def test_accumulated_batches_train_as_one_batch(schedule: str, layout: dict[str, object]) -> None:
    """Tied weights on two stages, a skip and BatchNorm; one and several stages per rank, split backwards,
    replicas (DDP, FSDP2), shards with clipping: the same losses and update as the unsplit model on the k batches
    joined into one (microbatched alike), and as ``pv.check_numerics``'s reference."""
    plan = _plan(schedule)
    data = _batches(2 * K)
    run = pv.launch(plan, schedule, M, steps=None, data=iter(data), loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), accumulate=K, **layout)
    assert run.wait(300) == "done", run.error
    assert len(run.losses) == 2
    check = pv.check_numerics(run)
    assert check.ok and check.param_diff <= 1e-5, check
    dp = int(layout.get("dp", 1))  # type: ignore[call-overload]
    losses, state = pv.train_reference(plan.graph.model, (), data[0][1], loss_fn=pv.cross_entropy,
                                       optimizer=pv.sgd(lr=0.1), microbatches=K * M * dp, replicas=dp,
                                       batches=_as_one(data), fixups=plan.graph.capture.fixups,
                                       clip_grad_norm=layout.get("clip_grad_norm"))  # type: ignore[arg-type]
    if dp == 1:  # (with replicas the joined batch's microbatches fall to other replicas: running statistics differ)
        one = compare_to_reference(run.losses, run.state_dict(), losses, state)
        assert one.ok, one
    assert run.losses == pytest.approx(losses, abs=1e-5)
    # the timeline numbers an accumulated step's microbatches on: k x microbatches per step
    forwards = {(e.step, e.mb) for e in run.events if e.kind == "F" and e.stage == 0}
    assert forwards == {(s, mb) for s in range(2) for mb in range(K * M)}


@pytest.mark.slow
def test_replicas_reduce_once_per_step_not_per_batch() -> None:
    """DDP's all-reduce runs in the last accumulated batch's backward only: as many DP events per step as
    without accumulation."""
    plan = _plan("1F1B")
    counts = []
    for k in (1, 3):
        run = pv.launch(plan, "1F1B", M, steps=2, inputs=(_batches(1)[0][0],), target=_batches(1)[0][1],
                        loss_fn=pv.cross_entropy, dp=2, accumulate=k)
        assert run.wait(300) == "done", run.error
        assert pv.check_numerics(run).ok
        counts.append(sum(1 for e in run.events if e.kind == "DP"))
    assert counts[0] == counts[1] > 0, counts


@pytest.mark.slow
def test_token_mean_counts_every_accumulated_batch() -> None:
    """Batches with 40, 32, 40 and 28 valid tokens: the token mean divides by the step's count over both batches, as
    the whole batch's token mean does (a model without batch statistics: the whole batch matches too); a mean
    per microbatch is caught against the whole batch."""
    from tests.test_loss_reduction import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    data = _batches(2 * K, pad=True)
    plan = pv.trace(model, example_args=(data[0][0],)).split(["l1"])
    for reduction in ("token_mean", "mean"):
        run = pv.launch(plan, "1F1B", M, steps=None, data=iter(data), loss_fn=pv.cross_entropy,
                        optimizer=pv.sgd(lr=0.5), accumulate=K, loss_reduction=reduction)
        assert run.wait(240) == "done", run.error
        assert pv.check_numerics(run).ok
        whole = pv.check_numerics(run, reference="whole batch")
        if reduction == "token_mean":
            assert whole.ok, whole
            losses, _ = pv.train_reference(model, (), data[0][1], loss_fn=pv.cross_entropy,
                                           optimizer=pv.sgd(lr=0.5), batches=_as_one(data))
            assert run.losses == pytest.approx(losses, abs=1e-5)
        else:
            assert not whole.ok and "loss_reduction='token_mean'" in whole.note, whole


@pytest.mark.slow
def test_a_short_last_step_is_left_out() -> None:
    """data= ending inside a step (5 batches at k = 2): two whole steps train, the fifth batch is not used."""
    plan = _plan("GPipe")
    run = pv.launch(plan, "GPipe", M, steps=None, data=iter(_batches(5)), loss_fn=pv.cross_entropy, accumulate=K)
    assert run.wait(240) == "done", run.error
    assert len(run.losses) == 2 and pv.check_numerics(run).ok


def test_bad_accumulation_is_refused_before_any_process() -> None:
    plan = _plan("GPipe")
    ids, target = _batches(1)[0]
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(pv.LaunchError, match=r"accumulate must be a positive int .* got .*Fix: accumulate=4"):
            pv.launch(plan, "GPipe", M, inputs=(ids,), target=target, loss_fn=pv.cross_entropy, accumulate=bad)
    with pytest.raises(pv.LaunchError, match="accumulate=2 was given without a loss_fn"):
        pv.launch(plan, "GPipe", M, inputs=(ids,), accumulate=2)
