"""The Explorer's state without a widget (``pipeviz.widgets.state``): its plan history, the settings and the one
LaunchConfig they make, and why those settings cannot launch, each refusal one sentence in the widget's terms."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import pipeviz as pv
from pipeviz.errors import LaunchError
from pipeviz.schedule.traits import ALL
from pipeviz.widgets.state import HERE, ExplorerState, Settings
from pipeviz.zoo import MyNetwork


@pytest.fixture
def state(classic_graph: pv.ModelGraph) -> ExplorerState:
    return ExplorerState(classic_graph, pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=2))  # a batch of 32


def one_sentence(text: str) -> bool:
    """Ends with its only full stop: no ". Next" inside, no "Fix:" written for code."""
    return text.endswith(".") and not re.search(r"\.\s+[A-Z(]", text[:-1]) and "Fix:" not in text


def test_the_state_imports_neither_ipywidgets_nor_plotly() -> None:
    code = ("import sys, pipeviz.widgets.state, pipeviz.widgets.refusals; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ipywidgets', 'plotly', 'anywidget')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plan_history_undo_and_redo(state: ExplorerState) -> None:
    assert state.plan.num_stages == 1 and not state.can_undo and not state.can_redo
    state.toggle("layer0")
    state.set_plan(["layer0", "layer1"])  # layer names work too
    assert state.plan.num_stages == 3 and state.can_undo
    assert state.undo().num_stages == 2 and state.undo().num_stages == 1 and not state.can_undo
    assert state.redo().num_stages == 2 and state.can_redo
    state.toggle("layer2")  # a new change drops what redo had
    assert not state.can_redo and state.plan.split_spec == {"layer0": pv.SplitPoint.END, "layer2": pv.SplitPoint.END}
    before = state.plan
    with pytest.raises(ValueError, match="no module runs after it"):
        state.toggle("output_proj")
    assert state.plan is before
    state.set_plan(before)  # the same plan: nothing recorded
    assert state.undo().num_stages == 2
    assert state.balance(3).num_stages == 3 and state.undo().num_stages == 2  # Balance is undone like a click


def test_expand_and_collapse_are_plans_on_another_graph(skip_graph: pv.ModelGraph) -> None:
    state = ExplorerState(skip_graph, pv.LaunchConfig())
    block = next(la.name for la in skip_graph.layers if la.expandable)
    state.expand(block)
    assert block not in state.graph.layer_names and state.plan.graph is state.graph
    state.undo()
    assert block in state.graph.layer_names


def test_the_settings_make_one_launch_config(state: ExplorerState) -> None:
    cfg = state.launch_config()
    assert (cfg.schedule, cfg.microbatches, cfg.steps, cfg.dp, cfg.tp) == ("1F1B", 4, 2, 1, 1)
    assert cfg.loss_fn is pv.cross_entropy and state.settings == Settings("1F1B", 4, 2)
    state.update(schedule="Interleaved1F1B", microbatches=8, dp=2, recompute="full")
    cfg = state.launch_config()
    assert (cfg.schedule, cfg.microbatches, cfg.dp, cfg.recompute, cfg.stages_per_rank) == (
        "Interleaved1F1B", 8, 2, "full", None)
    state.update(mode="infer", tp=2, sequence_parallel=True)
    cfg = state.launch_config()
    assert cfg.loss_fn is None and cfg.optimizer is None and cfg.recompute == "none" and cfg.sequence_parallel
    state.update(tp=1)
    assert not state.launch_config().sequence_parallel  # nothing to split the tokens over
    assert state.cost_options() == pv.CostOptions(recompute="full") and state.settings.hardware == HERE
    with pytest.raises(TypeError, match=r"Unknown setting.*'micro_batches'.*valid: schedule, microbatches"):
        state.update(micro_batches=4)
    with pytest.raises(ValueError, match="mode='infr' is not one of"):
        state.update(mode="infr")


def test_a_microbatch_count_that_never_launches_is_refused_at_one_stage(state: ExplorerState) -> None:
    assert state.refusal() is None
    state.update(microbatches=5)
    refusal = state.refusal()
    assert isinstance(refusal, LaunchError) and refusal.setting == "microbatches"
    assert str(refusal) == ("microbatches 5 cannot launch: it does not divide the batch of 32; valid: 1, 2, 4, 8, "
                            "16, 32.")
    # split: the schedule's rule joins in, and the sentence says why 1 and 2 are not valid
    state.set_plan(["layer0", "layer1"])
    assert str(state.refusal()) == ("microbatches 5 cannot launch: it does not divide the batch of 32; valid: 4, 8, "
                                    "16, 32 (1F1B on 3 stages needs at least 3).")
    state.update(microbatches=2)
    assert str(state.refusal()) == ("microbatches 2 cannot launch: 1F1B on 3 stages needs at least 3 microbatches; "
                                    "valid: 4, 8, 16, 32.")
    state.update(microbatches=4)
    assert state.refusal() is None and state.launch_refusal() is None


def test_the_rounds_rule_is_said_in_the_widgets_words() -> None:
    graph = pv.trace(MyNetwork(16, [16] * 7), example_args=(torch.randn(32, 16),))
    state = ExplorerState(graph, pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=16))
    state.set_plan(pv.balance(graph, 6))  # 3 ranks of 2 stages
    assert str(state.refusal()) == ("microbatches 16 cannot launch: Interleaved1F1B on 3 ranks runs each rank's "
                                    "microbatches in rounds of 5, and 16 is not a whole number of rounds; valid: 1, 2, "
                                    "4, 8.")


def test_dp_and_schedule_refusals_name_the_control_and_the_valid_values(state: ExplorerState) -> None:
    state.update(dp=3)
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "dp"
    assert str(refusal) == "dp 3 cannot launch: 3 replicas cannot share the batch of 32 equally; valid with 4 " \
                           "microbatches: 1, 2, 4, 8."
    state.update(dp=8, microbatches=8)  # 4 rows a replica cannot make 8 microbatches
    assert str(state.refusal()) == ("microbatches 8 cannot launch: it does not divide the 4 rows each of the 8 "
                                    "data-parallel replicas takes from the batch of 32; valid: 1, 2, 4.")
    state.update(dp=1, microbatches=4, mode="infer", schedule="DualPipeV")
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "schedule"  # at one stage already
    assert str(refusal) == ("schedule DualPipeV cannot run forward only: torch's V-shaped schedule needs a backward; "
                            "valid in infer mode: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble "
                            "(or switch run to train).")


def test_every_refusal_is_one_sentence(state: ExplorerState) -> None:
    """The settings' own refusals and pv.launch's checks reworded: one sentence, the control first, no code fix."""
    said = []
    for plan, changes in ((3, {"microbatches": 5}), (3, {"microbatches": 2}), (3, {"dp": 3}), (4, {"tp": 2}),
                          (3, {"mode": "infer", "schedule": "ZBVZeroBubble"}), (3, {"schedule": "ZBVZeroBubble"}),
                          (3, {"schedule": "Interleaved1F1B"})):
        state.set_plan(["layer0", "layer1", "layer2"][:plan - 1])
        state.update(**changes)
        refusal = state.refusal()
        assert refusal is not None, changes
        said.append(str(refusal))
        state.update(**{k: getattr(Settings("1F1B", 4, 2), k) for k in changes})
    assert all(one_sentence(s) for s in said), said
    assert said[3].startswith("tp 2 cannot launch: nothing to shard: ") and said[3].endswith("; valid here: 1.")
    assert said[5].startswith("schedule ZBVZeroBubble cannot launch: ")  # 3 stages cannot be V-shaped
    assert said[5].endswith("; valid here: GPipe, 1F1B.")


def test_launch_says_a_single_stage_in_the_widgets_terms(state: ExplorerState) -> None:
    assert state.refusal() is None  # nothing wrong with the settings: the preview asks for a split
    refusal = state.launch_refusal()
    assert refusal is not None and str(refusal) == (
        "Launch needs a pipeline of at least 2 stages and the plan has 1: click a layer in the graph to split after "
        "it, or press Balance.")


def test_the_schedule_help_links_the_cheat_sheet() -> None:
    pytest.importorskip("ipywidgets")
    from pipeviz.widgets.controls import schedule_help

    for name in ALL:
        text = schedule_help(name)
        assert text.startswith(f"{name} (") and text.endswith("the schedules cheat sheet, docs/schedules.md.")
    assert "two stages per rank in a V" in schedule_help("ZBVZeroBubble")
    assert "at least as many microbatches as stages" in schedule_help("1F1B")
