"""A split inside a routed mixture-of-experts block would send a tensor sized by the routing: refused at the plan."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.plan.errors import PlanError
from pipeviz.zoo import MoENet


@pytest.fixture(scope="module")
def graph() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(MoENet(layers=3), example_args=(torch.randint(0, 512, (4, 16)),))


def test_a_split_sending_routed_rows_is_refused_naming_the_value_and_the_fix(graph: pv.ModelGraph) -> None:
    with pytest.raises(PlanError) as err:
        graph.split(["blocks.1.experts.0"])
    text = str(err.value)
    assert "'blocks.1.experts.0'" in text and "depends on the data" in text
    assert "(blocks.1" in text  # the value named with the module that makes it
    assert "split before or after the whole mixture-of-experts block" in text and "blocks.1," in text


def test_no_split_candidate_cuts_a_routed_block(graph: pv.ModelGraph) -> None:
    inside = [n for n in graph.split_candidates if ".experts" in n]
    assert inside == []
    assert {"blocks.0", "blocks.1", "blocks.0.router"} <= set(graph.split_candidates)
    assert graph.data_dependent_at(graph.position("blocks.1.experts.1")) != ""
    assert graph.data_dependent_at(graph.position("blocks.1")) == ""
    assert graph.split(["blocks.0", "blocks.1"]).num_stages == 3
