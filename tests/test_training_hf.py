"""Every training option of ``LaunchConfig`` together on the models people train, with replicas and with
tensor-parallel shards: accumulation, a token mean over the whole step, clipping by the global norm, recomputation,
fp16 with its loss scale, the overlapped reduction, each exact against the unsplit model trained the same way
(``pv.check_numerics``). HF Llama under tensor parallelism in ``make test``; the other models and layouts in
``make compat``."""

from __future__ import annotations

import re

import pytest
import torch

import pipeviz as pv

pytest.importorskip("transformers")

from tests.test_tensor_parallel_hf import _model  # the same tiny configs at their libraries' defaults

ALL_OPTIONS: dict[str, object] = {"accumulate": 2, "clip_grad_norm": 0.5, "loss_reduction": "token_mean",
                                  "recompute": "full"}


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
