"""Checkpoints that resume under another layout: ``run.save(folder)`` after 2 steps, ``pv.launch(...,
resume=folder)`` for 2 more, equals 4 steps in one run (AdamW's state, a warm-up-cosine schedule, a data= stream
going on where it stopped), from and to other pipeline splits, schedules, replicas (DDP, FSDP2) and shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipeviz as pv
from tests.models import TiedSkipBN


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 16, (16, 4), generator=g), torch.randint(0, 16, (16, 4), generator=g))
            for _ in range(4)]


def _graph() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(TiedSkipBN(), example_args=(torch.randint(0, 16, (16, 4)),))


SPLITS = {2: ["bn"], 3: ["l1", "bn"], 4: ["l1", "bn", "l2"]}
TP = {"tp": 2, "tp_plan": {"l2": "colwise", "l3": "rowwise"}}


def _adamw(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1)


def _launch(stages: int, schedule: str, steps: int, microbatches: int = 4, **more: object) -> pv.Run:
    run = pv.launch(_graph().split(SPLITS[stages]), schedule, microbatches, steps=steps, data=iter(_data()),
                    loss_fn=pv.cross_entropy, optimizer=_adamw, lr_scheduler=pv.warmup_cosine(1, 4), **more)
    assert run.wait(300) == "done", run.error
    return run


@pytest.fixture(scope="module")
def straight() -> pv.Run:
    """4 steps in one run: what 2 + 2 must equal."""
    return _launch(2, "1F1B", 4)


WIDE = (pytest.mark.compat, pytest.mark.coverage)  # (make compat, not the version grid)


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [
    ((2, "1F1B", 4, {}), (2, "1F1B", 4, {})),
    ((2, "1F1B", 4, {}), (3, "1F1B", 4, {})),  # pp 2 -> 3
    ((2, "GPipe", 4, TP), (4, "Interleaved1F1B", 2, {"dp": 2})),  # shards gathered; dp 1 -> 2, another schedule
    ((2, "GPipe", 2, {"dp": 2, "dp_shard": True}), (4, "ZBVZeroBubble", 4, {})),  # FSDP2's shards gathered
    # into the other schedules (make compat), and ZeRO-1's shards gathered
    pytest.param((2, "1F1B", 4, {}), (4, "LoopedBFS", 4, {}), marks=WIDE),
    pytest.param((2, "1F1B", 4, {}), (4, "InterleavedZeroBubble", 4, {}), marks=WIDE),
    pytest.param((2, "1F1B", 2, {"dp": 2, "dp_reduce": "zero1"}), (4, "DualPipeV", 4, {}), marks=pytest.mark.compat),
])
def test_two_steps_saved_and_two_resumed_equal_four(straight: pv.Run, tmp_path: Path,
                                                    before: tuple[int, str, int, dict[str, object]],
                                                    after: tuple[int, str, int, dict[str, object]]) -> None:
    """Each replica's microbatches are the same samples as the straight run's (dp 2 halves the microbatches),
    so losses and parameters match to 1e-5; running statistics too where one replica saw every microbatch."""
    first = _launch(before[0], before[1], 2, before[2], **before[3])
    written = first.save(tmp_path)
    assert {Path(f).name for f in written} >= {"optimizer.safetensors", "trainer_state.pt", "pipeviz_checkpoint.json"}
    manifest = json.loads((tmp_path / "pipeviz_checkpoint.json").read_text())
    assert manifest["step"] == 2 and manifest["batches"] == 2 and manifest["optimizer"] == "AdamW"
    assert manifest["optimizer_state"] == ["exp_avg", "exp_avg_sq", "step"]
    second = _launch(after[0], after[1], 2, after[2], resume=tmp_path, **after[3])
    # (ZBV holds the tied embedding and head on one rank: their optimizer states shared one tensor on resume, which
    # then took two updates a step, 1.6e-3 off by step 4, until each copy got its own)
    assert first.losses + second.losses == pytest.approx(straight.losses, abs=1e-5)
    assert second.learning_rates == pytest.approx(straight.learning_rates[2:])
    want, got = straight.state_dict(), second.state_dict()
    replicated = after[3].get("dp", 1) > 1 or before[3].get("dp", 1) > 1
    for name, value in want.items():
        if replicated and name.startswith("bn.") and not name.endswith(("weight", "bias")):
            continue  # each replica keeps its own running statistics (replica 0's: half the microbatches)
        assert torch.allclose(got[name].double(), value.double(), atol=1e-5), name
    check = pv.check_numerics(second)  # the unsplit model from the checkpoint's weights and optimizer state
    assert check.ok, check
    # a resumed run's checkpoint counts the steps and batches of both
    second.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "pipeviz_checkpoint.json").read_text())["step"] == 4


@pytest.mark.slow
def test_without_the_optimizer_state_the_run_would_differ(straight: pv.Run, tmp_path: Path) -> None:
    """The test above can fail: resuming from the weights alone (weights=, a fresh AdamW) does not give 4 steps."""
    first = _launch(2, "1F1B", 2)
    first.save(tmp_path)
    data = _data()[2:]
    fresh = pv.launch(_graph().split(SPLITS[2]), "1F1B", 4, steps=2, data=iter(data), loss_fn=pv.cross_entropy,
                      optimizer=_adamw, weights=tmp_path)
    assert fresh.wait(300) == "done", fresh.error
    assert abs(fresh.losses[-1] - straight.losses[-1]) > 1e-3


def test_a_checkpoint_that_cannot_resume_is_refused_before_any_process(tmp_path: Path) -> None:
    plan = _graph().split(SPLITS[2])
    kw: dict[str, object] = {"data": iter(_data()), "loss_fn": pv.cross_entropy, "optimizer": _adamw}
    with pytest.raises(pv.LaunchError, match=r"holds no pipeviz checkpoint \(pipeviz_checkpoint.json is missing\)"):
        pv.launch(plan, "1F1B", 4, resume=tmp_path, **kw)
    # a checkpoint written by hand: another optimizer, a scheduler on one side, another model's tensors
    from pipeviz.runtime.checkpoint import write_checkpoint

    state = {"l1.weight": {"exp_avg": torch.zeros(8, 8), "exp_avg_sq": torch.zeros(8, 8), "step": torch.tensor(2.)}}
    trainer = {"optimizer": "AdamW", "groups": [], "scheduler": None, "step": 2, "batches": 2}
    write_checkpoint(tmp_path, state, {**trainer, "optimizer": "SGD"}, {})
    with pytest.raises(pv.LaunchError, match=r"holds SGD's state, but the launch's optimizer is AdamW"):
        pv.launch(plan, "1F1B", 4, resume=tmp_path, **kw)
    write_checkpoint(tmp_path, state, trainer, {})
    with pytest.raises(pv.LaunchError, match=r"saved with no learning-rate scheduler, and this launch has one"):
        pv.launch(plan, "1F1B", 4, resume=tmp_path, lr_scheduler=pv.warmup_cosine(1, 4), **kw)
    write_checkpoint(tmp_path, {"l1.weight": {"exp_avg": torch.zeros(4, 8)}}, trainer, {})
    with pytest.raises(pv.LaunchError, match=r"optimizer state of 'l1.weight' is \(4, 8\), the model's tensor \(8, "
                                             r"8\): a checkpoint of another model"):
        pv.launch(plan, "1F1B", 4, resume=tmp_path, **kw)
    write_checkpoint(tmp_path, {"gone.weight": {"exp_avg": torch.zeros(4)}}, trainer, {})
    with pytest.raises(pv.LaunchError, match=r"optimizer state for 'gone.weight', which this model does not have"):
        pv.launch(plan, "1F1B", 4, resume=tmp_path, **kw)
    with pytest.raises(pv.LaunchError, match="resume= reads the weights from its checkpoint; weights= was given"):
        pv.launch(plan, "1F1B", 4, resume=tmp_path, weights=tmp_path, **kw)
