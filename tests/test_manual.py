"""pv.manual_plan: per-stage module lists for models torch.export cannot capture."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeviz as pv


class Gate(nn.Module):
    """Data-dependent control flow: torch.export cannot capture this."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.relu(y) if y.sum() > 0 else y


class GatedStack(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Gate(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_non_exportable_model_through_manual_route() -> None:
    torch.manual_seed(0)
    model, x = GatedStack(), torch.randn(4, 8)
    with pytest.raises(pv.TraceError, match="data-dependent control flow"):
        pv.trace(model, example_args=(x,))
    plan = pv.manual_plan(model, [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]], example_args=(x,))
    assert plan.num_stages == 2
    assert [s.layers for s in plan.stages] == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head")]
    assert [s.params for s in plan.stages] == [2 * 72, 2 * 72 + 27]
    assert plan.stages[0].send_bytes == 4 * 8 * 4
    assert plan.stages[0].flops == 2 * (2 * 4 * 8 * 8)
    stage0, stage1 = plan.stage_modules()
    # Original names are kept, so state dicts line up with the model's.
    assert set(stage1.state_dict()) == {f"blocks.{i}.lin.{p}" for i in (2, 3) for p in ("weight", "bias")} | {
        "head.weight", "head.bias"}
    with torch.no_grad():
        torch.testing.assert_close(stage1(stage0(x)), model(x))
    assert plan.toggle("blocks.2").num_stages == 3  # previews and toggles work as for traced plans
    with pytest.raises(pv.PlanError, match=r"from pv.manual_plan: there is no traced graph to build a Pipe from"):
        plan.pipe()


def test_manual_route_rejects_a_wrong_sequence() -> None:
    model, x = GatedStack(), torch.randn(4, 8)
    with pytest.raises(pv.PlanError) as info:
        pv.manual_plan(model, [["blocks.0"], ["blocks.2", "head"]], example_args=(x,))
    assert str(info.value).startswith("Running ['blocks.0', 'blocks.2', 'head'] in sequence does not reproduce "
                                      "GatedStack's output")


def test_manual_route_unknown_module() -> None:
    msg = r"Unknown module 'blocks.9'. Did you mean 'blocks.3' or 'blocks.2' or 'blocks.1'\? Modules: blocks, "
    with pytest.raises(pv.PlanError, match=msg):
        pv.manual_plan(GatedStack(), [["blocks.9"], ["head"]], example_args=(torch.randn(4, 8),))
