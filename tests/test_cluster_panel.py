"""The "Plan for a cluster" panel, headless: the controls drive pv.plan_cluster, a chosen row reaches the callback
and loads into the Explorer."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.zoo import TinyTransformer

pytest.importorskip("ipywidgets")

from pipeviz.widgets.cluster import ClusterPanel, load_layout


@pytest.fixture(scope="module")
def tiny() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(TinyTransformer(vocab=64, dim=32, heads=2, depth=4, seq=16),
                    example_args=(torch.randint(0, 64, (8, 16)),))


def test_plan_then_pick_a_row(tiny: pv.ModelGraph) -> None:
    chosen: list[pv.LayoutOption] = []
    panel = ClusterPanel(tiny, on_select=chosen.append, top=5)
    assert list(panel.hardware.options) == list(pv.HARDWARE) and panel.global_batch.value == 64
    panel.hardware.value, panel.gpus.value, panel.global_batch.value = "a100-80gb", 4, 16
    result = panel.plan()
    assert result is not None and result == panel.result
    assert result.rows == pv.plan_cluster(tiny, 4, "a100", 16, top=5).rows
    assert len(panel.rows.options) == len(result.rows) and panel.rows.options[0][0].startswith("1. pp")
    assert "4 x a100-80gb" in panel.summary.value and panel.errors.value == ""
    panel.rows.value = 1  # what a click on the second row does
    assert chosen == [result.rows[1]] and panel.selected == result.rows[1]


def test_errors_are_shown_not_swallowed(tiny: pv.ModelGraph) -> None:
    def broken(option: pv.LayoutOption) -> None:
        raise RuntimeError("callback failed")

    panel = ClusterPanel(tiny, on_select=broken, gpus=2, global_batch=8)
    panel.plan()
    panel.rows.value = 0
    assert "callback failed" in panel.errors.value
    with pytest.raises(IndexError, match="No row 99"):
        panel.select(99)


def test_a_row_loads_into_the_explorer(tiny: pv.ModelGraph) -> None:
    ex = pv.Explorer(tiny)
    panel = ClusterPanel(ex.graph, on_select=lambda option: load_layout(ex, option), gpus=4, global_batch=16)
    result = panel.plan()
    assert result is not None
    option = next(r for r in result.rows if r.pp > 1)
    panel.select(result.rows.index(option))
    assert ex.plan == option.plan and ex.schedule.value == option.schedule
    assert (ex.microbatches.value, ex.dp.value, ex.tp.value) == (option.microbatches, option.dp, option.tp)


def test_the_explorer_has_the_panel(tiny: pv.ModelGraph) -> None:
    ex = pv.Explorer(tiny)
    ex.cluster.gpus.value, ex.cluster.global_batch.value = 4, 16
    result = ex.cluster.plan()
    assert result is not None and ex.cluster.graph is ex.graph
    ex.cluster.rows.value = 0
    assert ex.plan == result.rows[0].plan and ex.schedule.value == result.rows[0].schedule
