"""pipeviz.costs: one memory figure per plan in the preview, the simulator and the balancer; times from
FLOPs or a profile."""

from __future__ import annotations

import itertools
import re

import pytest

import pipeviz as pv
from pipeviz.costs import OPTIMIZER_STATES, in_flight, layer_times, memory_per_rank, peak_activations, stage_costs
from pipeviz.schedule import traits as sched_traits


def _plans(graph: pv.ModelGraph, stages: int) -> list[pv.SplitPlan]:
    names = list(graph.layer_names[:-1])
    return [graph.split(list(c)) for c in itertools.combinations(names, stages - 1)]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_preview_simulator_and_balancer_agree_on_memory(classic_graph: pv.ModelGraph, schedule: str) -> None:
    plan, m = classic_graph.split(["layer0", "layer1"]), 4
    memory = memory_per_rank(plan, schedule, m)
    assert pv.simulate(plan, schedule, m).memory_bytes == memory
    if schedule == "GPipe":  # the preview's figure: a stage with every microbatch in flight
        assert [s.memory_bytes for s in plan.stages] == memory
    # The balancer's limit is in the same units, the copies a stage saves of the tensors it receives included
    # (``SplitPlan.received_saved_bytes``: they depend on where a stage starts; these splits have them): the
    # smallest limit it reports is the best plan's peak.
    plans = _plans(classic_graph, 3)
    assert any(any(p.received_saved_bytes) for p in plans)
    best = min(max(memory_per_rank(p, schedule, m)) for p in plans)
    with pytest.raises(pv.PlanError) as info:
        pv.balance(classic_graph, 3, memory_limit=best - 1, schedule=schedule, microbatches=m)
    reported = float(re.search(r"smallest limit that fits is about ([\d,]+) bytes", str(info.value))[1]
                     .replace(",", ""))
    assert abs(reported - best) <= 1
    fitted = pv.balance(classic_graph, 3, memory_limit=best, schedule=schedule, microbatches=m)
    assert max(memory_per_rank(fitted, schedule, m)) <= best


def test_the_memory_formula(classic_graph: pv.ModelGraph) -> None:
    plan, m = classic_graph.split(["layer1"]), 8
    costs = stage_costs(plan, m)
    # 1F1B on 2 stages: stage 0 keeps 2 microbatches alive at its peak, stage 1 keeps 1.
    assert in_flight("1F1B", 2, m) == [2.0, 1.0]
    assert peak_activations(sched_traits.orders("1F1B", 2, m), costs.activation_bytes) == [
        2 * costs.activation_bytes[0], costs.activation_bytes[1]]
    s0 = plan.stages[0]
    expected = s0.param_bytes * (2 + OPTIMIZER_STATES) + s0.buffer_bytes + 2 * s0.activation_bytes // m
    assert memory_per_rank(plan, "1F1B", m)[0] == expected
    assert memory_per_rank(plan, "1F1B", m, optimizer_states=0)[0] == expected - s0.param_bytes * OPTIMIZER_STATES


def test_times_from_flops_or_from_a_profile(classic_graph: pv.ModelGraph) -> None:
    fwd, bwd, source = layer_times(classic_graph, microbatches=4)
    assert source == "flops" and bwd == [2 * f for f in fwd]
    assert fwd[1] == pytest.approx(classic_graph.layer("layer1").flops / 4 / 2e10)
    prof = pv.Profile("cpu", 2, {n: 0.001 * (i + 1) for i, n in enumerate(classic_graph.layer_names)},
                      {n: 0.002 for n in classic_graph.layer_names}, 0.0, 0.0, 0.0, 0.0)
    fwd, bwd, source = layer_times(classic_graph.with_profile(prof), microbatches=4)
    assert source == "measured"
    assert fwd == pytest.approx([0.0005, 0.001, 0.0015, 0.002])  # measured at 2 microbatches, half the size at 4
