"""``LaunchConfig(ep_overlap=True)``: DualPipeV's overlapped forward/backward pairs (torch's ``OVERLAP_F_B``), or the
combined 1F1B's under 1F1B, run at once, the backward in a second thread over its own expert-parallel group
(``pipeviz.adapter.overlap_fb``), so one half's all-to-alls wait while the other computes; exact against the unsplit
model; priced by ``pv.simulate`` (a pair ``max(F, B, F's compute + B's compute)``, ``pipeviz.sim.ep_overlap``);
``ep_delay`` slows every all-to-all (a slowed link) so that the overlap shows on a CPU; refused before any process
starts where it cannot run."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import pipeviz as pv
from pipeviz.adapter.schedules import overlap_pairs
from pipeviz.cost.model import Costs
from pipeviz.schedule.ep_overlap import combined_1f1b
from pipeviz.sim.engine import check_order, play
from pipeviz.sim.ep_overlap import PairOverlap
from pipeviz.sim.simulate import schedule_orders
from tests.foreign import routed_moe_net


@functools.cache
def _plan(stages: int = 4) -> tuple[pv.SplitPlan, torch.Tensor]:
    """MoENet's 4 blocks, one per stage (DualPipeV's 2 per pipeline rank), or 2 per stage (``stages=2``: 1F1B on 2
    pipeline ranks), traced once for every test (a plan is immutable; the ids are read only)."""
    torch.manual_seed(0)
    model = routed_moe_net()
    torch.manual_seed(1)
    ids = torch.randint(0, 32, (8, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = pv.trace(model, example_args=(ids[:2],))
    return graph.split([f"blocks.{i}" for i in range(3)] if stages == 4 else ["blocks.1"]), ids


def _config(**changes: object) -> pv.LaunchConfig:
    base = pv.LaunchConfig(schedule="DualPipeV", microbatches=4, loss_fn=pv.cross_entropy, optimizer=pv.sgd(lr=0.1),
                           dp=2, ep=2)
    return base.replace(**changes)


@pytest.mark.parametrize(("changes", "words"), [
    ({"schedule": "GPipe", "ep_overlap": True}, ["ep_overlap=True", "'GPipe'", "Valid schedules with ep_overlap: "
                                                 "DualPipeV, 1F1B", "Fix: schedule='DualPipeV' or '1F1B', or "
                                                 "ep_overlap=False"]),
    ({"schedule": "ZBVZeroBubble", "ep_overlap": True}, ["'ZBVZeroBubble'", "OVERLAP_F_B"]),
    ({"ep": 1, "ep_overlap": True}, ["ep_overlap=True with ep=1", "Valid: ep_overlap=False, or ep > 1"]),
    ({"ep": 1, "ep_delay": 0.01}, ["ep_delay=0.01 with ep=1", "Fix: ep_delay=0.0"]),
])
def test_refused_before_any_process_and_by_simulate_naming_the_value(changes: dict[str, object],
                                                                      words: list[str]) -> None:
    plan, ids = _plan()
    cfg = _config(**changes)
    with pytest.raises(pv.LaunchError) as launched:
        pv.launch(plan, cfg, inputs=(ids,), target=ids)
    with pytest.raises(ValueError) as simulated:
        pv.simulate(plan, cfg)
    for err in (launched.value, simulated.value):
        assert all(w in str(err) for w in words), str(err)
    assert launched.value.setting == ("ep_delay" if "ep_delay" in changes else "ep_overlap")  # type: ignore[attr-defined]


def test_config_types_checked() -> None:
    with pytest.raises(TypeError, match="ep_overlap must be True or False, got 'yes'"):
        pv.LaunchConfig(ep_overlap="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ep_delay must be seconds >= 0"):
        pv.LaunchConfig(ep_delay=-1.0)


def test_pairs_are_torchs_overlap_actions_a_forward_then_a_backward() -> None:
    """Where torch's DualPipeV order holds OVERLAP_F_B, the simulator's flat order has an F then a B of other
    microbatches (the positions both read from torch's pipeline_order)."""
    for ranks, micro in ((2, 4), (2, 8), (4, 8)):
        orders = schedule_orders("DualPipeV", 2 * ranks, micro)
        pairs = overlap_pairs("DualPipeV", ranks, 2 * ranks, micro)
        assert any(positions for _, positions in pairs)
        for rank, (count, positions) in enumerate(pairs):
            assert count == len(orders[rank])
            for p in positions:
                f, b = orders[rank][p], orders[rank][p + 1]
                assert (f.kind, b.kind) == ("F", "B") and f.stage != b.stage, (rank, p, f, b)


@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 4), (2, 8), (3, 5), (4, 4), (4, 9)])
def test_combined_1f1b_runs_and_pairs_each_forward_with_an_earlier_backward(stages: int, micro: int) -> None:
    """The combined 1F1B's order: every action once, no deadlock, the sends and receives as torch's runtime posts
    them (check_order); each pair a forward then the backward of an earlier microbatch; the last stage pairs every
    forward but the first."""
    combined = combined_1f1b(stages, micro)
    lay = pv.schedule.layout("1F1B", stages)
    check_order([acts for acts, _ in combined], lay, micro)
    # and played with each pair waiting for both its inputs (as torch's runtime runs an OVERLAP_F_B): no deadlock
    unit = Costs.uniform(stages)
    pairs = PairOverlap(frozenset((r, p) for r, (_, at) in enumerate(combined) for p in at), (0.0,) * stages,
                        (0.0,) * stages)
    events = play([acts for acts, _ in combined], lay, unit, stages, pairs=pairs)
    assert len(events) == 2 * stages * micro
    for acts, pairs in combined:
        for p in pairs:
            f, b = acts[p], acts[p + 1]
            assert (f.kind, b.kind) == ("F", "B") and b.mb < f.mb, (f, b)
    assert len(combined[-1][1]) == micro - 1


def test_a_pair_costs_the_longer_half_or_both_computes() -> None:
    costs = Costs(forward=(1.0, 1.0), backward=(2.0, 2.0), comm=(0.0,), activation_bytes=(0, 0), param_bytes=(0, 0),
                  collective=(0.5, 0.5), collective_backward=(1.5, 1.5))
    pair = PairOverlap(frozenset(), forward_a2a=(0.5, 0.5), backward_a2a=(1.5, 1.5))
    # F 1.5 (1.0 compute + 0.5 all-to-all), B 3.5 (2.0 + 1.5): both computes, 3.0, beat the longer half only by
    # its own all-to-alls: max(1.5, 3.5, 3.0) = 3.5 against 5.0 one after the other
    assert pair.seconds(costs, 0, 1) == pytest.approx(3.5)
    no_wait = PairOverlap(frozenset(), forward_a2a=(0.0, 0.0), backward_a2a=(0.0, 0.0))
    assert no_wait.seconds(costs, 0, 1) == pytest.approx(5.0)  # nothing to hide: the two in turn


def test_simulated_1f1b_combined_shorter_on_a_slowed_link_holding_more_activations() -> None:
    plan, _ = _plan()
    cfg = _config(schedule="1F1B", ep_delay=0.02, microbatches=8)
    alone, overlapped = pv.simulate(plan, cfg), pv.simulate(plan, cfg.replace(ep_overlap=True))
    assert overlapped.step_time < 0.8 * alone.step_time, (overlapped.step_time, alone.step_time)
    # stage r holds up to 2(p-1-r)+2 microbatches' activations during its first pair (1F1B: p-r): 8 against 4
    first = overlapped.peak_activation_bytes[0] / alone.peak_activation_bytes[0]
    assert first == pytest.approx(8 / 4), first


def test_simulated_step_shorter_with_overlap_on_a_slowed_link_and_the_same_a2a_actions() -> None:
    plan, _ = _plan()
    cfg = _config(ep_delay=0.02)
    alone, overlapped = pv.simulate(plan, cfg), pv.simulate(plan, cfg.replace(ep_overlap=True))
    assert overlapped.step_time < 0.9 * alone.step_time, (overlapped.step_time, alone.step_time)
    a2a = sorted((e.rank, e.stage, e.mb) for e in alone.events if e.kind == "A2A")
    assert a2a == sorted((e.rank, e.stage, e.mb) for e in overlapped.events if e.kind == "A2A")
    slowed = pv.simulate(plan, cfg.replace(ep_delay=0.0))
    # 32 A2A per process and step (2 stages x 4 microbatches x (2 + 2)), each 20 ms slower, on the critical path
    assert alone.step_time - slowed.step_time == pytest.approx(32 * 0.02, rel=0.35)
    # 4 processes on 2 cores: an A2A's wait for a core is no link time, nothing the other half computes under
    shared = [pv.simulate(plan, _config(ep_overlap=k), cores=2).step_time for k in (False, True)]
    assert shared[1] > 0.9 * shared[0], shared


@pytest.mark.slow
def test_pp2_dp2_ep2_dualpipev_overlapped_is_exact_and_runs_forward_beside_backward() -> None:
    plan, ids = _plan()
    run = pv.launch(plan, _config(ep_overlap=True, ep_delay=0.005), steps=1, inputs=(ids,), target=ids)
    assert run.wait(300) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok and check.loss_diff <= 1e-6 and check.param_diff <= 1e-6, check
    events = run.timeline().events
    fb = [e for e in events if e.kind in ("F", "B")]
    beside = {(f.rank, f.step) for f in fb for b in fb if f.kind == "F" and b.kind == "B" and f.rank == b.rank
              and f.step == b.step and f.start < b.end and b.start < f.end}
    assert beside == {(r, 0) for r in range(4)}  # every process: an F beside a B
    a2a = [e for e in events if e.kind == "A2A"]
    assert len(a2a) == 4 * 2 * 4 * (2 + 2)  # processes x stages per process x microbatches x (F + B)
    # each all-to-all is labelled with the action of its own thread (the clock's stage and microbatch per thread);
    # DualPipeV splits some backwards (I, W: the first stage's input-grad pass is empty, its W holds them)
    computes = [e for e in events if e.kind in ("F", "B", "I", "W")]
    for a in a2a:
        assert any(e.rank == a.rank and e.stage == a.stage and e.mb == a.mb and e.step == a.step
                   and e.start - 1e-3 <= a.start and a.end <= e.end + 1e-3 for e in computes), a


@pytest.mark.compat
@pytest.mark.parametrize("schedule", ["DualPipeV", "1F1B"])
def test_slowed_link_measured_and_simulated_steps_shorter_with_overlap_and_the_same_losses(schedule: str) -> None:
    plan, ids = _plan(4 if schedule == "DualPipeV" else 2)  # 2 pipeline ranks x dp 2: 4 processes either way
    cfg = _config(schedule=schedule, ep_delay=0.02, microbatches=8)
    ids = torch.cat([ids, ids])  # 16 rows: 8 microbatches of one row per replica
    runs = {}
    for overlap in (False, True):
        run = pv.launch(plan, cfg.replace(ep_overlap=overlap), steps=3, inputs=(ids,), target=ids)
        assert run.wait(300) == "done", run.error
        runs[overlap] = run
    assert runs[True].losses == runs[False].losses  # the same ops on the same values: bit for bit
    check = pv.check_numerics(runs[True])
    assert check.ok and check.param_diff <= 1e-6, check
    measured = {k: r.timeline().step_time for k, r in runs.items()}
    simulated = {k: pv.simulate(plan, cfg.replace(ep_overlap=k)).step_time for k in (False, True)}
    assert measured[True] < 0.95 * measured[False], measured
    assert simulated[True] < 0.95 * simulated[False], simulated
