"""Hang diagnosis (``pipeviz.schedule.hang.diagnose``, ``run.hang``): when a run stops making progress, each rank's last
finished action, the action it is in, whom it waits for, the cycle when ranks wait on each other, and the likely
cause; planted in a real run (a loss that never returns on the last stage), named within a second of the timeout."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.schedule import traits as sched
from pipeviz.schedule.hang import diagnose
from pipeviz.zoo import MyNetwork


def test_a_rank_stuck_computing_and_the_one_waiting_on_it() -> None:
    """1F1B, 2 ranks, 4 microbatches: rank 1 finished 1F0 and is in 1B0 with its input there (it computes);
    rank 0 ran 0F0, 0F1 and waits in 0B0 for rank 1's 1B0."""
    report = diagnose(sched.orders("1F1B", 2, 4), [0, 1], {(0, "F", 0), (0, "F", 1), (1, "F", 0)},
                      computing_for=3.0)
    r0, r1 = report.ranks
    assert (r0.last, r0.current, r0.waits_on, r0.waits_for) == ("0F1", "0B0", 1, "1B0")
    assert "receiving the gradients of stage 1's backward of microbatch 0 (1B0) from rank 1" in r0.what
    assert (r1.last, r1.current, r1.waits_on) == ("1F0", "1B0", None)
    assert "computing for 3.0 s" in r1.what
    assert report.cycle == [] and report.cause.startswith("rank 1 in 1B0: the others wait on it")


def test_orders_that_wait_on_each_other_are_a_cycle() -> None:
    """A custom order whose ranks take the microbatches in opposite orders: rank 0 waits for rank 1's 1B0, rank 1
    for rank 0's 0F1."""
    orders = sched.order_of([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    report = diagnose(orders, [0, 1], {(0, "F", 0)})
    assert [(r.current, r.waits_on, r.waits_for) for r in report.ranks] == [("0B0", 1, "1B0"), ("1F1", 0, "0F1")]
    assert report.cycle == [0, 1] and "orders deadlock" in report.cause
    assert "Ranks 0 -> 1 -> 0 wait on each other" in str(report)


def test_a_rank_that_finished_what_the_other_waits_for() -> None:
    """Rank 0 finished 0F0 but rank 1 never got it (a hand-off of another shape): said, naming rank 0."""
    report = diagnose(sched.orders("GPipe", 2, 2), [0, 1], {(0, "F", 0), (0, "F", 1)})
    assert report.ranks[1].current == "1F0" and report.ranks[1].waits_on is None
    assert report.ranks[0].current == "0B0" and report.ranks[0].waits_on == 1


class _StuckLoss:
    """The last stage's loss never returns on microbatch 1 (its targets hold class 9)."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if bool((target == 9).any()):
            time.sleep(60)
        return F.cross_entropy(output, target)


@pytest.mark.slow
def test_a_planted_hang_is_named_within_a_second_of_the_timeout() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 9, (8,))
    y[2:4] = 9  # microbatch 1 of 4
    plan = pv.trace(MyNetwork(16, [16, 16]), example_args=(x,)).split(["layer0"])
    run = pv.launch(plan, "1F1B", 4, steps=1, inputs=(x,), target=y, loss_fn=_StuckLoss(), timeout=3)
    assert run.wait(120) == "failed"
    ended = time.time()
    assert run.hang is not None and run.error is not None
    r0, r1 = run.hang.ranks
    assert (r1.last, r1.current, r1.waits_on) == ("1F1", "1B1", None), run.error
    assert (r0.current, r0.waits_on, r0.waits_for) == ("0B1", 1, "1B1"), run.error
    assert "Rank 1 in 1B1: the others wait on it" in run.error
    last = run.started_at + max(e.end for e in run.events)
    assert ended - last <= 3 + 1.5  # the timeout, then the report at once


def test_an_order_that_would_hang_is_refused_before_launch_with_the_same_report() -> None:
    """Each rank waits on the other: rank 0 in 0B0 for rank 1's 1B0, rank 1 in 1F1 for rank 0's 0F1 (after 0B0 on
    rank 0). The launch never starts; the error reads as the report of the hang it would have been."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 9, (8,))
    plan = pv.trace(MyNetwork(16, [16, 16]), example_args=(x,)).split(["layer0"])
    order = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]
    cfg = pv.LaunchConfig(microbatches=2, loss_fn=pv.cross_entropy, order=order)
    with pytest.raises(pv.ScheduleError) as info:
        pv.launch(plan, config=cfg, inputs=(x,), target=y)
    report = info.value.report  # type: ignore[attr-defined]
    assert [(r.current, r.waits_on, r.waits_for) for r in report.ranks] == [("0B0", 1, "1B0"), ("1F1", 0, "0F1")]
    assert report.cycle == [0, 1]
    assert "A launch would hang here:\n" + str(report) in str(info.value)
    assert "Ranks 0 -> 1 -> 0 wait on each other. The ranks' orders deadlock" in str(info.value)
