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
    assert str(state.refusal()).startswith("Launch needs at least 2 stages")  # a fresh Explorer: one stage
    state.update(microbatches=5)
    refusal = state.refusal()
    assert isinstance(refusal, LaunchError) and refusal.setting == "microbatches"
    assert str(refusal) == ("microbatches 5 cannot launch: it does not divide the batch of 32; valid: 1, 2, 4, 8, "
                            "16, 32; set microbatches to one of them.")
    # split: the schedule's rule joins in, and the sentence says why 1 and 2 are not valid
    state.set_plan(["layer0", "layer1"])
    assert str(state.refusal()) == ("microbatches 5 cannot launch: it does not divide the batch of 32; valid: 4, 8, "
                                    "16, 32 (1 and 2 are fewer than the 3 stages 1F1B needs); set microbatches to one "
                                    "of them.")
    state.update(microbatches=2)
    assert str(state.refusal()) == ("microbatches 2 cannot launch: 1F1B on 3 stages needs at least 3 microbatches; "
                                    "valid: 4, 8, 16, 32; set microbatches to one of them.")
    state.update(microbatches=4)
    assert state.refusal() is None and state.launch_refusal() is None


def test_every_check_runs_live_at_one_stage_and_the_fix_is_a_click(state: ExplorerState) -> None:
    """Issue 50, point 1: a fresh one-stage state refuses Launch with the click as its fix; the checks that do not
    depend on the stage count (here tp's) run on a stand-in split before the first click; the refusal goes the
    moment its cause does."""
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "stages"
    assert str(refusal) == ("Launch needs at least 2 stages and the plan has 1: click a layer in the graph to split "
                            "after it (or set stages to 2 and press Balance).")
    assert str(state.launch_refusal()) == str(refusal)  # what Launch says when pressed is what is shown
    for microbatches in (5, 3, 64):  # the three: refused before the first split, Launch's own words
        state.update(microbatches=microbatches)
        assert str(state.refusal()).startswith(f"microbatches {microbatches} cannot launch: it does not divide")
    state.update(microbatches=4, tp=3)  # pv.launch's tp check, on a two-stage stand-in
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "tp" and str(refusal).startswith("tp 3 cannot launch: ")
    assert str(refusal).endswith("; set tp to one of them.") and one_sentence(str(refusal))
    state.update(tp=1, microbatches=1)  # 1F1B's rule on a stand-in's 2 stages: not said, the click is the fix
    assert state.refusal() is not None and state.refusal().setting == "stages"  # type: ignore[union-attr]
    state.toggle("layer1")  # now the rule is the plan's own
    assert str(state.refusal()).startswith("microbatches 1 cannot launch: 1F1B on 2 stages needs at least 2")
    state.update(microbatches=4)
    assert state.refusal() is None  # gone the moment its cause is
    state.toggle("layer2")
    state.update(schedule="ZBVZeroBubble")  # 3 stages cannot make a V
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "schedule" and "the plan has 3" in str(refusal)
    assert str(refusal).endswith("; pick one of them in schedule, or click layers to change the stage count.")


def test_no_torch_history_or_tracker_number_in_the_widgets_words(state: ExplorerState) -> None:
    """The rule's history stays in pv.launch's error (and docs/schedules.md); the widget says the rule."""
    from pipeviz.schedule.traits import ScheduleError
    from pipeviz.widgets.refusals import one_sentence as reword

    exc = ScheduleError("1F1B needs at least 3 microbatches for 3 stages, got 2 (torch 2.13's Schedule1F1B refuses "
                        "this when built; older torch hung, torchtitan#775). Fix: microbatches=4.")
    exc.setting = "microbatches"  # type: ignore[attr-defined]
    said = str(reword(exc, state.launch_config().replace(microbatches=2)))
    assert said == "microbatches 2 cannot launch: 1F1B needs at least 3 microbatches for 3 stages, got 2."
    assert "torch" not in said and "#" not in said and one_sentence(said)
    state.set_plan(["layer0", "layer1"])
    state.update(microbatches=2)
    assert "torch" not in str(state.refusal()) and "#" not in str(state.refusal())


def test_a_run_is_out_of_date_after_any_change_of_plan_or_setting(state: ExplorerState) -> None:
    state.toggle("layer1")
    assert state.changes_since_launch() == []  # nothing launched yet
    state.launched()
    assert state.changes_since_launch() == []
    state.update(hardware="h100-sxm")  # prices the simulation only: the run is what it was
    assert state.changes_since_launch() == []
    state.update(microbatches=8)
    assert state.changes_since_launch() == ["microbatches 4 → 8"]
    state.update(tp=2, schedule="GPipe")
    assert state.changes_since_launch() == ["schedule 1F1B → GPipe", "microbatches 4 → 8", "tp 1 → 2"]
    state.update(tp=1, schedule="1F1B", microbatches=4)
    assert state.changes_since_launch() == []  # back to what ran: current again
    state.toggle("layer2")
    assert state.changes_since_launch() == ["the split"]
    state.undo()
    state.update(recompute="full")
    assert state.changes_since_launch() == ["recompute none → full"]


def test_one_vocabulary_for_a_runs_state() -> None:
    """Issue 50, point 5: the status line, the chart title and the numerics line say one state, in the same words;
    no ✓ beside a fix; Stop says the numerics were not checked."""
    from pipeviz.runtime.numerics import NumericsCheck
    from pipeviz.widgets.run_state import run_state

    ok = NumericsCheck(True, 1e-7, 2e-7, "w", 3, 10, 1e-5)
    assert run_state("running").headline == "running" and run_state("running").numerics == ""
    stopped = run_state("stopped")
    assert stopped.headline == "stopped · numerics not checked"
    assert stopped.numerics == "not checked: the run was stopped."
    assert run_state("failed", error="RuntimeError: rank 1 died\n...").headline == "failed ✗ RuntimeError: rank 1 died"
    assert run_state("done", checking=True).headline == "done · checking numerics against the unsplit model…"
    done = run_state("done", ok, changes=["microbatches 4 → 8"])
    assert done.headline == "done ✓ matches the unsplit model · out of date: microbatches 4 → 8"
    assert done.numerics.startswith("✓ matches the unsplit model trained the same way: max |Δloss| 1.00e-07")
    assert done.numerics.endswith(" · out of date: microbatches 4 → 8")
    differs = run_state("done", NumericsCheck(False, 0.5, 0.1, "w", 3, 10, 1e-5))
    assert differs.headline == "done ✗ differs from the unsplit model" and differs.numerics.startswith("✗ differs")
    # tensor parallelism with dropout: the check's note says the differences include chance: no ✓, no "Fix:"
    chance = NumericsCheck(True, 1e-3, 1e-3, "w", 3, 10, 1e-2, note=(
        "The model draws random numbers (3 random ops per forward: dropout or the like); tensor-parallel shards "
        "draw their masks over their shards of each tensor, which the unsplit model cannot draw alike, so the "
        "differences include chance. Fix: model.eval(), or dropout 0 in its config, for a check that compares "
        "computation only; training keeps dropout"))
    vague = run_state("done", chance)
    assert vague.headline == "done · numerics not conclusive (random draws)" and vague.mark == ""
    assert "✓ matches" not in vague.numerics and "Fix:" not in vague.numerics
    assert "with dropout 0 in the model's config" in vague.numerics


def test_the_rounds_rule_is_said_in_the_widgets_words() -> None:
    graph = pv.trace(MyNetwork(16, [16] * 7), example_args=(torch.randn(32, 16),))
    state = ExplorerState(graph, pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=16))
    state.set_plan(pv.balance(graph, 6))  # 3 ranks of 2 stages
    assert str(state.refusal()) == ("microbatches 16 cannot launch: Interleaved1F1B on 3 ranks runs each rank's "
                                    "microbatches in rounds of 5, and 16 is not a whole number of rounds; valid: 1, 2, "
                                    "4, 8; set microbatches to one of them.")


def test_dp_and_schedule_refusals_name_the_control_and_the_valid_values(state: ExplorerState) -> None:
    state.update(dp=3)
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "dp"
    assert str(refusal) == "dp 3 cannot launch: 3 replicas cannot share the batch of 32 equally; valid with 4 " \
                           "microbatches: 1, 2, 4, 8; set dp to one of them."
    state.update(dp=8, microbatches=8)  # 4 rows a replica cannot make 8 microbatches
    assert str(state.refusal()) == ("microbatches 8 cannot launch: it does not divide the 4 rows each of the 8 "
                                    "data-parallel replicas takes from the batch of 32; valid: 1, 2, 4; set "
                                    "microbatches to one of them.")
    state.update(dp=1, microbatches=4, mode="infer", schedule="DualPipeV")
    refusal = state.refusal()
    assert refusal is not None and refusal.setting == "schedule"  # at one stage already
    assert str(refusal) == ("schedule DualPipeV cannot run forward only: torch's V-shaped schedule needs a backward; "
                            "valid in infer mode: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble; "
                            "pick one of them in schedule, or switch run to train.")


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
    assert said[3].startswith("tp 2 cannot launch: nothing to shard: ")
    assert said[3].endswith("; valid here: 1; set tp to one of them.")
    assert said[5].startswith("schedule ZBVZeroBubble cannot launch: ")  # 3 stages cannot be V-shaped
    assert said[5].endswith("; valid here: GPipe, 1F1B; pick one of them in schedule, or click layers to change the "
                            "stage count.")


def test_the_schedule_help_links_the_cheat_sheet() -> None:
    pytest.importorskip("ipywidgets")
    from pipeviz.widgets.controls import schedule_help

    for name in ALL:
        text = schedule_help(name)
        assert text.startswith(f"{name} (") and text.endswith("the schedules cheat sheet, docs/schedules.md.")
    assert "two stages per rank in a V" in schedule_help("ZBVZeroBubble")
    assert "at least as many microbatches as stages" in schedule_help("1F1B")
