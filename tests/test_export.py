"""Scale-out: an exported torchrun script trains like pv.launch, on one host and as two nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.runtime.procs import free_port as _free_port
from pipeviz.schedule import traits as sched_traits
from pipeviz.zoo import MyNetwork

pytestmark = pytest.mark.slow


def _plan(stages: int) -> tuple[pv.SplitPlan, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, x, y = MyNetwork(8, [8, 8, 8]), torch.randn(8, 8), torch.randint(0, 10, (8,))
    graph = pv.trace(model, example_args=(x,))
    return graph.split(list(graph.layer_names[: stages - 1])), x, y


def _torchrun(script: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, str(script)], cwd=script.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _launch_losses(plan: pv.SplitPlan, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=steps, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(120) == "done", run.error
    return run.losses


def test_exported_script_matches_launch_and_is_watched_live(tmp_path: Path) -> None:
    plan, x, y = _plan(3)
    # 120 steps (0.8 s of running here) read every 20 ms: the ranks write every 0.1 s (SEND_INTERVAL), so the watch
    # sees several batches. With 40 steps (0.25 s) and the default 0.2 s poll a clean CI run saw them all at once.
    script = pv.export_torchrun(plan, tmp_path / "train_pp.py", schedule="1F1B", microbatches=4, steps=120,
                                inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert script.read_text().startswith("#!/usr/bin/env python")
    watch = pv.watch(tmp_path / "train_pp_events", poll=0.02, timeout=240)
    seen: list[int] = []
    watch.subscribe(lambda batch: seen.append(len(batch)))
    proc = _torchrun(script, "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert watch.wait(30) == "done", watch.error
    assert len(seen) > 2  # events arrived in several batches while the run went
    assert watch.losses == pytest.approx(_launch_losses(plan, x, y, 120), abs=1e-6)
    tl = watch.timeline()
    assert tl.num_ranks == 3 and {e.kind for e in tl.events} >= {"F", "B"}
    assert tl.order(0, step=0) == sched_traits.orders("1F1B", 3, 4)[0]


@pytest.mark.compat  # make compat (CI): 6 s; keeps make test within 10 minutes
def test_exported_script_accumulates_schedules_the_rate_and_evaluates(tmp_path: Path) -> None:
    """The training options travel in the payload: 2 batches a step, a warm-up-cosine rate, full recomputation and a
    held-out batch evaluated after each step give the losses, rates, held-out losses and saved-activation peaks
    pv.launch gives."""
    plan, x, y = _plan(2)
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=3, loss_fn=pv.cross_entropy, accumulate=2,
                          lr_scheduler=pv.warmup_cosine(1, 3), eval_every=1, recompute="full")
    held_out = [(x.flip(0), y.flip(0))]
    script = pv.export_torchrun(plan, tmp_path / "train_acc.py", config=cfg, inputs=(x,), target=y, eval_data=held_out)
    watch = pv.watch(tmp_path / "train_acc_events", timeout=240)
    proc = _torchrun(script, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert watch.wait(30) == "done", watch.error
    run = pv.launch(plan, config=cfg, inputs=(x,), target=y, eval_data=held_out)
    assert run.wait(120) == "done", run.error
    assert watch.losses == pytest.approx(run.losses, abs=1e-6) and len(run.losses) == 3
    assert watch.learning_rates == pytest.approx(run.learning_rates) and len(run.learning_rates) == 3
    assert [s for s, _ in watch.eval_losses] == [0, 1, 2]
    assert [v for _, v in watch.eval_losses] == pytest.approx([v for _, v in run.eval_losses], abs=1e-6)
    peaks = [max(b for _, b in run.activation_memory[r]) for r in (0, 1)]
    assert [max(b for _, b in watch.activation_memory[r]) for r in (0, 1)] == peaks
    plain = pv.launch(plan, config=cfg.replace(recompute="none"), inputs=(x,), target=y, eval_data=held_out)
    assert plain.wait(120) == "done", plain.error
    assert sum(peaks) < sum(max(b for _, b in plain.activation_memory[r]) for r in (0, 1))  # it did recompute


@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes
def test_exported_script_as_two_nodes_with_replicas(tmp_path: Path) -> None:
    # 2 agents x 2 processes: pipeline ranks x data-parallel replicas (pp-major: each host holds one stage's two
    # replicas), training like pv.launch with the same mesh -- both given the one LaunchConfig.
    plan, x, y = _plan(2)
    cfg = pv.LaunchConfig(schedule="GPipe", microbatches=2, steps=3, loss_fn=F.cross_entropy, dp=2)
    script = pv.export_torchrun(plan, tmp_path / "two.py", config=cfg, inputs=(x,), target=y)
    assert "2 stages on 2 ranks x 2 replicas, GPipe, 2 microbatches, 3 steps" in script.read_text()
    port = str(_free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    nodes = [_torchrun(script, *common, "--node-rank", str(r)) for r in range(2)]
    for node in nodes:
        out, _ = node.communicate(timeout=240)
        assert node.returncode == 0, out
    watched = pv.watch(tmp_path / "two_events", timeout=30)
    assert watched.wait(30) == "done", watched.error
    assert {e.rank for e in watched.events} == {0, 1, 2, 3}
    run = pv.launch(plan, config=cfg, inputs=(x,), target=y)
    assert run.wait(120) == "done", run.error
    assert watched.losses == pytest.approx(run.losses, abs=1e-6)  # one loss per step: the global batch's


@pytest.mark.compat
def test_exported_script_with_tensor_parallel_shards(tmp_path: Path) -> None:
    # pp 2 x tp 2 under torchrun: the exported ranks build their payloads with pv.launch's one builder, so each
    # stage's projections are sharded as in pv.launch(..., tp=2), and the losses agree.
    plan, x, y = _plan(2)
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=2, steps=2, loss_fn=F.cross_entropy, tp=2)
    script = pv.export_torchrun(plan, tmp_path / "tp.py", config=cfg, inputs=(x,), target=y)
    proc = _torchrun(script, "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    watched = pv.watch(tmp_path / "tp_events", timeout=30)
    assert watched.wait(30) == "done", watched.error
    run = pv.launch(plan, config=cfg, inputs=(x,), target=y)
    assert run.wait(120) == "done", run.error
    assert len(watched.losses) == 2 and watched.losses == pytest.approx(run.losses, abs=1e-6)


def test_export_validates_before_writing(tmp_path: Path) -> None:
    plan, x, y = _plan(3)
    with pytest.raises(pv.ScheduleError, match="1F1B needs at least as many microbatches as stages"):
        pv.export_torchrun(plan, tmp_path / "bad.py", microbatches=2, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert not (tmp_path / "bad.py").exists()


def test_chrome_trace_is_valid(tmp_path: Path) -> None:
    plan, x, y = _plan(3)
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=2, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(120) == "done"
    path = run.timeline().to_chrome_trace(tmp_path / "trace.json")
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(run.events)
    assert {e["tid"] for e in spans} == {0, 1, 2}  # one track per rank
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1", "rank 2"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    # One clock: stage 1's forward of mb 0 starts after stage 0's ends.
    f = {(e["args"]["stage"], e["args"]["microbatch"], e["args"]["step"]): e for e in spans if e["cat"] == "F"}
    assert f[(1, 0, 0)]["ts"] >= f[(0, 0, 0)]["ts"] + f[(0, 0, 0)]["dur"]
    sim = pv.simulate(plan, "1F1B", 4).to_chrome_trace(tmp_path / "sim.json")
    assert json.loads(sim.read_text())["traceEvents"]


@pytest.mark.compat  # make compat (CI): a saved run and a resumed script, 5 s; keeps make test within 10 minutes
def test_exported_script_resumes_a_saved_run(tmp_path: Path) -> None:
    """``resume=``: the script goes on from ``run.save``'s checkpoint (weights, AdamW's state, the scheduler, the
    step), as ``pv.launch(..., resume=)`` does: its losses and rates are the straight 4-step run's last two."""
    import functools

    plan, x, y = _plan(2)
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=2, loss_fn=pv.cross_entropy,
                          optimizer=functools.partial(torch.optim.AdamW, lr=0.01),
                          lr_scheduler=pv.warmup_cosine(1, 4))
    straight = pv.launch(plan, config=cfg.replace(steps=4), inputs=(x,), target=y)
    first = pv.launch(plan, config=cfg, inputs=(x,), target=y)
    assert straight.wait(120) == "done" and first.wait(120) == "done", (straight.error, first.error)
    first.save(tmp_path / "ckpt")
    script = pv.export_torchrun(plan, tmp_path / "resumed.py", config=cfg, inputs=(x,), target=y,
                                resume=tmp_path / "ckpt")
    watch = pv.watch(tmp_path / "resumed_events", timeout=240)
    proc = _torchrun(script, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert watch.wait(30) == "done", watch.error
    assert watch.losses == pytest.approx(straight.losses[2:], abs=1e-5)
    assert watch.learning_rates == pytest.approx(straight.learning_rates[2:])
    with pytest.raises(pv.LaunchError, match="holds no pipeviz checkpoint"):
        pv.export_torchrun(plan, tmp_path / "bad.py", config=cfg, inputs=(x,), target=y, resume=tmp_path)
