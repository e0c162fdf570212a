"""Context parallelism, the mesh's fourth dimension (pp x dp x cp x tp): each sequence split over cp processes,
priced in pv.simulate and searched by pv.plan_cluster, refused by pv.launch before any process starts."""

from __future__ import annotations

import warnings

import pytest
import torch

import pipeviz as pv
from pipeviz.cost.calibration import constant
from pipeviz.costs import attention_kv_bytes, stage_costs
from pipeviz.zoo import gpt2

BW, LAT = 1e8, 1e-4


@pytest.fixture(scope="module")
def plan() -> pv.SplitPlan:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
        return pv.trace(model, example_args=(torch.randint(0, 128, (4, 16)),)).split(["transformer.h.0"])


def test_the_mesh_orders_cp_between_dp_and_tp() -> None:
    mesh = pv.Mesh(pp=2, dp=2, tp=2, cp=2)
    assert mesh.world == 16 and mesh.dims == ("pp", "dp", "cp", "tp")
    assert mesh.coords(5) == (0, 1, 1, 0) and mesh.coords(5).cp == 0 and mesh.coords(6).cp == 1
    assert all(mesh.rank_of(mesh.coords(r)) == r for r in range(16))
    assert mesh.shares(pp=1, dp=1, tp=1) == (13, 15) and mesh.label(6) == "pp0 dp1 cp1 tp0"
    assert pv.LaunchConfig(cp=2).mesh(4) == pv.Mesh(pp=4, cp=2)


def test_cp_1_is_the_run_without_context_parallelism(plan: pv.SplitPlan) -> None:
    for schedule in ("GPipe", "1F1B"):
        alone = pv.simulate(plan, schedule, 2, bandwidth=BW, latency=LAT)
        same = pv.simulate(plan, pv.LaunchConfig(schedule=schedule, microbatches=2, cp=1, loss_fn=pv.cross_entropy),
                           bandwidth=BW, latency=LAT)
        assert same.events == alone.events and same.meta["memory_bytes"] == alone.meta["memory_bytes"]


def test_cp_2_against_costs_computed_by_hand(plan: pv.SplitPlan) -> None:
    m, cp = 2, 2
    base = stage_costs(plan, m, bandwidth=BW, latency=LAT)
    one = pv.simulate(plan, "GPipe", m, bandwidth=BW, latency=LAT)
    two = pv.simulate(plan, "GPipe", m, cp=cp, bandwidth=BW, latency=LAT)
    assert two.mesh == pv.Mesh(pp=2, cp=2) and two.meta["processes"] == ["pp0 cp0", "pp1 cp0"]
    kv = attention_kv_bytes(plan)
    assert kv == [32768.0, 32768.0]  # per stage: one layer's keys and values, 4 x 4 heads x 16 tokens x 16 x 4 B x 2
    for s in range(2):
        # the keys and values of one microbatch (16,384 B), gathered across 2 shares: (cp-1)/cp of them, one step
        gather = (cp - 1) / cp * kv[s] / m / BW + (cp - 1) * LAT
        f1 = next(e.duration for e in one.events if (e.stage, e.kind, e.mb) == (s, "F", 0))
        b1 = next(e.duration for e in one.events if (e.stage, e.kind, e.mb) == (s, "B", 0))
        f2 = next(e.duration for e in two.events if (e.stage, e.kind, e.mb) == (s, "F", 0))
        b2 = next(e.duration for e in two.events if (e.stage, e.kind, e.mb) == (s, "B", 0))
        o = base.overhead
        # (on a CPU the share runs its stage graph op by op: a measured constant per op of the stage)
        ops = sum(1 for op in plan.graph.capture.ops if plan._stage_of_op(op.index) == s)
        assert f2 == pytest.approx((f1 - o) / cp + o + gather + ops * constant("cpu_cp_op_overhead"), rel=1e-9)
        # the backward reduce-scatters their gradients: on gloo an all-reduce, twice the forward's exchange
        assert b2 == pytest.approx((b1 - o) / cp + o + 2 * gather, rel=1e-9)
        # each exchange a CP action inside the action issuing it
        cps = [e for e in two.events if (e.stage, e.kind, e.mb) == (s, "CP", 0)]
        assert len(cps) == 2 and all(c.duration == pytest.approx(gather * k) for c, k in zip(sorted(
            cps, key=lambda e: e.start), (1, 2), strict=True))
    # each share saves half the activations (GPipe holds every microbatch's), but its attention keeps the keys and
    # values it gathered whole: the other share's half of them too; the shares hold the same parameters: their
    # gradients are averaged, as replicas' are
    assert one.meta["peak_activation_bytes"] == [m * a for a in base.activation_bytes]
    gathered = [round(k / m * (cp - 1) / cp) for k in kv]
    assert two.meta["peak_activation_bytes"] == [m * (round(a / cp) + g)
                                                 for a, g in zip(base.activation_bytes, gathered, strict=True)]
    assert two.meta["dp_bytes"] == list(base.param_bytes) and "dp_bytes" not in one.meta
    assert any(e.kind == "B" for e in two.events) and two.step_time > 0


def test_the_planner_searches_cp_and_each_row_reproduces(plan: pv.SplitPlan) -> None:
    result = pv.plan_cluster(plan.graph, 8, "h100", global_batch=8, seq_len=16, cp=[1, 2], tp=[1], schedules=["1F1B"],
                             recompute="none", top=1000)
    with_cp = [r for r in result.rows if r.cp == 2]
    assert with_cp and {r.cp for r in result.rows} == {1, 2}
    assert all(r.gpus == r.pp * r.dp * r.cp * r.tp == 8 for r in result.rows)
    row = with_cp[0]
    assert " cp2 " in f" {row.label()} " and row.config.cp == 2
    tl = pv.simulate(row.plan, row.config, options=row.options, collectives=row.collectives)
    assert max(e.end for e in tl.events) - min(e.start for e in tl.events) == pytest.approx(row.step_time)
    assert row.peak_memory == max(tl.memory_bytes)  # the gathered keys and values kept whole, in both
    assert "cp" in result.table(top=len(result.rows)).splitlines()[1].split()


def test_launch_refuses_a_sequence_2cp_does_not_divide(plan: pv.SplitPlan) -> None:
    """pv.launch runs cp > 1 (tests/test_cp_launch.py); a sequence it cannot cut into 2·cp chunks is refused."""
    ids = torch.randint(0, 128, (4, 16))
    with pytest.raises(pv.LaunchError, match=r"cp=3: a sequence of 16 tokens .*Valid cp for 16 tokens: 1, 2, 4, 8"):
        pv.launch(plan, "GPipe", 2, steps=1, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, cp=3)


def test_the_exchanges_are_drawn_in_their_own_colour(plan: pv.SplitPlan) -> None:
    """A simulated cp step's exchanges: one ``CP`` action per attention op in each forward and backward, inside
    the action issuing it, drawn as their own kind (own colour and legend entry, as TP's collectives are)."""
    from pipeviz.widgets.figures import KIND_COLORS, timeline_traces

    tl = pv.simulate(plan, "1F1B", 2, cp=2, bandwidth=BW, latency=LAT)
    cps = [e for e in tl.events if e.kind == "CP"]
    assert len(cps) == 2 * 2 * 2  # 2 stages x 2 microbatches x (forward + backward), one attention op a stage
    for c in cps:
        host = next(e for e in tl.events if e.kind in ("F", "B") and (e.stage, e.mb) == (c.stage, c.mb)
                    and e.start <= c.start and c.end <= e.end)
        assert host.rank == c.rank
    drawn = [t for t in timeline_traces(tl) if t["meta"][1] == "CP"]
    assert len(drawn) == 1 and len(drawn[0]["x"]) == len(cps)
    assert drawn[0]["marker"]["color"] == KIND_COLORS["CP"] not in {KIND_COLORS[k] for k in KIND_COLORS if k != "CP"}
    assert drawn[0]["name"].startswith("CP · context-parallel exchange")


def test_on_gpus_the_backward_reduce_scatters_and_nothing_runs_op_by_op(plan: pv.SplitPlan) -> None:
    """On a GPU preset the backward's exchange is NCCL's reduce-scatter, as long as the forward's all-gather (gloo
    all-reduces instead: twice as long), and no CPU constant is charged."""
    gpu = pv.simulate(plan, "1F1B", 2, cp=2, hardware="h100", cores=1)
    cpu = pv.simulate(plan, "1F1B", 2, cp=2, bandwidth=BW, latency=LAT)
    for tl, ratio in ((gpu, 1.0), (cpu, 2.0)):
        f = [e.duration for e in tl.events if e.kind == "CP" and e.stage == 0]
        assert len(f) == 4 and sorted(f)[-1] == pytest.approx(ratio * sorted(f)[0])
    # no wait for a core (cpu_cp_exchange_wait, milliseconds) though the processes outnumber cores=1
    assert max(e.duration for e in gpu.events if e.kind == "CP") < constant("cpu_cp_exchange_wait") / 10
