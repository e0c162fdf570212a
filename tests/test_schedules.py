"""Schedules as data: per-rank action orders, the validator, and the order a real run executes."""

from __future__ import annotations

import itertools

import pytest

from pipeviz.schedule import traits as sched


def table(text: str) -> sched.Order:
    """An order written as torch prints it, one rank a line, as the Actions ``orders`` gives."""
    return sched.order_of([line.split() for line in text.strip().splitlines()])


def test_gpipe_order() -> None:
    assert sched.orders("GPipe", 3, 4) == table("""
        0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
        1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
        2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3
    """)


def test_1f1b_order() -> None:
    # torch warms stage r up with min(m, p - r) forwards, then one backward, one forward, ...
    assert sched.orders("1F1B", 3, 5) == table("""
        0F0 0F1 0F2 0B0 0F3 0B1 0F4 0B2 0B3 0B4
        1F0 1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3 1B4
        2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4
    """)


def test_interleaved_order_from_torch() -> None:
    assert sched.orders("Interleaved1F1B", 4, 4) == table("""
        0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    """)


def test_zbv_order_is_v_shaped_with_split_backward() -> None:
    o = sched.orders("ZBVZeroBubble", 4, 4)
    assert [str(a) for a in o[0][:6]] == ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0"]
    assert {a.stage for a in o[0]} == {0, 3} and {a.stage for a in o[1]} == {1, 2}


def _accepted(schedule: str, stages: int, m: int, spr: int | None) -> bool:
    try:
        sched.check_microbatches(schedule, stages, m, spr)
    except sched.ScheduleError:
        return False
    return True


_COMBOS = [
    (s, ranks, v, m)
    for s in sched.ALL
    for ranks, v, m in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4, 6, 8])
    if (s in sched.SINGLE) == (v == 1) and not (s in sched.V_SHAPED and v != 2)
]
GRID = [c for c in _COMBOS if _accepted(c[0], c[1] * c[2], c[3], None if c[2] == 1 else c[2])]
REJECTED = [c for c in _COMBOS if c not in GRID]


@pytest.mark.parametrize(("schedule", "ranks", "v", "m"), GRID)
def test_every_order_is_valid(schedule: str, ranks: int, v: int, m: int) -> None:
    stages = ranks * v
    spr = None if v == 1 else v
    lay = sched.layout(schedule, stages, spr)
    sched.validate(sched.orders(schedule, stages, m, spr), stages, m, lay.stage_ranks)


@pytest.mark.parametrize(("schedule", "ranks", "v", "m"), REJECTED)
def test_rejected_combinations_say_which_counts_work(schedule: str, ranks: int, v: int, m: int) -> None:
    with pytest.raises(sched.ScheduleError, match=r"microbatches=\d+ does not work: .* Valid: "):
        sched.orders(schedule, ranks * v, m, None if v == 1 else v)


@pytest.mark.parametrize(
    ("order", "message"),
    [
        ([["0F0", "0B0"], ["1F0"]], "stage 1 microbatch 0 needs either B, or both I and W."),
        ([["0B0", "0F0"], ["1F0", "1B0"]], "0B0 runs before 0F0."),
        ([["0F0", "0F0", "0B0"], ["1F0", "1B0"]], "rank 0: 0F0 appears twice."),
        ([["0F0", "0B0", "1F0"], ["1B0"]], "rank 0: 1F0 runs stage 1, which lives on rank 1."),
        ([["0F0", "0I0", "0W0"], ["1F0", "1W0", "1I0"]], "1W0 runs before 1I0."),
    ],
)
def test_validator_names_the_broken_rule(order: list[list[str]], message: str) -> None:
    with pytest.raises(sched.ScheduleError) as info:
        sched.validate(order, 2, 1, (0, 1))
    assert str(info.value) == message


def test_an_action_of_an_unknown_kind_is_refused_wherever_it_enters() -> None:
    import pipeviz as pv
    from pipeviz.costs import Costs
    from pipeviz.schedule.traits import Action, ScheduleError, parse

    assert parse("2I3") == Action(2, "I", 3) == (2, "I", 3) and str(Action(2, "W", 0)) == "2W0"
    for bad in ("0X0", "F0", "0F", "a0F0"):
        with pytest.raises(ScheduleError, match=rf"Not an action: '{bad}'.*F, B, I, W"):
            parse(bad)
    with pytest.raises(ScheduleError, match=r"Not an action: '0X0'"):  # a custom order: refused, not priced as I
        pv.simulate(None, "1F1B", 1, costs=Costs.uniform(2), num_stages=2,
                    order=[["0F0", "0X0", "0B0"], ["1F0", "1B0"]])
    with pytest.raises(ScheduleError, match=r"Cannot price an action of kind 'X'"):
        Costs.uniform(1).duration(0, "X")
