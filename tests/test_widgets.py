"""pv.Explorer and pv.TimelineView driven headless, as the browser would: set the clicked layer, press the
buttons, and assert on the core state (the plan), the preview, the error area and the timelines."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pipeviz as pv
from pipeviz.schedule.timeline import Event, Timeline
from pipeviz.schedule.traits import ALL
from pipeviz.widgets import panels
from pipeviz.widgets.figures import KIND_COLORS

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

needs_sim = pytest.mark.skipif(not hasattr(pv, "simulate") or not hasattr(pv, "balance"),
                               reason="pv.simulate / pv.balance not available")


@pytest.fixture
def explorer(classic_graph: pv.ModelGraph) -> pv.Explorer:
    return pv.Explorer(classic_graph)


def text(html_: str) -> str:
    """What the HTML reads as (tags dropped)."""
    return re.sub(r"<[^>]+>", "", html_)


def stage_rows(ex: pv.Explorer) -> int:
    return ex.preview.value.count("class='pipeviz-stage-row'")


def marker_colors(ex: pv.Explorer) -> list[str]:
    return list(ex.graph_figure.data[-1].marker.color)


def split_lines(ex: pv.Explorer) -> int:
    return sum(1 for s in ex.graph_figure.layout.shapes if s.type == "line")


# --------------------------------------------------------------------------------------------- Explorer
def test_click_toggles_a_split_and_the_view_follows(classic: tuple, explorer: pv.Explorer) -> None:
    model, x = classic
    ex = pv.Explorer(model, example_args=(x,))  # traces once, from the model
    assert ex.graph.layer_names == ("layer0", "layer1", "layer2", "output_proj")
    assert ex.plan.num_stages == 1 and stage_rows(ex) == 1 and split_lines(ex) == 0
    ex.clicked = "layer0"  # what the browser's click on the node sets
    assert ex.clicked == ""  # handled and reset, so the same node can be clicked again
    assert ex.plan.split_spec == {"layer0": pv.SplitPoint.END}
    assert stage_rows(ex) == 2 and "<b>2 stages</b>" in ex.preview.value and split_lines(ex) == 1
    assert len(set(marker_colors(ex))) == 2 and ex.stages.value == 2
    ex.clicked = "layer1"
    assert ex.plan.num_stages == 3 and stage_rows(ex) == 3 and split_lines(ex) == 2
    assert [s.layers for s in ex.plan.stages] == [("layer0",), ("layer1",), ("layer2", "output_proj")]
    assert "layer2, output_proj" in ex.preview.value
    ex.clicked = "layer1"  # again: removes the split
    assert ex.plan.num_stages == 2 and stage_rows(ex) == 2
    assert ex.plan_json == ex.plan.to_json() and ex.error == ""
    # What a reloaded page draws is the figure plotly keeps in the widget's synced state, which plotly sets only
    # when first shown: the graph read "1 stage" with no split lines after a reload, beside a preview of 2.
    fig = ex.graph_figure
    kept_lines = [sh for sh in fig._widget_layout.get("shapes", []) if sh.get("type") == "line"]
    assert len(kept_lines) == split_lines(ex) == 1
    assert fig._widget_data == fig._data  # every trace as drawn now (marker colours by stage included)


def test_plotly_click_on_a_marker_calls_click(explorer: pv.Explorer) -> None:
    from plotly.callbacks import Points

    trace = explorer.graph_figure.data[-1]
    trace._dispatch_on_click(Points(point_inds=[2], xs=[0], ys=[2], trace_name="layers", trace_index=2), None)
    assert explorer.plan.split_spec == {"layer2": pv.SplitPoint.END}


def test_invalid_clicks_show_the_validation_message(explorer: pv.Explorer) -> None:
    explorer.click("layer0")
    before = explorer.plan
    assert explorer.click("output_proj") is None  # no exception escapes a UI handler
    assert explorer.plan is before
    assert "Cannot split at the END of 'output_proj': no module runs after it" in explorer.error
    assert "Valid split points: layer0, layer1, layer2" in explorer.errors.value
    explorer.clicked = "layr1"
    assert "Did you mean 'layer1'?" in explorer.error and explorer.plan is before
    explorer.click("layer1")  # a valid click clears the error area
    assert explorer.error == "" and explorer.errors.value == "" and explorer.plan.num_stages == 3


def test_setting_the_plan_from_code_updates_the_view(explorer: pv.Explorer, classic_graph: pv.ModelGraph) -> None:
    explorer.plan = classic_graph.split(["layer0", "layer1"])
    assert explorer.stages.value == 3 and stage_rows(explorer) == 3 and split_lines(explorer) == 2
    assert len(set(marker_colors(explorer))) == 3
    explorer.plan = ["layer2"]  # layer names work too
    assert explorer.plan.split_spec == {"layer2": pv.SplitPoint.END} and stage_rows(explorer) == 2
    explorer.plan_json = classic_graph.split(["layer1"]).to_json()  # the synced trait drives the plan too
    assert explorer.plan.split_spec == {"layer1": pv.SplitPoint.END}
    assert "layer0, layer1" in text(explorer.preview.value)
    explorer.plan_json = '{"layers": ["x"], "splits": []}'
    assert "refers to other layers" in explorer.error and explorer.plan.num_stages == 2


@needs_sim
def test_controls_simulate_and_balance(explorer: pv.Explorer) -> None:
    explorer.plan = ["layer0", "layer1"]
    sim = explorer.sim
    assert sim is not None and sim.source == "simulated" and sim.schedule == "1F1B" and sim.num_stages == 3
    assert explorer.sim_view.timeline is sim and explorer.sim_view.event_count == len(sim.events) > 0
    assert "time/mb: a stage's forward + backward of one microbatch (in the simulated step" in explorer.preview.value

    def header(preview: str) -> str:
        return preview[preview.index("<tr>"):preview.index("</tr>")]

    simulated_header = header(explorer.preview.value)
    # layer1 is twice as heavy as layer0 and layer2: alone in its stage it is the best 3 stages can do.
    assert "✓ balanced: the slowest stage is at the optimum, the best any split into 3 stages" in explorer.preview.value
    explorer.plan = ["layer2"]
    verdict = "⚠ imbalance: the slowest stage takes 1.33× the best slowest stage a split into 2 stages"
    assert verdict in explorer.preview.value
    explorer.plan = ["layer0", "layer1"]
    assert list(explorer.schedule.options) == list(ALL)
    explorer.microbatches.value = 8
    assert explorer.sim.microbatches == 8
    explorer.schedule.value = "GPipe"
    assert explorer.sim.schedule == "GPipe" and explorer.error == ""
    explorer.schedule.value = "ZBVZeroBubble"  # 3 stages cannot be V-shaped: said once, in the error area
    assert explorer.sim is None and "needs a stage count divisible by 2" in explorer.error
    assert "divisible" not in explorer.preview.value
    assert "(estimated, no simulation; layer times" in explorer.preview.value
    # the header is the same with and without a simulation (it flipped between "estimated from flops" and
    # "simulated"): what the figures are is said under the table
    assert header(explorer.preview.value) == simulated_header
    hand_made = explorer.plan
    explorer.stages.value = 4  # a new stage count is a target: the hand-placed splits stay
    assert explorer.plan is hand_made and explorer.balance_button.description == "Balance into 4"
    assert "Press <b>Balance into 4</b>" in explorer.hint.value
    explorer.balance_button.click()
    assert explorer.plan.num_stages == 4 and explorer.sim is not None and explorer.sim.num_ranks == 2
    assert explorer.error == "" and explorer.hint.value == "" and explorer.balance_button.description == "Balance"
    assert explorer.undo() is hand_made and explorer.plan.num_stages == 3  # undo brings the hand-placed split back
    assert explorer.redo().num_stages == 4
    explorer.schedule.value = "1F1B"
    explorer.stages.value = 2
    explorer.balance_button.click()
    assert explorer.plan.num_stages == 2 and stage_rows(explorer) == 2
    assert "✓ balanced: the slowest stage is at the optimum" in explorer.preview.value
    explorer.auto_balance(num_stages=9)
    assert "Cannot balance 4 layers into 9" in explorer.error and explorer.plan.num_stages == 2


def test_undo_and_redo_walk_the_history(explorer: pv.Explorer) -> None:
    assert explorer.undo_button.disabled and explorer.redo_button.disabled
    explorer.click("layer0")
    explorer.click("layer1")
    explorer.click("layer0")
    assert [n for n, _ in explorer.plan.splits] == ["layer1"]
    explorer.undo_button.click()
    assert [n for n, _ in explorer.plan.splits] == ["layer0", "layer1"] and not explorer.redo_button.disabled
    explorer.undo()
    explorer.undo()
    assert explorer.plan.num_stages == 1 and explorer.undo_button.disabled
    explorer.redo_button.click()
    assert [n for n, _ in explorer.plan.splits] == ["layer0"]
    explorer.click("layer2")  # a new change drops what could be redone
    assert explorer.redo_button.disabled


def test_pipe_structure_on_demand(explorer: pv.Explorer) -> None:
    explorer.click("layer1")
    assert explorer.pipe_text.value == ""
    explorer.pipe_button.value = True
    assert "submod_pp_0" in explorer.pipe_text.value and "submod_pp_1" in explorer.pipe_text.value
    explorer.click("layer0")  # follows the plan while shown
    assert "submod_pp_2" in explorer.pipe_text.value
    explorer.pipe_button.value = False
    assert explorer.pipe_text.value == ""


def test_expand_and_collapse_keep_deep_models_readable() -> None:
    pytest.importorskip("transformers")
    from pipeviz.zoo import gpt2

    torch.manual_seed(0)
    ex = pv.Explorer(gpt2(12, 32, 2, 64, 32), example_args=(torch.randint(0, 64, (4, 8)),),
                     splits=["transformer.h.3", "transformer.h.7"])
    names = ex.graph.layer_names
    assert len(names) == 16 and ex.graph_figure.layout.height >= 30 * 16  # one readable row per layer
    layers = ex.graph_figure.data[-1]
    assert [c[0] for c in layers.customdata] == list(names)
    # Blocks that open up are squares marked ⊕; leaf modules circles; hovers say what a click does.
    assert layers.marker.symbol[names.index("transformer.h.3")] == "square"
    assert layers.text[names.index("transformer.h.3")] == "transformer.h.3 ⊕"
    assert layers.marker.symbol[names.index("lm_head")] == "circle"
    assert layers.customdata[names.index("lm_head")][6] == "the last layer: no split after it"
    assert layers.customdata[names.index("transformer.h.3")][6].startswith("click: remove the split after it")
    assert "shift-click a ■ block to open it" in ex.view_bar.children[0].value
    from plotly.callbacks import InputDeviceState, Points

    shift = InputDeviceState(ctrl=False, alt=False, shift=True, meta=False, button=0, buttons=1)
    layers._dispatch_on_click(Points(point_inds=[names.index("transformer.h.3")], xs=[0], ys=[0],
                                     trace_name="layers", trace_index=2), shift)  # shift-click: expand
    assert "transformer.h.3.mlp" in ex.graph.layer_names  # the split after h.3 stays where it was
    assert ex.plan.split_spec == {"transformer.h.3": pv.SplitPoint.END, "transformer.h.7": pv.SplitPoint.END}
    assert ex.plan.stages[0].layers[-1] == "transformer.h.3.mlp"
    assert len(ex.graph_figure.data[-1].text) == 19
    collapse = [b for b in ex.view_bar.children if "pipeviz-collapse" in b._dom_classes]
    assert [b.tooltip for b in collapse] == ["collapse transformer.h.3"]
    collapse[0].click()  # the bar folds it back
    assert len(ex.graph.layers) == 16 and ex.plan.num_stages == 3
    ex.undo()
    assert "transformer.h.3.mlp" in ex.graph.layer_names  # undo covers the view too
    ex.collapse("transformer.h")  # both splits fall inside the collapsed blocks
    assert ex.plan.num_stages == 1 and len(ex.graph.layers) == 5
    assert ex.error == str(ex.refusal) and ex.refusal.setting == "stages"  # one stage: the click is the fix
    ex.regroup()
    assert len(ex.graph.layers) == 16
    ex.expand("lm_head")
    assert "has no child modules to expand" in ex.error


def test_skip_edges_are_drawn(skip_graph: pv.ModelGraph) -> None:
    from pipeviz.widgets.graph_figures import graph_figure

    fig = graph_figure(skip_graph.split(["layer0", "layer1"]))
    skips = next(t for t in fig.data if t.name == "skip edges")
    assert skip_graph.skip_edges and sum(v is None for v in skips.x) == len(skip_graph.skip_edges)
    assert max(v for v in skips.x if v is not None) > 0.3  # arcs leave the chain to the right
    hover = fig.data[-1].hovertemplate
    assert all(k in hover for k in ("kind", "params", "FLOPs", "output"))


class DenseSkips(torch.nn.Module):
    """A residual MLP whose every layer also reads the output two and three layers back: overlapping skips."""

    def __init__(self, n: int = 12) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x]
        for k, layer in enumerate(self.layers):
            h = layer(outs[-1])
            outs.append(h + (outs[k - 1] if k >= 1 else 0) + (outs[k - 2] if k >= 2 else 0))
        return outs[-1]


def test_many_skip_arcs_stay_inside_the_graph_and_off_the_stage_labels() -> None:
    """21 arcs of a residual MLP ran off the graph's right edge and over the stage labels: their lanes are
    squeezed, in order, into the room left of the labels."""
    from pipeviz.widgets.graph_figures import ARC_ROOM, graph_figure

    graph = pv.trace(DenseSkips(), (torch.randn(4, 8),))
    assert len(graph.skip_edges) >= 20
    fig = graph_figure(graph.split([graph.layer_names[5]]))
    skips = next(t for t in fig.data if t.name == "skip edges")
    right = max(v for v in skips.x if v is not None)
    assert right <= ARC_ROOM + 1e-9 < fig.layout.xaxis.range[1]  # inside the plot, left of the labels' strip
    # still in lanes: the arcs reach different widths
    assert len({round(max(v for v in skips.x[k:k + 16] if v is not None), 3)
                for k in range(0, len(skips.x), 17)}) > 5


@pytest.mark.slow
@needs_sim
def test_launch_fills_the_timeline_live_and_checks_numerics(explorer: pv.Explorer) -> None:
    from pipeviz.schedule.training import cross_entropy

    explorer.plan = ["layer0", "layer1"]
    explorer.steps.value = 30
    # Runs in the stage processes: fails the run if unpickling the default loss loaded a view library.
    explorer.loss_fn = lambda out, t: (1 / 0 if __import__("multiprocessing").parent_process() and {
        "ipywidgets", "plotly", "anywidget"} & set(__import__("sys").modules) else cross_entropy(out, t))
    counts: list[int] = []
    explorer.run_view.busy_interval = explorer.run_view.interval  # live redraws even while 3 ranks share 2 cores
    # after every live redraw: the measured step in the chart's title and in the run notes beside it
    pairs: list[tuple[list[str], list[str]]] = []
    # (while the run goes: the last redraw, at its end, is explained once the numerics are checked)
    explorer.run_view.drawn.append(lambda tl: explorer.run is None or explorer.run.done or pairs.append((
        re.findall(r"step ([\d.]+) ms", explorer.run_view.summary.value),
        re.findall(r"measured step ([\d.]+) ms", explorer.run_notes.value))))
    explorer.launch_button.click()
    run = explorer.run
    assert run is not None and explorer.error == "" and explorer.launch_button.disabled
    run.subscribe(lambda batch: counts.append(explorer.run_view.event_count))
    assert explorer.wait(180) == "done", explorer.error
    assert "✓ matches" in explorer.numerics.value, explorer.numerics.value
    assert explorer.error == "" and not explorer.launch_button.disabled and explorer.stop_button.disabled
    assert "step 30/30" in explorer.progress.value and "done" in explorer.progress.value
    assert explorer.run_view.event_count == len(run.events)
    assert sum(e.kind in ("F", "B") for e in run.events) == 30 * 3 * 4 * 2
    assert counts == sorted(counts) and len(set(counts)) >= 2 and explorer.run_view.redraws >= 3
    # one snapshot, one figure: mid-run the notes said 229.54 ms beside a title of 167.61 ms
    live = [(title, notes) for title, notes in pairs if notes]
    assert len(live) >= 2 and all(title[:1] == notes for title, notes in live), pairs
    assert {t.meta[1] for t in explorer.run_view.figure.data if t.meta and len(t.x)} >= {"F", "B"}
    assert any(t.meta[0].endswith("(overlay)") and len(t.x) for t in explorer.run_view.figure.data)
    # one vocabulary for the run's state: the status line, the chart's title and the numerics line (issue 50)
    def said() -> list[str]:
        return [text(w.value) for w in (explorer.progress, explorer.run_view.summary, explorer.numerics)]

    assert all("✓ matches the unsplit model" in s for s in said()), said()
    assert not any("out of date" in s for s in said())
    explorer.microbatches.value = 8  # any setting, not the split only, makes the run out of date
    assert all("out of date: microbatches 4 → 8" in s for s in said()), said()
    assert "pipeviz-stale" in explorer.run_section._dom_classes
    explorer.tp.value = 2
    assert all("out of date: microbatches 4 → 8, tp 1 → 2" in s for s in said()), said()
    explorer.microbatches.value, explorer.tp.value = 4, 1  # back to what ran
    assert not any("out of date" in s for s in said()) and "pipeviz-stale" not in explorer.run_section._dom_classes
    explorer.click("layer2")
    assert all("out of date: the split" in s for s in said()), said()


@pytest.mark.slow
def test_the_loss_chart_shows_the_training_and_held_out_losses(classic_graph: pv.ModelGraph, tmp_path: Path) -> None:
    """A training Launch with held-out batches (eval_data=, eval_every from the config) and a warm-up schedule:
    under the run's timeline the loss per step and the held-out loss after every second step, as the run has
    them; the simulated timeline and a forward-only run show no loss chart. Saved, the run resumes from the
    Explorer (``explorer.resume``): the next Launch goes on from its step 4 and still matches the unsplit model."""
    x = classic_graph.example_args[0]
    assert isinstance(x, torch.Tensor)
    held_out = [(torch.randn_like(x), torch.randint(0, 10, (x.shape[0],)))]
    ex = pv.Explorer(classic_graph, splits=["layer0"], steps=4, eval_data=held_out, eval_every=2,
                     lr_scheduler=pv.warmup_cosine(1, 4), target=torch.randint(0, 10, (x.shape[0],)))
    assert ex.launch_config().eval_every == 2 and ex.sim_view.loss_box.layout.display == "none"
    ex.launch()
    assert ex.wait(180) == "done", ex.error
    run = ex.run
    assert run is not None and len(run.losses) == 4 and [s for s, _ in run.eval_losses] == [1, 3]
    assert len(run.learning_rates) == 4 and "✓ matches" in ex.numerics.value, ex.numerics.value
    chart = ex.run_view.loss_chart
    assert ex.run_view.loss_box.layout.display == "flex"
    assert list(chart.data[0].x) == [1, 2, 3, 4] and list(chart.data[0].y) == pytest.approx(run.losses)
    assert list(chart.data[1].x) == [2, 4] and list(chart.data[1].y) == pytest.approx([v for _, v in run.eval_losses])
    assert {e.step for e in run.events if e.kind == "EVAL"} == {1, 3}
    assert ex.sim_view.loss_box.layout.display == "none"
    run.save(tmp_path / "ckpt")
    ex.resume = tmp_path / "ckpt"
    ex.launch()
    assert ex.wait(180) == "done", ex.error
    assert ex.run is not run and ex.run is not None and len(ex.run.losses) == 4
    assert ex.run.losses[0] < run.losses[0] and "✓ matches" in ex.numerics.value, ex.numerics.value
    ex.resume = None
    ex.mode.value = "infer"
    assert ex.launch_config().eval_every is None and ex.launch_config().lr_scheduler is None


@pytest.mark.slow
@needs_sim
def test_dp_and_tp_controls_simulate_draw_the_mesh_and_launch_the_one_config(explorer: pv.Explorer,
                                                                             tmp_path: Path) -> None:
    explorer.plan = ["layer1"]
    assert "2 processes" in text(explorer.mesh_view.value) and explorer.sim.meta["mesh"] == (2, 1, 1)
    explorer.dp.value, explorer.tp.value = 2, 2
    assert explorer.error == "" and explorer.sim.meta["mesh"] == (2, 2, 2)
    mesh = text(explorer.mesh_view.value)
    assert "8 processes (2 pipeline ranks × 2 replicas × 2 shards" in mesh
    # a header row per dimension ("replica 1" over "shard 0", "shard 1"), each cell a process rank
    cells = re.findall(r"<tr class='pipeviz-mesh-row'>.*?</tr>", explorer.mesh_view.value)
    assert [re.findall(r"<td[^>]*>(\d+)</td>", c) for c in cells] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert "replica 1" in mesh and "shard 1" in mesh and "title='process 5: pp1 dp0 tp1'" in explorer.mesh_view.value
    explorer.tp.value = 1
    cfg = explorer.launch_config()
    assert (cfg.schedule, cfg.microbatches, cfg.steps, cfg.dp, cfg.tp) == ("1F1B", 4, explorer.steps.value, 2, 1)
    script = pv.export_torchrun(explorer.plan, tmp_path / "ex.py", config=cfg,
                                inputs=explorer.graph.example_args, target=torch.randint(0, 10, (32,)))
    assert "x 2 replicas" in script.read_text()
    run = explorer.launch()  # pp 2 x dp 2: four processes, one loss per step
    assert run is not None and run.mesh == pv.Mesh(pp=2, dp=2)
    assert run.spec.config == explorer.sim.meta["config"]  # launched what was simulated
    assert explorer.wait(180) == "done", explorer.error
    assert len(run.losses) == explorer.steps.value and "✓ matches" in explorer.numerics.value, explorer.numerics.value
    assert {run.timeline().process_label(r) for r in range(4)} == {"pp0 dp0", "pp0 dp1", "pp1 dp0", "pp1 dp1"}
    # the run's notes count its processes, not its pipeline ranks (they said "2 processes" of these 4)
    assert "4 processes share 2 CPU cores" in panels.run_notes_html(run, explorer.sim, None, cores=2, load=0.0)


@pytest.mark.slow
def test_infer_switch_simulates_and_runs_forward_only(explorer: pv.Explorer) -> None:
    explorer.plan = ["layer0", "layer1"]
    train_step = explorer.sim.step_time
    explorer.mode.value = "infer"
    sim = explorer.sim
    assert sim is not None and {e.kind for e in sim.events} <= {"F", "COMM"} and sim.step_time < train_step
    assert explorer.error == "" and "mode=infer" in repr(explorer)
    explorer.schedule.value = "ZBVZeroBubble"  # V-shaped: needs a backward
    assert explorer.sim is None and explorer.error == (
        "schedule ZBVZeroBubble cannot run forward only: torch's V-shaped schedule needs a backward; valid in infer "
        "mode: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble; pick one of them in schedule, or switch "
        "run to train.")
    explorer.schedule.value = "GPipe"
    assert explorer.error == "" and explorer.sim is not None
    run = explorer.launch()
    assert run is not None and run.spec.loss_fn is None
    assert explorer.wait(180) == "done", explorer.error
    assert len(run.outputs) == explorer.steps.value and run.losses == []
    assert {e.kind for e in run.events} <= {"F", "COMM"}
    assert "✓ matches" in explorer.numerics.value and "Δoutput" in explorer.numerics.value, explorer.numerics.value
    with pytest.raises(ValueError, match=r"mode='fast'.*\['train', 'infer'\].*Fix"):
        pv.Explorer(explorer.graph, mode="fast")


@pytest.mark.slow
def test_errors_from_the_run_appear_in_the_widget(explorer: pv.Explorer) -> None:
    explorer.plan = ["layer1"]
    explorer.loss_fn = lambda out, t: ((_ for _ in ()).throw(ValueError("loss exploded on purpose"))
                                       if out.requires_grad else out.float().mean())  # fails in the run only
    explorer.launch()
    assert explorer.wait(180) == "failed"
    # under the Launch button that caused it, not in the area under the controls
    assert "The run failed" in explorer.error and "loss exploded on purpose" in explorer.launch_error.value
    assert explorer.errors.value == ""
    # the status line, the chart's title and the numerics line in one vocabulary; the error itself said once
    assert "failed ✗ the error is under Launch" in text(explorer.progress.value)
    assert "failed ✗" in text(explorer.run_view.summary.value)
    assert text(explorer.numerics.value) == "Numerics check: not checked: the run failed."
    assert "loss exploded" not in explorer.progress.value + explorer.numerics.value
    # A loss that fails on any output is refused before a process starts: said once, under the controls
    explorer.loss_fn = lambda out, t: (_ for _ in ()).throw(ValueError("loss exploded on purpose"))
    assert explorer.launch() is None and "loss_fn(output, target) fails on an output like" in explorer.error
    assert "loss_fn(output, target)" in explorer.refused.value and explorer.launch_button.disabled
    assert "loss_fn" not in explorer.launch_error.value + explorer.progress.value


@pytest.mark.slow
def test_stop_button_stops_the_run(explorer: pv.Explorer) -> None:
    explorer.plan = ["layer1"]
    explorer.steps.value = 100000
    explorer.launch()
    assert "A run is still going" in (explorer.launch() or explorer.error)
    deadline = time.time() + 120
    while explorer.run.status != "running" and time.time() < deadline:
        time.sleep(0.05)
    explorer.stop_button.click()
    assert explorer.wait(30) == "stopped"
    assert "stopped · numerics not checked" in text(explorer.progress.value)
    assert text(explorer.numerics.value) == "Numerics check: not checked: the run was stopped."


def test_bad_launch_is_shown_before_any_process(explorer: pv.Explorer) -> None:
    # in the widget's terms: the fix is a click (or Balance), not plan.toggle(<layer>)
    said = "Launch needs at least 2 stages and the plan has 1: click a layer in the graph to split after it"
    assert explorer.launch_button.disabled and said in text(explorer.refused.value)  # live, before any press
    assert explorer.launch() is None and said in explorer.error
    # one place: under the controls; not again under Launch or in the status line
    assert said not in explorer.launch_error.value + explorer.progress.value
    explorer.click("layer0")
    assert explorer.refused.value == "" and not explorer.launch_button.disabled and explorer.error == ""
    explorer.plan = ["layer0", "layer1"]
    explorer.microbatches.value = 5
    assert explorer.launch() is None and explorer.run is None
    assert explorer.error.startswith("microbatches 5 cannot launch: it does not divide the batch of 32;")


def test_a_setting_that_cannot_launch_is_refused_at_its_control(explorer: pv.Explorer) -> None:
    """pv.launch's own checks run at every change: nothing is simulated that Launch would refuse, the control at
    fault is outlined and its refusal shown under the controls; putting it right brings the simulation back."""
    explorer.plan = ["layer0", "layer1"]  # a batch of 32
    assert explorer.refusal is None and explorer.sim is not None and not explorer.launch_button.disabled
    explorer.microbatches.value = 5
    assert explorer.refusal is not None and explorer.refusal.setting == "microbatches"
    assert explorer.sim is None and explorer.launch_button.disabled
    # one sentence: the control, why, the valid values (and why 1 and 2 are not among them)
    assert text(explorer.refused.value).endswith("⚠ microbatches 5 cannot launch: it does not divide the batch of "
                                                 "32; valid: 4, 8, 16, 32 (1 and 2 are fewer than the 3 stages 1F1B "
                                                 "needs); set microbatches to one of them.")
    assert "pipeviz-refused-control" in explorer.microbatches._dom_classes
    assert "but Launch is refused" in explorer.preview.value and "✓" not in explorer.preview.value  # no ✓ here
    assert "overflow-wrap:anywhere" not in explorer.refused.value + explorer.preview.value  # wraps at spaces
    explorer.microbatches.value = 8
    assert explorer.refusal is None and explorer.refused.value == "" and explorer.sim is not None
    assert "pipeviz-refused-control" not in explorer.microbatches._dom_classes and not explorer.launch_button.disabled
    explorer.dp.value = 8  # 8 replicas of 4 rows each cannot take 8 microbatches
    assert explorer.refusal.setting == "microbatches" and str(explorer.refusal) == (
        "microbatches 8 cannot launch: it does not divide the 4 rows each of the 8 data-parallel replicas takes from "
        "the batch of 32; valid: 4 (1 and 2 are fewer than the 3 stages 1F1B needs); set microbatches to one of them.")
    assert explorer.sim is None
    explorer.dp.value = 1
    explorer.mode.value = "infer"
    explorer.schedule.value = "ZBVZeroBubble"  # needs a backward
    assert explorer.refusal.setting == "schedule" and "cannot run forward only" in explorer.refused.value


def test_a_microbatch_count_that_never_launches_is_flagged_before_the_first_split(explorer: pv.Explorer) -> None:
    """At one stage nothing launches yet, but a microbatch count that does not divide the batch never will: it is
    flagged at once, in one sentence, and the flag goes the moment the count divides."""
    explorer.plan = []
    assert explorer.plan.num_stages == 1 and explorer.refusal.setting == "stages"
    explorer.microbatches.value = 5
    assert explorer.refusal is not None and explorer.refusal.setting == "microbatches"
    assert text(explorer.refused.value).endswith("}⚠ microbatches 5 cannot launch: it does not divide the batch of "
                                                  "32; valid: 1, 2, 4, 8, 16, 32; set microbatches to one of them.")
    assert "pipeviz-refused-control" in explorer.microbatches._dom_classes and explorer.launch_button.disabled
    explorer.microbatches.value = 4
    assert explorer.refusal.setting == "stages" and "microbatches" not in explorer.refused.value
    explorer.click("layer0")
    assert explorer.refusal is None and explorer.refused.value == ""


def test_the_memory_column_is_the_simulated_peak_and_sends_are_per_microbatch(explorer: pv.Explorer) -> None:
    """The stage table's memory followed neither the schedule nor dp while "memory per rank" under it did, and its
    sends were a whole batch's beside a time per microbatch."""
    from pipeviz.plan.preview import human_bytes

    explorer.plan = ["layer1"]  # 2 stages on 2 ranks
    for control, value in (("schedule", "1F1B"), ("schedule", "GPipe"), ("dp", 2)):
        getattr(explorer, control).value = value
        peaks = explorer.sim.meta["memory_bytes"]
        cells = re.findall(r"<tr class='pipeviz-stage-row'.*?</tr>", explorer.preview.value)
        assert [re.findall(r"<td[^>]*>([^<]*)</td>", c)[-1] for c in cells] == [human_bytes(m) for m in peaks]
        assert "memory: its rank's simulated peak" in explorer.preview.value, (control, value)
    sends = [re.findall(r"<td[^>]*>([^<]*)</td>", c)[-3] for c in cells]
    mb = explorer.microbatches.value
    assert sends == [human_bytes(s.send_bytes / mb) for s in explorer.plan.stages]
    assert "sends/mb" in explorer.preview.value


def test_the_explorer_takes_the_options_its_hints_name(classic_graph: pv.ModelGraph) -> None:
    ex = pv.Explorer(classic_graph, splits=["layer0"], tp=2, tp_plan={"layer1.0": "colwise"}, timeout=30)
    cfg = ex.launch_config()
    assert cfg.tp == 2 and cfg.tp_plan == {"layer1.0": "colwise"} and cfg.timeout == 30


# --------------------------------------------------------------------------------------------- TimelineView
def synthetic(n: int, ranks: int = 4, microbatches: int = 8) -> list[Event]:
    events: list[Event] = []
    step = 0
    while len(events) < n:
        for r in range(ranks):
            for m in range(microbatches):
                for k, kind in enumerate(("F", "B")):
                    t = step + 0.01 * (r + 2 * m + k)
                    events.append(Event(r, r, kind, m, t, t + 0.008, step))
        step += 1
    return events[:n]


def test_timeline_view_draws_10000_events_as_webgl_segments() -> None:
    # How long a redraw takes is measured in benchmarks/speed/timeline_redraw.py, not asserted here.
    tl = Timeline(synthetic(10_000), 4, 4, 8, "1F1B")
    view = pv.TimelineView(tl)
    assert view.event_count == 10_000
    view.update(tl)
    drawn = [t for t in view.figure.data if len(t.x)]
    assert {t.type for t in drawn} == {"scattergl"}  # WebGL segments, one trace per kind, not 10,000 shapes
    assert len(view.figure.data) <= len(KIND_COLORS) and sum(len(t.x) for t in drawn) == 3 * 10_000
    small = Timeline(synthetic(64), 4, 4, 8, "1F1B")
    view.update(small)
    assert {t.type for t in view.figure.data} == {"bar"} and "0" in list(view.figure.data[0].text)


class HandFed:
    """A run fed by hand (no processes): anything satisfying ``pv.Live`` is what the views follow."""

    def __init__(self, steps: int) -> None:
        self.status, self.events, self.losses, self.error, self.step, self.steps = "running", [], [], None, 0, steps
        self._subscribers: list[Any] = []

    @property
    def done(self) -> bool:
        return self.status != "running"

    def subscribe(self, callback: Any) -> None:
        self._subscribers.append(callback)

    def publish(self, batch: list[Event]) -> None:
        self.events.extend(batch)
        for cb in self._subscribers:
            cb(batch)

    def finish(self) -> None:
        self.status = "done"
        self.publish([])

    def wait(self, timeout: float | None = None) -> str:
        return self.status

    def stop(self) -> str:
        return self.status

    def timeline(self) -> Timeline:
        return Timeline(list(self.events), 4, 4, 8, "1F1B")


def test_live_updates_are_throttled() -> None:
    run = HandFed(steps=1000)
    assert isinstance(run, pv.Live)  # the views use the Protocol only, as they use Run and Watch
    now = [0.0]
    pending: list[tuple[float, object]] = []
    view = pv.TimelineView(run, interval=0.25, cores=8, clock=lambda: now[0],
                           later=lambda s, fn: pending.append((s, fn)))  # 4 ranks on 8 cores: not busy
    assert not view.busy
    events = synthetic(10_000)
    first = view.redraws
    for i in range(0, 10_000, 100):  # 100 batches while the clock stands still
        run.publish(events[i:i + 100])
    assert view.redraws == first  # attaching drew at t=0: every batch waits for the interval
    assert len(pending) == 1 and view.event_count == 0
    seconds, flush = pending.pop()
    assert seconds == pytest.approx(0.25)
    now[0] += 0.3
    flush()  # the pending redraw fires without another batch: everything that came is drawn
    assert view.event_count == 10_000 and view.redraws == first + 1
    run.publish(events[:1])  # at 10,000 events the interval grows to 1 s (SECONDS_PER_EVENT)
    assert view.redraws == first + 1 and len(pending) == 1 and pending[0][0] == pytest.approx(1.0001)
    run.finish()
    assert view.event_count == 10_001
    assert view.step_select.options[-1] == (f"step {events[-1].step + 1}", events[-1].step)  # counted from 1
    view.step_select.value = 3  # zoom to one step
    lo, hi = view.figure.layout.xaxis.range
    assert 2990 < lo < 3000 < hi < 3200


def test_live_updates_wait_longer_while_the_run_takes_every_core() -> None:
    """Each redraw (the kernel's and the browser's) is time taken from ranks that use every core: spaced by
    busy_interval then (benchmarks/speed/explorer_overhead.py: x1.36-1.47 the script's step before, x1.08 after)."""
    run = HandFed(steps=1000)
    pending: list[tuple[float, object]] = []
    view = pv.TimelineView(run, interval=0.25, busy_interval=2.0, cores=2, clock=lambda: 0.0,
                           later=lambda s, fn: pending.append((s, fn)))  # 4 ranks on 2 cores
    assert view.busy and view.live_redraws == 1  # drawn once on attach
    run.publish(synthetic(100))
    assert len(pending) == 1 and pending[0][0] == pytest.approx(2.0)
    run.finish()  # the final redraw is never delayed
    assert view.event_count == 100 and view.live_redraws == 2 and view.redraw_s > 0


def test_timeline_figure_overlay_and_static() -> None:
    measured = Timeline(synthetic(64 * 3), 4, 4, 8, "1F1B")
    sim = Timeline(synthetic(64), 4, 4, 8, "1F1B", source="simulated")
    fig = pv.timeline_figure(measured, overlay=sim)
    overlay = [t for t in fig.data if t.meta[0].endswith("(overlay)") and len(t.x)]
    assert sum(len(t.x) for t in overlay) == 3 * 64  # the simulated step under each of 3 measured steps
    assert fig.layout.yaxis.ticktext == ("rank 0", "rank 1", "rank 2", "rank 3")
    with pytest.raises(TypeError, match=r"takes a pv\.Run, a pv\.watch\(folder\) or a pv\.Timeline, got int\."):
        pv.TimelineView(42)


def test_static_fallback_for_nbconvert(explorer: pv.Explorer) -> None:
    explorer.click("layer1")
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    html = bundle["text/html"]
    assert "pipeviz-stage-row" in html and "plotly" in html and "layer1" in html
    figs = explorer.figures()
    assert {"graph"} <= set(figs) and all(hasattr(f, "to_html") for f in figs.values())


@pytest.mark.slow
def test_views_load_only_on_use() -> None:
    code = ("import sys, pipeviz, pipeviz.widgets, pipeviz.schedule.training; "
            "print([m for m in ('ipywidgets', 'plotly', 'anywidget') if m in sys.modules]); "
            "pipeviz.TimelineView(None); print(all(m in sys.modules for m in ('ipywidgets', 'plotly', 'anywidget')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "True"]


@pytest.mark.slow
def test_nbconvert_html_renders_the_figures_without_widgets(tmp_path: object) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nbconvert = pytest.importorskip("nbconvert")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import torch, pipeviz as pv\nfrom pipeviz.zoo import MyNetwork\ntorch.manual_seed(0)\n"
        "pv.Explorer(MyNetwork(512, [512, 1024, 256]), example_args=(torch.randn(32, 512),), splits=['layer0'])")]
    # As JupyterLab saves by default: outputs kept, widget state not saved, so viewers fall back to text/html.
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", store_widget_state=False,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    html, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    assert "pipeviz-static" in html and html.count("pipeviz-stage-row") == 2
    assert html.count('class="plotly-graph-div"') == 2  # the layer graph and the simulated timeline
    assert "Plotly.newPlot" in html


def test_every_control_reaches_the_simulation_and_the_launch_as_one_config(classic_graph: pv.ModelGraph) -> None:
    # Walk the controls: after each change the simulated configuration is the one Launch would run (stages per
    # rank included: the Explorer simulated 2 and launched its config's until 2026-12-02).
    explorer = pv.Explorer(classic_graph, config=pv.LaunchConfig(stages_per_rank=4))
    explorer.plan = ["layer0", "layer1", "layer2"]
    steps = [("schedule", "Interleaved1F1B"), ("microbatches", 8), ("dp", 2), ("tp", 2), ("tp", 1), ("steps", 3),
             ("mode", "infer"), ("schedule", "GPipe"), ("mode", "train"), ("dp", 1)]
    for control, value in steps:
        getattr(explorer, control).value = value
        if (control, value) == ("tp", 2):  # one Linear per stage: nothing to shard, so Launch would refuse it
            assert explorer.sim is None and explorer.refusal is not None and explorer.refusal.setting == "tp"
            continue
        sim = explorer.sim
        assert sim is not None, (control, value, explorer.error)
        assert sim.meta["config"] == explorer.launch_config(), (control, value)
        assert sim.mesh == explorer.launch_config().mesh(explorer.plan.num_stages)
        if control == "schedule" and value == "Interleaved1F1B":
            assert sim.num_stages // sim.num_ranks == 4  # the config's 4 stages per rank, not a hard-coded 2


def test_the_schedule_control_has_help_naming_the_cheat_sheet(explorer: pv.Explorer) -> None:
    """Beside the schedule: what the chosen schedule is, and where all of them are compared (docs/schedules.md)."""
    help_ = explorer.controls.schedule_help
    assert "1F1B (Narayanan et al. 2021, PipeDream-Flush)" in help_.value and "docs/schedules.md" in help_.value
    explorer.schedule.value = "ZBVZeroBubble"
    assert "ZBVZeroBubble (" in help_.value and "two stages per rank in a V" in help_.value


def test_the_schedule_control_points_to_the_cheat_sheet(explorer: pv.Explorer) -> None:
    from pathlib import Path

    assert "docs/schedules.md" in explorer.schedule.tooltip
    assert (Path(__file__).resolve().parent.parent / "docs" / "schedules.md").exists()


def test_a_tp_runs_notes_name_the_measured_factor_and_its_cause(classic_graph: pv.ModelGraph) -> None:
    """Issue 50, point 6: a tp run measured far off the simulated step says by how much and why, beside both."""
    from types import SimpleNamespace

    from pipeviz.widgets import panels

    plan = classic_graph.split(["layer1"])
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, tp=2)
    slow = pv.simulate(plan, cfg)  # this machine's costs, as "measured"
    fast = pv.simulate(plan, cfg, options=pv.CostOptions(hardware="h100-sxm", dtype="bfloat16"))
    assert slow.step_time > 2 * fast.step_time
    run = SimpleNamespace(timeline=lambda: slow, schedule=slow.schedule, layout=SimpleNamespace(num_stages=2),
                          mesh=SimpleNamespace(world=4), spec=SimpleNamespace(tp=2))
    notes = text(panels.run_notes_html(run, fast, None, 2, 0.0))  # type: ignore[arg-type]
    factor = slow.step_time / fast.step_time
    assert (f"measured is {factor:.1f}× the simulated step, which gives each process a core and each collective its "
            "link time only: Simulate as run here prices the shared cores and each TP all-reduce's wait") in notes
    assert "4 processes share 2 CPU cores" in notes
    assert "DTensors" not in notes  # the H100's simulation prices no CPU dispatch (tests/test_tp_pricing.py does)
    run.spec.tp = 1  # pp only: no tp factor named
    assert "all-reduce" not in text(panels.run_notes_html(run, fast, None, 2, 0.0))  # type: ignore[arg-type]
