"""The Explorer's tools (``pipeviz.widgets.tools``): Synthesize beside the schedules, with a memory limit per rank (the
order found is what the Explorer simulates, compares and launches), and the export menu (torchrun, torchtitan,
Megatron-LM), headless on a real tiny transformer: a real synthesis, real files written and read back."""

from __future__ import annotations

import csv
import re
import tomllib
from pathlib import Path

import pytest
import torch

import pipeviz as pv
from pipeviz.planner.synthesize import MemoryLimitError
from pipeviz.widgets.state import ExplorerState
from pipeviz.widgets.tools import Synthesizer, export_plan, mib, parse_memory
from pipeviz.zoo import MyNetwork, TinyTransformer


def one_sentence(text: str) -> bool:
    """Ends with its only full stop: no ". Next" inside, no "Fix:" written for code."""
    return text.endswith(".") and not re.search(r"\.\s+[A-Z(]", text[:-1]) and "Fix:" not in text


@pytest.fixture(scope="module")
def graph() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(TinyTransformer(depth=4), example_args=(torch.randint(0, 64, (8, 16)),))


@pytest.fixture
def state(graph: pv.ModelGraph) -> ExplorerState:
    state = ExplorerState(graph, pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=2))
    state.set_plan(["blocks.1"])
    return state


@pytest.fixture(scope="module")
def explorer() -> pv.Explorer:
    torch.manual_seed(0)
    x = torch.randint(0, 64, (8, 16))
    return pv.Explorer(TinyTransformer(depth=4), example_args=(x,), splits=["blocks.1"], schedule="1F1B",
                       microbatches=4, steps=2)


def test_the_memory_box_reads_sizes_per_rank() -> None:
    assert parse_memory("") is None and parse_memory("  ") is None
    assert parse_memory("512 MB") == 512 * 2**20 == parse_memory("512") == parse_memory("512mib")
    assert parse_memory("1.5 GB") == 3 * 2**29 and parse_memory("64 KB") == 2**16 and parse_memory("100 B") == 100
    for bad in ("two GB", "-1 GB", "0", "5 parsecs", "1e3"):
        with pytest.raises(ValueError) as err:
            parse_memory(bad)
        assert one_sentence(str(err.value)) and repr(bad.strip()) in str(err.value)
    assert mib(284_128) == "0.28 MB" and parse_memory(mib(284_128))  # shown rounded up, so typing it is enough
    assert parse_memory(mib(284_128)) >= 284_128  # type: ignore[operator]


def test_synthesize_puts_the_order_into_the_state_and_follows_it(state: ExplorerState) -> None:
    syn = Synthesizer(state)
    found = syn.synthesize()
    assert state.launch_config().order == found.order  # what the simulation and Launch now take
    assert state.settings.schedule == found.config.schedule
    sim = state.simulate()
    assert sim is not None and sim.step_time == pytest.approx(found.step_time)
    torch_steps = {n: t.step_time for n, t in found.baselines.items()}
    assert found.step_time <= min(torch_steps.values()) * (1 + 1e-9), torch_steps  # no limit: at least the fastest
    assert state.refusal() is None  # it launches as it is
    assert "Synthesized order in use" in syn.summary() and "1F1B" in syn.summary()
    # a setting it was found for changes: the order is taken out (it would no longer run), and the reason said
    assert not syn.follow()
    state.update(microbatches=8)
    assert syn.follow() and state.launch_config().order is None and syn.synthesis is None
    assert "4 microbatches" in syn.dropped and one_sentence(syn.dropped)
    syn.synthesize()
    state.toggle("blocks.0")  # a click
    assert syn.follow() and "the plan" in syn.dropped and state.launch_config().order is None
    syn.synthesize()
    assert syn.clear() and state.launch_config().order is None and not syn.clear()


def test_a_limit_no_order_fits_names_the_smallest_in_the_boxs_units(state: ExplorerState) -> None:
    syn = Synthesizer(state)
    with pytest.raises(MemoryLimitError) as err:
        syn.synthesize(parse_memory("0.01 MB"))
    text, smallest = str(err.value), err.value.smallest
    assert one_sentence(text) and f"the smallest feasible limit is {mib(smallest)}" in text, text
    assert state.launch_config().order is None  # nothing changed
    within = syn.synthesize(parse_memory(mib(smallest)))  # the limit the sentence names is enough
    assert max(within.memory_bytes) <= parse_memory(mib(smallest))  # type: ignore[operator]
    fastest = Synthesizer(state).synthesize(None)
    assert within.step_time >= fastest.step_time * (1 - 1e-9)  # (less memory costs time, never gains it)


def test_refusals_before_a_search(graph: pv.ModelGraph) -> None:
    state = ExplorerState(graph, pv.LaunchConfig(microbatches=4))
    with pytest.raises(ValueError, match="at least 2 stages") as err:
        Synthesizer(state).synthesize()
    assert one_sentence(str(err.value))
    state.set_plan(["blocks.1"])
    state.update(mode="infer")
    with pytest.raises(ValueError, match="switch run to train"):
        Synthesizer(state).synthesize()


def test_compare_rows_run_their_own_order_under_a_custom_one(state: ExplorerState) -> None:
    found = Synthesizer(state).synthesize()
    cfg = state.launch_config()
    with_order = pv.compare(state.plan, microbatches=4, config=cfg)
    plain = pv.compare(state.plan, microbatches=4, config=cfg.replace(order=None))
    assert [(r.schedule, r.step_time) for r in with_order.rows] == [(r.schedule, r.step_time) for r in plain.rows]
    assert all(r.config.order is None for r in with_order.rows) and found.order


def test_the_torchtitan_export_writes_the_synthesized_order_beside_the_toml(state: ExplorerState,
                                                                            tmp_path: Path) -> None:
    syn = Synthesizer(state)
    found = syn.synthesize()
    out = export_plan(state, "torchtitan", tmp_path / "pp.toml")
    toml_path, table = out.files
    data = tomllib.loads(toml_path.read_text())
    par = data["parallelism"]
    assert par["module_fqns_per_model_part"] == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm",
                                                                                     "head"]]
    assert par["pipeline_parallel_degree"] == 2 and par["pipeline_parallel_schedule"] == found.config.schedule
    assert Path(par["pipeline_parallel_schedule_csv"]) == table.resolve()
    with table.open() as f:
        assert tuple(tuple(row) for row in csv.reader(f)) == tuple(tuple(map(str, r)) for r in found.order)
    assert par["pipeline_parallel_microbatch_size"] * 4 == data["training"]["local_batch_size"] == 8
    assert out.text.startswith(toml_path.read_text()) and "pp.schedule.csv" in out.text
    assert syn.clear()
    state.update(schedule="GPipe")
    plain = export_plan(state, "torchtitan", tmp_path / "plain.toml")  # a torch schedule: no CSV
    assert len(plain.files) == 1 and "pipeline_parallel_schedule_csv" not in tomllib.loads(plain.text)["parallelism"]


def test_the_megatron_export_and_its_refusal(state: ExplorerState) -> None:
    out = export_plan(state, "megatron")
    assert "--pipeline-model-parallel-layout 'Ett|ttL'" in out.text and "--pipeline-model-parallel-size 2" in out.text
    assert "--micro-batch-size 2" in out.text and not out.files and out.note == ""
    layout = re.search(r"layout '([^']+)'", out.text).group(1)  # type: ignore[union-attr]
    assert state.graph.split_megatron(layout) == state.plan  # read back: the same stages
    torch.manual_seed(0)
    other = ExplorerState(pv.trace(MyNetwork(64, [128, 64]), example_args=(torch.randn(8, 64),)), pv.LaunchConfig())
    other.set_plan(["layer0"])
    with pytest.raises(ValueError) as err:
        export_plan(other, "megatron")
    text = str(err.value)
    assert text.startswith("The Megatron-LM export refuses this plan: ") and one_sentence(text), text
    assert isinstance(err.value.__cause__, pv.PlanError)
    with pytest.raises(ValueError, match="Unknown export 'deepspeed'; valid: torchrun, torchtitan, megatron"):
        export_plan(state, "deepspeed")


def test_the_torchrun_export_writes_a_script_for_the_settings(state: ExplorerState, tmp_path: Path) -> None:
    out = export_plan(state, "torchrun", tmp_path / "train.py")
    script, payload = out.files
    assert script.exists() and payload.exists() and f"torchrun --nproc-per-node 2 {script}" in out.text
    compile(script.read_text(), str(script), "exec")  # a Python script
    with pytest.raises(ValueError, match="is a folder"):
        export_plan(state, "torchrun", tmp_path)


def test_the_explorer_synthesizes_draws_compares_and_exports(explorer: pv.Explorer, tmp_path: Path) -> None:
    ex, tools = explorer, explorer.tools
    tools.memory_limit.value = "0.01 MB"
    tools.synth_button.click()
    assert tools.synthesizer.synthesis is None and "smallest feasible limit" in tools.synth_note.value
    assert one_sentence(tools.error) and ex.launch_config().order is None
    tools.memory_limit.value = ""
    tools.synth_button.click()
    syn = tools.synthesizer.synthesis
    assert syn is not None and tools.error == ""
    assert ex.launch_config().order == syn.order and ex.schedule.value == syn.config.schedule
    assert ex.sim is not None and ex.sim.step_time == pytest.approx(syn.step_time)  # drawn as simulated
    assert ex.refusal is None and not ex.launch_button.disabled
    assert "Synthesized order in use" in tools.synth_note.value and tools.clear_button.layout.display == ""
    ex.side_button.value = True  # side by side: the order first, then torch's schedules on these ranks
    titles = [a.text for a in ex.side_figure.layout.annotations]  # type: ignore[union-attr]
    assert titles[0].startswith(f"custom order ({syn.config.schedule}'s placement): step {syn.step_time * 1e3:.2f}")
    assert any(t.startswith("GPipe: step") for t in titles)
    ex.side_button.value = False
    tools.export_kind.value = "torchtitan"
    tools.export_path.value = str(tmp_path / "tt.toml")
    tools.export_button.click()
    assert tools.error == "" and tools.exported is not None
    assert "pipeline_parallel_schedule_csv" in tools.export_text.value
    tools.export_kind.value = "megatron"
    assert tools.export_path.disabled
    tools.export_button.click()
    assert "'Ett|ttL'" in tools.export_text.value and "does not carry over" in tools.export_note.value
    ex.microbatches.value = 8  # the order was for 4: out, and said so
    assert ex.launch_config().order is None and "no longer runs here" in tools.synth_note.value
    ex.microbatches.value = 4
    assert ex.launch_config().order is None  # (taken out stays out)


@pytest.mark.slow
def test_the_synthesized_order_launches_from_the_explorer_as_found(explorer: pv.Explorer) -> None:
    ex = explorer
    ex.microbatches.value = 4
    syn = ex.tools.synthesize()
    assert syn is not None
    run = ex.launch()
    assert run is not None and ex.wait(240) == "done", run.error if run else ex.error
    measured = run.timeline()
    for rank in range(2):  # each rank ran the synthesized order, action for action, every step
        for step in measured.steps:
            assert measured.order(rank, step=step) == list(syn.order[rank])
    assert "✓ matches" in ex.numerics.value, ex.numerics.value
