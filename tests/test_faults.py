"""Failures end visibly and leave no process behind."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

pytestmark = pytest.mark.slow


@pytest.fixture
def plan() -> pv.SplitPlan:
    torch.manual_seed(0)
    return pv.trace(MyNetwork(8, [8, 8, 8]), example_args=(torch.randn(8, 8),)).split(["layer0", "layer1"])


X, Y = torch.randn(8, 8), torch.randint(0, 10, (8,))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_running(run: pv.Run, timeout: float = 60) -> None:
    end = time.time() + timeout
    while run.step < 1 and time.time() < end and not run.done:
        time.sleep(0.05)
    assert run.status == "running", run.error


def boom_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise ValueError("boom from the loss function")


def sleepy_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    time.sleep(3600)
    return F.cross_entropy(out, target)


def test_exception_in_a_stage(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=3, inputs=(X,), target=Y, loss_fn=boom_loss)
    assert run.wait(60) == "failed"
    assert run.error.startswith("rank 2 failed:\nTraceback")
    assert "ValueError: boom from the loss function" in run.error
    assert not any(alive(pid) for pid in run.pids)


def test_worker_killed_by_a_signal(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="GPipe", microbatches=4, steps=100000, inputs=(X,), target=Y,
                    loss_fn=F.cross_entropy)
    wait_running(run)
    os.kill(run.pids[1], signal.SIGKILL)
    t = time.time()
    assert run.wait(10) == "failed"
    assert time.time() - t < 10
    assert run.error.startswith("rank 1 died (killed by signal SIGKILL) without a Python traceback.")
    assert not any(alive(pid) for pid in run.pids)


def test_hung_step_ends_at_the_timeout(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=2, inputs=(X,), target=Y, loss_fn=sleepy_loss,
                    timeout=3)
    t = time.time()
    assert run.wait(60) == "failed"
    assert time.time() - t < 20
    assert run.error.startswith("no progress for 3 s (step timeout); the run was stopped.")
    assert not any(alive(pid) for pid in run.pids)


def test_stop_within_five_seconds(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=100000, inputs=(X,), target=Y,
                    loss_fn=F.cross_entropy)
    wait_running(run)
    t = time.time()
    assert run.stop() == "stopped"
    assert time.time() - t < 5
    assert not any(alive(pid) for pid in run.pids)


def test_keyboard_interrupt_in_wait_stops_the_run(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=100000, inputs=(X,), target=Y,
                    loss_fn=F.cross_entropy)
    wait_running(run)
    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        run.wait(60)
    assert run.status == "stopped"
    assert not any(alive(pid) for pid in run.pids)


def test_no_orphans_when_the_parent_dies(tmp_path: object) -> None:
    script = textwrap.dedent("""
        import sys, time, torch, torch.nn.functional as F, pipeviz as pv
        from pipeviz.zoo import MyNetwork
        plan = pv.trace(MyNetwork(8, [8, 8]), example_args=(torch.randn(8, 8),)).split(["layer0"])
        run = pv.launch(plan, schedule="GPipe", microbatches=2, steps=10**6, inputs=(torch.randn(8, 8),),
                        target=torch.randint(0, 10, (8,)), loss_fn=F.cross_entropy)
        while run.step < 1:
            time.sleep(0.05)
        print(*run.pids, flush=True)
        time.sleep(3600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        proc.kill()  # like a restarted kernel: no atexit, no cleanup in the parent
        proc.wait()
    end = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < end:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"schedule": "gpipee"}, pv.ScheduleError,
         "Unknown schedule 'gpipee'. Did you mean 'GPipe'? Valid: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
         "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."),
        ({"schedule": "1F1B", "microbatches": 2}, pv.ScheduleError,
         "microbatches=2 does not work: 1F1B needs at least as many microbatches as stages (3). Valid: 4, 8."),
        ({"schedule": "GPipe", "microbatches": 3}, pv.ScheduleError,
         "microbatches=3 does not work: it does not divide the batch of 8. Valid: 1, 2, 4, 8."),
        ({"schedule": "ZBVZeroBubble"}, pv.ScheduleError,
         "ZBVZeroBubble with 2 stages per rank needs a stage count divisible by 2; the plan has 3. "
         "Fix: split into one of 2, 4, 6, 8, 10, 12 stages, or change stages_per_rank."),
        ({"schedule": "GPipe", "stages_per_rank": 2}, pv.ScheduleError,
         "GPipe runs one stage per rank; got stages_per_rank=2. Fix: drop stages_per_rank, or pick a multi-stage "
         "schedule: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."),
        ({"target": torch.zeros(6, dtype=torch.long)}, pv.LaunchError,
         "target must be a tensor whose dim 0 is the batch (8); got (6,)."),
        ({"loss_fn": None}, pv.LaunchError,
         "loss_fn must be a callable loss(output, target), got None. Fix: loss_fn=torch.nn.functional.cross_entropy "
         "(or your own)."),
        ({"devices": ["cpu", "cpu"]}, pv.LaunchError,
         "devices lists 2 entries but the run has 3 ranks. Fix: pass 3 devices, or devices='auto'."),
        ({"devices": "cuda:7"}, pv.LaunchError,
         f"Device 'cuda:7' is not available: this machine has {torch.cuda.device_count()} CUDA device(s). "
         "Fix: devices='auto' or 'cpu'."),
        ({"input_kwargs": {"mask": torch.ones(8)}}, pv.LaunchError,
         "input_kwargs ['mask'] were not in the traced example_kwargs []. Fix: trace with the same keyword inputs "
         "you launch with."),
    ],
)
def test_bad_launches_fail_before_any_process(plan: pv.SplitPlan, kwargs: dict, exc: type, message: str) -> None:
    args = {"schedule": "1F1B", "microbatches": 4, "inputs": (X,), "target": Y, "loss_fn": F.cross_entropy} | kwargs
    before = set(_children())
    with pytest.raises(exc) as info:
        pv.launch(plan, **args)
    assert str(info.value) == message
    assert set(_children()) == before


def _children() -> list[int]:
    """Live child processes of this process, from /proc."""
    me, kids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                kids.append(int(entry))
    return kids
