"""Failures end visibly, name their real cause, and leave nothing behind (docs/faults.md, the fault matrix).

How long each takes is measured in benchmarks/speed/soak.py, not asserted here; the waits below only keep a broken
run from hanging the suite.
"""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

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
    # A zombie still answers kill(0); it has exited all the same. It can be reaped between the two looks: its /proc
    # entry then reads as gone (ESRCH while reading, or no file), which once failed a clean run here.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def left_behind(run: pv.Run) -> list[str]:
    """The run's processes still alive and its files (payloads, rank logs) still on disk."""
    procs = [f"pid {p}" for p in run.pids if alive(p)]
    assert run._files or not run.pids  # a started run made files: the check below is not empty by accident
    return procs + [f for f in run._files if os.path.exists(f)]


def wait_running(run: pv.Run, timeout: float = 60) -> None:
    end = time.time() + timeout
    while run.step < 1 and time.time() < end and not run.done:
        time.sleep(0.05)
    assert run.status == "running", run.error


def boom_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if out.requires_grad:  # in the run, not on the sample launch() checks the loss with
        raise ValueError("boom from the loss function")
    return F.cross_entropy(out, target)


def sleepy_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if out.requires_grad:
        time.sleep(3600)
    return F.cross_entropy(out, target)


def nan_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target) * (float("nan") if out.requires_grad else 1.0)


class Checked(nn.Module):
    """A layer that asserts on values at run time (the trace cannot know): inputs must stay below 100."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert_async((x.abs() < 100).all())
        return self.lin(x)


def test_an_exception_names_rank_stage_step_and_what_failed(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=3, inputs=(X,), target=Y, loss_fn=boom_loss)
    assert run.wait(60) == "failed"
    assert run.error.startswith("rank 2 (stage 2) failed in step 0: loss_fn failed on rank 2 (the last stage, 2) on "
                                "its output [2, 10] float32 and target [2] int64: ValueError: boom from the loss "
                                "function."), run.error
    assert "Traceback" in run.error and not left_behind(run)


def test_a_failing_layer_is_named_with_its_op_and_shapes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Checked(), nn.Linear(8, 4))
    plan = pv.trace(model, example_args=(X,)).split(["0"])
    run = pv.launch(plan, "GPipe", 2, steps=1, inputs=(X * 1000,), target=torch.randint(0, 4, (8,)),
                    loss_fn=F.cross_entropy)
    assert run.wait(60) == "failed"
    first = run.error.splitlines()[0]
    assert first.startswith("rank 1 (stage 1) failed in step 0: stage 1's forward, in layer '1', at "
                            "aten._assert_async.default on [] bool: RuntimeError: Expected Tensor with single nonzero "
                            "value, but got zero"), first
    assert not left_behind(run)


def test_a_rank_killed_by_a_signal(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="GPipe", microbatches=4, steps=100000, inputs=(X,), target=Y,
                    loss_fn=F.cross_entropy)
    wait_running(run)
    os.kill(run.pids[1], signal.SIGKILL)
    assert run.wait(60) == "failed"
    assert run.error.startswith("rank 1 (stage 1) died (killed by signal SIGKILL) without a Python traceback.")
    assert not left_behind(run)


@pytest.mark.parametrize(("layout", "victim", "named"), [({"dp": 2}, 3, "rank 3 (pp1 dp1, stage 1)"),
                                                        ({"dp": 2}, 1, "rank 1 (pp0 dp1, stage 0)"),
                                                        ({"tp": 2}, 2, "rank 2 (pp1 tp0, stage 1)")])
def test_a_killed_process_is_named_by_its_coordinates_and_stage(layout: dict, victim: int, named: str) -> None:
    # A process rank is not a pipeline rank: with replicas or shards, process 1 is pp0 (stage 0), process 3 pp1.
    torch.manual_seed(0)
    plan = pv.trace(MyNetwork(8, [8, 8]), example_args=(torch.randn(8, 8),)).split(["layer0"])
    run = pv.launch(plan, schedule="GPipe", microbatches=2, steps=100000, inputs=(X,), target=Y,
                    loss_fn=F.cross_entropy, **layout)
    wait_running(run)
    os.kill(run.pids[victim], signal.SIGKILL)
    assert run.wait(60) == "failed"
    assert run.error.startswith(f"{named} died (killed by signal SIGKILL) without a Python traceback."), run.error
    assert not left_behind(run)


def test_a_hung_step_ends_at_the_timeout(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=2, inputs=(X,), target=Y, loss_fn=sleepy_loss,
                    timeout=3)
    assert run.wait(60) == "failed"
    assert run.error.startswith("no progress for 3 s (step timeout); the run was stopped.")
    assert not left_behind(run)


def test_stop_and_ctrl_c_in_wait(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=100000, inputs=(X,), target=Y,
                    loss_fn=F.cross_entropy)
    wait_running(run)
    assert run.stop() == "stopped" and not left_behind(run)
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=100000, inputs=(X,), target=Y,
                    loss_fn=F.cross_entropy)
    wait_running(run)
    # Ctrl-C is Python's default SIGINT handler raising KeyboardInterrupt. An earlier test in the same process can
    # leave another handler installed (the whole suite lost this interrupt twice in a row, never the file alone),
    # and interrupt_main() does nothing then: the test installs the default for itself.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, _thread.interrupt_main).start()
        try:
            run.wait(60)
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail(f"wait() saw no Ctrl-C: the run is {run.status!r} ({run.error}); SIGINT's handler had been "
                        f"{previous!r}")
        assert run.status == "stopped" and not left_behind(run)
    finally:
        signal.signal(signal.SIGINT, previous)
        run.stop()  # never left running for the next test (it would take the cores a run pins)


def test_nan_stops_the_run_or_is_recorded(plan: pv.SplitPlan) -> None:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=3, inputs=(X,), target=Y, loss_fn=nan_loss)
    assert run.wait(60) == "failed"
    assert run.error.startswith("NaN or inf in step 0: the loss is nan (step 0, rank 2, stage 2); the gradient of ")
    assert "The run was stopped before that step's optimizer update." in run.error
    assert run.losses == [] and not left_behind(run)
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=2, inputs=(X,), target=Y, loss_fn=nan_loss,
                    on_nonfinite="continue")
    assert run.wait(60) == "done"
    assert {s for s, _ in run.nonfinite} == {0, 1} and len(run.losses) == 2


def test_no_space_for_the_payloads(plan: pv.SplitPlan, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []

    def full_disk(prefix: str = "", suffix: str = "", **kw: object) -> tuple[int, str]:
        # A file name in the temp dir, but every write fails as on a full disk (/dev/full).
        path = os.path.join(tempfile.gettempdir(), f"{prefix}test{suffix}")
        made.append(path)
        open(path, "wb").close()
        return os.open("/dev/full", os.O_WRONLY), path

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=1, inputs=(X,), target=Y, loss_fn=F.cross_entropy)
    assert run.wait(60) == "failed"
    assert run.error.startswith(f"No space left in {tempfile.gettempdir()} for rank 0's payload")
    assert "Fix: free some space there, or point TMPDIR at a disk with room." in run.error
    # the ranks had started (they join the process group while their payloads are written): all reaped
    assert not left_behind(run) and not any(os.path.exists(p) for p in made)


def test_concurrent_launches_each_get_their_own_rendezvous(plan: pv.SplitPlan) -> None:
    runs = [pv.launch(plan, schedule=s, microbatches=4, steps=2, inputs=(X,), target=Y, loss_fn=F.cross_entropy)
            for s in ("GPipe", "1F1B", "GPipe", "1F1B")]
    assert len({r._store.port for r in runs if r._store is not None}) == len([r for r in runs if r._store])
    assert [r.wait(120) for r in runs] == ["done"] * 4, [r.error for r in runs]
    assert all(r.losses == runs[0].losses for r in runs)
    assert not any(left_behind(r) for r in runs)


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
    # The parent's temporary files go to a folder of its own: a launch anywhere else on the machine (another test
    # run) sweeps the shared temporary folder, and would take them before this test looks (it did, once in five).
    folder = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": folder})
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        proc.kill()  # like a restarted kernel: no atexit, no cleanup in the parent
        proc.wait()
    end = time.time() + 30
    while any(alive(p) for p in pids) and time.time() < end:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    # Its temporary files (payloads, rank logs, the state folder) stay behind; the next launch sweeps them.
    from pipeviz.runtime.procs import sweep_stale

    theirs = [n for n in os.listdir(folder) if n.startswith("pipeviz-") and f"-{proc.pid}-" in n]
    assert any(n.startswith("pipeviz-state-") for n in theirs), theirs
    removed = {os.path.basename(p) for p in sweep_stale(folder)}
    assert set(theirs) <= removed
    assert not any(f"-{proc.pid}-" in n for n in os.listdir(folder))
