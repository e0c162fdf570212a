"""Expert parallelism priced by ``pv.simulate`` (``pipeviz.sim.experts``): the all-to-alls a run issues, as many
``A2A`` actions per process and step, inside each forward and backward (``I`` under a split backward, never ``W``),
each of the rows a rank sends on the expert-parallel link (``ep_bandwidth``); the busiest owner's compute
(``expert_imbalance``, measured from ``run.expert_tokens``); 1/ep of the routed experts' weights, gradients and
optimizer state per rank."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

import pipeviz as pv
from pipeviz.cost.comm import backend_link
from pipeviz.runtime.reducer import ExpertLoad
from pipeviz.sim.experts import a2a_seconds, measured_imbalance, moe_stages
from tests.foreign import routed_moe_net
from tests.test_ep_launch import _train, _train_once


@pytest.fixture(scope="module")
def graph() -> pv.ModelGraph:
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (8, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pv.trace(routed_moe_net(), example_args=(ids[:2],))


def _cfg(schedule: str = "1F1B", ep: int = 2) -> pv.LaunchConfig:
    return pv.LaunchConfig(schedule=schedule, microbatches=4, loss_fn=pv.cross_entropy, dp=2, ep=ep)


def _enclosing(tl: pv.Timeline, e: pv.Event) -> str:
    return next(str(x.kind) for x in tl.events if x.rank == e.rank and x.mb == e.mb and x.kind in ("F", "B", "I", "W")
                and x.start <= e.start and e.end <= x.end)


@pytest.mark.slow
def test_the_simulated_all_to_alls_are_the_runs_per_process_and_step() -> None:
    """pp 2 x dp 2 x ep 2 under 1F1B (exact, ``_train`` checks it): each process issues, per step, the A2A actions
    its pipeline rank's simulation holds (the count exchange is neither timed by the run nor an A2A event)."""
    run = _train_once("moenet", "1F1B", steps=1)  # the run test_ep_launch reads too: one launch for both
    sim = pv.simulate(run.plan, run.spec.config)
    simulated = Counter(e.rank for e in sim.events if e.kind == "A2A")
    counts = Counter((e.rank, e.step) for e in run.timeline().events if e.kind == "A2A")
    assert len(counts) == 4 and simulated == {0: 32, 1: 32}, (counts, simulated)
    assert all(n == simulated[run.mesh.coords(r).pp] for (r, _), n in counts.items()), (counts, simulated)
    assert {_enclosing(sim, e) for e in sim.events if e.kind == "A2A"} == {"F", "B"}
    # the run's routing, read back as the factor the simulator takes (random weights: 1.12 measured, 3 steps)
    imbalance = measured_imbalance(run.expert_tokens, 2)
    assert 1.0 <= imbalance <= 2.0
    slower = pv.simulate(run.plan, run.spec.config, expert_imbalance=imbalance)
    assert slower.step_time >= sim.step_time


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "schedule"), [("Qwen2-MoE", "1F1B"), ("moenet", "ZBVZeroBubble")])
def test_fused_hf_experts_and_a_split_backward_simulated_as_run(kind: str, schedule: str) -> None:
    """transformers 5.x's fused experts (rows read from the grouped matmul's input) and a split backward (the
    input-grad pass exchanges, the weight-grad pass does not): the run's A2A count per process and step."""
    if kind != "moenet":
        pytest.importorskip("transformers")
    run = _train(kind, schedule, steps=1)
    sim = pv.simulate(run.plan, run.spec.config)
    simulated = Counter(e.rank for e in sim.events if e.kind == "A2A")
    counts = Counter((e.rank, e.step) for e in run.timeline().events if e.kind == "A2A")
    assert simulated and all(n == simulated[run.mesh.coords(r).pp] for (r, _), n in counts.items()), (counts,
                                                                                                      simulated)
    assert all(s.row_bytes and all(b > 0 for b in s.row_bytes) for s in moe_stages(run.plan))


def test_a_split_backward_exchanges_in_its_input_grad_pass(graph: pv.ModelGraph) -> None:
    plan = graph.split(["blocks.0", "blocks.1", "blocks.2"])  # one MoE block per stage, two stages per rank
    tl = pv.simulate(plan, _cfg("ZBVZeroBubble"))
    a2a = [e for e in tl.events if e.kind == "A2A"]
    # per rank: 2 stages x 4 microbatches x (forward's dispatch + combine, input-grad's two reversed)
    assert Counter(e.rank for e in a2a) == {0: 32, 1: 32}
    assert Counter(_enclosing(tl, e) for e in a2a) == {"F": 32, "I": 32}
    assert not [e for e in pv.simulate(plan, _cfg("ZBVZeroBubble", ep=1)).events if e.kind == "A2A"]


def test_each_all_to_all_moves_the_rows_a_rank_sends_over_the_ep_link(graph: pv.ModelGraph) -> None:
    plan = graph.split(["blocks.1"])
    stages = moe_stages(plan)
    # top-2 of 2 x 6 traced tokens, 16 wide, float32: whatever the traced routing (dropless)
    assert [s.row_bytes for s in stages] == [(2 * 6 * 2 * 16 * 4.0,) * 2] * 2
    assert [s.blocks for s in stages] == [("blocks.0.experts", "blocks.1.experts"),
                                          ("blocks.2.experts", "blocks.3.experts")]
    bw, lat = 1e6, backend_link()[1]  # (gloo's latency: no hardware named)
    tl = pv.simulate(plan, _cfg(), ep_bandwidth=bw)
    # a microbatch of one replica routes 1/(4 x 2) of the traced batch's rows (as every cost reads the trace: the
    # step's batch); half of them leave the rank
    one = a2a_seconds(stages[0].row_bytes[0] / (4 * 2), 2, (bw, lat))
    assert one == pytest.approx(0.5 * 192 / bw + lat)
    assert all(e.duration == pytest.approx(one) for e in tl.events if e.kind == "A2A")
    assert tl.step_time > pv.simulate(plan, _cfg(), ep_bandwidth=100 * bw).step_time
    # the busiest owner's compute: charged on the experts' share of the stage, forward and backward
    assert pv.simulate(plan, _cfg(), expert_imbalance=2.0).step_time > pv.simulate(plan, _cfg()).step_time
    # on a hardware (each replica's microbatch costed at its own size), the group's link: NVLink within a node
    gpu = pv.simulate(plan, "1F1B", 4, dp=8, ep=8, hardware="h100")
    assert Counter(e.rank for e in gpu.events if e.kind == "A2A") == {0: 32, 1: 32}
    assert gpu.step_time < pv.simulate(plan, "1F1B", 4, dp=8, ep=8, hardware="h100", ep_bandwidth=1e9).step_time


def test_a_rank_holds_one_ep_th_of_the_experts_weights_grads_and_optimizer_state(graph: pv.ModelGraph) -> None:
    plan = graph.split(["blocks.1"])
    experts = [s.expert_param_bytes for s in moe_stages(plan)]
    assert experts[0] == 2 * 4 * (16 * 32 + 32 + 32 * 16 + 16) * 4  # 2 blocks x 4 experts of d -> 2d -> d, fp32
    whole, shared = pv.simulate(plan, _cfg(ep=1)), pv.simulate(plan, _cfg(ep=2))
    # weights, gradients and Adam's 2 states: 4 copies, half of them gone
    saved = [w - s for w, s in zip(whole.memory_bytes, shared.memory_bytes, strict=True)]
    assert saved == [4 * x // 2 for x in experts]


def test_measured_imbalance_is_the_busiest_owners_tokens_over_the_mean() -> None:
    loads = [ExpertLoad(0, 0, "b.experts", 0, 0, (6, 2, 0, 0)), ExpertLoad(0, 0, "b.experts", 0, 1, (0, 0, 2, 2)),
             ExpertLoad(0, 0, "b.experts", 1, 0, (1, 1, 1, 1)), ExpertLoad(0, 0, "b.experts", 1, 1, (1, 1, 1, 1))]
    # microbatch 0: owners hold 8 and 4 tokens (mean 6: 8/6); microbatch 1: balanced
    assert measured_imbalance(loads, 2) == pytest.approx((8 / 6 + 1) / 2)
    assert measured_imbalance([], 2) == 1.0
    with pytest.raises(ValueError, match=r"expert_imbalance=0.5.*at least 1.0.*Fix"):
        pv.CostOptions(expert_imbalance=0.5)


def test_ep_on_a_model_without_routed_experts_is_refused_naming_ep() -> None:
    x = torch.randn(8, 8)
    plan = pv.trace(pv.zoo.MyNetwork(8, [8, 8, 8, 8], 4), example_args=(x,)).split(["layer1"])
    with pytest.raises(ValueError, match=r"ep=2: the model has no routed experts.*Fix: ep=1"):
        pv.simulate(plan, "1F1B", 2, dp=2, ep=2)
