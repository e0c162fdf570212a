"""The communication order checked before launch (``pipeviz.schedule.comm_order``): torch's own sends and receives for
every
built-in schedule play without deadlock; a hand-made order that waits to receive before it sends is refused with
the hang report naming ranks, peers and actions; a custom compute order is checked through torch's own lowering;
too few microbatches are refused naming the starved ranks."""

from __future__ import annotations

import pytest

from pipeviz.schedule import traits as sched
from pipeviz.schedule.comm_order import check_comm_order, check_comms, programs
from pipeviz.sim.engine import check_order


@pytest.mark.parametrize("name", sched.ALL)
def test_every_builtin_schedule_plays_without_deadlock(name: str) -> None:
    checked = 0
    for stages in (2, 4, 6, 8):
        for m in (1, 2, 3, 4, 6, 8, 12):
            try:
                sched.check_microbatches(name, stages, m)
            except sched.ScheduleError:
                continue
            check_comms(name, stages, m)
            checked += 1
    assert checked >= 8


def test_1f1b_program_is_torchs_batched_pairs() -> None:
    """Schedule1F1B, 2 stages, 2 microbatches, rank 0: the kept-back forward send goes out with the first gradient
    receive, in one batch waited on together."""
    rank0 = [str(s) for s in programs("1F1B", 2, 2)[0]]
    assert rank0 == ["0F0", "post(0SEND_F0)", "0F1", "wait(0SEND_F0)", "post(0SEND_F1, 0RECV_B0)",
                     "wait(0SEND_F1, 0RECV_B0)", "0B0", "post(0RECV_B1)", "wait(0RECV_B1)", "0B1"]


def test_a_receive_before_send_cycle_is_refused_naming_ranks_peers_and_actions() -> None:
    # rank 0 sends 0F0's activations only after its backward, which waits for rank 1's gradients; rank 1 waits for
    # those activations in 1F0 first
    order = [["0F0", "0RECV_B0", "0B0", "0SEND_F0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    with pytest.raises(sched.ScheduleError, match="communication order deadlocks") as info:
        check_comm_order(order, (0, 1))
    report = info.value.report  # type: ignore[attr-defined]
    assert [(r.rank, r.last, r.current, r.waits_on, r.waits_for) for r in report.ranks] == [
        (0, "0F0", "0RECV_B0", 1, "1SEND_B0"), (1, None, "1RECV_F0", 0, "0SEND_F0")]
    assert report.cycle == [0, 1]
    text = str(info.value)
    assert "rank 0: is blocked after 0F0 and before 0B0, receiving stage 1's gradients of microbatch 0 (0RECV_B0) " \
           "from rank 1, which has not posted its send 1SEND_B0" in text
    assert "Ranks 0 -> 1 -> 0 wait on each other" in text


def test_a_send_waiting_on_a_receive_never_posted_is_named() -> None:
    # rank 1 receives microbatch 1 before microbatch 0: the pair's messages would match out of order
    order = [["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
             ["1RECV_F1", "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"]]
    with pytest.raises(sched.ScheduleError, match="from rank 0 to rank 1 would be matched out of order"):
        check_comm_order(order, (0, 1))


def test_a_custom_compute_order_is_checked_through_torchs_lowering() -> None:
    lay = sched.layout("Interleaved1F1B", 4)
    order = [["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
             ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"]]
    assert check_order(sched.order_of(order), lay, 2) == sched.order_of(order)


def test_too_few_microbatches_names_the_starved_ranks_and_numbers() -> None:
    with pytest.raises(sched.ScheduleError) as info:
        sched.check_microbatches("1F1B", 4, 2)
    text = str(info.value)
    assert "microbatches=2 does not work: 1F1B needs at least as many microbatches as stages (4)" in text
    assert "rank 0 (stage 0) runs 4 forwards before its first backward, rank 1 (stage 1) 3" in text
    assert "rank 2" not in text and "Valid: 4, 5" in text


def test_a_layout_is_played_once_and_a_refusal_every_time() -> None:
    """validate_launch's check is remembered per layout (every Explorer control change validates a launch); a refused
    layout raises again, naming the same ranks."""
    from pipeviz.schedule.comm_order import check_schedule_comms

    check_schedule_comms.cache_clear()
    check_schedule_comms("Interleaved1F1B", 8, 16, 2)
    check_schedule_comms("Interleaved1F1B", 8, 16, 2)
    assert check_schedule_comms.cache_info().hits == 1
    for _ in range(2):
        with pytest.raises(sched.ScheduleError, match="rank 0 \\(stage 0\\) runs 4 forwards before its first backward"):
            check_schedule_comms("1F1B", 4, 2)
