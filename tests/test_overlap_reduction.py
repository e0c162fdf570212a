"""The replicas' gradient average overlapped with the rest of the step (``dp_reduce="overlap"``, ``pv.launch``'s
default with replicas: ``pipeviz.runtime.overlap``), torch's DDP (``"ddp"``) and one all-reduce after the step
(``"after_flush"``): each exact against the unsplit model; the overlapped one starts while the rank still computes
its other stages; ``pv.simulate`` of the same config reduces the same way; bad settings refused before any
process starts. (Every schedule with replicas under the default: ``tests/test_data_parallel.py``.)"""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.runtime.config import dp_reduce_mode
from pipeviz.timeline import COMPUTE
from tests.models import TiedSkipBN


def _setup() -> tuple[pv.ModelGraph, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids, target = torch.randint(0, 16, (16, 4)), torch.randint(0, 16, (16, 4))
    return pv.trace(TiedSkipBN(), example_args=(ids,)), ids, target


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "dp_reduce"), [("Interleaved1F1B", None), ("ZBVZeroBubble", "overlap"),
                                                     ("1F1B", "ddp"), ("Interleaved1F1B", "after_flush")])
def test_each_reduction_trains_like_the_unsplit_model(schedule: str, dp_reduce: str | None) -> None:
    graph, ids, target = _setup()
    plan = graph.split(["bn"] if schedule == "1F1B" else ["l1", "bn", "l2"])
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), dp=2, dp_reduce=dp_reduce)
    assert run.wait(240) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok and check.param_diff <= 1e-5 and check.loss_diff <= 1e-5, check
    dp_events = [e for e in run.events if e.kind == "DP"]
    assert {(e.rank, e.step) for e in dp_events} == {(r, s) for r in range(4) for s in range(2)}
    if dp_reduce in (None, "overlap"):  # one DP event per stage (its bucket) and step on every process
        per_rank = 2 if schedule != "1F1B" else 1
        assert len(dp_events) == 4 * 2 * per_rank
        for rank in range(4):
            for step in range(2):
                mine = [e for e in run.events if e.rank == rank and e.step == step]
                last = max(e.end for e in mine if e.kind in COMPUTE)
                first_dp = min(e.start for e in mine if e.kind == "DP")
                # the earlier stage's average started while the rank still computed its other stage
                assert first_dp < last, (rank, step, first_dp, last)


def test_the_simulator_reduces_as_the_launch_does() -> None:
    cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=4, loss_fn=pv.cross_entropy, dp=2)
    assert dp_reduce_mode(cfg) == "overlap"
    assert dp_reduce_mode(cfg.replace(tp=2)) == "after_flush"
    assert dp_reduce_mode(cfg.replace(dp_shard=True)) == "fsdp2"
    assert dp_reduce_mode(cfg.replace(dp_reduce="ddp")) == "ddp"
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
    with pytest.raises(pv.LaunchError, match=r"dp_reduce must be one of 'overlap', 'ddp', 'after_flush' or None, "
                                             r"got 'zero1'. Fix: dp_reduce='overlap'"):
        pv.launch(plan, "Interleaved1F1B", 4, dp_reduce="zero1", **kw)
    with pytest.raises(pv.LaunchError, match=r"dp_reduce='ddp' under ZBVZeroBubble \(a split backward\).*Fix: "
                                             r"dp_reduce='overlap'"):
        pv.launch(plan, "ZBVZeroBubble", 4, dp_reduce="ddp", **kw)
    with pytest.raises(pv.LaunchError, match=r"dp_reduce='overlap' with dp_shard=True: FSDP2 reduce-scatters"):
        pv.launch(plan, "Interleaved1F1B", 4, dp_reduce="overlap", dp_shard=True, **kw)
    with pytest.raises(pv.LaunchError, match=r"dp_reduce='overlap' with tp=2.*Fix: dp_reduce='after_flush'"):
        pv.launch(plan, "Interleaved1F1B", 4, dp_reduce="overlap", tp=2, tp_plan={"l2": "colwise", "l3": "rowwise"},
                  **kw)
