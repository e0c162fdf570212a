"""Every training option of ``LaunchConfig`` together on the models people train, with replicas and with
tensor-parallel shards: accumulation, a token mean over the whole step, clipping by the global norm, recomputation,
fp16 with its loss scale, the overlapped reduction, each exact against the unsplit model trained the same way
(``pv.check_numerics``). HF Llama under tensor parallelism in ``make test``; the other models and layouts in
``make compat``."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import pipeviz as pv

transformers = pytest.importorskip("transformers")

_SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 64}
ALL_OPTIONS: dict[str, object] = {"accumulate": 2, "clip_grad_norm": 0.5, "loss_reduction": "token_mean",
                                  "recompute": "full"}


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL, num_key_value_heads=2))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**_SMALL, num_key_value_heads=2,
                                                                          sliding_window=8))
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**_SMALL, hidden_dropout_prob=0.0,
                                                                    attention_probs_dropout_prob=0.0))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _train(kind: str, **layout: object) -> None:
    model = _model(kind)
    ids = torch.randint(0, 128, (8, 16))
    target = ids.clone()
    target[:, :3] = -100  # unequal valid tokens per microbatch would not show: the first three of every row
    target[0, 3:9] = -100  # ... so one row has fewer: the token mean must count them over the whole step
    graph = pv.trace(model, example_args=(ids,))
    blocks = [n for n in graph.layer_names if re.search(r"\.(layers|layer|h)\.\d+$", n)]
    run = pv.launch(graph.split([blocks[1]]), "1F1B", 2, steps=2, inputs=(ids,), target=target,
                    loss_fn=pv.cross_entropy, optimizer=pv.sgd(lr=0.1), **ALL_OPTIONS, **layout)
    assert run.wait(300) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok, check
    assert len(run.grad_norms) == 2


@pytest.mark.slow
def test_llama_trains_with_every_option_under_tensor_parallelism() -> None:
    _train("llama", tp=2)


@pytest.mark.compat
@pytest.mark.parametrize(("kind", "layout"), [
    ("llama", {"dp": 2, "mixed_precision": "fp16"}), ("mistral", {"tp": 2}), ("gpt2", {"tp": 2}),
    ("bert", {"tp": 2}), ("gpt2", {"dp": 2})])
def test_hf_models_train_with_every_option(kind: str, layout: dict[str, object]) -> None:
    _train(kind, **layout)
