"""plan.pipe(): the real torch Pipe agrees with the preview and reproduces the model."""

from __future__ import annotations

import itertools

import pytest
import torch

import pipeviz as pv
from pipeviz.zoo import MyNetwork, TinyTransformer


def _stage_params(pipe: object, i: int) -> set[str]:
    mod = pipe.get_stage_module(i)  # type: ignore[attr-defined]
    return {n.split(".")[0] if n.startswith("moved_") else n for n, _ in mod.named_parameters()}


def test_classic_pipe_matches_preview(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer0", "layer1"])
    pipe = plan.pipe(microbatches=4)
    assert pipe.num_stages == 3
    for stage in plan.stages:
        names = {n for n, _ in pipe.get_stage_module(stage.index).named_parameters()}
        expected = {n for layer in stage.layers for n, _ in classic_graph.model.get_submodule(layer).named_parameters(
            prefix=layer)}
        assert names == expected
        assert sum(p.numel() for p in pipe.get_stage_module(stage.index).parameters()) == stage.params


@pytest.mark.parametrize("graph_name", ["classic_graph", "skip_graph", "tied_graph"])
def test_pipe_output_equals_model_output(graph_name: str, request: pytest.FixtureRequest) -> None:
    graph: pv.ModelGraph = request.getfixturevalue(graph_name)
    for splits in ([graph.layer_names[0]], list(graph.layer_names[:2])):
        plan = graph.split(splits)
        pipe = plan.pipe(microbatches=2)
        (x,), _ = plan.microbatch_inputs(2)
        with torch.no_grad():
            got = pipe(x)
            want = graph.model(x)
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_transformer_pipe_output() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(depth=4)
    ids = torch.randint(0, 64, (4, 16))
    plan = pv.trace(model, (ids,)).split(["embed", "blocks.1", "blocks.3"])
    with torch.no_grad():
        got = plan.pipe(2)(ids[:2])
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, model(ids[:2]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes
def test_hundred_different_splits_on_one_model() -> None:
    # torch's own pipeline() keeps stale markers on a reused model (2 stages became 3); pipeviz copies.
    model = MyNetwork(8, [8, 8, 8, 8, 8])
    graph = pv.trace(model, example_args=(torch.randn(4, 8),))
    cands = graph.layer_names[:-1]
    combos = [c for r in range(len(cands) + 1) for c in itertools.combinations(cands, r)]
    for i in range(100):
        splits = combos[(i * 13) % len(combos)]
        assert graph.split(list(splits)).pipe(microbatches=2).num_stages == len(splits) + 1
    assert not any(hasattr(m, "_orig_forward") for m in model.modules())
