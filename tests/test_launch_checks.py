"""Every checkable mistake is refused before a process starts, with the bad value, the choices and the fix.

No process starts in this file: ``pv.launch`` raises before it would.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.runtime.checks import validate_launch
from pipeviz.zoo import MyNetwork


@pytest.fixture(scope="module")
def plan() -> pv.SplitPlan:
    torch.manual_seed(0)
    return pv.trace(MyNetwork(512, [512, 1024, 256]), example_args=(torch.randn(32, 512),)).split(
        ["layer0", "layer1"])


X, Y = torch.randn(32, 512), torch.randint(0, 10, (32,))
RETRACE = "or re-trace with it: pv.trace(model, example_args=..., example_kwargs=...)."


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"schedule": "gpipee"}, pv.ScheduleError,
         "Unknown schedule 'gpipee'. Did you mean 'GPipe'? Valid: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
         "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."),
        ({"schedule": "1F1B", "microbatches": 2}, pv.ScheduleError,
         "microbatches=2 does not work: 1F1B needs at least as many microbatches as stages (3): rank 0 (stage 0) "
         "runs 3 forwards before its first backward, but only 2 microbatches exist (torch 2.13's Schedule1F1B "
         "refuses this when built; older torch hung, torchtitan#775). Valid: 4, 8, 16, 32."),
        ({"schedule": "GPipe", "microbatches": 3}, pv.ScheduleError,
         "microbatches=3 does not work: it does not divide the batch of 32. Valid: 1, 2, 4, 8, 16, 32."),
        ({"schedule": "ZBVZeroBubble"}, pv.ScheduleError,
         "ZBVZeroBubble with 2 stages per rank needs a stage count divisible by 2; the plan has 3. "
         "Fix: split into one of 2, 4, 6, 8, 10, 12 stages, or change stages_per_rank."),
        ({"schedule": "GPipe", "stages_per_rank": 2}, pv.ScheduleError,
         "GPipe runs one stage per rank; got stages_per_rank=2. Fix: drop stages_per_rank, or pick a multi-stage "
         "schedule: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."),
        ({"steps": 0}, pv.LaunchError, "steps must be a positive int, got 0 (steps=None runs until data= runs out)."),
        ({"timeout": 0}, pv.LaunchError,
         "timeout must be a positive number of seconds, got 0. Fix: timeout=120 (seconds without progress before "
         "the run is declared hung)."),
        ({"inputs": {"x": X}}, pv.LaunchError,
         "inputs must be a tensor, or a tuple or list of tensors (the model's positional inputs), got dict. "
         "Fix: pass keyword inputs as input_kwargs={...}."),
        ({"inputs": (torch.randn(32, 100),)}, pv.LaunchError,
         "inputs[0] has shape (32, 100), but the model was traced with (32, 512) (every dim after the batch must "
         f"match). Fix: pass a batch shaped like the example, {RETRACE}"),
        ({"inputs": (torch.randint(0, 5, (32, 512)),)}, pv.LaunchError,
         "inputs[0] is torch.int64, but the model was traced with torch.float32. Fix: pass a torch.float32 tensor "
         f"(e.g. x.to(torch.float32)), {RETRACE}"),
        ({"inputs": (X, X)}, pv.LaunchError,
         "The model was traced with 1 positional input(s); launch got 2. Fix: pass inputs like the example, or "
         "re-trace with these."),
        ({"target": torch.zeros(6, dtype=torch.long)}, pv.LaunchError,
         "target must be a tensor whose dim 0 is the batch (32); got (6,)."),
        ({"loss_fn": None}, pv.LaunchError,
         "target= was given without a loss_fn. Fix: pass loss_fn=... to train, or drop target for a forward-only "
         "run (run.outputs holds the model's outputs)."),
        ({"loss_fn": "mse"}, pv.LaunchError,
         "loss_fn must be a callable loss(output, target), got 'mse'. Fix: loss_fn=pv.cross_entropy (or "
         "torch.nn.functional.cross_entropy, or your own); no loss_fn runs forward only."),
        ({"loss_fn": lambda out, t: out}, pv.LaunchError,
         "loss_fn must return a scalar float tensor (one loss per microbatch); on an output like the last stage's "
         "((8, 10)) it returned a tensor of shape (8, 10) (torch.float32). Fix: reduce it, e.g. .mean()."),
        ({"loss_fn": lambda out, t: out[:, 99].mean()}, pv.LaunchError, None),  # raises on the sample
        ({"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)}, pv.LaunchError,
         "optimizer must be a factory params -> torch.optim.Optimizer, got SGD"),
        ({"optimizer": lambda ps: torch.optim.SGD(ps, lr=-1.0)}, pv.LaunchError,
         "optimizer(params) fails on a dummy parameter: ValueError: Invalid learning rate: -1.0."),
        ({"devices": ["cpu", "cpu"]}, pv.LaunchError,
         "devices lists 2 entries but the run has 3 ranks. Fix: pass 3 devices, or devices='auto'."),
        ({"devices": "cuda:7"}, pv.LaunchError,
         f"Device 'cuda:7' is not available: this machine has {torch.cuda.device_count()} CUDA device(s). "
         "Fix: devices='auto' or 'cpu'."),
        ({"input_kwargs": {"mask": torch.ones(32)}}, pv.LaunchError,
         "input_kwargs ['mask'] were not in the traced example_kwargs []. Fix: trace with the same keyword inputs "
         "you launch with."),
        ({"on_nonfinite": "ignore"}, pv.LaunchError, "on_nonfinite='ignore'; valid: 'stop', 'continue'."),
    ],
)
def test_bad_launches_fail_before_any_process(plan: pv.SplitPlan, kwargs: dict, exc: type,
                                              message: str | None) -> None:
    args = {"schedule": "1F1B", "microbatches": 4, "inputs": (X,), "target": Y, "loss_fn": F.cross_entropy} | kwargs
    before = _children()
    with pytest.raises(exc) as info:
        pv.launch(plan, **args)
    if message is not None:
        assert str(info.value).startswith(message), str(info.value)
    else:
        assert str(info.value).startswith("loss_fn(output, target) fails on an output like the last stage's ((8, 10)) "
                                          "and a target microbatch ((8,) torch.int64): IndexError: index 99 is out")
    assert _children() == before


def test_the_same_checks_guard_export(plan: pv.SplitPlan, tmp_path: object) -> None:
    with pytest.raises(pv.LaunchError, match=r"inputs\[0\] has shape \(32, 100\)"):
        pv.export_torchrun(plan, f"{tmp_path}/train.py", inputs=(torch.randn(32, 100),), target=Y,
                           loss_fn=F.cross_entropy)
    assert not os.listdir(str(tmp_path))


def test_a_list_of_inputs_is_taken_as_a_tuple(plan: pv.SplitPlan) -> None:
    spec = validate_launch(plan, pv.LaunchConfig(loss_fn=F.cross_entropy), inputs=[X], target=Y)
    assert spec.args == (X,)
    spec = validate_launch(plan, pv.LaunchConfig(loss_fn=F.cross_entropy), inputs=X, target=Y)  # a bare tensor too
    assert spec.args == (X,)


def test_trace_tells_a_misfit_input_from_a_tracing_limit() -> None:
    model = MyNetwork(512, [512, 1024, 256])
    with pytest.raises(pv.TraceError) as info:
        pv.trace(model, example_args=(torch.randn(3, 7),))
    text = str(info.value)
    assert "the example inputs do not fit the model (a shape or dtype mismatch, not a tracing limit)" in text
    assert "inputs: (3, 7) torch.float32" in text and "(3x7 and 512x512)" in text
    assert "data-dependent" not in text and "manual_plan" not in text
    with pytest.raises(pv.TraceError, match="must have the same dtype, but got Long and Float"):
        pv.trace(model, example_args=(torch.randint(0, 5, (3, 512)),))


def test_trace_errors_keep_torch_logs_off_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(pv.TraceError):
        pv.trace(MyNetwork(512, [512]), example_args=(torch.randn(3, 7),))
    assert "fake_tensor" not in capfd.readouterr().err


def _children() -> set[int]:
    """Live child processes of this process (the fork server, if started, stays the same)."""
    psutil = pytest.importorskip("psutil")
    kids = set()
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended since the listing
            if p.status() != psutil.STATUS_ZOMBIE:
                kids.add(p.pid)
    return kids


def test_an_unchanged_loss_question_is_asked_once(plan: pv.SplitPlan) -> None:
    """The Explorer validates its settings at every control change; loss_fn runs on sampled logits (hundreds of MB
    for a 128k vocabulary) only when the question changed: another loss_fn, target, or microbatch size."""
    calls: list[tuple[int, ...]] = []

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(out.shape))
        return F.cross_entropy(out, target)

    for schedule in ("1F1B", "GPipe", "1F1B"):  # a control that does not change the question
        validate_launch(plan, pv.LaunchConfig(schedule=schedule, microbatches=4, loss_fn=loss), inputs=(X,), target=Y)
    assert calls == [(8, 10)]
    validate_launch(plan, pv.LaunchConfig(microbatches=8, loss_fn=loss), inputs=(X,), target=Y)
    assert calls == [(8, 10), (4, 10)]
    validate_launch(plan, pv.LaunchConfig(microbatches=4, loss_fn=loss), inputs=(X,), target=Y.clone())
    assert len(calls) == 3  # another target: asked again
    with pytest.raises(pv.LaunchError, match="scalar float tensor"):  # a failing loss is never remembered as good
        validate_launch(plan, pv.LaunchConfig(microbatches=4, loss_fn=lambda out, t: out), inputs=(X,), target=Y)
