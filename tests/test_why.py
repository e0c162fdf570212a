"""Why a step takes as long as it does (``pv.critical_path``, ``pv.idle_gaps``): the critical path of a simulated
step spans exactly the step under every schedule, each of its links tight; idle gaps labelled on a hand-checked
1F1B case; on a measured run the path lies within the run's step."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.costs import Costs
from pipeviz.schedule import traits as sched
from pipeviz.sim.why import dependencies, handoffs
from pipeviz.zoo import MyNetwork


def test_a_hand_checked_1f1b_step() -> None:
    """2 stages on 2 ranks, 2 microbatches, F = 1, B = 2, no link cost. Rank 0: F0 0-1, F1 1-2, B0 4-6, B1 7-9;
    rank 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7. Rank 1 waits for rank 0's first forward; rank 0 for rank 1's
    backwards, twice; the path runs F0, then all of rank 1, then rank 0's last backward."""
    tl = pv.simulate(None, "1F1B", 2, costs=Costs.uniform(2, 1.0, 2.0), num_stages=2)
    path = pv.critical_path(tl)
    assert [(e.rank, e.kind, e.mb) for e in path] == [(0, "F", 0), (1, "F", 0), (1, "B", 0), (1, "F", 1),
                                                      (1, "B", 1), (0, "B", 1)]
    assert path[-1].end - path[0].start == tl.step_time == 9.0
    gaps = pv.idle_gaps(tl)
    assert [(g.rank, g.start, g.end, g.reason) for g in gaps] == [
        (0, 2.0, 4.0, "waits for rank 1's B of microbatch 0 (stage 1)"),
        (0, 6.0, 7.0, "waits for rank 1's B of microbatch 1 (stage 1)"),
        (1, 0.0, 1.0, "waits for rank 0's F of microbatch 0 (stage 0)")]
    assert str(gaps[0]).startswith("rank 0 idle 2000.000-4000.000 ms: waits for rank 1's B")
    b0 = next(e for e in tl.events if (e.rank, e.kind, e.mb) == (0, "B", 0))
    assert {(d.rank, d.kind, d.mb) for d in dependencies(tl, b0)} == {(0, "F", 1), (0, "F", 0), (1, "B", 0)}
    # the hand-offs between ranks, in the order the receiving actions start: the arrows of the drawing
    assert [(a.label, b.label) for a, b in handoffs(tl)] == [("0F0", "1F0"), ("0F1", "1F1"), ("1B0", "0B0"),
                                                             ("1B1", "0B1")]


@pytest.mark.parametrize("schedule", sched.ALL)
def test_the_critical_path_of_a_simulated_step_is_the_step(schedule: str) -> None:
    """Uneven stages and a link cost: the path spans the step exactly, and each link waits no longer than the
    hand-off between two ranks (or not at all on one rank)."""
    n = 4
    spr = sched.SCHEDULES[schedule].stages_per_rank if sched.SCHEDULES[schedule].multi else None
    costs = Costs((1.0, 1.5, 0.7, 1.2), (2.0, 3.0, 1.4, 2.4), (0.1, 0.2, 0.1), (1,) * n, (0,) * n)
    tl = pv.simulate(None, schedule, 8, costs=costs, num_stages=n, stages_per_rank=spr)
    path = pv.critical_path(tl)
    assert path[-1].end - path[0].start == pytest.approx(tl.step_time)
    assert path[0].start == pytest.approx(min(e.start for e in tl.events))
    for a, b in itertools.pairwise(path):
        wait = b.start - a.end
        assert -1e-9 <= wait <= 0.2 + 1e-9, (a, b)
        if a.rank == b.rank:
            assert wait == pytest.approx(0.0)
    for g in pv.idle_gaps(tl):  # every gap says what it waits for
        assert g.reason and g.end > g.start


@pytest.mark.slow
def test_on_a_measured_run_the_path_lies_within_the_step() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    plan = pv.trace(MyNetwork(64, [128, 128, 128]), example_args=(x,)).split(["layer1"])
    run = pv.launch(plan, "1F1B", 4, steps=3, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(120) == "done", run.error
    tl = run.timeline()
    path = pv.critical_path(tl)  # the second step's
    assert path and {e.step for e in path} == {1}
    span = path[-1].end - path[0].start
    assert 0 < span <= tl.step_times[1] + 1e-9
    gaps = pv.idle_gaps(tl)
    assert gaps and all(g.reason for g in gaps)
    assert any("waits for rank 0's F of microbatch 0" in g.reason for g in gaps if g.rank == 1)


def test_the_figure_draws_the_path_and_labels_the_gaps() -> None:
    """``timeline_figure(..., why=True)``: a line through the critical path's actions (at their ranks' rows) and a
    faint bar per idle gap whose hover is its label."""
    from pipeviz.widgets.figures import timeline_figure

    tl = pv.simulate(None, "1F1B", 2, costs=Costs.uniform(2, 1.0, 2.0), num_stages=2)
    fig = timeline_figure(tl, why=True)
    [path] = [t for t in fig.data if t.meta and t.meta[1] == "PATH"]
    [idle] = [t for t in fig.data if t.meta and t.meta[1] == "IDLE"]
    assert list(path.y) == [0, 1, 1, 1, 1, 0] and list(path.x) == [500.0, 1500.0, 3000.0, 4500.0, 6000.0, 8000.0]
    assert list(idle.base) == [2000.0, 6000.0, 0.0] and list(idle.x) == [2000.0, 1000.0, 1000.0]
    assert idle.hovertext[0] == "waits for rank 1's B of microbatch 0 (stage 1)"
    [arrows] = [t for t in fig.data if t.meta and t.meta[1] == "DEP"]  # 0F0's end (1000 ms) to 1F0's start
    assert list(arrows.x[:3]) == [1000.0, 1000.0, None] and list(arrows.y[:3]) == [0, 1, None]
    assert arrows.marker.symbol == "arrow" and list(arrows.marker.size[:3]) == [0, 7, 0]
    assert not [t for t in timeline_figure(tl).data if t.meta and t.meta[0] == "why"]
