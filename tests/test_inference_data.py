"""Forward-only runs (no ``loss_fn``) and runs fed by ``data=`` (a DataLoader), against the unsplit model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pipeviz as pv
from tests.compat import ROWS
from tests.foreign import case

ALL_FORWARD = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


@pytest.mark.slow
def test_forward_only_every_schedule_equals_the_model() -> None:
    model, args, kwargs, _, _, splits = case("kwargs")  # a keyword input used past the first stage
    graph = pv.trace(model, example_args=args, example_kwargs=kwargs)
    want = model(*args, **kwargs).detach()
    for schedule in ALL_FORWARD:
        plan = graph.split(splits) if schedule in ("GPipe", "1F1B") else pv.balance(graph, 4)
        run = pv.launch(plan, schedule, 4, steps=2, input_kwargs=kwargs)
        assert run.wait(120) == "done", run.error
        assert len(run.outputs) == 2 and run.losses == []
        for out in run.outputs:
            torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
        kinds = {e.kind for e in run.events}
        assert kinds <= {"F", "COMM"} and "F" in kinds, (schedule, kinds)
        check = pv.check_numerics(run)
        assert check.ok and check.output_diff is not None and check.output_diff <= 1e-5, check


@pytest.mark.slow
def test_check_numerics_of_a_forward_only_run_with_batchnorm_statistics() -> None:
    # Running statistics move in a forward: the microbatched reference matches them; a changed output is caught.
    model, args, _, _, _, splits = case("batchnorm")
    run = pv.launch(pv.trace(model, example_args=args).split(splits), "GPipe", 4, steps=2)
    assert run.wait(120) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok and check.steps == 2 and check.output_diff == pytest.approx(0, abs=1e-5), check
    assert "running_mean" in " ".join(run.state_dict()) and "forward-only run matches" in str(check)
    assert not torch.equal(run.state_dict()["bn0.running_mean"], model.state_dict()["bn0.running_mean"])
    run.outputs[1] = run.outputs[1] + 1e-3
    bad = pv.check_numerics(run)
    assert not bad.ok and bad.output_diff == pytest.approx(1e-3, rel=1e-3), bad


@pytest.mark.slow
def test_forward_only_keeps_an_hf_output_structure() -> None:
    model = next(r for r in ROWS if r.name == "GPT-2").build().eval()
    ids = torch.randint(0, 96, (4, 8))
    plan = pv.trace(model, example_args=(ids,)).split(["transformer.h.1"])
    run = pv.launch(plan, "1F1B", 2, steps=1)
    assert run.wait(120) == "done", run.error
    out, want = run.outputs[0], model(ids)
    assert type(out).__name__ == type(want).__name__  # CausalLMOutputWithCrossAttentions, not a bare tuple
    torch.testing.assert_close(out.logits, want.logits.detach(), rtol=0, atol=1e-5)


def test_forward_only_is_simulated_without_backwards_and_v_schedules_refused() -> None:
    model, args, *_ = case("mlp_chain")
    plan = pv.balance(pv.trace(model, example_args=args), 2)
    train, infer = pv.simulate(plan, "1F1B", 4), pv.simulate(plan, "1F1B", 4, forward_only=True)
    assert {e.kind for e in infer.events} <= {"F", "COMM"} and "B" in {e.kind for e in train.events}
    assert infer.step_time < train.step_time and infer.meta["memory_bytes"] < train.meta["memory_bytes"]
    cmp = pv.compare(plan, microbatches=4, forward_only=True)
    assert "ZBVZeroBubble" in cmp.skipped and "DualPipeV" in cmp.skipped
    with pytest.raises(pv.LaunchError, match=r"cannot run forward only.*loss_fn"):
        pv.launch(pv.trace(model, example_args=args).split(["0", "1", "2"]), "ZBVZeroBubble", 4, steps=1)
    with pytest.raises(pv.LaunchError, match=r"target.*loss_fn"):
        pv.launch(plan, "1F1B", 4, steps=1, target=torch.zeros(8, dtype=torch.long))


def loader(n: int, batch: int, drop_last: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(ds, batch_size=batch, drop_last=drop_last)


@pytest.mark.slow
def test_data_loader_trains_like_the_unsplit_model_on_the_same_batches() -> None:
    model, args, _, _, loss_fn, splits = case("mlp_chain")
    plan = pv.trace(model, example_args=args).split(splits)
    run = pv.launch(plan, "1F1B", 4, steps=None, data=loader(40, 8), loss_fn=loss_fn)  # until it runs out: 5 steps
    assert run.wait(120) == "done", run.error
    assert run.step == 5 and len(run.losses) == 5
    ref_losses, _ = pv.train_reference(model, args, None, loss_fn=loss_fn, optimizer=None, microbatches=4,
                                       batches=run.batches)
    assert len(set(ref_losses)) == 5  # five different batches, not the first one five times
    check = pv.check_numerics(run)
    assert check.ok and check.steps == 5, check
    # steps= stops early; a mapping carries the keyword inputs
    model, args, kwargs, target, loss_fn, splits = case("kwargs")
    data = [{"inputs": args, "target": target, "mask": kwargs["mask"] * s} for s in (1.0, 0.5, 0.0)]
    run = pv.launch(pv.trace(model, example_args=args, example_kwargs=kwargs).split(splits), "GPipe", 4, steps=2,
                    data=data, loss_fn=loss_fn)
    assert run.wait(120) == "done", run.error
    assert pv.check_numerics(run).ok and len(run.losses) == 2


def test_a_bad_batch_names_the_step_and_shapes_and_the_ranks_end() -> None:
    model, args, _, _, loss_fn, splits = case("mlp_chain")
    plan = pv.trace(model, example_args=args).split(splits)
    run = pv.launch(plan, "1F1B", 4, steps=None, data=loader(42, 12, drop_last=False), loss_fn=loss_fn)
    assert run.wait(120) == "failed"  # (batches of another size are traced again: tests/test_shapes.py)
    assert "data= batch 3 holds 6 samples, which do not split into the run's 4 microbatches x 1 replicas" \
        in run.error and "drop_last=True" in run.error
    assert len(run.losses) == 3 and all(not p.is_alive() for p in run._procs)
    with pytest.raises(pv.LaunchError, match="drop inputs="):
        pv.launch(plan, "1F1B", 4, steps=None, data=loader(40, 8), inputs=args, loss_fn=loss_fn)
    with pytest.raises(pv.ScheduleError, match="does not divide the batch of 6"):
        pv.launch(plan, "1F1B", 4, steps=None, data=loader(40, 6), loss_fn=loss_fn)
