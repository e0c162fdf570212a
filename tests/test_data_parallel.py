"""Pipeline × data parallel (``pv.launch(..., dp=N)``): N replicas of the pipeline, each on its share of every
batch, train exactly like the unsplit model on the whole batch — tied weights, a skip across stages and
BatchNorm included — under every schedule (three in ``make test``, one per runtime path; the other four in
``make compat``)."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.schedule.mesh import Coords, Mesh, MeshError
from pipeviz.schedule.training import cross_entropy
from tests.models import TiedSkipBN
from tests.schedule_sets import SCHEDULES, train_exactly

lm_loss = cross_entropy  # the one language-model loss: pv.cross_entropy over the last dim


def _setup() -> tuple[TiedSkipBN, torch.Tensor, torch.Tensor, pv.ModelGraph]:
    torch.manual_seed(0)
    model = TiedSkipBN()
    ids = torch.randint(0, 16, (16, 4))
    target = torch.randint(0, 16, (16, 4))
    return model, ids, target, pv.trace(model, example_args=(ids,))


def test_the_mesh_names_every_process_by_its_coordinates() -> None:
    mesh = Mesh(pp=2, dp=2)
    assert mesh.world == 4 and mesh.dims == ("pp", "dp")
    assert [mesh.coords(r) for r in range(4)] == [Coords(0, 0, 0), Coords(0, 1, 0), Coords(1, 0, 0), Coords(1, 1, 0)]
    assert all(mesh.rank_of(mesh.coords(r)) == r for r in range(4))
    assert mesh.pipeline(dp=1) == (1, 3) and mesh.replicas(pp=1) == (2, 3)
    assert mesh.label(3) == "pp1 dp1" and Mesh(pp=3).label(2) == "pp2"
    assert Mesh(pp=2, dp=2, tp=2).shards(pp=1, dp=1) == (6, 7)
    with pytest.raises(MeshError, match=r"pp=2 × dp=3 × tp=1 = 6 processes, but the world has 8. Fix: degrees "
                                        r"whose product is 8 \(dp=4\)"):
        Mesh(pp=2, dp=3).check(8)
    with pytest.raises(MeshError, match=r"dp must be a positive int .*got 0"):
        Mesh(pp=2, dp=0)


def test_a_replica_count_that_cannot_share_the_batch_is_refused_before_any_process() -> None:
    _, ids, target, graph = _setup()
    plan = graph.split(["bn"])
    with pytest.raises(pv.LaunchError, match=r"dp=3 replicas cannot share a batch of 16 equally. Valid dp for 4 "
                                             r"microbatches: 1, 2, 4"):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(ids,), target=target, loss_fn=lm_loss, dp=3)
    with pytest.raises(pv.LaunchError, match="dp must be a positive int"):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(ids,), target=target, loss_fn=lm_loss, dp=0)
    with pytest.raises(ValueError, match=r"each of the dp=4 replicas takes 4 of the batch of 16"):
        pv.launch(plan, "1F1B", 8, steps=1, inputs=(ids,), target=target, loss_fn=lm_loss, dp=4)


def _train(schedules: tuple[str, ...], dp_shard: bool = False) -> None:
    _, ids, target, graph = _setup()
    plans = graph.split(["bn"]), graph.split(["l1", "bn", "l2"])
    for schedule in schedules:
        run = train_exactly(schedule, plans, inputs=(ids,), target=target, loss_fn=lm_loss, dp=2, dp_shard=dp_shard)
        if dp_shard:  # FSDP2 holds each process's shard only; its reduce-scatter is not a timed action (yet)
            held = [t for _, t in run.phases if "parameter elements held" in t]
            assert len(held) == 4 and all("sharded over 2 replicas" in t for t in held), run.phases
            assert all(int(t.split("(")[-1].split(" of ")[0].replace(",", "")) * 2
                       <= int(t.split(" of ")[1].split(" ")[0].replace(",", "")) + 64 for t in held), held
            continue
        assert len(run.losses) == 2  # one loss per step: the whole batch's, not one per replica
        assert run.mesh == Mesh(pp=2, dp=2) and {e.rank for e in run.events} == {0, 1, 2, 3}
        # the replicas' gradient averaging is measured: per process and step, DDP's bucket all-reduces (launched
        # inside the stage's last backward) or, for split-backward schedules, the one average after the step
        reductions = [e for e in run.events if e.kind == "DP"]
        assert {(e.rank, e.step) for e in reductions} == {(r, s) for r in range(4) for s in range(2)}, schedule
        for e in reductions:  # within its step: after the process's first backward of it began
            first = min(c.start for c in run.events if c.rank == e.rank and c.step == e.step and c.kind in "BI")
            assert first <= e.start <= e.end, (schedule, e)


@pytest.mark.slow
@SCHEDULES
def test_pipeline_times_data_parallel_trains_like_the_unsplit_model(schedules: tuple[str, ...]) -> None:
    _train(schedules)


@pytest.mark.slow
@pytest.mark.parametrize("schedules", [("1F1B",), pytest.param(
    ("GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"),
    marks=pytest.mark.compat)], ids=["1F1B", "the-other-six"])
def test_replicas_sharded_by_fsdp2_train_like_the_unsplit_model(schedules: tuple[str, ...]) -> None:
    # dp_shard=True: torch's fully_shard over the dp mesh dim on every stage (ZeRO-3 across the replicas)
    _train(schedules, dp_shard=True)


def test_dp_shard_is_checked_before_any_process() -> None:
    _, ids, target, graph = _setup()
    plan = graph.split(["bn"])
    with pytest.raises(pv.LaunchError, match=r"dp_shard=True shards parameters across data-parallel replicas, but "
                                             r"dp=1.*Fix: dp=2"):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(ids,), target=target, loss_fn=lm_loss, dp_shard=True)
    with pytest.raises(pv.LaunchError, match=r"tp > 1 .* not supported yet"):
        pv.launch(plan, "1F1B", 2, steps=1, inputs=(ids,), target=target, loss_fn=lm_loss, dp=2, tp=2, dp_shard=True)


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes
def test_data_parallel_forward_only_joins_the_replicas_outputs() -> None:
    _, ids, _, graph = _setup()
    run = pv.launch(graph.split(["bn"]), "GPipe", 2, steps=1, inputs=(ids,), dp=2)
    assert run.wait(120) == "done", run.error
    assert run.outputs[0].shape == (16, 4, 16)  # replica 0's 8 rows, then replica 1's
    assert pv.check_numerics(run).ok  # against the unsplit model run forward on the same microbatches


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes
def test_data_batches_are_shared_out_so_each_step_consumes_one_global_batch() -> None:
    _, ids, _, graph = _setup()
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 16, ids.shape, generator=gen), torch.randint(0, 16, ids.shape, generator=gen))
               for _ in range(3)]
    run = pv.launch(graph.split(["bn"]), "1F1B", 4, steps=None, data=batches, loss_fn=lm_loss, optimizer=pv.sgd(lr=0.1),
                    dp=2)
    assert run.wait(120) == "done", run.error
    assert len(run.losses) == 3
    assert pv.check_numerics(run).ok  # the unsplit model trained on the same three whole batches
