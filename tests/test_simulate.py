"""The simulator reproduces the textbook results at equal costs, and reports deadlocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

import pipeviz as pv
from pipeviz.sim.simulate import Costs


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_bubble_formula(schedule: str, p: int, m: int) -> None:
    # GPipe (Huang et al. 2019): bubble fraction (p - 1) / (m + p - 1); 1F1B has the same bubble.
    tl = pv.simulate(None, schedule, m, costs=Costs.uniform(p), num_stages=p)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert tl.step_time == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16)])
def test_1f1b_bounds_activation_memory(p: int, m: int) -> None:
    gpipe = pv.simulate(None, "GPipe", m, costs=Costs.uniform(p), num_stages=p)
    one = pv.simulate(None, "1F1B", m, costs=Costs.uniform(p), num_stages=p)
    assert gpipe.peak_activation_bytes == [m] * p  # GPipe keeps every microbatch alive
    assert one.peak_activation_bytes[0] == min(p, m)  # 1F1B: at most p on stage 0
    assert one.peak_activation_bytes == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 16, 2), (2, 8, 4), (4, 8, 4)])
def test_interleaving_divides_the_bubble_by_v(p: int, m: int, v: int) -> None:
    # Narayanan et al. 2021: v model chunks per rank cut the bubble time by v (same work per rank).
    base = pv.simulate(None, "1F1B", m, costs=Costs.uniform(p), num_stages=p)
    inter = pv.simulate(None, "Interleaved1F1B", m, stages_per_rank=v, costs=Costs.uniform(p * v, 1 / v, 2 / v),
                        num_stages=p * v)
    ideal = 3.0 * m
    assert (inter.step_time - ideal) == pytest.approx((base.step_time - ideal) / v)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 12), (8, 16)])
def test_zero_bubble_is_a_third_of_1f1b(p: int, m: int) -> None:
    # Qi et al. 2024 (ZB1P / ZB-H1): with F = I = W, the bubble shrinks to a third of 1F1B's.
    base = pv.simulate(None, "1F1B", m, costs=Costs.uniform(p), num_stages=p)
    zb = pv.simulate(None, "InterleavedZeroBubble", m, stages_per_rank=1, costs=Costs.uniform(p), num_stages=p)
    ideal = 3.0 * m
    assert (zb.step_time - ideal) == pytest.approx((base.step_time - ideal) / 3)
    assert {e.kind for e in zb.events} == {"F", "I", "W"}


def test_v_schedules_beat_1f1b() -> None:
    base = pv.simulate(None, "1F1B", 8, costs=Costs.uniform(4), num_stages=4)
    for name in ("ZBVZeroBubble", "DualPipeV"):
        tl = pv.simulate(None, name, 8, costs=Costs.uniform(8, 0.5, 1.0), num_stages=8)
        assert tl.bubble_fraction < base.bubble_fraction / 3


def test_deadlock_is_reported_not_hung() -> None:
    order = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]  # rank 1 waits for mb 1 first
    with pytest.raises(pv.ScheduleError) as info:
        pv.simulate(None, "1F1B", 2, costs=Costs.uniform(2), num_stages=2, order=order)
    assert str(info.value).startswith("The schedule deadlocks: no rank can run its next action. rank 0 waits at "
                                      "0B0; rank 1 waits at 1F1.")


def test_simulate_a_real_plan_and_compare(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer0", "layer1"])
    tl = pv.simulate(plan, "1F1B", 4)
    assert tl.source == "simulated" and tl.num_ranks == 3 and len(tl.events) == 3 * 4 * 2
    stages = plan.stages
    # FLOP-based: stage 1 (twice the FLOPs) is the slowest; its forward is twice stage 0's.
    f = {e.stage: e.duration for e in tl.events if e.kind == "F"}
    assert f[1] == pytest.approx(2 * f[0]) and stages[1].flops == 2 * stages[0].flops
    assert tl.memory_bytes[1] > tl.memory_bytes[0]
    cmp = pv.compare(plan, microbatches=4)
    names = [r.schedule for r in cmp.rows]
    assert names == ["GPipe", "1F1B"]  # 3 stages: the multi-stage schedules need an even count
    assert set(cmp.skipped) == {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
    assert "1F1B" in cmp.table()
    assert "needs 6 stages (2 per rank)" in cmp.skipped["Interleaved1F1B"]  # 4 layers cannot make 6 stages
    four = classic_graph.split(["layer0", "layer1", "layer2"])
    two = classic_graph.split(["layer1"])
    rows = pv.compare(two, microbatches=4).rows
    assert len(rows) == 7  # every schedule on the same 2 ranks: the multi-stage ones on a balanced 4-stage split
    assert {(r.ranks, r.stages) for r in rows if r.schedule in ("GPipe", "1F1B")} == {(2, 2)}
    assert {(r.ranks, r.stages) for r in rows if r.schedule not in ("GPipe", "1F1B")} == {(2, 4)}
    zbv = next(r for r in rows if r.schedule == "ZBVZeroBubble")
    assert zbv.plan == pv.balance(classic_graph, 4) and zbv.config.stages_per_rank == 2
    # a row launches as it is: its plan and its LaunchConfig (a training run: compare's default loss)
    assert zbv.config.schedule == "ZBVZeroBubble" and zbv.config.microbatches == 4 and zbv.config.loss_fn
    assert len(pv.compare(four, microbatches=4).rows) == 2


@pytest.mark.parametrize(("schedule", "crossings"),
                         [("Interleaved1F1B", [1, 2, 2, 1]), ("ZBVZeroBubble", [1, 1, 1, 1])])
def test_multi_stage_runtime_pays_its_send_and_receive_actions(schedule: str, crossings: list[int]) -> None:
    # torch's multi-stage runtime runs each cross-rank hand-off as an action of its own: a forward or backward
    # pays the fixed per-action cost once more for each boundary it crosses to another rank (V-shaped schedules
    # keep their middle stages on one rank: nothing crosses there).
    costs = replace(Costs.uniform(4, 1.0, 2.0), overhead=0.1)
    tl = pv.simulate(None, schedule, 4, stages_per_rank=2, costs=costs, num_stages=4)
    for e in tl.events:
        if e.kind == "F":
            assert e.duration == pytest.approx(1.0 + 0.1 + 0.1 * crossings[e.stage])
        if e.kind == "W":
            assert e.duration == pytest.approx(2.0 * 0.5 + 0.1)  # the weight-grad pass sends nothing
    single = pv.simulate(None, "1F1B", 4, costs=replace(Costs.uniform(2, 1.0, 2.0), overhead=0.1), num_stages=2)
    assert {round(e.duration, 9) for e in single.events if e.kind == "F"} == {1.1}  # hand-offs inside the action


def test_the_simulate_path_reads_no_action_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Orders travel as typed Actions from their generation to the engine, the cost model and the memory rule:
    simulating a named schedule reads no text; a custom order given as text is read once, where it is given."""
    import torch

    from pipeviz.schedule import traits as sched
    from pipeviz.zoo import MyNetwork

    read: list[str] = []
    real = sched.Action.parse.__func__  # type: ignore[attr-defined]  # a classmethod's function, to wrap it

    def counted(cls: type[sched.Action], text: str) -> sched.Action:
        read.append(text)
        return real(cls, text)  # type: ignore[no-any-return]  # the wrapped classmethod's own result

    monkeypatch.setattr(sched.Action, "parse", classmethod(counted))
    x = torch.randn(8, 16)
    plan = pv.trace(MyNetwork(16, [16, 16, 16]), example_args=(x,)).split(["layer0", "layer1", "layer2"])
    for name in sched.ALL:
        tl = pv.simulate(plan, pv.LaunchConfig(schedule=name, microbatches=8, loss_fn=pv.cross_entropy))
        assert tl.step_time > 0
    assert read == []
    text = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=2, loss_fn=pv.cross_entropy, order=text)
    assert len(read) == 8  # each action read once, by the config
    assert [str(a) for a in pv.simulate(None, cfg, costs=Costs.uniform(2), num_stages=2).order(1)] == text[1]
    assert len(read) == 8  # and never again
