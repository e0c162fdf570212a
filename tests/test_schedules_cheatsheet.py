"""docs/schedules.md, the schedules cheat sheet: every figure of its table checked against ``pv.simulate``.

The table's formulas are Python expressions in ``p``, ``m``, ``v`` and ``r``; this test reads them from the page and
evaluates them, so the page and the simulator cannot drift apart. Equal stages throughout (``pv.Costs.uniform``:
forward 1, backward 2, a split backward's I and W 1 each, hand-offs free unless a test says otherwise).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

import pipeviz as pv
from pipeviz.schedule import traits as sched

PAGE = Path(__file__).resolve().parents[1] / "docs" / "schedules.md"
# (p, m): m a multiple of p and at least 2p, where the page says its formulas hold
GRID = [(2, 4), (2, 8), (3, 6), (3, 9), (4, 8), (4, 12), (5, 10)]
FREE_V = (1, 2, 3)  # stages per rank tried where the schedule takes any


@dataclass(frozen=True)
class Row:
    schedule: str
    stages_per_rank: str
    backward: str
    microbatches: str
    bubble: str
    example: str
    in_flight: str
    hand_offs: str


def _code(cell: str) -> str:
    found = re.findall(r"`([^`]+)`", cell)
    assert len(found) == 1, f"expected one formula in {cell!r}"
    return found[0]


def _rows() -> dict[str, Row]:
    lines = [ln for ln in PAGE.read_text(encoding="utf-8").splitlines() if ln.startswith("| ")]
    header, *body = lines
    assert header.split(" | ")[0] == "| schedule"
    rows = {}
    for line in body:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[cells[0]] = Row(*cells[:8])
    return rows


ROWS = _rows()


def _eval(formula: str, **names: int) -> float:
    return eval(formula, {"__builtins__": {}, "min": min, "max": max}, names)  # the page's own expression


def _default_v(row: Row) -> int:
    found = re.search(r"\d+", row.stages_per_rank)
    assert found, row.stages_per_rank
    return int(found.group())


def _v_values(row: Row) -> tuple[int, ...]:
    return FREE_V if "(any)" in row.stages_per_rank else (_default_v(row),)


def _sim(schedule: str, p: int, m: int, v: int, **costs: object) -> pv.Timeline:
    c = replace(pv.Costs.uniform(p * v), **costs) if costs else pv.Costs.uniform(p * v)
    return pv.simulate(None, schedule, m, costs=c, num_stages=p * v,
                       stages_per_rank=v if sched.info(schedule).multi else None)


def _in_flight(tl: pv.Timeline) -> list[int]:
    """Per rank, the most (stage, microbatch) pairs held at once: from a forward's start to its last backward's end."""
    spans: dict[tuple[int, int, int], list[float]] = {}
    for e in tl.events:
        span = spans.setdefault((e.rank, e.stage, e.mb), [float("inf"), float("-inf")])
        if e.kind == "F":
            span[0] = min(span[0], e.start)
        else:
            span[1] = max(span[1], e.end)
    peaks = []
    for rank in range(tl.num_ranks):
        marks = sorted(mark for (r, _, _), (a, b) in spans.items() if r == rank for mark in ((a, 1), (b, -1)))
        held = peak = 0
        for _, change in marks:  # at one instant, a release before a start
            held += change
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def test_the_page_lists_all_seven_schedules_in_torchs_order() -> None:
    assert tuple(ROWS) == sched.ALL
    assert len(ROWS) == 7


@pytest.mark.parametrize("schedule", sched.ALL)
def test_bubble_and_the_example_column(schedule: str) -> None:
    row = ROWS[schedule]
    for v in _v_values(row):
        for p, m in GRID:
            tl = _sim(schedule, p, m, v)
            expected = _eval(_code(row.bubble), p=p, m=m, v=v)
            assert tl.bubble_fraction == pytest.approx(expected, abs=1e-9), (schedule, p, m, v)
    shown = float(row.example.rstrip(" %")) / 100
    assert round(_sim(schedule, 4, 8, _default_v(row)).bubble_fraction, 3) == pytest.approx(shown, abs=1e-9)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize(("forward", "backward"), [(2.0, 2.0), (1.0, 4.0), (1.0, 1.0)])
def test_without_a_split_backward_the_idle_time_is_p_minus_1_stage_forwards_and_backwards(
        schedule: str, forward: float, backward: float) -> None:
    v = 1 if schedule == "1F1B" else 2
    for p, m in GRID:
        tl = _sim(schedule, p, m, v, forward=(forward,) * p * v, backward=(backward,) * p * v)
        busy = v * m * (forward + backward)
        assert tl.step_time - busy == pytest.approx((p - 1) * (forward + backward))
        assert tl.bubble_fraction == pytest.approx(_eval(_code(ROWS[schedule].bubble), p=p, m=m, v=v))


def test_zero_bubble_idles_a_third_of_1f1b_at_equal_costs_and_zb_h1_is_a_third_of_1f1b() -> None:
    for p, m in GRID:
        one_f_one_b = _sim("1F1B", p, m, 1)
        assert one_f_one_b.step_time - 3 * m == pytest.approx(3 * (p - 1))
        for schedule in sched.ZERO_BUBBLE:
            assert _sim(schedule, p, m, 2).step_time - 2 * 3 * m == pytest.approx(p - 1)  # (p-1) * tF
        zb_h1 = _sim("InterleavedZeroBubble", p, m, 1)  # one stage per rank
        assert zb_h1.step_time - 3 * m == pytest.approx((one_f_one_b.step_time - 3 * m) / 3)


def test_zbv_needs_enough_microbatches_for_its_figure() -> None:
    tl = _sim("ZBVZeroBubble", 4, 4, 2)
    assert round(tl.bubble_fraction, 2) == 0.20
    assert round(_eval(_code(ROWS["ZBVZeroBubble"].bubble), p=4, m=4, v=2), 2) == 0.11


@pytest.mark.parametrize("schedule", sched.ALL)
def test_peak_in_flight_per_rank(schedule: str) -> None:
    row = ROWS[schedule]
    for v in _v_values(row):
        for p, m in GRID:
            expected = [_eval(_code(row.in_flight), p=p, m=m, v=v, r=r) for r in range(p)]
            assert _in_flight(_sim(schedule, p, m, v)) == expected, (schedule, p, m, v)
            # pv.simulate's own memory figure says the same once an input-grad pass frees nothing
            counted = _sim(schedule, p, m, v, input_freed=(0.0,) * p * v)
            assert counted.peak_activation_bytes == expected


def test_an_input_grad_pass_frees_part_of_the_activations() -> None:
    tl = pv.simulate(None, "InterleavedZeroBubble", 8, costs=pv.Costs.uniform(8, activation_bytes=1000),
                     num_stages=8)
    assert [b / 1000 for b in tl.peak_activation_bytes] == [8, 7.5, 7, 6.5]


def _rank_of(tl: pv.Timeline) -> dict[int, int]:
    return {e.stage: e.rank for e in tl.events if e.kind == "F"}


@pytest.mark.parametrize("schedule", sched.ALL)
def test_hand_offs_across_ranks_per_microbatch(schedule: str) -> None:
    row = ROWS[schedule]
    for v in _v_values(row):
        for p, m in GRID:
            tl = _sim(schedule, p, m, v)
            where = _rank_of(tl)
            n = p * v
            for mb in range(m):  # every microbatch crosses the same boundaries, forward and back
                fwd = {(e.stage, e.rank) for e in tl.events if e.mb == mb and e.kind == "F"}
                bwd = {(e.stage, e.rank) for e in tl.events if e.mb == mb and e.kind in ("B", "I")}
                assert fwd == bwd == set(where.items())
            crossings = sum(where[s] != where[s + 1] for s in range(n - 1))
            assert crossings == _eval(_code(row.hand_offs), p=p, m=m, v=v), (schedule, p, m, v)


@pytest.mark.parametrize("schedule", [s for s in sched.ALL if s != "LoopedBFS"])
def test_the_simulator_charges_exactly_those_hand_offs(schedule: str) -> None:
    """A hand-off cost delays microbatch 0's way to the last stage by one cost per crossing (LoopedBFS left out:
    there microbatch 0 waits for its rank's other forwards anyway)."""
    v = 1 if schedule in sched.SINGLE else 2
    p, m, c = 4, 8, 1e-3
    n = p * v

    def arrival(tl: pv.Timeline) -> float:
        return next(e.start for e in tl.events if e.kind == "F" and e.stage == n - 1 and e.mb == 0)

    free, priced = _sim(schedule, p, m, v), _sim(schedule, p, m, v, comm=(c,) * (n - 1))
    crossings = _eval(_code(ROWS[schedule].hand_offs), p=p, m=m, v=v)
    assert (arrival(priced) - arrival(free)) / c == pytest.approx(crossings)


def test_the_busiest_links() -> None:
    """Loop placement: v hand-offs on each neighbouring link, v - 1 from the last rank back to rank 0; the V: 2 on
    each neighbouring link and none back; 1F1B: 1 (links counted between pairs of ranks, both ways alike)."""
    p = 4
    neighbours = [(r, r + 1) for r in range(p - 1)]
    for schedule, v, links in (("1F1B", 1, dict.fromkeys(neighbours, 1)),
                               ("Interleaved1F1B", 2, {**dict.fromkeys(neighbours, 2), (0, p - 1): 1}),
                               ("Interleaved1F1B", 3, {**dict.fromkeys(neighbours, 3), (0, p - 1): 2}),
                               ("InterleavedZeroBubble", 2, {**dict.fromkeys(neighbours, 2), (0, p - 1): 1}),
                               ("ZBVZeroBubble", 2, dict.fromkeys(neighbours, 2)),
                               ("DualPipeV", 2, dict.fromkeys(neighbours, 2))):
        where = _rank_of(_sim(schedule, p, 2 * p, v))
        counted = Counter((min(where[s], where[s + 1]), max(where[s], where[s + 1]))
                          for s in range(p * v - 1) if where[s] != where[s + 1])
        assert dict(counted) == links, (schedule, v)


@pytest.mark.parametrize("schedule", sched.ALL)
def test_what_each_needs(schedule: str) -> None:
    row, traits = ROWS[schedule], sched.info(schedule)
    # stages per rank: the default, and whether any other is taken
    assert _default_v(row) == traits.stages_per_rank
    assert ("(any)" in row.stages_per_rank) == (traits.multi and not traits.v_shape)
    if row.stages_per_rank.startswith("exactly"):
        assert traits.v_shape
        with pytest.raises(sched.ScheduleError, match="exactly 2 stages per rank"):
            sched.layout(schedule, 12, stages_per_rank=3)
    # the backward: split into I and W (and DualPipeV keeps some whole)
    kinds = set(Counter(e.kind for e in _sim(schedule, 4, 8, 2 if traits.multi else 1).events))
    assert row.backward.startswith("split") == traits.split_backward == ({"I", "W"} <= kinds)
    assert ("B" in kinds) == (row.backward == "whole" or "some whole" in row.backward)
    # the microbatch rule, against torch's as check_microbatches applies it
    v = traits.stages_per_rank
    for p in (2, 3, 4):
        for m in range(1, 5 * p):
            rule = True if row.microbatches == "any" else _eval(_code(row.microbatches), p=p, m=m, v=v)
            try:
                sched.check_microbatches(schedule, p * v, m)
                accepted = True
            except sched.ScheduleError:
                accepted = False
            assert accepted == rule, (schedule, p, m)


def test_training_only_is_what_the_page_says() -> None:
    text = {line.split(" | ")[0].strip("| "): line for line in PAGE.read_text(encoding="utf-8").splitlines()
            if line.startswith("| ")}
    for schedule in sched.ALL:
        assert ("training only" in text[schedule]) == (not sched.info(schedule).forward_only), schedule
