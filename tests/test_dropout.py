"""Dropout on, as a user trains: each rank seeds its stage forwards per step and microbatch and the reference draws
the same numbers (``pipeviz.runtime.rng``), so ``pv.check_numerics`` is exact, and says so; HF GPT-2 at its default
config
(dropout 0.1 in three places) failed the check before."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import pipeviz as pv
from pipeviz.runtime.rng import CountDraws, RunDraws


class DropMLP(nn.Module):
    """Dropout between layers and on a long skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.3)) for _ in range(4))
        self.skip_drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = layer(h)
        return self.head(h + self.skip_drop(x))


def test_gpt2_at_its_default_config_checks_exactly_with_dropout_on() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1  # the library's defaults
    model = transformers.GPT2LMHeadModel(config).train()
    x, y = torch.randint(0, 128, (8, 16)), torch.randint(0, 128, (8, 16))
    plan = pv.trace(model, (x,)).split(["transformer.h.1"])
    run = pv.launch(plan, schedule="1F1B", microbatches=2, steps=3, inputs=(x,), target=y, loss_fn=pv.cross_entropy)
    assert run.wait(300) == "done", run.error
    assert all(run.random_draws)  # both stages draw (embedding, attention and residual dropout)
    check = pv.check_numerics(run)
    assert check.ok, check
    assert check.loss_diff <= 1e-6 and "the comparison is exact" in check.note and "dropout" in str(check)
    # dropout really is on: the unsplit model trained with its own draws is far from the run
    unseeded, _ = pv.train_reference(model, (x,), y, loss_fn=pv.cross_entropy, optimizer=pv.sgd(lr=0.1),
                                     microbatches=2, steps=3)
    assert max(abs(a - b) for a, b in zip(unseeded, run.losses, strict=True)) > 1e-3


@pytest.mark.parametrize(("schedule", "dp", "stages"), [("GPipe", 2, 2), ("ZBVZeroBubble", 1, 4)])
def test_dropout_on_a_skip_under_replicas_and_a_split_backward(schedule: str, dp: int, stages: int) -> None:
    torch.manual_seed(0)
    model = DropMLP().train()
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    plan = pv.balance(pv.trace(model, (x,)), stages)
    run = pv.launch(plan, schedule=schedule, microbatches=4, steps=2, inputs=(x,), target=y,
                    loss_fn=pv.cross_entropy, dp=dp)
    assert run.wait(120) == "done", run.error
    assert sum(run.random_draws) == 5  # four layers' dropout and the skip's
    check = pv.check_numerics(run)
    assert check.ok, check


def test_a_forward_only_run_in_training_mode_draws_alike() -> None:
    torch.manual_seed(0)
    model = DropMLP().train()
    x = torch.randn(8, 16)
    run = pv.launch(pv.balance(pv.trace(model, (x,)), 2), schedule="GPipe", microbatches=2, steps=2, inputs=(x,))
    assert run.wait(120) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok and check.output_diff == 0.0, check


def test_eval_mode_draws_nothing_and_the_check_says_nothing_of_it() -> None:
    torch.manual_seed(0)
    model = DropMLP().eval()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    run = pv.launch(pv.balance(pv.trace(model, (x,)), 2), schedule="1F1B", microbatches=2, steps=1, inputs=(x,),
                    target=y, loss_fn=pv.cross_entropy)
    assert run.wait(120) == "done", run.error
    assert run.random_draws == (0, 0)
    check = pv.check_numerics(run)
    assert check.ok and check.note == "", check


def test_a_forward_the_stages_do_not_account_for_is_named() -> None:
    """The reference lines its draws up by counting random ops; a forward that meets more than the stages did
    (code the trace never saw) cannot be lined up, and says so."""
    model, x = DropMLP().train(), torch.randn(2, 16)
    with CountDraws() as counted:
        model(x)
    assert counted.count == 5
    draws = RunDraws(seed=0, per_stage=[2, 2])  # one op short
    with draws.forward(step=0, microbatch=0):
        model(x)
    assert not draws.aligned and draws.seen == 5
    exact = RunDraws(seed=0, per_stage=[3, 2])
    with exact.forward(step=0, microbatch=0):
        first = model(x)
    with exact.forward(step=0, microbatch=0):  # the same step and microbatch: the same masks
        assert torch.equal(model(x), first)
    assert exact.aligned


def test_a_shards_part_of_a_draw_is_that_part_of_the_whole_draw() -> None:
    """``drawn_part``: what a shard keeps (heads 2-3, or a sequence share) is the slice of the unsplit model's
    draw from the same generator state, and the generator ends where the unsplit model's does."""
    from pipeviz.runtime.rng import drawn_part

    like = torch.empty(0)
    torch.manual_seed(5)
    whole = torch.empty(2, 4, 6).bernoulli_(0.9)
    after = torch.rand(3)
    for part in ((slice(None), slice(2, 4)), (slice(None), slice(None), slice(3, 6))):
        torch.manual_seed(5)
        mine = drawn_part((2, 4, 6), part, lambda t: t.bernoulli_(0.9), like)
        assert torch.equal(mine, whole[part]) and torch.equal(torch.rand(3), after)


def _hf_default(kind: str, layers: int) -> Any:
    """A tiny HF model at its library's defaults but the sizes: GPT-2's and BERT's dropout 0.1, Llama's none."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
             "num_attention_heads": 4, "max_position_embeddings": 64}
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
        assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1
        return transformers.GPT2LMHeadModel(config).train()
    if kind == "bert":
        config = transformers.BertConfig(**small)
        assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == 0.1
        return transformers.BertForMaskedLM(config).train()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, num_key_value_heads=2)).train()


def _tp_run(kind: str, schedule: str, layers: int = 2, sequence_parallel: bool = False) -> pv.Run:
    model = _hf_default(kind, layers)
    ids = torch.randint(0, 128, (8, 16))
    graph = pv.trace(model, example_args=(ids,))
    blocks = [n for n in graph.layer_names if re.search(r"\.(layers|layer|h)\.\d+$", n)]
    plan = graph.split(blocks[:1] if schedule in ("GPipe", "1F1B") else blocks[:-1])
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), tp=2, sequence_parallel=sequence_parallel)
    assert run.wait(300) == "done", f"{kind} {schedule}: {run.error}"
    assert run.mesh == pv.Mesh(pp=2, tp=2)
    check = pv.check_numerics(run)
    assert check.ok and check.loss_diff <= 1e-6 and check.param_diff <= 1e-5, f"{kind} {schedule}: {check}"
    if kind != "llama":  # the shards drew (attention probabilities by heads, the stream by token) and lined up
        assert all(run.random_draws) and "the comparison is exact" in check.note, check.note
    return run


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "sequence_parallel"), [
    ("gpt2", False), ("bert", False), ("llama", False), ("gpt2", True),
    pytest.param("bert", True, marks=pytest.mark.compat)])  # make compat (CI): keeps make test within 10 minutes
def test_tensor_parallel_runs_with_dropout_on_check_exactly(kind: str, sequence_parallel: bool) -> None:
    """pp 2 x tp 2 (4 processes) at the models' default configs under 1F1B: each shard keeps its part of the
    unsplit model's masks, so ``check_numerics`` is exact (before: 4.5e-04 off on BERT, each shard drawing its
    own). Under sequence parallelism the residual stream's dropout is split by token: the same masks."""
    _tp_run(kind, "1F1B", sequence_parallel=sequence_parallel)


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes
@pytest.mark.parametrize(("kind", "schedule"), [
    ("gpt2", "GPipe"), ("gpt2", "Interleaved1F1B"), ("gpt2", "ZBVZeroBubble"), ("bert", "InterleavedZeroBubble"),
    ("bert", "DualPipeV"), ("llama", "LoopedBFS")])
def test_tensor_parallel_dropout_is_exact_under_more_schedules(kind: str, schedule: str) -> None:
    _tp_run(kind, schedule, layers=2 if schedule == "GPipe" else 4)
