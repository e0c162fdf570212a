"""transformers 4.x's LayerDrop checks decided at trace time (pipeviz.adapter.hf_layerdrop): a layer loop written as
transformers 4.57 writes it (``torch.rand([])`` before each layer, compared with ``self.layerdrop``) traces, splits
and trains exactly at probability 0, and is refused with the fix above it. The code runs as a module named like
transformers' modelling modules, the only callers whose draws are decided."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.adapter.hf_layerdrop import LayerDropDraw, decided_layerdrop

SOURCE = '''
import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self, layerdrop):
        super().__init__()
        self.layerdrop = layerdrop
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            # transformers 4.57's modeling_bart.py, line for line
            to_drop = False
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:  # skip the layer
                    to_drop = True
            if not to_drop:
                x = torch.relu(layer(x))
        return self.head(x)
'''


@pytest.fixture(scope="module")
def modelling() -> types.ModuleType:
    module = types.ModuleType("transformers.models.layerdrop_test.modeling_layerdrop_test")
    exec(compile(SOURCE, "<modeling_layerdrop_test>", "exec"), module.__dict__)
    sys.modules[module.__name__] = module  # spawned ranks never import it: they run the traced code
    yield module
    del sys.modules[module.__name__]


def test_torch_export_alone_cannot_capture_the_check(modelling: types.ModuleType) -> None:
    with pytest.raises(Exception, match=r"(?i)data.dependent|guard"):
        torch.export.export(modelling.Encoder(0.0), (torch.randn(4, 8),))


@pytest.mark.slow
def test_at_probability_zero_it_traces_splits_and_trains_exactly(modelling: types.ModuleType) -> None:
    torch.manual_seed(0)
    model, x, y = modelling.Encoder(0.0), torch.randn(8, 8), torch.randint(0, 3, (8,))
    graph = pv.trace(model, example_args=(x,))
    assert not any("rand" in op.target for op in graph.capture.ops), "a random op left in the traced graph"
    plan = graph.split(["layers.1"])
    run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(120) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok, check


def test_above_zero_it_is_refused_with_the_fix(modelling: types.ModuleType) -> None:
    with pytest.raises(pv.TraceError, match=r"Cannot trace Encoder: modeling_layerdrop_test:\d+ drops each layer "
                                            r"with probability 0.1 while training.*Fix: set the config's layerdrop"):
        pv.trace(modelling.Encoder(0.1), example_args=(torch.randn(4, 8),))


def test_only_transformers_draws_are_decided_and_only_inside_the_block(modelling: types.ModuleType) -> None:
    caller = types.ModuleType("transformers.models.layerdrop_test.other")
    exec("import torch\ndef draw():\n    return torch.rand([])", caller.__dict__)
    with decided_layerdrop():
        assert isinstance(caller.draw(), LayerDropDraw)
        assert isinstance(torch.rand([]), torch.Tensor) and torch.rand(2).shape == (2,)  # this test's own draws
        d = caller.draw()
        assert (d < 0.0, d >= 0.0, d < 1.0, d > 1.0, d <= -0.5) == (False, True, True, False, False)
    assert isinstance(caller.draw(), torch.Tensor)
