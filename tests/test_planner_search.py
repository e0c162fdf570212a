"""pv.plan_cluster's pruned search: the same best rows as the exhaustive one, and bounds that never exceed what they
bound (issue 49: the reduction became a searched dimension; the bounds prune it again)."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.cost.memory import peak_activations
from pipeviz.planner import search as planner
from pipeviz.schedule import traits as sched
from pipeviz.sim.collectives import Collectives
from pipeviz.zoo import TinyTransformer

MEGATRON_CORE = Collectives(dp_reduce="distributed", grad_dtype="float32", tp_overlap=True, scatter_gather=True)
# (gpus, global batch, keywords): torch's defaults; Megatron-Core's collectives with every reduction searched, tensor
# and context parallelism; a memory limit that binds (set from the free plan's peaks in the test)
CASES = {
    "default": (8, 32, {}),
    "megatron-core": (8, 16, {"collectives": MEGATRON_CORE, "dp_reduce": ["ddp", "overlap", "after_flush",
                                                                           "distributed"], "cp": [1, 2]}),
    "tight memory": (8, 32, {"recompute": ["none", "full"], "tight": True}),
}


@pytest.fixture(scope="module")
def tiny() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(TinyTransformer(vocab=64, dim=32, heads=2, depth=4, seq=16),
                    example_args=(torch.randint(0, 64, (8, 16)),))


def _key(r: pv.LayoutOption) -> tuple[object, ...]:
    return (r.pp, r.dp, r.cp, r.tp, r.schedule, r.stages_per_rank, r.microbatch_size, r.microbatches, r.recompute,
            r.dp_reduce)


def _plan(graph: pv.ModelGraph, case: str, top: int) -> pv.ClusterPlan:
    gpus, batch, kw = CASES[case]
    kw = dict(kw)
    # seq_len 4096 over the traced 16: compute of the size of the links' latency, so neither decides alone
    common = {"global_batch": batch, "seq_len": 4096, "tp": [1, 2, 4]}
    if kw.pop("tight", False):
        free = pv.plan_cluster(graph, gpus, "h100", **common, **kw, top=10_000)
        peaks = sorted(r.peak_memory for r in free.rows)
        kw["memory_limit"] = peaks[len(peaks) // 3]
    return pv.plan_cluster(graph, gpus, "h100", **common, **kw, top=top)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pruned_ranking_is_the_exhaustive_ones(tiny: pv.ModelGraph, case: str) -> None:
    everything = _plan(tiny, case, top=10_000)  # nothing pruned by the step bound: every option that fits simulated
    pruned = _plan(tiny, case, top=8)
    assert everything.rows and pruned.simulated < everything.simulated and pruned.pruned > everything.pruned
    best = everything.rows[:8]
    assert [r.step_time for r in pruned.rows] == pytest.approx([r.step_time for r in best], rel=1e-12)
    # the same rows (two rows of one step may come in either order: compared as sets of equal steps)
    by_step: dict[float, set[tuple[object, ...]]] = {}
    for r in best:
        by_step.setdefault(round(r.step_time, 15), set()).add(_key(r))
    last = round(best[-1].step_time, 15)
    for r in pruned.rows:
        step = round(r.step_time, 15)
        assert _key(r) in by_step[step] or step == last, (case, r.label())
    assert (everything.considered, everything.too_long) == (pruned.considered, pruned.too_long)
    if case == "tight memory":
        assert everything.too_big > 0 and all(r.peak_memory <= everything.memory_limit for r in everything.rows)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bounds_never_exceed_the_step_and_the_memory(tiny: pv.ModelGraph, case: str) -> None:
    """Every option simulated by the exhaustive search: its step bound (compute, pipeline fill, the reduction's
    floor) is at most its simulated step, its memory bound at most its peak."""
    gpus, batch, kw = CASES[case]
    kw = {k: v for k, v in kw.items() if k != "tight"}
    everything = pv.plan_cluster(tiny, gpus, "h100", global_batch=batch, seq_len=4096, tp=[1, 2, 4], top=10_000, **kw)
    search, space = planner._ask(tiny, gpus, "h100", batch, 4096, None, None, kw.get("recompute"), "bfloat16",
                                 [1, 2, 4], kw.get("cp"), None, (2,), 2, kw.get("collectives"), kw.get("dp_reduce"))
    candidates, _, _ = planner._candidates(search, space)
    bounds = {(o.pp, o.dp, o.cp, o.tp, o.schedule, o.v, o.b, o.m, o.mode, o.reduce if o.dp > 1 else "ddp"): (b, o)
              for b, o in candidates}
    assert len(everything.rows) > 20
    tight = 0
    for r in everything.rows:
        key = _key(r)
        if r.dp == 1:
            key = (*key[:-1], "ddp")
        bound, o = bounds[key]
        assert bound <= r.step_time, (r.label(), bound, r.step_time)
        tight += bound > 0.8 * r.step_time
        memory = search.memory_bound(o.tp, o.cp, o.pp, o.schedule, o.v, o.b, o.mode)
        assert memory <= r.peak_memory * (1 + 1e-12)
        assert planner._peak(search, o) == pytest.approx(r.peak_memory, rel=1e-9)
    assert tight > len(everything.rows) // 4  # and not vacuous: a quarter within 20 % of the step


@pytest.mark.parametrize("name", [n for n in sched.ALL if sched.SCHEDULES[n].multi])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_a_schedules_activations_never_fall_past_two_microbatches_per_rank(name: str, pp: int) -> None:
    """What the planner's memory check leans on (``_fewer``): from any multiple of pp microbatches on, the peak
    per rank never falls as microbatches are added, so an option over the limit with ``2 x pp`` is over it with
    more. (Below, it can: Interleaved1F1B holds more with pp + 1 than with 2 x pp.)"""
    spr = 2
    n = pp * spr
    sizes = [3.0 + s for s in range(n)]  # uneven stages
    peaks = {}
    for m in range(1, 6 * pp + 1):
        try:
            peaks[m] = peak_activations(sched.orders(name, n, m, spr), sizes, 0.5)
        except sched.ScheduleError:
            continue
    for a in [c for c in peaks if c % pp == 0]:
        for b in [c for c in peaks if c > a]:
            assert all(x <= y for x, y in zip(peaks[a], peaks[b], strict=True)), (name, a, b, peaks[a], peaks[b])
    for m in peaks:
        fewer = planner._fewer(name, n, m, spr)
        assert fewer == m or (fewer == 2 * pp < m and fewer in peaks)
