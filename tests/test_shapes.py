"""Batches that change shape (``data=`` with another sequence length per batch: padded buckets): each new shape is
traced again in the launching process and its stages bound to the parameters the ranks already train
(``pipeviz.runtime.shapes``). Exact against the unsplit model trained on the same batches, under three schedules,
on a plain-torch model with a tied head, a skip and BatchNorm, and on an HF Llama."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz import zoo
from pipeviz.schedule import traits as schedules
from tests.models import TiedSkipBN

M = 4  # microbatches
LENGTHS = (4, 6, 4, 8)  # each batch's sequence length: three shapes, the first met again


def _batches(vocab: int, lengths: tuple[int, ...] = LENGTHS, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, vocab, (rows, s), generator=g), torch.randint(0, vocab, (rows, s), generator=g))
            for s in lengths]


def _train(plan: pv.SplitPlan, schedule: str, data: list[tuple[torch.Tensor, torch.Tensor]], **options: object,
           ) -> pv.Run:
    run = pv.launch(plan, schedule, M, steps=None, data=iter(data), loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), **options)  # type: ignore[arg-type]
    assert run.wait(300) == "done", run.error
    assert len(run.losses) == len(data)
    check = pv.check_numerics(run)
    assert check.ok and check.param_diff <= 1e-5 and check.loss_diff <= 1e-5, check
    return run


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_batches_of_several_lengths_train_like_the_unsplit_model(schedule: str) -> None:
    """Tied embedding and head on two stages, a skip and BatchNorm: every step exact, and the stages were built
    once per shape (the run's phases say so, with the time it took)."""
    torch.manual_seed(0)
    graph = pv.trace(TiedSkipBN(), example_args=(torch.randint(0, 16, (8, 4)),))
    plan = graph.split(["l1", "bn", "l2"] if schedules.info(schedule).multi else ["bn"])
    run = _train(plan, schedule, _batches(16))
    traced = [text for _, text in run.phases if "traced for it" in text]  # in the launching process
    built = [text for _, text in run.phases if "stages built" in text]  # on each rank (rank 0 says)
    assert run.input_shapes == 3 and len(traced) == len(built) == 2, run.phases
    assert "input shape 2 ((8, 6)) at data= batch 1" in traced[0] and "(8, 6)" in built[0]
    assert "input shape 3 ((8, 8)) at data= batch 3" in traced[1] and "input shape 3" in built[1]
    # each step's forwards ran every microbatch, whatever its shape
    assert {(e.step, e.mb) for e in run.events if e.kind == "F" and e.stage == 0} == \
        {(s, mb) for s in range(len(LENGTHS)) for mb in range(M)}


@pytest.mark.slow
# 1F1B in `make test`; GPipe and ZBV (8-17 s each on 2 cores) in `make compat`, which CI runs too.
@pytest.mark.parametrize("schedule", [pytest.param("GPipe", marks=pytest.mark.compat), "1F1B",
                                      pytest.param("ZBVZeroBubble", marks=pytest.mark.compat)])
def test_an_hf_llama_trains_on_padded_buckets(schedule: str) -> None:
    """HF ``LlamaForCausalLM`` (RoPE, grouped-query attention, its causal mask built from the sequence length):
    batches padded to buckets of 8, 16 and 12 tokens, the padding's targets -100, trained under a token-normalised
    loss; every step exact against the unsplit model on the same batches."""
    torch.manual_seed(0)
    model = zoo.llama(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=64)
    data = _batches(64, (8, 16, 12))
    for _, target in data:  # a bucket's shorter sequences: padded, their padding ignored by the loss
        target[::2, -3:] = -100
    graph = pv.trace(model, example_args=(data[0][0],))
    plan = pv.balance(graph, 4 if schedules.info(schedule).multi else 2, by="params")
    run = _train(plan, schedule, data, loss_reduction="token_mean")
    assert run.input_shapes == 3 and sum("stages built" in text for _, text in run.phases) == 2


@pytest.mark.slow
def test_replicas_and_forward_only_runs_take_several_lengths() -> None:
    """Two replicas (their gradients averaged as the first shape's stages average them) and a forward-only run:
    exact on every shape."""
    torch.manual_seed(0)
    graph = pv.trace(TiedSkipBN(), example_args=(torch.randint(0, 16, (8, 4)),))
    plan = graph.split(["bn"])
    _train(plan, "1F1B", _batches(16), dp=2)
    inputs = [ids for ids, _ in _batches(16)]
    run = pv.launch(plan, "GPipe", M, steps=None, data=iter(inputs))
    assert run.wait(120) == "done", run.error
    assert [tuple(o.shape) for o in run.outputs] == [(8, s, 16) for s in LENGTHS]
    check = pv.check_numerics(run)
    assert check.ok and check.output_diff <= 1e-5, check


@pytest.mark.slow
def test_what_cannot_take_another_shape_fails_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor-parallel shards are placed once: a batch of another shape fails the run (the steps before it
    trained), naming the shapes and the fix; a run meeting more shapes than ``MAX_SHAPES`` fails the same way."""
    from pipeviz.runtime import feed

    torch.manual_seed(0)
    graph = pv.trace(TiedSkipBN(), example_args=(torch.randint(0, 16, (8, 4)),))
    plan = graph.split(["bn"])
    run = pv.launch(plan, "1F1B", M, steps=None, data=iter(_batches(16)), loss_fn=pv.cross_entropy,
                    tp=2, tp_plan={"l2": "colwise", "l3": "rowwise"})
    assert run.wait(120) == "failed"
    assert "another shape ((8, 6); the run started with (8, 4))" in run.error and "tp > 1" in run.error
    assert "Fix: pad every batch to one shape" in run.error and len(run.losses) == 1
    monkeypatch.setattr(feed, "MAX_SHAPES", 2)
    run = pv.launch(plan, "1F1B", M, steps=None, data=iter(_batches(16)), loss_fn=pv.cross_entropy)
    assert run.wait(120) == "failed"
    assert "data= batch 3 is the 3th input shape" in run.error and "Fix: pad the batches" in run.error
    assert len(run.losses) == 3
