"""``pv.synthesize_schedule``: the order it finds is at least as fast as every torch schedule that fits the memory
limit on the same plan, microbatches and ranks; it finds one where none of torch's fits; it names the smallest
feasible limit where no order fits; it recovers the known optimal points (ZB-H1, ZB-H2, ZB-V, V-Half; V-Min with the
widened search); on another model and stage count (a transformer in 6 stages) too; its order launches through
torch's runtime and trains exactly within the limit; torch reads its CSV."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest
import torch

import pipeviz as pv
from pipeviz.planner.receives import charged_step
from pipeviz.planner.synthesize import MemoryLimitError, Synthesis, smallest_limit
from pipeviz.schedule import traits as sched
from pipeviz.zoo import MyNetwork, TinyTransformer

TOL = 1e-9  # seconds: the same simulator on both sides; only float sums differ


@pytest.fixture(scope="module")
def graph() -> pv.ModelGraph:
    torch.manual_seed(0)
    # uneven widths: stages of unequal time and memory, as real models have
    model = MyNetwork(64, [128, 64, 256, 64, 128, 32, 128, 64, 192])
    return pv.trace(model, example_args=(torch.randn(32, 64),))


def _torch_schedules(plan: pv.SplitPlan, cfg: pv.LaunchConfig, spr: int) -> dict[str, pv.Timeline]:
    """Every torch schedule that runs ``plan`` with ``spr`` stages per rank, simulated by name."""
    out = {}
    for name in sched.ALL:
        info = sched.info(name)
        if (spr > 1 and not info.multi) or (spr != 2 and info.v_shape):
            continue
        try:
            sched.check_microbatches(name, plan.num_stages, cfg.microbatches, spr if info.multi else None)
        except pv.ScheduleError:
            continue
        out[name] = pv.simulate(plan, cfg.replace(schedule=name, stages_per_rank=spr if info.multi else None))
    return out


def _peak(tl: pv.Timeline) -> int:
    return max(tl.meta["memory_bytes"])


@pytest.mark.parametrize(("spr", "expected"), [
    (1, {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"}),
    (2, {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}),
], ids=["1-stage-per-rank", "2-stages-per-rank"])
def test_without_a_limit_at_least_as_fast_as_torchs_fastest(graph: pv.ModelGraph, spr: int,
                                                            expected: set[str]) -> None:
    plan = pv.balance(graph, 8)
    cfg = pv.LaunchConfig(schedule="Interleaved1F1B", stages_per_rank=spr, microbatches=8, loss_fn=pv.cross_entropy)
    theirs = _torch_schedules(plan, cfg, spr)
    assert set(theirs) == expected  # the two cases together: all seven of torch's schedules
    syn = pv.synthesize_schedule(plan, cfg)
    assert isinstance(syn, Synthesis) and syn.timeline.num_ranks == 8 // spr
    # at least as fast as their fastest, each step with its receives charged where torch's runtime posts them
    # (what a launch follows: LoopedBFS's 3.07 ms simulated become 7.58 ms so on these comm-bound stages)
    assert syn.charged_step <= min(charged_step(t) for t in theirs.values()) + TOL
    assert syn.charged_step == charged_step(syn.timeline) >= syn.step_time
    assert set(syn.baselines) == expected and syn.fits == syn.baselines
    # the timeline is the order's own simulation, as pv.launch would run syn.config
    again = pv.simulate(plan, syn.config)
    assert again.step_time == syn.step_time and syn.config.order == syn.order
    assert syn.config.microbatches == 8 and syn.config.loss_fn is pv.cross_entropy


def test_with_a_limit_as_fast_as_every_torch_schedule_that_fits(graph: pv.ModelGraph) -> None:
    plan = pv.balance(graph, 8)
    cfg = pv.LaunchConfig(schedule="ZBVZeroBubble", microbatches=8, loss_fn=pv.cross_entropy)
    theirs = _torch_schedules(plan, cfg, 2)
    peaks = sorted(_peak(t) for t in theirs.values())
    for limit in (peaks[0], (peaks[0] + peaks[-1]) // 2, peaks[-2]):
        syn = pv.synthesize_schedule(plan, cfg, memory_limit=limit)
        fitting = {k: t for k, t in theirs.items() if _peak(t) <= limit}
        assert fitting and set(syn.fits) == set(fitting)
        assert syn.charged_step <= min(charged_step(t) for t in fitting.values()) + TOL, (limit, syn.table())
        assert _peak(syn.timeline) <= limit and syn.memory_limit == limit


def test_where_no_torch_schedule_fits_it_still_finds_an_order(graph: pv.ModelGraph) -> None:
    plan = pv.balance(graph, 4)
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=8, loss_fn=pv.cross_entropy)
    theirs = _torch_schedules(plan, cfg, 1)
    below = min(_peak(t) for t in theirs.values()) - 1
    syn = pv.synthesize_schedule(plan, cfg, memory_limit=below)
    assert syn.fits == {} and _peak(syn.timeline) <= below
    pv.simulate(plan, syn.config)  # it plays: no deadlock, in compute or in its sends and receives
    # and it is not the order that fits any limit that can be met (one microbatch at a time through the pipeline)
    one_at_a_time = [[a for mb in range(8) for a in (f"{r}F{mb}", f"{r}B{mb}")] for r in range(4)]
    assert syn.step_time < pv.simulate(plan, cfg.replace(order=one_at_a_time)).step_time


def test_where_no_order_fits_the_error_names_the_smallest_feasible_limit(graph: pv.ModelGraph) -> None:
    plan = pv.balance(graph, 4)
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=8, loss_fn=pv.cross_entropy)
    with pytest.raises(MemoryLimitError) as err:
        pv.synthesize_schedule(plan, cfg, memory_limit=1000)
    smallest = err.value.smallest
    assert isinstance(err.value, pv.ScheduleError) and isinstance(err.value, ValueError)
    assert f"Smallest feasible limit: {smallest:,} bytes" in str(err.value) and "memory_limit=1,000" in str(err.value)
    # exactly that much is enough (one microbatch at a time), one byte less is not
    syn = pv.synthesize_schedule(plan, cfg, memory_limit=smallest)
    assert _peak(syn.timeline) <= smallest
    with pytest.raises(MemoryLimitError, match=f"{smallest:,}"):
        pv.synthesize_schedule(plan, cfg, memory_limit=smallest - 1)
    lay = cfg.layout(4)
    from pipeviz.cost.model import stage_costs

    assert smallest == smallest_limit(stage_costs(plan, 8), lay)



@pytest.mark.parametrize("spr", [1, 2], ids=["6-ranks", "3-ranks-2-stages-each"])
def test_a_transformer_in_6_stages_against_every_torch_schedule_that_fits(spr: int) -> None:
    """Another model (a transformer: an embedding first, a head and the loss last), another stage count (6) and
    limits between torch's schedules' peaks: at each limit at least as fast as every torch schedule that fits it
    on the same plan, microbatches and ranks, and within the limit; under all of torch's peaks it still finds one."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=256, dim=32, heads=2, depth=6, seq=16)
    plan = pv.balance(pv.trace(model, example_args=(torch.randint(0, 256, (12, 16)),)), 6)
    cfg = pv.LaunchConfig(schedule="Interleaved1F1B", stages_per_rank=spr, microbatches=12, loss_fn=pv.cross_entropy)
    theirs = _torch_schedules(plan, cfg, spr)
    assert len(theirs) == 5
    peaks = sorted({_peak(t) for t in theirs.values()})
    assert len(peaks) >= 3  # the limits below fall between torch's schedules, each leaving some of them out
    for limit in (peaks[1], (peaks[1] + peaks[-1]) // 2, peaks[0] - 1):
        syn = pv.synthesize_schedule(plan, cfg, memory_limit=limit)
        fitting = {k: t for k, t in theirs.items() if _peak(t) <= limit}
        assert set(syn.fits) == set(fitting) and len(fitting) < len(theirs)
        for name, tl in fitting.items():
            assert syn.charged_step <= charged_step(tl) + TOL, (name, limit, syn.table())
        assert _peak(syn.timeline) <= limit and syn.timeline.num_ranks == 6 // spr
        assert pv.simulate(plan, syn.config).step_time == syn.step_time  # what pv.launch will run

# ------------------------------------------------------------------------------------------- receives as posted
def test_a_receive_torch_posts_late_is_charged_its_hand_off() -> None:
    """2 ranks, F = 1, B = 2, hand-offs 0.5. torch's _add_send_recv puts rank 1's receive of microbatch 1 just
    after 1F0 (it lowers 0F1 in the second lock-step round) and rank 0's receive of 1B1's gradient just after 0B0:
    posted then, their transfers start only then, where pv.simulate had them arrive 0.5 after the send."""
    from pipeviz.adapter.schedules import comm_actions

    order = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    assert comm_actions(order, (0, 1), 2) == [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1RECV_F1", "1F1", "1B0", "1SEND_B0", "1B1", "1SEND_B1"]]
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=2, order=order)
    tl = pv.simulate(None, cfg, costs=pv.Costs.uniform(2, comm=0.5), num_stages=2, forward_only=False)
    # simulated: 1F1 at 2.5 (0F1's 2 + 0.5), ..., 0B1 at 8 (1B1's 7.5 + 0.5): 10. As posted: 1F1's receive posted at
    # 2.5 arrives at 3, so 1F1 [3, 4], 1B0 [4, 6], 1B1 [6, 8], 0B0 [6.5, 8.5]; 0B1's receive posted at 8.5: [9, 11]
    assert tl.step_time == 10.0 and charged_step(tl, charged=False) == 10.0 and charged_step(tl) == 11.0
    free = pv.simulate(None, cfg, costs=pv.Costs.uniform(2), num_stages=2, forward_only=False)
    assert charged_step(free) == free.step_time == 9.0  # no hand-off time: a late post costs nothing


def test_played_as_simulated_the_programs_give_the_simulated_step(graph: pv.ModelGraph) -> None:
    """The programs torch's runtime runs, played with pv.simulate's arrival rule, give pv.simulate's step for every
    multi-stage torch schedule and for a synthesized order; charged as posted, never less. (DualPipeV by name is
    the exception: torch lowers an overlapped F/B pair with the forward's send after the pair, later than
    pv.simulate sends it.)"""
    plan = pv.balance(graph, 8)
    cfg = pv.LaunchConfig(schedule="ZBVZeroBubble", microbatches=8, loss_fn=pv.cross_entropy)
    syn = pv.synthesize_schedule(plan, cfg)
    for tl in [syn.timeline, *syn.baselines.values()]:
        plain = charged_step(tl, charged=False)
        if tl.schedule == "DualPipeV" and tl.meta["config"].order is None:
            assert plain > tl.step_time
        else:
            assert plain == pytest.approx(tl.step_time, abs=TOL), tl.schedule
        assert charged_step(tl) >= plain - TOL
    assert syn.charged_baselines == {k: charged_step(t) for k, t in syn.baselines.items()}
    assert "as posted" in syn.table()


# ------------------------------------------------------------------------------------------- known points
def _zb_h1(p: int, m: int) -> list[list[str]]:
    """ZB-H1 (Qi et al. 2024) as lesson 06 writes it: 1F1B with I in B's place, rank r keeping r W passes pending,
    the one that falls due run before the next forward."""
    orders = []
    for r in range(p):
        warm = min(m, p - r)
        acts, nxt, pending = [f"{r}F{i}" for i in range(warm)], warm, []
        for b in range(m):
            acts.append(f"{r}I{b}")
            pending.append(f"{r}W{b}")
            if len(pending) > r:
                acts.append(pending.pop(0))
            if nxt < m:
                acts.append(f"{r}F{nxt}")
                nxt += 1
        orders.append(acts + pending)
    return orders


def _zb_h2(p: int, m: int) -> list[list[str]]:
    """ZB-H2 as lesson 06 writes it: over unit time steps, each free rank runs an I if one is ready, else a forward
    (at most 2p - 1 microbatches whose W has not run), else a pending W."""
    orders: list[list[str]] = [[] for _ in range(p)]
    end: dict[tuple[int, str, int], int] = {}  # (rank, kind, microbatch): the unit step it finished
    free_at, n_f, n_i, n_w = [0] * p, [0] * p, [0] * p, [0] * p
    pending: list[list[int]] = [[] for _ in range(p)]
    t = 0
    while any(len(a) < 3 * m for a in orders):
        for r in range(p):
            if free_at[r] > t or len(orders[r]) == 3 * m:
                continue
            b, f = n_i[r], n_f[r]
            grad = (r + 1, "I", b) if r < p - 1 else (r, "F", b)
            if b < f and end.get(grad, t + 1) <= t:
                kind, mb = "I", b
                n_i[r] += 1
                pending[r].append(b)
            elif f < m and f - n_w[r] < 2 * p - 1 and (r == 0 or end.get((r - 1, "F", f), t + 1) <= t):
                kind, mb = "F", f
                n_f[r] += 1
            elif pending[r]:
                kind, mb = "W", pending[r].pop(0)
                n_w[r] += 1
            else:
                continue
            end[r, kind, mb] = free_at[r] = t + 1
            orders[r].append(f"{r}{kind}{mb}")
        t += 1
    return orders


@pytest.mark.parametrize("weight_share", [0.5, 0.25], ids=["F=I=W", "W-cheaper"])
def test_recovers_zb_h1_and_zb_h2(weight_share: float) -> None:
    """At ZB-H1's memory (1F1B's) and at ZB-H2's (2p - 1 microbatches on rank 0) the synthesized order is at least
    as fast as theirs; with F = I = W both reach the synchronous step's bound, 3m + (p - 1) F."""
    p, m = 4, 8
    costs = dataclasses.replace(pv.Costs.uniform(p, activation_bytes=2), weight_fraction=weight_share)
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=m)

    def sim(order: list[list[str]] | None = None) -> pv.Timeline:
        return pv.simulate(None, cfg.replace(order=order), costs=costs, num_stages=p, forward_only=False)

    one_f_one_b, h1, h2 = sim(), sim(_zb_h1(p, m)), sim(_zb_h2(p, m))
    assert h2.peak_activation_bytes[0] / 2 == 2 * p - 1  # ZB-H2's memory: rank 0 holds 2p - 1 microbatches
    for known in (h1, h2):
        limit = max(known.meta["memory_bytes"])
        syn = pv.synthesize_schedule(None, cfg, limit, costs=costs)
        assert syn.step_time <= known.step_time + TOL and max(syn.memory_bytes) <= limit
        if weight_share == 0.5:
            assert syn.step_time == 3 * m + (p - 1)  # the bound: rank p - 1 starts (p - 1) F late
    i, w = 2 * (1 - weight_share), 2 * weight_share
    assert h1.step_time == 3 * m + (p - 1) * (1 + i - w)  # the paper's ZB-H1 bubble, (p - 1)(F + I - W)
    assert one_f_one_b.step_time == 3 * m + (p - 1) * 3
    if weight_share == 0.25:  # where W is cheaper than I, ZB-H2's memory buys time over ZB-H1: found too
        at_h2 = pv.synthesize_schedule(None, cfg, max(h2.meta["memory_bytes"]), costs=costs)
        assert at_h2.step_time < h1.step_time


@pytest.mark.parametrize(("p", "units", "bubble"), [(4, 4, 0.5 * 3), (6, 6, 0.5 * 5), (6, 4, 1.5 * 5)],
                         ids=["zb-v-4", "zb-v-6", "v-half-6"])
def test_recovers_the_v_shaped_points(p: int, units: int, bubble: float) -> None:
    """V-shaped, 2 stages per rank of F = 0.5, I = W = 0.5: at 1F1B's memory (p microbatches of a rank's
    activations) ZB-V's bubble, (p - 1) x 0.5, the bound; at V-Half's memory ((p + 2) // 2 microbatches, Qi et al.
    2024, "Pipeline Parallelism with Controllable Memory") half of 1F1B's bubble, (p - 1) x 3 / 2."""
    m = 2 * p
    costs = pv.Costs.uniform(2 * p, forward=0.5, backward=1.0, activation_bytes=1)
    cfg = pv.LaunchConfig(schedule="ZBVZeroBubble", microbatches=m)
    syn = pv.synthesize_schedule(None, cfg, 2 * units, costs=costs, placement="v")
    assert syn.placement == "v" and syn.config.schedule == "ZBVZeroBubble"
    assert syn.step_time - 3 * m <= bubble + TOL
    assert max(syn.timeline.peak_activation_bytes) <= 2 * units
    if units == p:
        assert syn.step_time == pytest.approx(syn.baselines["ZBVZeroBubble"].step_time)



def test_the_widened_search_recovers_v_min() -> None:
    """V-Min (Qi et al. 2024): V-shaped, (p + 4) // 3 microbatches of a rank's activations (a third of 1F1B's p),
    about 2/3 of 1F1B's bubble. The interactive grid misses it at 4 ranks (bubble 10.5, more than 1F1B's 9); the
    widened search (local searches from random rules) reaches it, and pv.simulate plays the order alike."""
    from pipeviz.planner.list_schedule import KINDS, Search, build_problem

    p, m = 4, 8
    units = (p + 4) // 3
    costs = pv.Costs.uniform(2 * p, forward=0.5, backward=1.0, activation_bytes=1)
    problem = build_problem(costs, sched.layout("ZBVZeroBubble", 2 * p, 2), "v", m, 2 * units, True, 0)
    best = Search(problem).widen(40, seed=2)[0]
    one_f_one_b = 3 * (p - 1)
    assert best.step - 3 * m <= one_f_one_b * 2 / 3 + TOL
    order = [[f"{s}{KINDS[k]}{mb}" for s, k, mb in row] for row in best.order]
    tl = pv.simulate(None, pv.LaunchConfig(schedule="ZBVZeroBubble", microbatches=m, order=order), costs=costs,
                     num_stages=2 * p, forward_only=False)
    assert tl.step_time == pytest.approx(best.step) and max(tl.peak_activation_bytes) <= 2 * units

# ------------------------------------------------------------------------------------------- the order's edges
def test_the_order_is_torchs_notation_and_its_csv_is_torchs(graph: pv.ModelGraph, tmp_path: Path) -> None:
    plan = pv.balance(graph, 4)
    cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=4, loss_fn=pv.cross_entropy)
    syn = pv.synthesize_schedule(plan, cfg)
    assert pv.LaunchConfig(order=[list(r) for r in syn.order]).order == syn.order
    lay = syn.config.layout(4)
    sched.validate([list(r) for r in syn.order], 4, 4, lay.stage_ranks)
    path = syn.to_csv(tmp_path / "order.csv")
    with path.open() as fh:
        assert tuple(map(tuple, csv.reader(fh))) == tuple(tuple(str(a) for a in r) for r in syn.order)
    # torch's own reader: _PipelineScheduleRuntime._load_csv (stand-in stages, as torch's visualizer builds them)
    from unittest import mock

    from torch.distributed.pipelining.schedules import ScheduleLoopedBFS
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, lay.num_ranks, None, 4
    runtime = ScheduleLoopedBFS([stage] * lay.stages_per_rank, 4)
    runtime._load_csv(str(path))
    loaded = [[str(a) for a in runtime.pipeline_order[r]] for r in range(lay.num_ranks)]
    assert loaded == [[str(a) for a in r] for r in syn.order]


def test_bad_arguments_are_named(graph: pv.ModelGraph) -> None:
    plan = pv.balance(graph, 4)
    cfg = pv.LaunchConfig(microbatches=4, loss_fn=pv.cross_entropy)
    with pytest.raises(pv.ScheduleError, match="Unknown placement 'w'; valid: auto, loop, v"):
        pv.synthesize_schedule(plan, cfg, placement="w")
    with pytest.raises(pv.ScheduleError, match="V-shaped placement needs exactly 2 stages per rank"):
        pv.synthesize_schedule(plan, cfg, placement="v")
    with pytest.raises(ValueError, match="memory_limit must be a positive number of bytes"):
        pv.synthesize_schedule(plan, cfg, memory_limit=-5)
    with pytest.raises(ValueError, match=r"needs a plan, or costs=pv\.Costs"):
        pv.synthesize_schedule(None, cfg)
    # split backwards off (as torch.compile'd stages need): only F and B in the order
    syn = pv.synthesize_schedule(plan, cfg, split_backward=False)
    assert {a.kind for r in syn.order for a in r} == {"F", "B"}


@pytest.mark.slow
def test_the_synthesized_order_trains_exactly_within_the_limit() -> None:
    """Launched through torch's runtime under a limit below every torch schedule's peak (priced as the run trains:
    SGD without momentum keeps no optimizer state, so the limit binds): each rank runs the order action for
    action, trains exactly, and its measured saved activations and total stay within the limit."""
    torch.manual_seed(0)
    model = MyNetwork(64, [128, 64, 128, 64])
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    plan = pv.balance(pv.trace(model, example_args=(x,)), 4)
    cfg = pv.LaunchConfig(schedule="ZBVZeroBubble", microbatches=4, steps=2, loss_fn=pv.cross_entropy,
                          optimizer=pv.sgd(lr=0.1))
    opts = pv.CostOptions(optimizer_states=0)
    baselines = pv.synthesize_schedule(plan, cfg, options=opts).baselines  # torch's on these ranks, both placements
    limit = min(_peak(t) for t in baselines.values()) - 1  # below every torch schedule on these 2 ranks
    syn = pv.synthesize_schedule(plan, cfg, memory_limit=limit, options=opts)
    assert syn.fits == {}
    run = pv.launch(plan, syn.config, inputs=(x,), target=y)
    assert run.wait(180) == "done", run.error
    measured = run.timeline()
    for rank in range(2):  # each rank ran the synthesized order, action for action
        assert measured.order(rank, step=1) == list(syn.order[rank])
    check = pv.check_numerics(run)
    assert check.ok, check
    planned, total = syn.timeline.peak_activation_bytes, syn.memory_bytes
    for rank in range(2):
        saved = max(b for _, b in run.activation_memory[rank])  # the tensors saved for backward, measured
        room = limit - (total[rank] - planned[rank])  # what the limit leaves for activations beside the weights
        assert saved <= planned[rank] * 1.01 and saved <= room
        assert max(b for _, b in run.memory[rank]) <= limit  # weights, gradients and saved activations, measured


@pytest.mark.slow
def test_the_first_stages_input_grad_pass_frees_nothing() -> None:
    """torch runs no input-grad pass on the first stage (its W runs the whole backward), so an order that splits
    stage 0's backward and defers its W keeps all of stage 0's activations until then: measured as simulated."""
    torch.manual_seed(0)
    model = MyNetwork(64, [128, 64, 128, 64])
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    plan = pv.balance(pv.trace(model, example_args=(x,)), 2)
    assert plan.input_grad_freed_bytes[0] == 0 < plan.input_grad_freed_bytes[1]
    order = [["0F0", "0F1", "0F2", "0F3", "0I0", "0I1", "0I2", "0I3", "0W0", "0W1", "0W2", "0W3"],
             [a for mb in range(4) for a in (f"1F{mb}", f"1I{mb}", f"1W{mb}")]]
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=1, order=order, loss_fn=pv.cross_entropy)
    planned = pv.simulate(plan, cfg).peak_activation_bytes
    run = pv.launch(plan, cfg, inputs=(x,), target=y)
    assert run.wait(180) == "done", run.error
    saved = [max(b for _, b in run.activation_memory[r]) for r in range(2)]
    assert saved[0] == pytest.approx(planned[0], rel=0.01) and saved[1] == pytest.approx(planned[1], rel=0.01)
    assert pv.check_numerics(run).ok


@pytest.mark.slow
def test_the_cli_planner_offers_a_synthesized_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    import json

    from transformers import LlamaConfig

    from pipeviz.cli import main

    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    args = ["plan", "--config", str(path), "--gpus", "8", "--hardware", "H100", "--global-batch", "32", "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "synthesized schedule for #1 (pp2 " in out and "pv.synthesize_schedule(row.plan, row.config" in out
    assert "both simulated in full at 8 microbatches" in out
    assert main([*args, "--no-synthesize"]) == 0
    assert "synthesized schedule" not in capsys.readouterr().out
