"""``pv.simulate(..., dp=, tp=)``: a pipeline composed with data and tensor parallelism, on known costs."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import replace

import pytest
import torch

import pipeviz as pv
from pipeviz.cost.calibration import constant
from pipeviz.cost.sharding import tp_shares
from pipeviz.costs import (
    DDP_BUCKET_BYTES,
    CostOptions,
    all_reduce_time,
    ddp_buckets,
    memory_per_rank,
    parallel_costs,
    stage_costs,
)
from pipeviz.schedule import traits as sched
from pipeviz.schedule.tensor_parallel import default_tp_plan
from pipeviz.sim.simulate import Collectives, Costs
from pipeviz.sim.tensor_parallel import stage_ops

BW, LAT = 1e9, 1e-4  # the link in these tests: 1 GB/s, 0.1 ms per ring step


def _costs(param_bytes: tuple[int, ...]) -> Costs:
    """Textbook costs (forward 1 s, backward 2 s per microbatch) with these parameter bytes per stage."""
    return dataclasses.replace(Costs.uniform(len(param_bytes)), param_bytes=param_bytes)


def _ring(nbytes: float, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / BW + 2 * (ranks - 1) * LAT


def _compute(tl: pv.Timeline) -> list[tuple[int, int, str, int, float, float]]:
    return [(e.rank, e.stage, e.kind, e.mb, round(e.start, 9), round(e.end, 9)) for e in tl.events
            if e.kind in ("F", "B", "I", "W")]


def test_ring_all_reduce_formula() -> None:
    # 2(N-1) steps (reduce-scatter, all-gather), each moving bytes / N and paying the latency.
    assert all_reduce_time(8e6, 4, (BW, LAT)) == pytest.approx(6 / 4 * 8e6 / BW + 6 * LAT)
    assert all_reduce_time(8e6, 1, (BW, LAT)) == 0.0 and all_reduce_time(0, 8, (BW, LAT)) == 0.0
    assert ddp_buckets(DDP_BUCKET_BYTES * 2 + 5) == [DDP_BUCKET_BYTES, DDP_BUCKET_BYTES, 5] and ddp_buckets(0) == []


@pytest.mark.parametrize(("schedule", "n", "spr", "m"), [
    ("GPipe", 3, None, 4), ("1F1B", 4, None, 8), ("Interleaved1F1B", 4, 2, 4), ("LoopedBFS", 4, 2, 4),
    ("InterleavedZeroBubble", 4, 2, 4), ("ZBVZeroBubble", 4, 2, 4), ("DualPipeV", 4, 2, 4)])
def test_dp1_tp1_is_the_pipeline_alone(schedule: str, n: int, spr: int | None, m: int) -> None:
    costs = _costs((10**6,) * n)
    alone = pv.simulate(None, schedule, m, stages_per_rank=spr, costs=costs, num_stages=n)
    same = pv.simulate(None, schedule, m, stages_per_rank=spr, costs=costs, num_stages=n, dp=1, tp=1)
    assert same.events == alone.events and same.memory_bytes == alone.memory_bytes
    assert same.meta["mesh"] == (alone.num_ranks, 1, 1) and "processes" not in same.meta and "dp_bytes" not in same.meta


def test_dp1_tp1_on_a_real_plan(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer0", "layer1"])
    assert pv.simulate(plan, "1F1B", 4, dp=1, tp=1).events == pv.simulate(plan, "1F1B", 4).events


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_ddp_step_is_the_smaller_microbatch_step_plus_the_reduction_tail(schedule: str, dp: int) -> None:
    params = (4_000_000, 8_000_000, 2_000_000)  # one DDP bucket each: the whole reduction follows the backward
    m, p = 4, len(params)
    tl = pv.simulate(None, schedule, m, costs=_costs(params), num_stages=p, dp=dp, bandwidth=BW, latency=LAT,
                     dp_reduce="ddp")
    # Each replica's microbatch is 1/dp as large: the pipeline alone on costs / dp.
    smaller = pv.simulate(None, schedule, m, costs=Costs.uniform(p, 1 / dp, 2 / dp), num_stages=p)
    assert smaller.step_time == pytest.approx((m + p - 1) * 3 / dp)
    # DDP waits for its all-reduce in each stage's last backward, which then hands its grad on: the tails
    # of all stages line up on the critical path of the cool-down.
    assert tl.step_time == pytest.approx(smaller.step_time + sum(_ring(b, dp) for b in params))
    assert tl.meta["dp_bytes"] == list(params)  # the rank's parameter (= gradient) bytes
    assert tl.meta["dp_seconds"] == pytest.approx([_ring(b, dp) for b in params])
    assert tl.meta["mesh"] == (p, dp, 1) and tl.meta["processes"] == [f"pp{r} dp0" for r in range(p)]
    assert not [e for e in tl.events if e.kind == "DP"] and tl.num_ranks == p  # replica 0's rows only
    # Only each stage's last backward is longer; everything else is the smaller-microbatch pipeline's.
    longer = [e for e in tl.events if e.duration > 2 / dp + 1e-9]
    assert sorted((e.stage, e.kind, e.mb) for e in longer) == [(s, "B", m - 1) for s in range(p)]
    assert [e.duration for e in sorted(longer, key=lambda e: e.stage)] == pytest.approx(
        [2 / dp + _ring(b, dp) for b in params])


def test_ddp_buckets_overlap_the_last_backward() -> None:
    # 2.5 buckets on a link that reduces one bucket in 1 s (2 replicas, no latency): the two full buckets
    # start with the last backward (1 s of compute) and end 2 s later; the half bucket holding the first
    # layers follows: 0.5 s. The step grows by 1.5 s, not the 2.5 s a reduction after the backward would take.
    bw = DDP_BUCKET_BYTES
    costs = _costs((DDP_BUCKET_BYTES * 5 // 2,))
    base = pv.simulate(None, "1F1B", 2, costs=Costs.uniform(1, 0.5, 1.0), num_stages=1)
    tl = pv.simulate(None, "1F1B", 2, costs=costs, num_stages=1, dp=2, bandwidth=bw, latency=0.0, dp_reduce="ddp")
    assert base.step_time == pytest.approx(3.0)
    assert tl.step_time == pytest.approx(3.0 + 1.5)
    assert tl.meta["dp_seconds"] == pytest.approx([2.5])
    # A separate data-parallel link: twice the bandwidth halves every bucket (1 s overlapped, 0.25 s after).
    fast = pv.simulate(None, "1F1B", 2, costs=costs, num_stages=1, dp=2, bandwidth=bw, latency=0.0, dp_reduce="ddp",
                       dp_bandwidth=2 * bw)
    assert fast.step_time == pytest.approx(3.0 + 0.25)


@pytest.mark.parametrize(("schedule", "m"), [("InterleavedZeroBubble", 4), ("ZBVZeroBubble", 4), ("DualPipeV", 4)])
def test_split_backward_schedules_reduce_after_the_last_action(schedule: str, m: int) -> None:
    """``dp_reduce="after_flush"``: all the rank's gradients in one all-reduce after its last action."""
    params = (1_000_000, 3_000_000, 5_000_000, 7_000_000)
    n, dp = len(params), 2
    tl = pv.simulate(None, schedule, m, stages_per_rank=2, costs=_costs(params), num_stages=n, dp=dp, bandwidth=BW,
                     latency=LAT, dp_reduce="after_flush")
    smaller = pv.simulate(None, schedule, m, stages_per_rank=2, costs=Costs.uniform(n, 1 / dp, 2 / dp), num_stages=n)
    assert _compute(tl) == _compute(smaller)  # nothing overlaps: the compute is the smaller pipeline's
    lay = sched.layout(schedule, n, 2)
    reduced = [sum(params[s] for s in lay.stages_of(r)) for r in range(lay.num_ranks)]
    assert tl.meta["dp_bytes"] == reduced  # all the rank's gradients, in one all-reduce
    dp_events = sorted((e for e in tl.events if e.kind == "DP"), key=lambda e: e.rank)
    assert [(e.rank, e.stage, e.mb) for e in dp_events] == [(r, -1, -1) for r in range(lay.num_ranks)]
    for e in dp_events:
        last = max(x.end for x in tl.events if x.rank == e.rank and x.kind != "DP")
        assert e.start == pytest.approx(last) and e.duration == pytest.approx(_ring(reduced[e.rank], dp))
    # The step ends with the last reduction (Timeline.step_time spans compute events only).
    end = max(e.end for e in tl.events) - min(e.start for e in tl.events)
    assert end == pytest.approx(max(e.start + _ring(reduced[e.rank], dp) for e in dp_events))


def test_forward_only_has_no_reduction() -> None:
    tl = pv.simulate(None, "1F1B", 4, costs=_costs((10**6, 10**6)), num_stages=2, dp=2, forward_only=True)
    assert "dp_bytes" not in tl.meta and {e.kind for e in tl.events} == {"F"}
    assert tl.step_time == pytest.approx(5 * 0.5)


def test_tp_divides_compute_and_adds_collectives(classic_graph: pv.ModelGraph) -> None:
    plan, m, tp = classic_graph.split(["layer1"]), 4, 2
    base = stage_costs(plan, m, bandwidth=BW, latency=LAT)
    tl = pv.simulate(plan, "1F1B", m, tp=tp, bandwidth=BW, latency=LAT)
    layer = {lay.name: lay for lay in classic_graph.layers}
    # The all-reduces pv.launch's layout issues (default_tp_plan: layer0.lin column-wise, layer1.lin row-wise,
    # layer2.lin column-wise, output_proj row-wise): in the forward one per row-wise projection, of its layer's
    # output; in the backward one per column-wise group, of its input's gradient (a block's input taken as wide as
    # its output, a transformer block's hidden states).
    forward = [_ring(layer["layer1"].out_bytes / m, tp), _ring(layer["output_proj"].out_bytes / m, tp)]
    backward = [_ring(layer["layer0"].out_bytes / m, tp), _ring(layer["layer2"].out_bytes / m, tp)]
    # On this CPU each shard also runs its stage's ops through DTensor's dispatch (pipeviz.sim.tensor_parallel)
    ops = stage_ops(plan)
    f_ops = [n * constant("cpu_tp_op_overhead") for n in ops]
    b_ops = [n * constant("cpu_tp_backward_op_overhead") for n in ops]
    for e in tl.events:
        if e.kind not in ("F", "B"):
            continue
        work = base.forward[e.stage] / tp + f_ops[e.stage] if e.kind == "F" else (
            base.backward[e.stage] / tp + b_ops[e.stage])
        assert e.duration == pytest.approx(work + (forward if e.kind == "F" else backward)[e.stage])
    # each collective a TP action inside its forward or backward: one each way per stage and microbatch here
    assert sorted(e.duration for e in tl.events if e.kind == "TP") == pytest.approx(sorted(
        m * [*forward, *backward]))
    assert tl.meta["mesh"] == (2, 1, tp) and tl.meta["processes"] == ["pp0 tp0", "pp1 tp0"]
    # Memory per rank: what one shard keeps of the parameters (and their gradients and optimizer state) and of the
    # activations under the layout (tp_shares: the sharded weights and the sliced activations / tp, the rest
    # whole: here the row-wise projections' biases), not a uniform / tp.
    shares = tp_shares(plan, default_tp_plan(classic_graph.model, [s.layers for s in plan.stages]), tp)
    sharded = parallel_costs(base, tp=tp, shares=shares)
    assert all(1 / tp < share < 0.51 for share in shares.params), shares
    assert sharded.param_bytes == tuple(round(b * f) for b, f in zip(base.param_bytes, shares.params, strict=True))
    assert tl.memory_bytes == memory_per_rank(None, "1F1B", m, costs=sharded)
    assert max(tl.memory_bytes) < max(pv.simulate(plan, "1F1B", m).memory_bytes)
    # Zero bubble: the input-grad pass carries the backward's all-reduces, the weight-grad pass none.
    zb = pv.simulate(plan, "InterleavedZeroBubble", m, stages_per_rank=1, tp=tp, bandwidth=BW, latency=LAT)
    for e in zb.events:
        if e.kind == "W":
            assert e.duration == pytest.approx((base.backward[e.stage] / tp + b_ops[e.stage]) * base.weight_fraction)
        elif e.kind == "I":
            assert e.duration == pytest.approx(
                (base.backward[e.stage] / tp + b_ops[e.stage]) * (1 - base.weight_fraction) + backward[e.stage])


def test_dp_and_tp_compose(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer1"])
    tl = pv.simulate(plan, "GPipe", 4, dp=2, tp=2)
    assert tl.meta["mesh"] == (2, 2, 2) and tl.meta["processes"] == ["pp0 dp0 tp0", "pp1 dp0 tp0"]
    shares = tp_shares(plan, default_tp_plan(classic_graph.model, [s.layers for s in plan.stages]), 2)
    # each shard's gradients: its piece of the sharded weights, the replicated biases whole
    assert tl.meta["dp_bytes"] == [round(s.param_bytes * f) for s, f in zip(plan.stages, shares.params, strict=True)]
    # each replica's shards take half of every microbatch: its forwards and backwards (with their all-reduces,
    # of half the bytes) are shorter than one pipeline's; the replicas' gradient all-reduce comes on top (in each
    # stage's last backward, as DDP overlaps it)
    alone = pv.simulate(plan, "GPipe", 4, tp=2)
    for kind in ("F", "B"):
        for stage in range(2):
            assert min(e.duration for e in tl.events if (e.kind, e.stage) == (kind, stage)) < min(
                e.duration for e in alone.events if (e.kind, e.stage) == (kind, stage))


def test_cores_are_shared_by_the_replicas() -> None:
    # 2 pipeline ranks x 2 replicas on 2 cores: replica 0's pipeline gets one core.
    tl = pv.simulate(None, "1F1B", 4, costs=Costs.uniform(2), num_stages=2, dp=2, cores=2)
    one_core = pv.simulate(None, "1F1B", 4, costs=Costs.uniform(2, 0.5, 1.0), num_stages=2, cores=1)
    assert _compute(tl) == _compute(one_core)
    roomy = pv.simulate(None, "1F1B", 4, costs=Costs.uniform(2), num_stages=2, dp=2, cores=4)
    assert roomy.step_time == pytest.approx(pv.simulate(None, "1F1B", 4, costs=Costs.uniform(2, 0.5, 1.0),
                                                        num_stages=2).step_time)


@pytest.mark.parametrize(("option", "value"), [("dp", 0), ("dp", -2), ("tp", 0), ("dp", 1.5), ("tp", "2"),
                                               ("dp", True), ("tp", None), ("cp", 0), ("cp", 2.0)])
def test_bad_degrees_are_refused(option: str, value: object) -> None:
    # one check for simulate, launch and a LaunchConfig: a MeshError (a LaunchError, a ValueError)
    with pytest.raises(pv.MeshError) as info:
        pv.simulate(None, "1F1B", 4, costs=Costs.uniform(2), num_stages=2, **{option: value})
    assert str(info.value).startswith(f"{option} must be a positive int")
    assert f"got {value!r}. Fix: {option}=1 " in str(info.value)
    with pytest.raises(pv.LaunchError, match=rf"^{option} must be a positive int"):
        pv.LaunchConfig(**{option: value})


def test_compare_takes_dp_and_tp(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer1"])
    cmp = pv.compare(plan, ["GPipe", "1F1B"], microbatches=4, config=pv.LaunchConfig(loss_fn=pv.cross_entropy, dp=2,
                                                                                      tp=2))
    assert [r.step_time for r in cmp.rows] == [pv.simulate(plan, s, 4, dp=2, tp=2).step_time
                                                  for s in ("GPipe", "1F1B")]
    assert all(tl.meta["mesh"] == (2, 2, 2) for tl in cmp.timelines.values())


def test_after_flush_reduces_every_rank_once_after_its_last_action() -> None:
    # Megatron-LM's --DDP-impl local: the compute is the smaller pipeline's, untouched; each rank's gradients
    # follow in one all-reduce; float16 gradients (traced float32: 4 bytes) halve its bytes.
    params = (DDP_BUCKET_BYTES * 8, DDP_BUCKET_BYTES * 12)
    after = Collectives(dp_reduce="after_flush", grad_dtype="float16")
    tl = pv.simulate(None, "1F1B", 4, costs=_costs(params), num_stages=2, dp=2, bandwidth=BW, latency=LAT,
                     collectives=after)
    smaller = pv.simulate(None, "1F1B", 4, costs=Costs.uniform(2, 0.5, 1.0), num_stages=2)
    assert _compute(tl) == _compute(smaller)
    assert tl.meta["dp_bytes"] == [p / 2 for p in params]
    for e in (e for e in tl.events if e.kind == "DP"):
        last = max(x.end for x in tl.events if x.rank == e.rank and x.kind != "DP")
        assert e.start == pytest.approx(last) and e.duration == pytest.approx(_ring(params[e.rank] / 2, 2))
    # DDP overlaps most of it with the last backward: a shorter step for the same bytes.
    ddp = pv.simulate(None, "1F1B", 4, costs=_costs(params), num_stages=2, dp=2, bandwidth=BW, latency=LAT,
                      collectives=Collectives(grad_dtype="float16"))
    assert ddp.step_time < tl.step_time


def test_the_overlapped_all_reduce_starts_when_a_stage_is_done_and_waits_only_at_the_step_end() -> None:
    """``dp_reduce="overlap"`` (``pv.launch``'s default): a stage's buckets start when its last backward ends, on
    the rank's link one after another, while the rank computes its other stages; only what outlasts the rank's
    last action is a DP event after it. Interleaved on one rank: stage 0 finishes before stage 1's backwards, so
    its reduction hides behind them, where DDP's waits inside each stage's last backward."""
    costs = Costs.uniform(2, 0.5, 1.0)
    costs = replace(costs, param_bytes=(DDP_BUCKET_BYTES, DDP_BUCKET_BYTES))  # 1 s of all-reduce per stage
    kw = {"costs": costs, "num_stages": 2, "stages_per_rank": 2, "dp": 2, "bandwidth": DDP_BUCKET_BYTES,
          "latency": 0.0}
    overlap = pv.simulate(None, "Interleaved1F1B", 2, **kw)
    assert overlap.meta["config"].dp_reduce is None  # the default: dp_reduce_mode picks "overlap"
    ddp = pv.simulate(None, "Interleaved1F1B", 2, **kw, dp_reduce="ddp")
    flush = pv.simulate(None, "Interleaved1F1B", 2, **kw, dp_reduce="after_flush")
    compute = max(e.end for e in overlap.events if e.kind != "DP")
    assert compute == pytest.approx(max(e.end for e in flush.events if e.kind != "DP"))  # compute is unchanged
    [tail] = [e for e in overlap.events if e.kind == "DP"]
    assert tail.start == pytest.approx(compute)
    assert overlap.meta["dp_seconds"] == pytest.approx([2.0])  # both stages' all-reduces
    assert tail.duration < 2.0  # the first stage's, at least partly, ran under the other stage's backwards
    assert max(e.end for e in overlap.events) < max(e.end for e in flush.events)
    assert max(e.end for e in overlap.events) < max(e.end for e in ddp.events)
    assert overlap.meta["dp_exposed"] == pytest.approx([tail.duration])
    assert flush.meta["dp_exposed"] == pytest.approx([2.0])


def test_distributed_optimizer_reduce_scatters_and_hides_the_gather() -> None:
    # Megatron-Core's distributed optimizer: a reduce-scatter is half an all-reduce (its steps and bytes), in
    # buckets overlapping the last backward as DDP's; the parameters' all-gather hides in the first forward.
    params = (DDP_BUCKET_BYTES * 5 // 2,)
    costs = _costs(params)
    kw = {"costs": costs, "num_stages": 1, "dp": 2, "bandwidth": DDP_BUCKET_BYTES, "latency": 0.0}
    ddp = pv.simulate(None, "1F1B", 2, **kw, dp_reduce="ddp")  # 2.5 s of all-reduce, 1.5 s exposed (see above)
    dist = pv.simulate(None, "1F1B", 2, **kw, collectives=Collectives(dp_reduce="distributed"))
    assert ddp.step_time == pytest.approx(4.5)
    # One 40M-parameter bucket (160 MB) holds all 65 MB: a reduce-scatter of 1.25 s once the backward ends
    # (3 s); the all-gather, 1.25 s too, outlasts the first forward (0.5 s) by 0.75 s.
    assert dist.step_time == pytest.approx(3.0 + 1.25 + 0.75)
    assert dist.meta["dp_seconds"] == pytest.approx([2.5])
    with pytest.raises(ValueError, match="Unknown dp_reduce='zero3'; valid: ddp, after_flush, distributed"):
        Collectives(dp_reduce="zero3")
    with pytest.raises(ValueError, match="Unknown grad_dtype 'int8'"):
        Collectives(grad_dtype="int8")


def test_distributed_optimizer_reduces_and_gathers_stage_by_stage_when_interleaved() -> None:
    # Megatron-Core r0.8.0 interleaved: each model chunk's gradients are reduce-scattered once its last backward
    # is done, and each chunk's parameters all-gathered ahead of its first forward. 2 ranks x 2 stages, dp 2
    # (forward 0.5 s, backward 1 s); each stage's reduce-scatter and all-gather take 1 s.
    costs = dataclasses.replace(Costs.uniform(4), param_bytes=(2 * DDP_BUCKET_BYTES,) * 4)
    tl = pv.simulate(None, "Interleaved1F1B", 2, costs=costs, num_stages=4, stages_per_rank=2, dp=2,
                     bandwidth=DDP_BUCKET_BYTES, latency=0.0, collectives=Collectives(dp_reduce="distributed"))
    rows = [(r, s, k, mb, start, end) for r, s, k, mb, start, end in _compute(tl) if r == 0]
    assert rows == [
        # rank stage kind mb start end
        (0, 0, "F", 0, 0.0, 1.0),  # stage 0's gather (0-1 s) outlasts its 0.5 s forward
        (0, 0, "F", 1, 1.0, 1.5),
        (0, 2, "F", 0, 1.5, 2.0),  # stage 2's gather (1-2 s) hid behind stage 0's forwards
        (0, 2, "F", 1, 2.0, 2.5),
        (0, 2, "B", 0, 3.5, 4.5),
        (0, 2, "B", 1, 5.0, 6.0),  # stage 2's reduce-scatter: 6-7 s, behind stage 0's backwards
        (0, 0, "B", 0, 6.0, 7.0),
        (0, 0, "B", 1, 7.0, 8.0),
    ]
    # Only the first stage's reduce-scatter outlasts the rank's compute: 1 s of the rank's 2 s of reductions.
    dp_events = sorted((e.rank, e.start, e.end) for e in tl.events if e.kind == "DP")
    assert dp_events == [(0, 8.0, 9.0), (1, 7.0, 8.0)] and tl.step_time == pytest.approx(9.0)
    assert tl.meta["dp_seconds"] == pytest.approx([4.0, 4.0])  # per rank: 2 gathers + 2 reduce-scatters


def test_tp_overlap_and_scattered_hand_offs(classic_graph: pv.ModelGraph) -> None:
    plan, m, tp = classic_graph.split(["layer1"]), 4, 2
    plain = pv.simulate(plan, "1F1B", m, tp=tp, bandwidth=BW, latency=LAT)
    hidden = pv.simulate(plan, "1F1B", m, tp=tp, bandwidth=BW, latency=LAT, collectives=Collectives(tp_overlap=True))
    base = stage_costs(plan, m, bandwidth=BW, latency=LAT)
    # a shard's forward on this CPU: its half of the compute and its ops dispatched through DTensor
    shard = [f / tp + n * constant("cpu_tp_op_overhead") for f, n in zip(base.forward, stage_ops(plan), strict=True)]
    coll = [(p.duration - shard[p.stage]) for p in plain.events if p.kind == "F" and p.mb == 0]
    for e in (e for e in hidden.events if e.kind == "F"):
        exposed = max(0.0, coll[e.stage] - shard[e.stage])
        assert e.duration == pytest.approx(shard[e.stage] + exposed)
    assert hidden.step_time < plain.step_time
    # Two pipeline ranks of 8 shards each sit in two nodes: scattered, each shard sends 1/8 on its own NIC and
    # the receiver gathers over NVLink: cheaper for a large activation, dearer (a second latency) for a tiny one.
    big = CostOptions(hardware="a100", batch_scale=10_000)
    whole = pv.simulate(plan, "1F1B", m, tp=8, options=big)
    scattered = pv.simulate(plan, "1F1B", m, tp=8, options=big, collectives=Collectives(scatter_gather=True))
    assert scattered.step_time < whole.step_time
    tiny = pv.simulate(plan, "1F1B", m, tp=8, hardware="a100", collectives=Collectives(scatter_gather=True))
    assert tiny.step_time > pv.simulate(plan, "1F1B", m, tp=8, hardware="a100").step_time


def test_on_shared_cores_the_all_reduce_holds_a_core() -> None:
    """Gloo's all-reduce on CPU is the cores' own work: with one core for a replica's four ranks, every action and
    every reduction (in its rank's last backward) runs one after another, none overlapping (a rank's last
    backward used to free the core while its all-reduce went on)."""
    costs = _costs((8_000_000,) * 4)
    shared = pv.simulate(None, "GPipe", 4, costs=costs, num_stages=4, dp=2, cores=2, bandwidth=BW, latency=LAT,
                         dp_reduce="ddp")
    assert sum(shared.meta["dp_seconds"]) > 0
    assert shared.step_time == pytest.approx(sum(e.duration for e in shared.events))
    spans = sorted((e.start, e.end) for e in shared.events)
    assert all(b[0] >= a[1] - 1e-9 for a, b in itertools.pairwise(spans))


def test_the_cpu_preset_all_reduces_slower_than_it_hands_off() -> None:
    """Gloo's all-reduce moves 0.55 of a send's bytes per second here (benchmarks/calibration/gloo_links.py);
    GPU presets 1."""
    cpu, h100 = pv.hardware("cpu"), pv.hardware("h100")
    assert cpu.allreduce_efficiency == 0.55 and h100.allreduce_efficiency == 1.0
    with pytest.raises(pv.HardwareError, match="allreduce_efficiency"):
        dataclasses.replace(h100, allreduce_efficiency=0.0)
    graph = pv.trace(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)),
                     example_args=(torch.randn(32, 256),))
    plan = graph.split(["0"])
    slow = pv.simulate(plan, "1F1B", 4, dp=2, hardware="cpu")
    fast = pv.simulate(plan, "1F1B", 4, dp=2, hardware=dataclasses.replace(cpu, allreduce_efficiency=1.0))
    for s, f in zip(slow.meta["dp_seconds"], fast.meta["dp_seconds"], strict=True):
        assert s > f


def test_ranks_computing_at_once_slow_each_other_by_the_hardware_contention() -> None:
    """``Hardware.contention``: an op runs longer while another rank computes (one processor's cache and memory
    bandwidth shared; 1.10 on "cpu", 1 on GPUs). Ops that never overlap are untouched; replicas always compute
    beside each other, so every op stretches by the whole factor."""
    cpu, h100 = pv.hardware("cpu"), pv.hardware("h100")
    assert cpu.contention == pytest.approx(1.10) and h100.contention == 1.0
    with pytest.raises(pv.HardwareError, match="contention"):
        dataclasses.replace(h100, contention=0.5)
    graph = pv.trace(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]),
                     example_args=(torch.randn(64, 512),))
    plan = graph.split(["1"])
    # A device 10^5 times slower than an H100: the ops, not the links' latency, fill the step.
    slow = dataclasses.replace(h100, flops={k: v / 1e5 for k, v in h100.flops.items()},
                               memory_bandwidth=h100.memory_bandwidth / 1e5)
    slowed = dataclasses.replace(slow, contention=1.5)

    def step(hw: pv.Hardware, m: int) -> float:
        return pv.simulate(plan, "GPipe" if m == 1 else "1F1B", m, hardware=hw).step_time

    # One microbatch: rank 1 starts when rank 0 has finished, and so on back: never two ranks at once.
    assert step(slowed, 1) == pytest.approx(step(slow, 1))
    # Eight: the ranks overlap for most of the step, but not in its fill and drain.
    assert step(slow, 8) * 1.05 < step(slowed, 8) < step(slow, 8) * 1.5
    forwards = [[e.duration for e in pv.simulate(plan, "1F1B", 8, hardware=hw, dp=2).events if e.kind == "F"]
                for hw in (slow, slowed)]
    assert [b / a for a, b in zip(*forwards, strict=True)] == pytest.approx([1.5] * len(forwards[0]))
