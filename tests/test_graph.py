"""pv.trace: layers, costs, edges, granularity."""

from __future__ import annotations

import sys
import traceback

import pytest
import torch

import pipeviz as pv
from pipeviz.zoo import TinyTransformer


def test_classic_layers_in_order(classic_graph: pv.ModelGraph) -> None:
    g = classic_graph
    assert [layer.name for layer in g.layers] == ["layer0", "layer1", "layer2", "output_proj"]
    assert [layer.kind for layer in g.layers] == ["MyNetworkBlock"] * 3 + ["Linear"]
    # Any module can be split after, at any depth: the blocks and the Linear inside each.
    assert g.split_candidates == ["layer0.lin", "layer0", "layer1.lin", "layer1", "layer2.lin", "layer2"]
    assert [n for n in g.layer_names if g.can_split_after(n)] == ["layer0", "layer1", "layer2"]
    assert g.edges == [("layer0", "layer1"), ("layer1", "layer2"), ("layer2", "output_proj")]


def test_classic_costs(classic_graph: pv.ModelGraph) -> None:
    layer0, layer1, _layer2, head = classic_graph.layers
    assert [layer.params for layer in classic_graph.layers] == [512 * 512 + 512, 512 * 1024 + 1024,
                                                                1024 * 256 + 256, 256 * 10 + 10]
    # A Linear of (B, in) -> (B, out) costs 2*B*in*out FLOPs; ReLU is not counted by torch's counter.
    assert layer0.flops == 2 * 32 * 512 * 512
    assert layer1.flops == 2 * 32 * 512 * 1024
    assert head.flops == 2 * 32 * 256 * 10
    assert layer1.out_bytes == 32 * 1024 * 4
    assert head.out_bytes == 32 * 10 * 4
    assert classic_graph.total_params == sum(p.numel() for p in classic_graph.model.parameters())


def test_skip_connection_edge(skip_graph: pv.ModelGraph) -> None:
    assert ("layer0", "output_proj") in skip_graph.edges
    assert skip_graph.skip_edges == [("layer0", "output_proj")]


def test_tied_weights_counted_once_and_flagged(tied_graph: pv.ModelGraph) -> None:
    g = tied_graph
    embed, head = g.layer("embed"), g.layer("head")
    assert embed.shared == ("embed.weight",) and head.shared == ("embed.weight",)
    assert embed.params == 32 * 16 and head.params == 0
    assert g.total_params == sum(p.numel() for p in g.model.parameters())  # parameters() dedups too
    assert all(layer.shared == () for layer in g.layers if layer.name.startswith("blocks"))


def test_model_never_modified(classic: tuple) -> None:
    model, x = classic
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward = model.forward
    graph = pv.trace(model, example_args=(x,))
    for _ in range(3):
        graph.split(["layer1"]).pipe(microbatches=2)
    assert model.forward == forward and not hasattr(model.layer1, "_orig_forward")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_batchnorm_statistics_untouched() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    mean = model[1].running_mean.clone()
    pv.trace(model, example_args=(torch.randn(8, 4) + 3,))
    assert torch.equal(model[1].running_mean, mean)


def test_natural_blocks_and_regrouping() -> None:
    g = pv.trace(TinyTransformer(depth=3), example_args=(torch.randint(0, 64, (2, 16)),))
    assert g.layer_names == ("embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head")
    deeper = g.expand("blocks.1")
    assert deeper.layer_names == ("embed", "blocks.0", "blocks.1.ln1", "blocks.1.attn", "blocks.1.ln2",
                                  "blocks.1.mlp", "blocks.2", "norm", "head")
    assert deeper.collapse("blocks.1").layer_names == g.layer_names
    assert g.collapse("blocks").layer_names == ("embed", "blocks", "norm", "head")
    assert g.regroup(depth=1).layer_names == ("embed", "blocks", "norm", "head")
    # Regrouping never re-traces: all views share one capture, and FLOPs add up the same.
    assert deeper.capture is g.capture and deeper.total_flops == g.total_flops
    with pytest.raises(ValueError, match="Layer 'norm' has no child modules to expand"):
        g.expand("norm")


def test_not_exportable_names_cause_and_manual_route(capfd: pytest.CaptureFixture[str]) -> None:
    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x)) if x.sum() > 0 else self.lin(x)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Gate())
    with pytest.raises(pv.TraceError) as info:
        pv.trace(model, example_args=(torch.randn(4, 8),))
    text = str(info.value)
    assert text.startswith("Cannot trace Sequential: The forward has data-dependent control flow")
    assert "pv.manual_plan(model, [[" in text
    # what a notebook prints: pipeviz's diagnosis, not torch's partial graph and chained traceback (26.5 KB
    # before); torch's report stays one attribute away
    printed = "".join(traceback.format_exception(info.value))
    assert len(printed) < 4000 and "The above exception was the direct cause" not in printed
    assert printed.rstrip().splitlines()[-3].startswith("pipeviz.capture.export.TraceError: Cannot trace Sequential")
    assert info.value.torch_error is not None and "x.sum()" in "".join(
        traceback.format_exception(info.value.torch_error))
    # torch prints the partial graph to stderr (twice) as export fails: held on the error instead
    assert "def forward" not in capfd.readouterr().err and "def forward" in info.value.torch_output


def test_trace_rejects_non_module() -> None:
    with pytest.raises(TypeError, match=r"trace\(\) needs a torch.nn.Module, got function"):
        pv.trace(lambda x: x, example_args=(torch.randn(2),))


@pytest.mark.slow
def test_core_imports_no_view_library() -> None:
    import subprocess

    code = ("import sys, pipeviz, pipeviz.plan.split, pipeviz.graph.model, pipeviz.graph.manual, pipeviz.zoo; "
            "bad = [m for m in ('ipywidgets', 'plotly', 'anywidget') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
