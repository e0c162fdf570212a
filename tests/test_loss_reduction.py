"""How a step's loss is reduced over its tokens (``loss_reduction``): torch's schedules average each microbatch's
own mean, which weighs a token of a microbatch with few valid tokens (target not -100) more than the whole batch's
token mean does (pytorch/torchtitan#2972). ``"token_mean"`` divides the step's summed loss by the count of valid
tokens over every microbatch and replica, ``"sum"`` keeps the sum; ``pv.check_numerics(run, reference="whole
batch")`` compares with the unsplit model trained on each whole batch and names the difference and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeviz as pv


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.l1, self.l2 = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(self.emb(ids))))))


def _batch() -> tuple[TinyLM, torch.Tensor, torch.Tensor]:
    """8 sequences of 6 tokens; sequence r has r + 1 valid targets (padding is -100), so the 4 microbatches of
    2 hold 3, 7, 11 and 15 valid tokens: their means weigh a token 5x apart."""
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, 16, (8, 6))
    target = torch.randint(0, 16, (8, 6))
    for r in range(8):
        target[r, min(r + 1, 6):] = -100
    return model, ids, target


def _run(reduction: str, schedule: str = "1F1B", **layout: object) -> pv.Run:
    model, ids, target = _batch()
    graph = pv.trace(model, example_args=(ids,))
    plan = graph.split(["l1"] if schedule in ("GPipe", "1F1B") else ["emb", "l1", "l2"])
    if layout.get("tp"):
        plan = graph.split(["l2"])
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.5), loss_reduction=reduction, **layout)
    assert run.wait(240) == "done", run.error
    return run


@pytest.mark.slow
def test_a_per_microbatch_mean_is_caught_against_the_whole_batch() -> None:
    """The planted bug: today's default trains exactly like the unsplit model microbatched the same way, and
    unlike the unsplit model on the whole batch; the check says by how much and names the fix."""
    run = _run("mean")
    assert pv.check_numerics(run).ok
    whole = pv.check_numerics(run, reference="whole batch")
    assert not whole.ok and whole.loss_diff > 1e-3, whole
    assert "Fix: loss_reduction='token_mean'" in whole.note and "averages each of its 4 microbatches" in whole.note


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "layout"), [
    ("1F1B", {}), ("Interleaved1F1B", {}), ("ZBVZeroBubble", {}), ("1F1B", {"dp": 2}),
    ("1F1B", {"tp": 2, "tp_plan": {"l1": "colwise", "l2": "rowwise"}}),
    *[pytest.param(s, {}, marks=(pytest.mark.compat, pytest.mark.coverage))
      for s in ("GPipe", "LoopedBFS", "InterleavedZeroBubble", "DualPipeV")]])
def test_a_token_mean_trains_like_the_whole_batch(schedule: str, layout: dict[str, object]) -> None:
    """Every valid token of the step weighs the same, over microbatches, stages per rank, replicas and shards."""
    run = _run("token_mean", schedule, **layout)
    assert pv.check_numerics(run).ok
    whole = pv.check_numerics(run, reference="whole batch")
    assert whole.ok and whole.loss_diff <= 1e-5 and whole.note == "", whole
    # the run's loss is the whole batch's token mean
    model, ids, target = _batch()
    with torch.no_grad():
        expected = float(pv.cross_entropy(model(ids), target))
    assert run.losses[0] == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_a_sum_trains_like_the_unsplit_models_sum() -> None:
    run = _run("sum", dp=2)
    assert pv.check_numerics(run).ok
    model, ids, target = _batch()
    with torch.no_grad():
        total = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 16), target.reshape(-1), reduction="sum")
    assert run.losses[0] == pytest.approx(float(total), rel=1e-5)


def test_a_reduction_that_cannot_work_is_refused_before_any_process() -> None:
    model, ids, target = _batch()
    plan = pv.trace(model, example_args=(ids,)).split(["l1"])
    kw = {"inputs": (ids,), "target": target}
    with pytest.raises(pv.LaunchError, match=r"loss_reduction must be one of 'mean', 'sum', 'token_mean', got "
                                             r"'tokens'"):
        pv.launch(plan, "1F1B", 4, steps=1, loss_fn=pv.cross_entropy, loss_reduction="tokens", **kw)
    mse = torch.nn.functional.mse_loss
    with pytest.raises(pv.LaunchError, match=r"loss_reduction='token_mean' reduces pv.cross_entropy's per-token "
                                             r"losses, but loss_fn is 'mse_loss'. Fix: loss_fn=pv.cross_entropy"):
        pv.launch(plan, "1F1B", 4, steps=1, loss_fn=mse, loss_reduction="token_mean", **kw)
    run_like = pv.LaunchConfig(loss_fn=pv.cross_entropy, loss_reduction="token_mean")
    assert run_like.loss_reduction == "token_mean"


def test_the_explorer_keeps_the_training_options_and_its_infer_mode_runs_without_them() -> None:
    """An Explorer built with a token mean and a clip launches them in train mode; in infer mode (no loss) the
    same settings are neither refused nor sent."""
    pytest.importorskip("ipywidgets")
    model, ids, _ = _batch()
    ex = pv.Explorer(model, example_args=(ids,), loss_reduction="token_mean", clip_grad_norm=0.5)
    ex.click(ex.plan.graph.split_candidates[0])  # (a fresh Explorer has one stage, which Launch refuses)
    cfg = ex.launch_config()
    assert cfg.loss_reduction == "token_mean" and cfg.clip_grad_norm == 0.5 and ex.refusal is None
    ex.mode.value = "infer"
    assert ex.refusal is None and ex.launch_config().clip_grad_norm is None and ex.launch_config().loss_fn is None
