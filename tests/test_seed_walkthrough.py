"""The PiPPy walkthrough (PiPPy实战, the tutorial this project grew from: "the seed") as it is written: the classic
PiPPy example in plain torch, ``MyNetwork`` written out in the script, under torchrun (notebooks/01_quickstart).

``MyNetwork`` split at the END of ``layer0`` and ``layer1`` by torch's own ``pipeline()``, three gloo ranks on
the CPU, each building its stage with ``pipe.build_stage`` and running ``ScheduleGPipe`` forward only. Its
output must equal the unsplit model's and a forward-only ``pv.launch`` of the same split.

Then the training route of torch's own pipelining tutorial: each rank wraps its own stage module in a
``PipelineStage``, ``ScheduleGPipe(stage, n_microbatches, loss_fn=...)`` runs the loss on the last stage,
``schedule.step(x)`` on rank 0 and ``schedule.step(target=y, losses=losses)`` on the last rank, which prints its
losses, two SGD steps. The printed losses must be the unsplit model's per-microbatch losses, trained the same way.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.runtime.procs import free_port
from pipeviz.zoo import MyNetwork

pytestmark = pytest.mark.slow

IN_DIM, LAYER_DIMS, BATCH, CHUNKS = 512, [512, 1024, 256], 32, 4
LR, STEPS = 0.1, 2

# The tutorial's script, unchanged in substance: only the weights and the input come from the test's files (saved
# from pipeviz.zoo.MyNetwork, whose parameter names are the script's).
SCRIPT = textwrap.dedent(f"""\
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, SplitPoint, pipeline


    class MyNetworkBlock(torch.nn.Module):
        def __init__(self, in_dim, out_dim):
            super().__init__()
            self.lin = torch.nn.Linear(in_dim, out_dim)

        def forward(self, x):
            x = self.lin(x)
            x = torch.relu(x)
            return x


    class MyNetwork(torch.nn.Module):
        def __init__(self, in_dim, layer_dims):
            super().__init__()
            prev_dim = in_dim
            for i, dim in enumerate(layer_dims):
                setattr(self, f"layer{{i}}", MyNetworkBlock(prev_dim, dim))
                prev_dim = dim
            self.num_layers = len(layer_dims)
            self.output_proj = torch.nn.Linear(layer_dims[-1], 10)  # 10 output classes

        def forward(self, x):
            for i in range(self.num_layers):
                x = getattr(self, f"layer{{i}}")(x)
            return self.output_proj(x)


    here = sys.argv[1]
    in_dim, layer_dims, batch_size, chunks = {IN_DIM}, {LAYER_DIMS}, {BATCH}, {CHUNKS}

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    model = MyNetwork(in_dim, layer_dims)
    model.load_state_dict(torch.load(os.path.join(here, "weights.pt")))
    x = torch.load(os.path.join(here, "x.pt"))
    x_chunk = torch.chunk(x, chunks)[0]

    pipe = pipeline(model, mb_args=(x_chunk,),
                    split_spec={{"layer0": SplitPoint.END, "layer1": SplitPoint.END}})
    stage = pipe.build_stage(rank, device)
    schedule = ScheduleGPipe(stage, n_microbatches=chunks)

    if rank == 0:
        schedule.step(x)
    else:
        output = schedule.step()
    if rank == world_size - 1:
        torch.save(output, os.path.join(here, "out.pt"))

    # Training, torch's pipelining tutorial's route: this rank's own stage module, the loss on the last stage.
    def loss_fn(output, target):
        return torch.nn.functional.cross_entropy(output, target)

    y = torch.load(os.path.join(here, "y.pt"))
    own = [model.layer0, model.layer1, torch.nn.Sequential(model.layer2, model.output_proj)][rank]
    stage = PipelineStage(own, stage_index=rank, num_stages=world_size, device=device)
    schedule = ScheduleGPipe(stage, n_microbatches=chunks, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(own.parameters(), lr={LR})
    for step in range({STEPS}):
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world_size - 1:
            losses = []
            schedule.step(target=y, losses=losses)
            print(f"step {{step}} losses: {{[loss.item() for loss in losses]}}", flush=True)
        else:
            schedule.step()
        optimizer.step()
    dist.destroy_process_group()
""")


def _model() -> tuple[MyNetwork, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return MyNetwork(IN_DIM, LAYER_DIMS), torch.randn(BATCH, IN_DIM), torch.randint(0, 10, (BATCH,))


def _unsplit_losses(model: MyNetwork, x: torch.Tensor, y: torch.Tensor) -> list[list[float]]:
    """Per step, the loss of each of the CHUNKS microbatches, for a copy of ``model`` trained with SGD on the whole
    batch's mean loss (what the schedule's summed gradients divided by the microbatch count are)."""
    unsplit = copy.deepcopy(model)
    optimizer = torch.optim.SGD(unsplit.parameters(), lr=LR)
    out = []
    for _ in range(STEPS):
        with torch.no_grad():
            out.append([F.cross_entropy(unsplit(xc), yc).item()
                        for xc, yc in zip(x.chunk(CHUNKS), y.chunk(CHUNKS), strict=True)])
        optimizer.zero_grad()
        F.cross_entropy(unsplit(x), y).backward()
        optimizer.step()
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """torchrun and its workers (which run in sessions of their own, so a process group kill misses them)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = psutil.Process(proc.pid).children(recursive=True)
        for p in [psutil.Process(proc.pid), *tree]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=10)
    proc.wait(10)


def test_seed_walkthrough_matches_unsplit_model_and_launch(tmp_path: Path) -> None:
    model, x, y = _model()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    torch.save(x, tmp_path / "x.pt")
    torch.save(y, tmp_path / "y.pt")
    script = tmp_path / "pippy_walkthrough.py"
    script.write_text(SCRIPT)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # timed out or interrupted: nothing is left running
            _kill_tree(proc)
    assert proc.returncode == 0, out

    seed_out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = model(x)
    assert seed_out.shape == expected.shape == (BATCH, 10)
    torch.testing.assert_close(seed_out, expected, rtol=0, atol=1e-5)

    # The training route: the last rank printed one loss per microbatch and step, the unsplit model's.
    printed = {int(step): [float(v) for v in values.split(",")]
               for step, values in re.findall(r"step (\d+) losses: \[([^\]]*)\]", out)}
    assert sorted(printed) == list(range(STEPS)), out
    torch.testing.assert_close(torch.tensor([printed[s] for s in range(STEPS)]),
                               torch.tensor(_unsplit_losses(model, x, y)), rtol=0, atol=1e-5)
    assert sum(printed[1]) < sum(printed[0])  # and it learns

    plan = pv.trace(model, example_args=(x,)).split(["layer0", "layer1"])
    run = pv.launch(plan, "GPipe", CHUNKS, steps=1, inputs=(x,))  # no loss_fn: forward only
    assert run.wait(120) == "done", run.error
    torch.testing.assert_close(seed_out, run.outputs[0], rtol=0, atol=1e-5)
