"""A custom schedule (``LaunchConfig.order``): the same per-rank action lists ``pv.simulate`` plays run through
torch's own ``_PipelineScheduleRuntime`` in ``pv.launch``, train exactly like the unsplit model, and a broken order
is refused before any process starts."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.schedule import traits as sched
from pipeviz.schedule.traits import ScheduleError
from tests.models import Tied4
from tests.test_launch_checks import _children

# Two ranks, the backward split into input-grad (I) and weight-grad (W) passes, W deferred into the bubbles:
# ZB-H1's shape, written by hand (no torch schedule class has this exact order).
ZB_H1 = (("0F0", "0F1", "0F2", "0I0", "0F3", "0I1", "0W0", "0I2", "0W1", "0I3", "0W2", "0W3"),
         ("1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1F3", "1I3", "1W2", "1W3"))
# Four stages looped over two ranks (Interleaved1F1B's placement), all forwards first, full backwards in reverse.
LOOPED = (("0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"),
          ("1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"))


def _plan(stages: int) -> tuple[pv.SplitPlan, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))
    graph = pv.trace(Tied4(), (x,))  # tied embedding and head: shared-weight gradients summed across ranks
    names = graph.layer_names  # emb l1 l2 l3 head
    return graph.split(list(names[1:2] if stages == 2 else names[:3])), x, y


def _actions(tl: pv.Timeline, step: int = 0) -> list[list[str]]:
    per_rank: list[list[str]] = [[] for _ in range(tl.num_ranks)]
    for e in sorted(tl.events, key=lambda e: e.start):
        if e.kind in ("F", "B", "I", "W") and e.step == step:
            per_rank[e.rank].append(f"{e.stage}{e.kind}{e.mb}")
    return per_rank


@pytest.mark.parametrize(("order", "schedule", "stages", "microbatches"),
                         [(ZB_H1, "1F1B", 2, 4), (LOOPED, "Interleaved1F1B", 4, 2)], ids=["zb-h1", "looped"])
def test_a_custom_order_runs_in_torchs_runtime_as_simulated_and_trains_exactly(
        order: tuple[tuple[str, ...], ...], schedule: str, stages: int, microbatches: int) -> None:
    plan, x, y = _plan(stages)
    cfg = pv.LaunchConfig(schedule=schedule, microbatches=microbatches, steps=2, loss_fn=pv.cross_entropy,
                          order=[list(acts) for acts in order])
    assert cfg.actions() == sched.order_of(order)  # read once, held as Actions
    assert [[str(a) for a in acts] for acts in cfg.order or ()] == [list(acts) for acts in order]
    simulated = pv.simulate(plan, cfg)
    assert _actions(simulated) == [list(acts) for acts in order]
    run = pv.launch(plan, config=cfg, inputs=(x,), target=y)
    assert run.wait(120) == "done", run.error
    # each rank ran exactly the given actions in the given order, in both steps
    for step in (0, 1):
        assert _actions(run.timeline(), step) == [list(acts) for acts in order]
    check = pv.check_numerics(run)
    assert check.ok, check


@pytest.mark.parametrize(("order", "match"), [
    ([["0F0", "0B0"], ["1F0", "1B0"]], "0F1 is missing"),
    ([["0F0", "0F1", "0B1", "0B0"], ["1B0", "1F0", "1F1", "1B1"]], "1B0 runs before 1F0"),
    # each rank waits on the other: rank 0 for 0B0 (needs 1B0), rank 1 for 1F1 (needs 0F1, after 0B0 on rank 0)
    ([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]], "deadlocks"),
    ([["0F0", "0F1", "0B0", "0B1"]], "order has 1 rank lists"),
    ([["0F0", "0F1", "0X0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]], "Not an action: '0X0'"),
    ([["1F0", "1F1", "1B0", "1B1"], ["0F0", "0F1", "0B0", "0B1"]], "lives on rank"),
])
def test_a_broken_order_is_refused_before_any_process(order: list[list[str]], match: str) -> None:
    plan, x, y = _plan(2)
    before = _children()
    with pytest.raises(ScheduleError, match=match):
        cfg = pv.LaunchConfig(microbatches=2, loss_fn=pv.cross_entropy, order=order)
        pv.launch(plan, config=cfg, inputs=(x,), target=y)
    assert _children() <= before
    if "Not an action" not in match:  # (that one fails building the config) the simulator refuses it the same
        with pytest.raises(ScheduleError, match=match):
            pv.simulate(plan, cfg)


def test_an_order_without_a_loss_is_refused() -> None:
    plan, x, _ = _plan(2)
    with pytest.raises(pv.LaunchError, match="order= is a training step's actions"):
        pv.launch(plan, config=pv.LaunchConfig(microbatches=2, order=[["0F0"], ["1F0"]]), inputs=(x,))
