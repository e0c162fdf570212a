"""HF models from tiny configs (random weights, nothing downloaded)."""

from __future__ import annotations

import warnings

import pytest
import torch

import pipeviz as pv
from pipeviz import zoo

pytest.importorskip("transformers")


@pytest.mark.slow
def test_gpt2_tiny_blocks_and_cache_fix() -> None:
    torch.manual_seed(0)
    model = zoo.gpt2(n_layer=3)
    ids = torch.randint(0, 128, (4, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = pv.trace(model, example_args=(ids,))
    assert not [w for w in caught if "pipeviz" in w.filename]  # a note, not a warning pointing into pipeviz
    assert any("use_cache=False" in n and "your model is unchanged" in n for n in graph.notes), graph.notes
    assert model.config.use_cache is True  # the user's model is untouched
    # Dropout is glue between layers, not a layer (it stays a valid split point).
    assert graph.layer_names == ("transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                                 "transformer.h.2", "transformer.ln_f", "lm_head")
    assert "transformer.drop" in graph.split_candidates
    assert graph.layer("lm_head").shared == ("transformer.wte.weight",)
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    plan = graph.split(["transformer.h.0", "transformer.h.1"])
    assert [s.layers[-1] for s in plan.stages] == ["transformer.h.0", "transformer.h.1", "lm_head"]
    pipe = plan.pipe(microbatches=2)
    with torch.no_grad():
        got = pipe(ids[:2])
        want = model(ids[:2], use_cache=False).logits
    torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, want, rtol=1e-5, atol=1e-5)


def test_gpt2_cache_error_when_forced() -> None:
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(pv.TraceError, match=r"set model.config.use_cache = False"):
        pv.trace(zoo.gpt2(), example_args=(ids,), example_kwargs={"use_cache": True})


def test_bert_tiny_with_attention_mask() -> None:
    torch.manual_seed(0)
    model = zoo.bert(num_hidden_layers=3)
    ids = torch.randint(0, 128, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, -3:] = 0
    graph = pv.trace(model, example_args=(ids,), example_kwargs={"attention_mask": mask})
    assert graph.layer_names == ("embeddings", "encoder.layer.0", "encoder.layer.1", "encoder.layer.2", "pooler")
    plan = graph.split(["encoder.layer.0"])
    assert plan.stages[0].inputs == ("input_ids", "attention_mask")
    assert plan.stages[0].send_bytes > 4 * 16 * 32 * 4  # hidden state plus the expanded mask
    assert plan.pipe(microbatches=2).num_stages == 2
