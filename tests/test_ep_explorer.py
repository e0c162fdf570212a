"""The Explorer's expert parallelism (issue 45, point 5): an ep control beside dp / cp / tp (``Settings.ep`` ->
``LaunchConfig.ep``), refused live in the launch checks' words naming ep, the mesh box naming which experts each
process computes, and a launched ep run's A2A actions and tokens-per-expert figure (``pv.expert_tokens_figure``), on
a tiny ``pipeviz.zoo.MoENet`` (4 blocks of 4 experts, top-2 routing)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import pipeviz as pv
from pipeviz.zoo import MoENet


@pytest.fixture(scope="module")
def moe() -> tuple[pv.ModelGraph, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (8, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = pv.trace(MoENet(vocab=32, d=16, layers=4, experts=4), example_args=(ids,))
    return graph, ids


def test_the_ep_control_sets_the_launch_is_refused_live_and_names_each_shares_experts(
        moe: tuple[pv.ModelGraph, torch.Tensor]) -> None:
    from pipeviz.widgets.controls import Controls
    from pipeviz.widgets.panels import mesh_html
    from pipeviz.widgets.state import ExplorerState, Settings

    graph, _ = moe
    state = ExplorerState(graph, pv.LaunchConfig(dp=2, ep=2, microbatches=2))
    assert state.settings.ep == 2 and state.launch_config().ep == 2
    state.set_plan(["blocks.1"])
    assert state.refusal() is None
    box = mesh_html(state.plan, state.launch_config())
    assert "pv.Mesh(pp=2, dp=2, tp=1, ep=2)" in box
    assert "stage 0: blocks.0.experts (4), blocks.1.experts (4); stage 1: blocks.2.experts (4)" in box
    assert "ep0: processes 0, 2 (replica 0 of each stage) compute experts 0–1 of each block of 4" in box
    assert "ep1: processes 1, 3 (replica 1 of each stage) compute experts 2–3 of each block of 4" in box
    # refused live, in the launch checks' words, naming ep (the control outlined: err.setting)
    state.update(ep=3)
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "ep", refusal
    assert str(refusal).startswith("ep 3 cannot launch: does not divide dp × cp = 2 × 1 = 2") and \
        str(refusal).endswith("; valid here: 1, 2; set ep to one of them."), refusal
    state.update(ep=2, tp=2)
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "ep" and "with tp=2" in str(refusal), refusal
    assert str(refusal).endswith("; valid here: 1; set ep to one of them."), refusal
    state.update(ep=1, tp=1)
    assert state.launch_config().ep == 1 and "pipeviz-experts" not in mesh_html(state.plan, state.launch_config())
    controls = Controls(Settings(dp=2, ep=2), len(graph.layers), lambda: None)
    assert controls.values()["ep"] == 2 and controls.ep.description == "ep"
    controls.show_refusal(pv.LaunchError("ep 3 cannot launch: ...", setting="ep"))
    assert "pipeviz-refused-control" in controls.ep._dom_classes


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): a 4-process run from the widget, 9 s; keeps make test within 10 minutes
def test_an_ep_run_from_the_explorer_draws_its_a2a_actions_and_tokens_per_expert(
        moe: tuple[pv.ModelGraph, torch.Tensor]) -> None:
    from pipeviz.widgets.experts import expert_imbalance

    graph, ids = moe
    ex = pv.Explorer(graph, splits=["blocks.1"], microbatches=2, steps=1, dp=2, ep=2, target=ids,
                     loss_fn=pv.cross_entropy)
    assert ex.ep.value == 2 and ex.refusal is None, ex.error
    run = ex.launch()
    assert run is not None and ex.wait(300) == "done", ex.error
    assert "✓ matches" in ex.numerics.value, ex.numerics.value  # exact against the unsplit model
    # the measured timeline draws the all-to-alls, named in its legend
    legend = {t.name for t in ex.run_view.figure.data if t.showlegend}
    assert any(n.startswith("A2A") for n in legend), legend
    # 4 blocks x 2 microbatches x 2 replicas; a replica's microbatch: 2 rows of 6 tokens, each routed to 2 experts
    assert len(run.expert_tokens) == 16 and all(sum(ld.counts) == 24 for ld in run.expert_tokens)
    fig = ex.figures()["expert_tokens"]
    heat = [t for t in fig.data if t.type == "heatmap"]
    assert [t.name for t in heat] == [f"blocks.{i}.experts" for i in range(4)]
    assert all(len(t.z) == 4 and len(t.z[0]) == 2 for t in heat)  # experts x microbatches
    assert all(sum(sum(r) for r in t.z) == 2 * 2 * 24 for t in heat)  # every routed token, replicas summed
    ratios = expert_imbalance(run)
    assert all(1.0 <= a <= b <= 4.0 for a, b in ratios.values())
    worst = max(ratios, key=lambda n: ratios[n][0])
    assert f"most imbalanced: {worst}, max/mean {ratios[worst][0]:.2f}" in fig.layout.title.text
    title = fig.layout.annotations[0].text
    assert re.search(r"blocks\.0\.experts \(stage 0\): max/mean \d\.\d\d, worst microbatch \d\.\d\d", title)
    assert ex.runner.expert_box.layout.display == "flex" and len(ex.runner.expert_chart.data) == 4
    assert len(pv.expert_tokens_figure(run.expert_tokens).data) == 4
    with pytest.raises(ValueError, match=r"run\.expert_tokens is empty.*Fix"):
        pv.expert_tokens_figure([])


def test_experts_are_found_by_module_and_the_imbalance_is_max_over_mean() -> None:
    from pipeviz.runtime.reducer import ExpertLoad
    from pipeviz.widgets.experts import expert_blocks, expert_imbalance

    class Fused(torch.nn.Module):  # transformers 5.x's fused experts: 3-D weights, the expert count first
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(6, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.zeros(6, 4, 4))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    model.layers[0].experts = Fused()
    model.layers[1].experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))
    assert expert_blocks(model) == [("layers.0.experts", 6), ("layers.1.experts", 4)]
    assert expert_blocks(MoENet(vocab=8, d=4, layers=2, experts=2)) == [("blocks.0.experts", 2),
                                                                         ("blocks.1.experts", 2)]
    # two replicas' tokens summed per microbatch: mb 0 all on expert 0 (4.0), mb 1 even (1.0); over the run 6 / 3 = 2.0
    loads = [ExpertLoad(0, 0, "b.experts", 0, 0, (2, 0, 0, 0)), ExpertLoad(0, 0, "b.experts", 0, 1, (2, 0, 0, 0)),
             ExpertLoad(0, 0, "b.experts", 1, 0, (1, 1, 1, 1)), ExpertLoad(0, 0, "b.experts", 1, 1, (1, 1, 1, 1))]
    assert expert_imbalance(loads) == {"b.experts": (2.0, 4.0)}
    fig = pv.expert_tokens_figure(loads)
    assert [list(r) for r in fig.data[0].z] == [[4, 2], [0, 2], [0, 2], [0, 2]]
    assert "max/mean 2.00, worst microbatch 4.00" in fig.layout.annotations[0].text
