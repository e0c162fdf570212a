"""The public calls of pipeviz 0.2 still work after the redesign, with a DeprecationWarning where a form is retired
(arguments by position past the first few, a comparison row read as a dict, a planner row's simulate_options), and
give the same results as the new forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.costs import Costs, parallel_costs
from pipeviz.zoo import MyNetwork

RETIRED = pytest.warns(DeprecationWarning, match=r"by keyword; by position they are deprecated since pipeviz 0.3")


@pytest.fixture(scope="module")
def graph() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(MyNetwork(8, [8, 16, 8]), example_args=(torch.randn(8, 8),))


def test_simulate_by_position(graph: pv.ModelGraph) -> None:
    plan = graph.split(["layer0", "layer1", "layer2"])
    new = pv.simulate(plan, "Interleaved1F1B", 4, stages_per_rank=2, dp=2)
    with RETIRED:
        old = pv.simulate(plan, "Interleaved1F1B", 4, 2, None, None, None, None, None, False, 2)
    assert old.events == new.events and old.meta["config"] == new.meta["config"]
    with pytest.raises(TypeError, match="got multiple values for argument 'stages_per_rank'"):
        pv.simulate(plan, "Interleaved1F1B", 4, 2, stages_per_rank=2)
    # the short form, a schedule name then microbatches, is not retired
    assert pv.simulate(plan, "1F1B", 4).events == pv.simulate(
        plan, pv.LaunchConfig(schedule="1F1B", microbatches=4, loss_fn=pv.cross_entropy)).events


def test_balance_plan_cluster_and_references_by_position(graph: pv.ModelGraph) -> None:
    with RETIRED:
        assert pv.balance(graph, 2, "params") == pv.balance(graph, 2, by="params")
    with RETIRED:
        old = pv.plan_cluster(graph, 2, "h100", 8, None, None, ["1F1B"], "none")
    new = pv.plan_cluster(graph, 2, "h100", global_batch=8, schedules=["1F1B"], recompute="none")
    assert [r.step_time for r in old.rows] == [r.step_time for r in new.rows]
    x, y = graph.example_args[0], torch.randint(0, 10, (8,))
    with RETIRED:
        old_ref = pv.train_reference(graph.model, (x,), y, F.cross_entropy, pv.sgd(lr=0.1), 2, 2)
    new_ref = pv.train_reference(graph.model, (x,), y, loss_fn=F.cross_entropy, optimizer=pv.sgd(lr=0.1),
                                 microbatches=2, steps=2)
    assert old_ref[0] == new_ref[0]


@pytest.mark.slow
def test_launch_with_steps_by_position(graph: pv.ModelGraph) -> None:
    plan = graph.split(["layer1"])
    x, y = graph.example_args[0], torch.randint(0, 10, (8,))
    with RETIRED:
        run = pv.launch(plan, "1F1B", 2, 2, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(120) == "done" and len(run.losses) == 2 and run.spec.config.steps == 2


def test_rows_read_as_dicts(graph: pv.ModelGraph) -> None:
    cmp = pv.compare(graph.split(["layer1"]), microbatches=4)
    row = cmp.rows[0]
    with pytest.warns(DeprecationWarning, match=r"row\.schedule, not row\['schedule'\]"):
        assert row["schedule"] == row.schedule
    with pytest.warns(DeprecationWarning, match=r"row\.plan, not row\['plan'\]"):
        assert row["plan"] is row.plan
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        row["nope"]
    best = pv.plan_cluster(graph, 2, "h100", global_batch=8, schedules=["1F1B"], recompute="none").best
    with pytest.warns(DeprecationWarning, match="simulate_options is deprecated"):
        options = best.simulate_options
    assert options["dp"] == best.dp and options["options"] == best.options


def test_parallel_costs_with_loose_degrees() -> None:
    costs = Costs.uniform(2)
    assert parallel_costs(costs, 2, 2) == parallel_costs(costs, pv.Mesh(pp=1, dp=2, tp=2))


def test_compare_takes_the_runs_settings_in_its_config(graph: pv.ModelGraph) -> None:
    """pv.compare's dp=/tp=/loss_fn= keywords restated LaunchConfig's fields: they still work, with a warning naming
    the config form, and give the same rows."""
    plan = graph.split(["layer1"])
    new = pv.compare(plan, ["GPipe", "1F1B"], 4, config=pv.LaunchConfig(loss_fn=pv.cross_entropy, dp=2, tp=2))
    with pytest.warns(DeprecationWarning, match=r"pv.compare\(plan, config=pv.LaunchConfig\(dp=..., tp=..."):
        old = pv.compare(plan, ["GPipe", "1F1B"], 4, dp=2, tp=2)
    assert [r.step_time for r in old.rows] == [r.step_time for r in new.rows]
    assert all(tl.meta["mesh"] == (2, 2, 2) for tl in old.timelines.values())


def test_simulates_short_form_keywords_are_launch_configs_fields() -> None:
    """pv.simulate's short-form keywords (dp=, tp=, ...) are LaunchConfig's fields with LaunchConfig's types, and its
    cost keywords are CostOptions' fields (CostChanges): no option dict drifts from the config it restates."""
    import dataclasses

    from pipeviz.cost.options import CostChanges, CostOptions
    from pipeviz.sim.simulate import SimulateOptions

    launch = {f.name: f.type for f in dataclasses.fields(pv.LaunchConfig)}
    cost = {f.name for f in dataclasses.fields(CostOptions)}
    own = set(SimulateOptions.__annotations__) - set(CostChanges.__annotations__)
    assert own and all(k in launch for k in own)
    def text(t: object) -> str:  # an annotation as written (a TypedDict's are ForwardRefs, a dataclass's strings)
        return str(getattr(t, "__forward_arg__", t))

    assert {k: text(SimulateOptions.__annotations__[k]) for k in own} == {k: text(launch[k]) for k in own}
    assert set(CostChanges.__annotations__) == cost
