"""transformers 4.x's Mixtral / Qwen2-MoE sparse blocks loop over the experts the router hit, which torch.export
cannot capture; ``pipeviz.adapter.hf_moe.exportable_moe`` gives them an identical forward over every expert while
pipeviz traces and splits (transformers 5.x needs nothing)."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.adapter.hf_moe import _loop_blocks, exportable_moe
from tests.compat import ROWS, inputs

transformers = pytest.importorskip("transformers")
MAJOR = int(transformers.__version__.split(".")[0])


@pytest.mark.parametrize("name", ["Qwen2-MoE", "Mixtral"])
def test_the_exportable_forward_computes_what_the_original_does_and_traces(name: str) -> None:
    row = next(r for r in ROWS if r.name == name)
    torch.manual_seed(0)
    model = row.build()
    args, _, target = inputs(row)
    patched = {cls.__name__ for cls in _loop_blocks()}
    assert bool(patched) == (MAJOR < 5)  # 5.x rewrote the blocks: nothing to patch there
    outs, grads = [], []
    for ctx in (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), exportable_moe()):
        model.zero_grad()
        with ctx:
            logits = model(*args).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).backward()
        outs.append(logits.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert torch.equal(outs[0], outs[1])
    # gradients: the same terms, summed by autograd in an order that may differ (empty experts add no terms)
    worst = max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))
    assert len(grads[0]) == len(grads[1]) and worst <= 1e-7, worst
    assert all(cls.forward.__module__ != "pipeviz.adapter.hf_moe" for cls in _loop_blocks())  # restored after the block
    graph = pv.trace(model, example_args=args)  # the data-dependent loop no longer stops the trace
    assert len(graph.split_candidates) >= 4
