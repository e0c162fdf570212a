"""Pipeline × tensor parallel (``pv.launch(..., tp=K)``): each stage's projections sharded column-wise then
row-wise over K processes with DTensor, exact against the unsplit model under every schedule (three in
``make test``, the other four in ``make compat``), with data parallelism too (8 processes)."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.schedule.tensor_parallel import check_tp_plan, default_tp_plan
from pipeviz.zoo import MyNetwork
from tests.models import TiedSkipBN
from tests.schedule_sets import SCHEDULES, train_exactly

PLAN4 = {"layer0.lin": "colwise", "layer1.lin": "rowwise", "layer2.lin": "colwise", "output_proj": "rowwise"}


def _setup() -> tuple[MyNetwork, torch.Tensor, torch.Tensor, pv.ModelGraph]:
    torch.manual_seed(0)
    model = MyNetwork(16, [16, 32, 16])
    x, y = torch.randn(16, 16), torch.randint(0, 10, (16,))
    return model, x, y, pv.trace(model, example_args=(x,))


def test_the_default_plan_pairs_linears_column_then_row_within_each_stage() -> None:
    model, _, _, graph = _setup()
    plan = graph.split(["layer1"])
    assert default_tp_plan(model, [s.layers for s in plan.stages]) == {
        "layer0.lin": "colwise", "layer1.lin": "rowwise", "layer2.lin": "colwise", "output_proj": "rowwise"}
    assert check_tp_plan(model, {"layer0.lin": "colwise", "layer1.lin": "rowwise"}, 2) == {
        "layer0.lin.weight": "shard0", "layer0.lin.bias": "shard0", "layer1.lin.weight": "shard1",
        "layer1.lin.bias": "replicate"}


def test_a_tensor_parallel_plan_that_cannot_work_is_refused_before_any_process() -> None:
    _, x, y, graph = _setup()
    plan = graph.split(["layer1"])
    kw = {"inputs": (x,), "target": y, "loss_fn": pv.cross_entropy}
    with pytest.raises(pv.LaunchError, match=r"tp_plan names 'layer0', which is not an nn.Linear .*Valid: layer0.lin"):
        pv.launch(plan, "1F1B", 4, steps=1, tp=2, tp_plan={"layer0": "colwise"}, **kw)
    with pytest.raises(pv.LaunchError, match=r"tp_plan\['layer0.lin'\] is 'diagonal'; valid: 'colwise', 'rowwise'"):
        pv.launch(plan, "1F1B", 4, steps=1, tp=2, tp_plan={"layer0.lin": "diagonal"}, **kw)
    with pytest.raises(pv.LaunchError, match=r"'output_proj' has 10 output features, which tp=4 shards cannot share"):
        pv.launch(plan, "1F1B", 4, steps=1, tp=4, tp_plan={"output_proj": "colwise"}, **kw)
    with pytest.raises(pv.LaunchError, match=r"tp must be a positive int"):
        pv.launch(plan, "1F1B", 4, steps=1, tp=0, **kw)


def _train(schedules: tuple[str, ...], dp: int = 1) -> None:
    _, x, y, graph = _setup()
    for schedule in schedules:
        one = schedule in ("GPipe", "1F1B")
        plans = graph.split(["layer1"]), graph.split(["layer0", "layer1", "layer2"])
        run = train_exactly(schedule, plans, inputs=(x,), target=y, loss_fn=pv.cross_entropy, dp=dp, tp=2,
                            tp_plan=None if one else PLAN4)
        assert len(run.losses) == 2 and run.mesh.tp == 2 and len({e.rank for e in run.events}) == run.mesh.world
        # the shards' collectives are measured actions: every process, every step, within a stage it holds
        tp_events = [e for e in run.events if e.kind == "TP"]
        assert {(e.rank, e.step) for e in tp_events} == {(r, s) for r in range(run.mesh.world) for s in range(2)}
        assert all(e.end >= e.start and e.stage in run.layout.stages_of(run.mesh.coords(e.rank).pp)
                   for e in tp_events), schedule


@pytest.mark.slow
@SCHEDULES
def test_pipeline_times_tensor_parallel_trains_like_the_unsplit_model(schedules: tuple[str, ...]) -> None:
    _train(schedules)


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes
def test_pipeline_data_and_tensor_parallel_together_on_8_processes() -> None:
    _train(("1F1B",), dp=2)


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes
def test_tensor_parallel_keeps_tied_weights_skips_and_batchnorm_exact() -> None:
    torch.manual_seed(0)
    model = TiedSkipBN()
    ids, target = torch.randint(0, 16, (16, 4)), torch.randint(0, 16, (16, 4))
    plan = pv.trace(model, example_args=(ids,)).split(["l1", "bn", "l2"])

    run = pv.launch(plan, "Interleaved1F1B", 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), tp=2, tp_plan={"l2": "colwise", "l3": "rowwise"})
    assert run.wait(240) == "done", run.error
    assert pv.check_numerics(run).ok
