# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Quickstart: the PiPPy walkthrough, redone in a notebook
#
# PiPPy, the project that became `torch.distributed.pipelining`, introduced itself with a small network,
# `MyNetwork(512, [512, 1024, 256])`: mark split points after `layer0` and `layer1`
# (`annotate_split_points(mn, {'layer0': SplitPoint.END, 'layer1': SplitPoint.END})`), build the `Pipe` for a batch
# of 32 in 4 chunks (`pipeline(mn, chunks, example_args=(x,))`), then run its three stages under `torchrun`.
# That **PiPPy walkthrough** (*PiPPy实战*) is where this project started; the project's own pages call it **the
# seed**. This notebook first runs the walkthrough **as it was written, in today's plain torch**, then does the
# same from one notebook with pipeviz:
#
# 0. **the walkthrough's own code**: a script under `torchrun`, 3 processes, forward only; its output checked
#    against the unsplit model and against pipeviz; then the same stages **trained**, as torch's own pipelining
#    tutorial does (a loss on the last stage, the losses printed on the last rank); then the two other ways
#    today's torch splits a model (a `pipe_split()` marker in `forward`, and stages you build yourself),
# 1. **trace** the model once and look at its layers,
# 2. **split** it and preview every stage (parameters, FLOPs, bytes sent, memory) without building anything,
# 3. **simulate** a training step,
# 4. **launch** the three stages as real processes and watch the timeline fill in live,
# 5. **check the numerics** against the unsplit model.
#
# A glossary in English and Chinese (for readers of the Chinese PiPPy tutorial) closes the notebook.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import copy
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

torch.manual_seed(0)
model = MyNetwork(512, [512, 1024, 256])  # blocks layer0, layer1, layer2 (Linear + ReLU), then output_proj
x = torch.randn(32, 512)                  # one full batch of inputs
y = torch.randint(0, 10, (32,))           # its class labels

# %% [markdown]
# ## 0. The walkthrough's code, in plain torch
#
# Today's torch spells the walkthrough's steps `pipeline(model, mb_args, split_spec=...)` (the split points move
# from `annotate_split_points` into `split_spec`), `pipe.build_stage(rank, device)` and a schedule object; rank 0
# feeds the batch with `schedule.step(x)`, the others call `schedule.step()`, and the last rank gets the output.
# The walkthrough ran forward only: no loss, no backward (the script's last part adds them).
#
# Two changes trip up code ported from PiPPy:
#
# 1. **The example input is now one microbatch.** PiPPy's `pipeline(mn, chunks, example_args=(x,))` took the whole
#    batch and the number of chunks; torch's `pipeline(model, mb_args=(x_chunk,))` builds every stage for exactly
#    the shapes it is given, so pass one microbatch, `torch.chunk(x, chunks)[0]`. Given the whole batch,
#    `pipeline()` still succeeds, with stages that expect 32 rows where the schedule sends 8 (checked below).
# 2. **`chunks` moved to the schedule.** `pipeline()` no longer takes it; the number of microbatches is the
#    schedule's `n_microbatches` (`ScheduleGPipe(stage, n_microbatches=chunks)`), and `schedule.step(x)` splits the
#    whole batch into that many.
#
# Here is the script, with the walkthrough's `MyNetwork` written out in it (plain torch: nothing from pipeviz).
# After the walkthrough's route it runs the same three stages a second way, the one torchtitan uses: no tracing,
# each rank builds its own stage's module (`model.layer0`, `model.layer1`, `Sequential(model.layer2,
# model.output_proj)`) and wraps it as `PipelineStage(module, stage_index, num_stages, device)`; the stage learns
# its input shapes at the first step.
#
# Then it **trains** those stages, the route of torch's own pipelining tutorial: the schedule gets a `loss_fn`,
# which only the last stage runs (on each microbatch's output and its slice of the target); rank 0 still feeds the
# batch with `schedule.step(x)`, the last rank passes the whole target and a list to collect the losses,
# `schedule.step(target=y, losses=losses)`, and the rank in between calls `schedule.step()`. Each step runs every
# backward too, and torch divides the summed gradients by the number of microbatches (`scale_grads=True`), so each
# rank's own SGD over its stage's parameters takes the same step as the unsplit model on the whole batch. The last
# rank prints one loss per microbatch per step. The script is written to a temporary folder with this notebook's
# weights, input and target so that its outputs can be compared:

# %%
SEED_SCRIPT = textwrap.dedent("""\
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
                setattr(self, f"layer{i}", MyNetworkBlock(prev_dim, dim))
                prev_dim = dim
            self.num_layers = len(layer_dims)
            self.output_proj = torch.nn.Linear(layer_dims[-1], 10)  # 10 output classes

        def forward(self, x):
            for i in range(self.num_layers):
                x = getattr(self, f"layer{i}")(x)
            return self.output_proj(x)


    here = sys.argv[1]  # the folder with the weights and the input
    in_dim, layer_dims, batch_size, chunks = 512, [512, 1024, 256], 32, 4

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    model = MyNetwork(in_dim, layer_dims)
    model.load_state_dict(torch.load(os.path.join(here, "weights.pt")))
    x = torch.load(os.path.join(here, "x.pt"))
    x_chunk = torch.chunk(x, chunks)[0]  # pitfall 1: the example input is ONE microbatch

    pipe = pipeline(model, mb_args=(x_chunk,),
                    split_spec={"layer0": SplitPoint.END, "layer1": SplitPoint.END})
    if rank == 0:
        print(pipe)
    stage = pipe.build_stage(rank, device)
    schedule = ScheduleGPipe(stage, n_microbatches=chunks)  # pitfall 2: chunks is the schedule's

    if rank == 0:
        schedule.step(x)
    else:
        output = schedule.step()
    if rank == world_size - 1:
        torch.save(output, os.path.join(here, "out.pt"))

    # torchtitan's route: build this rank's stage module by hand (no tracing) and wrap it in a PipelineStage.
    own = [model.layer0, model.layer1, torch.nn.Sequential(model.layer2, model.output_proj)][rank]
    stage = PipelineStage(own, stage_index=rank, num_stages=world_size, device=device)
    schedule = ScheduleGPipe(stage, n_microbatches=chunks)
    output = schedule.step(x) if rank == 0 else schedule.step()
    if rank == world_size - 1:
        torch.save(output, os.path.join(here, "out_manual.pt"))

    # Training, as torch's pipelining tutorial does it: the loss runs on the last stage, the target goes to the last
    # rank.
    def loss_fn(output, target):
        return torch.nn.functional.cross_entropy(output, target)

    y = torch.load(os.path.join(here, "y.pt"))  # the batch's class labels
    stage = PipelineStage(own, stage_index=rank, num_stages=world_size, device=device)
    schedule = ScheduleGPipe(stage, n_microbatches=chunks, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(own.parameters(), lr=0.1)  # each rank steps its own stage's parameters
    for step in range(2):
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world_size - 1:
            losses = []
            schedule.step(target=y, losses=losses)  # one loss per microbatch
            print(f"step {step} losses: {[loss.item() for loss in losses]}", flush=True)
        else:
            schedule.step()
        optimizer.step()
    dist.destroy_process_group()
""")
seed_dir = Path(tempfile.mkdtemp(prefix="pipeviz_seed_"))  # keep the script's files out of the repository
torch.save(model.state_dict(), seed_dir / "weights.pt")
torch.save(x, seed_dir / "x.pt")
torch.save(y, seed_dir / "y.pt")
(seed_dir / "pippy_walkthrough.py").write_text(SEED_SCRIPT)
print(SEED_SCRIPT)


# %% [markdown]
# `torchrun --nproc-per-node 3 pippy_walkthrough.py` starts three processes, one per stage (here as `python -m
# torch.distributed.run`, with this kernel's interpreter, on a free local port). Rank 0's `print(pipe)` shows what
# `pipeline()` made: one `submod_pp_<i>` per stage, and the forward that chains them; the last rank's lines, the
# training route's losses.

# %%
def free_port() -> int:
    """A TCP port nobody listens on now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "pippy_walkthrough.py", str(seed_dir)]
print(" ".join(command[1:]))
done = subprocess.run(command, cwd=seed_dir, capture_output=True, text=True, timeout=240)
assert done.returncode == 0, done.stdout + done.stderr
print(done.stdout)                                    # rank 0's print(pipe)
assert all(f"submod_pp_{i}" in done.stdout for i in range(3)) and "submod_pp_3" not in done.stdout
seed_out = torch.load(seed_dir / "out.pt").detach()   # saved from inside the schedule, with its graph
by_hand_out = torch.load(seed_dir / "out_manual.pt").detach()
with torch.no_grad():
    expected = model(x)
seed_gap = float((seed_out - expected).abs().max())
by_hand_gap = float((by_hand_out - expected).abs().max())
print(f"the walkthrough's output: {tuple(seed_out.shape)}, max |difference| from model(x): {seed_gap:.1e}")
print(f"the stages built by hand: {tuple(by_hand_out.shape)}, max |difference| from model(x): {by_hand_gap:.1e}")
assert seed_out.shape == by_hand_out.shape == (32, 10) and seed_gap < 1e-5 and by_hand_gap < 1e-5
shutil.rmtree(seed_dir)

# The training route's losses, against the unsplit model trained the same way: the loss of each of the 4
# microbatches, then one SGD step on the whole batch's mean loss (what the summed, divided gradients are).
printed = {int(step): [float(v) for v in values.split(",")]
           for step, values in re.findall(r"step (\d+) losses: \[([^\]]*)\]", done.stdout)}
unsplit = copy.deepcopy(model)
sgd_unsplit = torch.optim.SGD(unsplit.parameters(), lr=0.1)
for step in range(2):
    with torch.no_grad():
        per_mb = [F.cross_entropy(unsplit(xc), yc).item() for xc, yc in zip(x.chunk(4), y.chunk(4), strict=True)]
    print(f"step {step}: the last rank printed {[round(v, 5) for v in printed[step]]}, "
          f"the unsplit model's {[round(v, 5) for v in per_mb]}")
    assert len(printed[step]) == 4 and all(abs(a - b) < 1e-5 for a, b in zip(printed[step], per_mb, strict=True))
    sgd_unsplit.zero_grad()
    F.cross_entropy(unsplit(x), y).backward()
    sgd_unsplit.step()
assert sum(printed[1]) < sum(printed[0])   # it learns: the second step's losses are lower

# %% [markdown]
# ### The same with pipeviz, side by side
#
# No script, no process group: `graph.split` names the same split points, and `pv.launch` without a `loss_fn` is
# a forward-only run of torch's same `ScheduleGPipe` on three processes. `run.outputs[step]` is the whole batch's
# output, the microbatches joined back.

# %%
seed_plan = pv.trace(model, example_args=(x,)).split(["layer0", "layer1"])   # = split_spec {...: END}
infer = pv.launch(seed_plan, "GPipe", microbatches=4, steps=1, inputs=(x,))   # no loss_fn: forward only
assert infer.wait(180) == "done", infer.error
pv_gap = float((infer.outputs[0] - seed_out).abs().max())
print(f"pipeviz's output: max |difference| from the walkthrough's {pv_gap:.1e}, from model(x) "
      f"{float((infer.outputs[0] - expected).abs().max()):.1e}")
assert pv_gap < 1e-5
print(pv.check_numerics(infer))
assert pv.check_numerics(infer).ok

# %% [markdown]
# Where each step of the walkthrough lives today, and in pipeviz:

# %%
from IPython.display import Markdown

STEPS = [  # (PiPPy, the walkthrough) -> (torch.distributed.pipelining today) -> (pipeviz)
    ("`annotate_split_points(mn, {'layer0': SplitPoint.END, ...})`",
     "`split_spec={'layer0': SplitPoint.END, ...}` in `pipeline(...)`",
     "`graph = pv.trace(model, example_args=(x,))`; `graph.split(['layer0', 'layer1'])`"),
    ("`pipe_split()` written in `forward`", "the same: `torch.distributed.pipelining.pipe_split()`",
     "`graph.split([...])` on the traced model: no edit to `forward`"),
    ("`pipe = pipeline(mn, chunks, example_args=(x,))`: the whole batch",
     "`pipe = pipeline(model, mb_args=(x_chunk,), split_spec=...)`: **one microbatch**",
     "`plan.pipe(microbatches=4)`: torch's `Pipe`, from a deep copy"),
    ("—", "`PipelineStage(module, stage_index, num_stages, device)` on a module you built (torchtitan)",
     "`pv.manual_plan(model, [[names], ...])`"),
    ("`PipelineStage(pipe, rank, device)`", "`stage = pipe.build_stage(rank, device)`",
     "`pv.launch(plan, ...)` builds every stage, one process each"),
    ("`torchrun --nproc-per-node 3`, `init_process_group`", "the same",
     "`pv.launch` starts the processes (gloo / NCCL); `pv.export_torchrun` for many hosts"),
    ("— (no schedule: the stage runs every microbatch itself; `chunks` is given to `pipeline`)",
     "`ScheduleGPipe(stage, n_microbatches=chunks)`, `Schedule1F1B`, …: `chunks` moved to the schedule",
     "`schedule='GPipe'`: any of torch's seven, by name"),
    ("`stage(x)` on rank 0, `stage()` elsewhere", "`schedule.step(x)` on rank 0, `schedule.step()` elsewhere",
     "`run = pv.launch(plan, ..., inputs=(x,))`; `run.wait()`; `run.outputs[step]`"),
    ("`loss_fn=` on the stage",
     "`Schedule…(stage, n, loss_fn=...)`; `step(x)` on rank 0, `step(target=y, losses=losses)` on the last rank",
     "`pv.launch(..., target=y, loss_fn=..., optimizer=...)`; `run.losses`"),
    ("—", "—", "`pv.simulate`, `pv.balance`, `pv.check_numerics`, `pv.TimelineView`, `pv.Explorer`"),
]
Markdown("| PiPPy (the walkthrough) | torch today | pipeviz |\n|---|---|---|\n"
         + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in STEPS))

# %% [markdown]
# ### Three ways to say where the stages are
#
# `split_spec` names the modules to cut after, from outside the model. torch has two other ways:
#
# - **A marker in `forward`:** `torch.distributed.pipelining.pipe_split()` where a stage should end. Run eagerly it
#   does nothing; `pipeline(model, mb_args=...)` without `split_spec` cuts at each marker.
# - **Stages built by hand:** what the script's second route did, and what torchtitan does for its models (it
#   deep-copies the model per stage, prunes the modules other stages own, and wraps the rest as
#   `PipelineStage(module, stage_index, num_stages, device, group=...)`). Nothing is traced, so it also fits models
#   `torch.export` cannot capture, as long as each stage's module runs its part of the forward.
#
# pipeviz's counterpart of the hand-built route is `pv.manual_plan(model, [[names of stage 0], [names of stage 1],
# ...])`: per-stage lists of module names (the same data torchtitan keeps). It needs no trace: it runs the listed
# modules in turn on the example batch, checks that they reproduce `model(x)`, and measures each, so the plan
# previews, simulates and launches like a traced one. Below, the marker split and the manual plan are checked
# against the `split_spec` split. (torch's `pipeline()` patches the model's modules in place, so each call here
# gets a copy, as `plan.pipe()` does.)

# %%
from torch.distributed.pipelining import SplitPoint, pipe_split, pipeline


class MarkedNetwork(MyNetwork):
    """The same network with its two split points written into its forward."""

    def forward(self, x):
        x = self.layer0(x)
        pipe_split()                # stage 0 ends here
        x = self.layer1(x)
        pipe_split()                # stage 1 ends here
        return self.output_proj(self.layer2(x))


marked = MarkedNetwork(512, [512, 1024, 256])
marked.load_state_dict(model.state_dict())
assert torch.equal(marked(x), model(x))    # run eagerly, pipe_split() does nothing

x_chunk = torch.chunk(x, 4)[0]             # one microbatch: 8 of the batch's 32 rows
SPEC = {"layer0": SplitPoint.END, "layer1": SplitPoint.END}
by_spec = pipeline(copy.deepcopy(model), mb_args=(x_chunk,), split_spec=SPEC)
by_marker = pipeline(marked, mb_args=(x_chunk,))   # no split_spec: the markers cut
whole_batch = pipeline(copy.deepcopy(model), mb_args=(x,), split_spec=SPEC)   # pitfall 1, on purpose


def stage_params(pipe):
    return [sum(p.numel() for p in pipe.get_stage_module(i).parameters()) for i in range(pipe.num_stages)]


def stage_input_rows(pipe):
    """The batch rows each stage was built to receive (its traced input's first dimension)."""
    return [[n.meta["val"].shape[0] for n in pipe.get_stage_module(i).graph.nodes if n.op == "placeholder"]
            for i in range(pipe.num_stages)]


print("parameters per stage: split_spec", stage_params(by_spec), " pipe_split()", stage_params(by_marker))
print("rows each stage expects: one microbatch as the example", stage_input_rows(by_spec),
      " the whole batch", stage_input_rows(whole_batch))
assert by_marker.num_stages == by_spec.num_stages == 3 and stage_params(by_marker) == stage_params(by_spec)
assert stage_params(by_spec) == [s.params for s in seed_plan.stages]
# Pitfall 1: the stages are built for the example's shape; the schedule sends 32 / 4 = 8 rows per microbatch.
assert stage_input_rows(by_spec) == [[8]] * 3 and stage_input_rows(whole_batch) == [[32]] * 3

# %%
manual = pv.manual_plan(model, [["layer0"], ["layer1"], ["layer2", "output_proj"]], example_args=(x,))
print(manual)
stage_mods = manual.stage_modules()        # one module per stage, what a PipelineStage would wrap
h = x
for stage_mod in stage_mods:
    h = stage_mod(h)
with torch.no_grad():
    assert torch.allclose(h, model(x), atol=1e-6)      # the stages in turn are the model
# The same stages as the traced split: parameters, FLOPs and the bytes each sends; so the same simulated step.
for field in ("params", "flops", "send_bytes"):
    assert [getattr(s, field) for s in manual.stages] == [getattr(s, field) for s in seed_plan.stages], field
assert pv.simulate(manual, "1F1B", 4).step_time == pv.simulate(seed_plan, "1F1B", 4).step_time

# %% [markdown]
# ## 1. Trace once
#
# `pv.trace` captures the model with `torch.export` (what torch's `pipeline()` uses, so every offered split really
# splits) and measures each layer: parameters, forward FLOPs for this batch, and the bytes of the activation it
# hands on. Your `model` is never modified; pipeviz works on deep copies.

# %%
graph = pv.trace(model, example_args=(x,))
for layer in graph.layers:
    print(f"{layer.name:12} {layer.kind:15} params={layer.params:>9,}  MFLOPs={layer.flops / 1e6:6.1f}"
          f"  out={layer.out_bytes / 1024:6.1f} KiB")
print("valid split points:", graph.split_candidates)

# %% [markdown]
# ## 2. Split after `layer0` and `layer1`
#
# In today's torch this is `pipeline(model, mb_args=..., split_spec={"layer0": SplitPoint.END, "layer1":
# SplitPoint.END})`. `graph.split` validates the names and previews the three stages straight from the graph (well
# under a millisecond; no tracing).

# %%
plan = graph.split(["layer0", "layer1"])
print(plan)
print("torch split_spec:", plan.split_spec)

# %% [markdown]
# The preview is computed, but the real thing is one call away: `plan.pipe()` runs torch's `pipeline()` on a fresh
# deep copy and returns its `Pipe`, one `submod_pp_<i>` per stage.

# %%
pipe = plan.pipe(microbatches=4)
print(pipe.num_stages, "stages")
print(pipe.split_gm.code)

# %% [markdown]
# ## 3. Simulate a step
#
# Before starting any process, `pv.simulate` plays the schedule's per-rank order (torch's own) with costs
# estimated from FLOPs and bytes. Each row of the chart is a rank; `0F1` is stage 0's forward of microbatch 1,
# `2B3` stage 2's backward of microbatch 3.

# %%
sim = pv.simulate(plan, "1F1B", microbatches=4)
print(f"predicted step {sim.step_time * 1e3:.2f} ms, idle share (bubble) {sim.bubble_fraction:.0%}")
print("rank 0 runs:", " ".join(map(str, sim.order(0))))
pv.timeline_figure(sim)


# %% [markdown]
# ## 4. Launch the three stages
#
# `pv.launch` starts one process per rank (gloo on CPU), runs torch's real `Schedule1F1B` and returns at once.
# `pv.TimelineView(run)` draws the measured events while they arrive, with the simulation as a thin overlay.

# %%
run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=5, inputs=(x,), target=y,
                loss_fn=F.cross_entropy, optimizer=pv.sgd(lr=0.1))  # the optimizer is built again on every rank
view = pv.TimelineView(run, overlay=sim)
view

# %%
status = run.wait(120)
assert status == "done", run.error
print("losses per step:", [round(loss, 4) for loss in run.losses])
measured = run.timeline()
print(f"measured step {measured.step_time * 1e3:.2f} ms, bubble {measured.bubble_fraction:.0%}")
# The processes ran exactly the order the simulator played:
assert measured.order(0, step=1) == sim.order(0)
print("rank 0 ran:", " ".join(map(str, measured.order(0, step=1))))
# The FLOP-based estimate leaves out what a real step pays besides arithmetic (asserted: the measured step is
# longer than the estimate with a core per rank).
assert measured.step_time > sim.step_time

# %% [markdown]
# The measured step is longer than the FLOP-based estimate (asserted above): with microbatches this small, a
# real step also pays the processes' hand-offs, gloo's communication and, with more ranks than free cores, waits
# for a core. The *shape* (who waits for whom) is what the chart shows. Export it for
# [Perfetto](https://ui.perfetto.dev) if you like:

# %%
trace_path = measured.to_chrome_trace(Path(tempfile.mkdtemp()) / "quickstart_trace.json")
print("Chrome trace written to", trace_path)

# %% [markdown]
# ## 5. Numerics: the pipeline trains exactly like the unsplit model
#
# `pv.check_numerics(run)` trains a deep copy of the unsplit model the way the run trained its pipeline (same
# inputs, target, loss, optimizer, microbatches and steps; gradients summed then divided by their count, as the
# schedule does: that is `pv.train_reference`), then compares. Losses and every trained parameter, gathered from
# all stages by `run.state_dict()`, must agree.

# %%
check = pv.check_numerics(run)
print(check)
assert check.ok

# %% [markdown]
# Next: `02_exploring_splits` (the Explorer widget on GPT-2 and BERT), or start the lessons in `tutorials/`.

# %% [markdown]
# ## Glossary · 术语表
#
# | English | 中文 | in pipeviz / torch |
# |---|---|---|
# | pipeline parallelism | 流水线并行 | `torch.distributed.pipelining` |
# | stage | 阶段 | `plan.stages`, `PipelineStage` |
# | rank (a process) | 进程编号 (rank) | `rank`; one process per rank |
# | microbatch | 微批次 | `microbatches=`, torch's `n_microbatches` (PiPPy: *chunks*) |
# | bubble (idle time) | 气泡 (空闲时间) | `tl.bubble_fraction` |
# | split point | 分割点 | `graph.split([...])`, `SplitPoint.END` / `BEGINNING` |
# | schedule | 调度 | `schedule="1F1B"`; `pipeviz.schedule.traits.orders` |
# | warm-up / cool-down (drain) | 预热 / 冷却 | the forwards before the first backward; the last backwards |
# | interleaved (virtual stages) | 交错 (虚拟阶段) | `Interleaved1F1B`, `stages_per_rank=` |
# | activations | 激活值 | `peak_activation_bytes` |
# | activation recomputation (checkpointing) | 激活重计算 (重计算) | `torch.utils.checkpoint` |
# | skip connection | 跳跃连接 | `graph.skip_edges` |
# | shared (tied) weights | 共享权重 | `StageInfo.shared_params` |
# | composability | 组合性 | `pv.launch(..., dp=, tp=)`, `pv.Mesh` |
# | data parallel / tensor parallel | 数据并行 / 张量并行 | `dp=`, `tp=` |
# | process group | 进程组 | `dist.init_process_group("gloo")`, `PipelineStage(..., group=)` |
# | forward / backward | 前向 / 反向传播 | `F`, `B` (input grads `I`, weight grads `W`) |
# | zero bubble | 零气泡 | `InterleavedZeroBubble`, `ZBVZeroBubble` |
# | inference (forward only) | 推理 (仅前向) | `pv.launch` without `loss_fn`, `run.outputs` |
# | device memory | 显存 | `memory_bytes`, `run.activation_memory`, `memory_limit=` |
# | global batch size | 全局批大小 | microbatch size × microbatches × dp (`plan_cluster(global_batch=)`) |
# | gradient accumulation | 梯度累积 | `accumulate=` |
# | virtual pipeline (VPP) | 虚拟流水线 | several stages per rank: `stages_per_rank=` |
# | input gradient / weight gradient | 输入梯度 / 权重梯度 | `I` / `W` (zero-bubble schedules) |
# | overlapping communication with computation | 通信与计算重叠 | `dp_reduce="overlap"` |
# | point-to-point / collective communication | 点对点通信 / 集合通信 | stage sends, receives / all-reduce |
# | node (a machine) | 节点 | `torchrun --nnodes`, `pv.export_torchrun` |
# | checkpoint (saved training state) | 检查点 | `run.save(path)`, `resume=` |
# | expert parallel / context parallel | 专家并行 / 上下文并行 | MoE experts across ranks (not in pipeviz) / `cp=` |
