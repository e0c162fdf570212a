"""The replicas' gradient average overlapped with the rest of the step (``dp_reduce="overlap"``, ``pv.launch``'s
default with replicas: ``pipeviz.runtime.overlap``), ZeRO-1 (``"zero1"``: reduce-scattered at the same moment, the
optimizer's state sharded, ``pipeviz.runtime.zero``), torch's DDP (``"ddp"``) and one all-reduce after the step
(``"after_flush"``): each exact against the unsplit model; the overlapped ones start while the rank still computes
its other stages; ``pv.simulate`` of the same config reduces the same way; bad settings refused before any
process starts. (Every schedule with replicas under the default: ``tests/test_data_parallel.py``.)"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import pipeviz as pv
from pipeviz.schedule.config import dp_reduce_mode
from pipeviz.schedule.timeline import COMPUTE
from pipeviz.sim.simulate import _run_collectives
from tests.models import TiedSkipBN


def _setup() -> tuple[pv.ModelGraph, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids, target = torch.randint(0, 16, (16, 4)), torch.randint(0, 16, (16, 4))
    return pv.trace(TiedSkipBN(), example_args=(ids,)), ids, target


WIDE = (pytest.mark.compat, pytest.mark.coverage)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "dp_reduce"), [
    ("Interleaved1F1B", None), ("ZBVZeroBubble", "overlap"), ("1F1B", "ddp"), ("Interleaved1F1B", "after_flush"),
    ("Interleaved1F1B", "zero1"),
    *[pytest.param(s, "zero1", marks=WIDE) for s in ("ZBVZeroBubble", "DualPipeV", "GPipe", "LoopedBFS",
                                                     "InterleavedZeroBubble")]])
def test_each_reduction_trains_like_the_unsplit_model(schedule: str, dp_reduce: str | None) -> None:
    graph, ids, target = _setup()
    plan = graph.split(["bn"] if schedule in ("1F1B", "GPipe") else ["l1", "bn", "l2"])
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), dp=2, dp_reduce=dp_reduce)
    assert run.wait(240) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok and check.param_diff <= 1e-5 and check.loss_diff <= 1e-5, check
    dp_events = [e for e in run.events if e.kind == "DP"]
    assert {(e.rank, e.step) for e in dp_events} == {(r, s) for r in range(4) for s in range(2)}
    if dp_reduce in (None, "overlap", "zero1"):  # DP events per stage (a bucket; ZeRO-1: a tensor) and step
        per_rank = 2 if schedule not in ("1F1B", "GPipe") else 1
        assert len(dp_events) >= 4 * 2 * per_rank
        for rank in range(4 if per_rank > 1 else 0):  # (one stage a rank: nothing computes after its last)
            for step in range(2):
                mine = [e for e in run.events if e.rank == rank and e.step == step]
                last = max(e.end for e in mine if e.kind in COMPUTE)
                first_dp = min(e.start for e in mine if e.kind == "DP")
                # the earlier stage's average started while the rank still computed its other stage
                assert first_dp < last, (rank, step, first_dp, last)


@pytest.mark.slow
def test_zero1_shards_the_optimizer_state_trains_exactly_and_resumes_either_way(tmp_path: Path) -> None:
    """ZeRO-1 with AdamW (weight decay), clipping and accumulation: exact; each process holds half the optimizer's
    state (the static bytes fall); ``run.save`` writes the state whole by name, so a plain run resumes from a ZeRO-1
    run's checkpoint and a ZeRO-1 run from a plain one's, each matching the unsplit model started from it."""
    graph, ids, target = _setup()
    plan = graph.split(["bn"])
    kw = {"inputs": (ids,), "target": target, "loss_fn": pv.cross_entropy,
          "optimizer": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
          "lr_scheduler": pv.warmup_cosine(1, 4)}
    zero = pv.launch(plan, "1F1B", 4, steps=2, dp=2, dp_reduce="zero1", clip_grad_norm=0.05, accumulate=2, **kw)
    full = pv.launch(plan, "1F1B", 4, steps=2, dp=2, clip_grad_norm=0.05, accumulate=2, **kw)
    assert zero.wait(240) == "done" and full.wait(240) == "done", (zero.error, full.error)
    check = pv.check_numerics(zero)
    assert check.ok and check.param_diff <= 1e-5, check
    assert zero.grad_norms == pytest.approx(full.grad_norms, rel=1e-5)
    for rank in range(4):  # parameters and their grads whole, Adam's two states and the shards halved
        assert zero.memory[rank][-1][1] < full.memory[rank][-1][1], rank
    zero.save(tmp_path / "zero")
    plain = pv.launch(plan, "1F1B", 4, steps=2, resume=tmp_path / "zero", **kw)
    assert plain.wait(240) == "done", plain.error
    assert pv.check_numerics(plain).ok
    full.save(tmp_path / "full")
    again = pv.launch(plan, "1F1B", 4, steps=2, dp=2, dp_reduce="zero1", resume=tmp_path / "full", **kw)
    assert again.wait(240) == "done", again.error
    check = pv.check_numerics(again)
    assert check.ok, check


def test_the_simulator_reduces_as_the_launch_does() -> None:
    cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=4, loss_fn=pv.cross_entropy, dp=2)
    assert dp_reduce_mode(cfg) == "overlap"
    assert dp_reduce_mode(cfg.replace(tp=2)) == "after_flush"
    assert dp_reduce_mode(cfg.replace(dp_shard=True)) == "fsdp2"
    assert dp_reduce_mode(cfg.replace(dp_reduce="ddp")) == "ddp"
    assert dp_reduce_mode(cfg.replace(dp_reduce="zero1")) == "zero1"
    assert _run_collectives(cfg.replace(dp_reduce="zero1")).dp_reduce == "distributed"  # Megatron's distributed
    graph, _, _ = _setup()
    plan = graph.split(["l1", "bn", "l2"])
    tl = pv.simulate(plan, cfg)
    dp = [e for e in tl.events if e.kind == "DP"]
    assert dp
    for e in dp:  # only the tail after the rank's last action is an event
        assert e.start == pytest.approx(max(x.end for x in tl.events if x.rank == e.rank and x.kind in COMPUTE))
    assert tl.meta["dp_exposed"] == pytest.approx([max([0.0, *(e.duration for e in dp if e.rank == r)])
                                                   for r in range(2)])


def test_a_reduction_that_cannot_work_is_refused_before_any_process() -> None:
    graph, ids, target = _setup()
    plan = graph.split(["l1", "bn", "l2"])
    kw = {"inputs": (ids,), "target": target, "loss_fn": pv.cross_entropy, "dp": 2}
    with pytest.raises(pv.LaunchError, match=r"dp_reduce must be one of 'overlap', 'zero1', 'ddp', 'after_flush' or "
                                             r"None, got 'zero3'. Fix: dp_reduce='overlap'"):
        pv.launch(plan, "Interleaved1F1B", 4, dp_reduce="zero3", **kw)
    with pytest.raises(pv.LaunchError, match=r"dp_reduce='ddp' under ZBVZeroBubble \(a split backward\).*Fix: "
                                             r"dp_reduce='overlap'"):
        pv.launch(plan, "ZBVZeroBubble", 4, dp_reduce="ddp", **kw)
    with pytest.raises(pv.LaunchError, match=r"dp_reduce='overlap' with dp_shard=True: FSDP2 reduce-scatters"):
        pv.launch(plan, "Interleaved1F1B", 4, dp_reduce="overlap", dp_shard=True, **kw)
    with pytest.raises(pv.LaunchError, match=r"dp_reduce='overlap' with tp=2.*Fix: dp_reduce='after_flush'"):
        pv.launch(plan, "Interleaved1F1B", 4, dp_reduce="overlap", tp=2, tp_plan={"l2": "colwise", "l3": "rowwise"},
                  **kw)
