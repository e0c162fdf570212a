"""The "Plan for a cluster" panel, headless: the controls drive pv.plan_cluster, a chosen row reaches the callback
and loads into the Explorer."""

from __future__ import annotations

import re

import pytest
import torch

import pipeviz as pv
from pipeviz.planner.cluster import LayoutOption
from pipeviz.zoo import TinyTransformer

pytest.importorskip("ipywidgets")

from pipeviz.widgets.cluster import ClusterPanel, load_layout


@pytest.fixture(scope="module")
def tiny() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(TinyTransformer(vocab=64, dim=32, heads=2, depth=4, seq=16),
                    example_args=(torch.randint(0, 64, (8, 16)),))


def test_plan_then_pick_a_row(tiny: pv.ModelGraph) -> None:
    chosen: list[LayoutOption] = []
    panel = ClusterPanel(tiny, on_select=chosen.append, top=5)
    assert panel.rows.layout.display == "none"  # no empty box before the first Plan
    assert list(panel.hardware.options) == list(pv.HARDWARE) and panel.global_batch.value == 64
    panel.hardware.value, panel.gpus.value, panel.global_batch.value = "a100-80gb", 4, 16
    result = panel.plan()
    assert result is not None and result == panel.result
    assert result.rows == pv.plan_cluster(tiny, 4, "a100", global_batch=16, top=5).rows
    assert len(panel.rows.options) == len(result.rows) and panel.rows.options[0][0].startswith("1. pp")
    assert "4 x a100-80gb" in panel.summary.value and panel.errors.value == ""
    panel.rows.value = 1  # what a click on the second row does
    assert chosen == [result.rows[1]] and panel.selected == result.rows[1]
    assert panel.rows.layout.display == ""


def test_the_panel_lists_rows_in_the_planners_units(tiny: pv.ModelGraph) -> None:
    """One set of figures: the panel's row and `pipeviz plan`'s table (ClusterPlan.table) give the same step,
    peak memory, MFU and microbatch size and count, in that order; a small model's MFU is not '0.0%'."""
    panel = ClusterPanel(tiny, gpus=4, hardware="a100-80gb", global_batch=16, top=3)
    result = panel.plan()
    assert result is not None and result.rows
    table = result.table(3).splitlines()
    columns = re.split(r"\s{2,}", table[1].strip())  # columns are 2+ spaces apart; "mb size", "32.3 us" hold one
    for i in range(min(3, len(result.rows))):
        text = panel.rows.options[i][0]
        cells = dict(zip(columns, re.split(r"\s{2,}", table[2 + i].strip()), strict=True))
        assert f"mb size {cells['mb size']} · m {cells['m']}" in text, (text, table[2 + i])
        assert f"MFU {cells['MFU']}" in text and cells["MFU"] != "0.0%"
        assert f"· {cells['step'].rstrip('*')} ·" in text and text.endswith(f"· {cells['peak memory']}")
    # the number of microbatches is m, not mbs (the lessons' microbatch size): a legend under the table and the rows
    assert "mbs" not in table[1].split() and "m" in columns and "mb size" in columns
    legend = result.legend()
    assert any("m: microbatches per step" in line for line in legend) and legend == table[2 + len(result.rows[:3]):][
        :len(legend)]
    assert panel.legend.layout.display == "" and "m: microbatches per step" in panel.legend.value
    assert "tp priced in Megatron-LM&#x27;s layout" in panel.legend.value and result.tp_layout == "megatron"
    # the demo's report shows the same cells (its HTML table, parsed back)
    from html.parser import HTMLParser

    from pipeviz.widgets.report import cluster_table

    class Cells(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list[str]] = []
            self.cell = False

        def handle_starttag(self, tag: str, attrs: object) -> None:
            if tag == "tr":
                self.rows.append([])
            elif tag in ("td", "th"):
                self.rows[-1].append("")
                self.cell = True

        def handle_endtag(self, tag: str) -> None:
            self.cell = self.cell and tag not in ("td", "th")

        def handle_data(self, data: str) -> None:
            if self.cell:
                self.rows[-1][-1] += data

    parsed = Cells()
    parsed.feed(cluster_table(result, top=3))
    assert parsed.rows[0] == columns
    for i in range(min(3, len(result.rows))):
        assert parsed.rows[1 + i] == re.split(r"\s{2,}", table[2 + i].strip())


def test_errors_are_shown_not_swallowed(tiny: pv.ModelGraph) -> None:
    def broken(option: LayoutOption) -> None:
        raise RuntimeError("callback failed")

    panel = ClusterPanel(tiny, on_select=broken, gpus=2, global_batch=8)
    panel.plan()
    panel.rows.value = 0
    assert "callback failed" in panel.errors.value
    with pytest.raises(IndexError, match="No row 99"):
        panel.select(99)
    panel.gpus.value = 0  # typed as is, refused by name (a bounded box turned it into 1 without a word)
    assert panel.gpus.value == 0 and panel.plan() is None
    assert "gpus must be a positive int, got 0" in panel.errors.value


def test_a_row_loads_into_the_explorer(tiny: pv.ModelGraph) -> None:
    ex = pv.Explorer(tiny)
    panel = ClusterPanel(ex.graph, on_select=lambda option: load_layout(ex, option), gpus=4, global_batch=16)
    result = panel.plan()
    assert result is not None
    option = next(r for r in result.rows if r.pp > 1)
    panel.select(result.rows.index(option))
    assert ex.plan == option.plan and ex.schedule.value == option.schedule
    assert (ex.microbatches.value, ex.dp.value, ex.tp.value) == (option.microbatches, option.dp, option.tp)
    # the Explorer's preview and simulation now cost the plan on the row's hardware, with its recomputation
    assert ex.hardware.value == "h100-sxm" and ex.recompute.value == option.recompute
    assert ex.cost_options().hw == pv.hardware("h100") and ex.cost_options().recompute == option.recompute
    # one set of figures: the Explorer simulates the step the panel lists for the row (with the row's own costs:
    # its dtype, batch scale and collectives), until the cost controls leave the row's hardware
    assert ex.cost_options() == option.options and ex.sim.step_time == pytest.approx(option.step_time, rel=1e-9)
    assert f"{option.step_time * 1e3:.2f}" in ex.preview.value or f"{option.step_time * 1e6:.2f}" in ex.preview.value
    ex.hardware.value = "a100-80gb"
    assert ex.cost_options() != option.options


def test_every_listed_row_simulates_in_the_explorer_as_listed(tiny: pv.ModelGraph) -> None:
    """One set of figures, every row: loaded into the Explorer a row simulates at the step and peak memory the
    panel lists, with its microbatches -- also a row whose microbatches do not divide this notebook's example
    batch (16 of size 1 against a traced batch of 8): the cluster's step is shown, Launch is refused and says why."""
    from pipeviz.plan.preview import human_bytes

    ex = pv.Explorer(tiny)
    panel = ClusterPanel(ex.graph, on_select=lambda option: load_layout(ex, option), gpus=4, global_batch=16,
                         top=14)
    result = panel.plan()
    assert result is not None
    assert any(r.microbatches > 8 and r.pp > 1 for r in result.rows)  # the case a local batch of 8 cannot launch
    for i, row in enumerate(result.rows):
        panel.select(i)
        if row.pp == 1:
            continue  # no pipeline: the Explorer's preview asks for a split
        assert ex.sim is not None, (row, ex.refused.value)
        assert ex.microbatches.value == row.microbatches
        assert ex.sim.step_time == pytest.approx(row.step_time, rel=1e-9)
        assert max(ex.sim.meta["memory_bytes"]) == row.peak_memory
        assert panel.rows.options[i][0].endswith(human_bytes(max(ex.sim.meta["memory_bytes"])))
        if row.microbatches > 8:
            assert ex.launch_button.disabled and "Launch runs this notebook's example batch" in ex.error


def test_the_explorer_costs_on_the_hardware_chosen(tiny: pv.ModelGraph) -> None:
    """Hardware and recomputation controls: the preview's times and memory, Balance and the simulated timeline
    all follow them (one cost model), and "this machine" gives back today's figures."""
    ex = pv.Explorer(tiny)
    ex.auto_balance(2)
    here_step, here_preview = ex.sim.step_time, ex.preview.value
    assert ex.cost_options() == pv.CostOptions()
    ex.hardware.value, ex.recompute.value = "a100-80gb", "full"
    options = pv.CostOptions(hardware="a100-80gb", dtype="bfloat16", recompute="full")
    assert ex.cost_options() == options
    expected = pv.simulate(ex.plan, ex.schedule.value, ex.microbatches.value, options=options)
    assert ex.sim.step_time == pytest.approx(expected.step_time) and ex.sim.step_time < here_step / 10
    from pipeviz.costs import stage_costs
    from pipeviz.plan.preview import human_bytes

    # the memory column is the simulated peak per rank: in the hardware's dtype, with what recomputation keeps
    for mem in ex.sim.meta["memory_bytes"]:
        assert human_bytes(mem) in ex.preview.value
    assert ex.sim.meta["memory_bytes"] != pv.simulate(ex.plan, ex.schedule.value, ex.microbatches.value).memory_bytes
    assert ex.auto_balance(2) == pv.balance(tiny, 2, schedule=ex.schedule.value, microbatches=ex.microbatches.value,
                                            options=options)
    assert stage_costs(ex.plan, 1, options=options).source != stage_costs(ex.plan, 1).source
    ex.hardware.value, ex.recompute.value = "this machine", "none"
    assert ex.sim.step_time == pytest.approx(here_step) and ex.preview.value == here_preview


def test_the_explorer_has_the_panel(tiny: pv.ModelGraph) -> None:
    ex = pv.Explorer(tiny)
    ex.cluster.gpus.value, ex.cluster.global_batch.value = 4, 16
    result = ex.cluster.plan()
    assert result is not None and ex.cluster.graph is ex.graph
    ex.cluster.rows.value = 0
    assert ex.plan == result.rows[0].plan and ex.schedule.value == result.rows[0].schedule


@pytest.mark.slow
def test_a_row_launches_here_scaled_down_with_one_click(tiny: pv.ModelGraph) -> None:
    """A row of 8 GPUs (pp x dp, its schedule, recomputation and reduction) launched from the Explorer's panel on the
    notebook's batch of 8: the same split, schedule, recomputation and reduction, the replicas cut to fit 4
    processes, the traced dtype; it trains exactly, and each process's measured peak of saved activations is what the
    Explorer's simulation of the launched config planned (within 10 %)."""
    ex = pv.Explorer(tiny)
    assert ex.cluster is not None
    panel = ex.cluster
    panel.gpus.value, panel.global_batch.value = 8, 64
    result = panel.plan()
    assert result is not None
    index = next(i for i, r in enumerate(result.rows) if r.pp == 2 and r.dp == 4 and r.recompute == "none")
    row = result.rows[index]
    panel.select(index)
    assert not panel.launch_button.disabled
    panel.launch_here()
    assert panel.errors.value == "" and ex.run is not None, (panel.errors.value, ex.error)
    assert ex.wait(240) == "done", ex.error
    run = ex.run
    cfg = run.spec.config
    assert (cfg.schedule, cfg.stages_per_rank, cfg.recompute) == (row.schedule, row.config.stages_per_rank,
                                                                 row.recompute)
    assert cfg.dp == 2 and cfg.tp == 1 and run.mesh.world == 4 and cfg.mixed_precision is None  # (traced dtype)
    assert row.config.mixed_precision == "bf16" and row.scaled_down(8, keep_dtype=True).mixed_precision == "bf16"
    assert (cfg.dp_reduce or "overlap") == row.dp_reduce
    assert [s.layers for s in run.plan.stages] == [s.layers for s in row.plan.stages]
    assert "✓ matches" in ex.numerics.value, ex.numerics.value
    assert ex.sim is not None
    planned = ex.sim.meta["peak_activation_bytes"]
    for proc, samples in run.activation_memory.items():
        got = max(b for _, b in samples)
        assert abs(planned[run.mesh.coords(proc).pp] / got - 1) <= 0.10, (proc, planned, got)


def test_an_expert_parallel_row_loads_with_its_ep() -> None:
    """A row of a MoE model with ep > 1 loads its ep (and cp) into the Explorer's controls: the Explorer then
    simulates the step the row lists (before, ep stayed 1 and the Explorer showed the step without all-to-alls)."""
    from pipeviz.zoo import MoENet

    torch.manual_seed(0)
    ex = pv.Explorer(pv.trace(MoENet(layers=4), example_args=(torch.randint(0, 512, (8, 16)),)))
    result = pv.plan_cluster(ex.graph, 8, "h100", global_batch=16, ep=[2], top=40)
    row = next(r for r in result.rows if r.ep == 2 and r.pp > 1)
    load_layout(ex, row)
    assert (ex.ep.value, ex.cp.value, ex.dp.value) == (2, row.cp, row.dp)
    assert ex.launch_config().ep == 2
    assert ex.sim is not None and ex.sim.step_time == pytest.approx(row.step_time, rel=1e-9)
    assert any(e.kind == "A2A" for e in ex.sim.events)
