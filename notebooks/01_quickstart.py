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
# of 32 in 4 chunks (`pipeline(mn, chunks, example_args=(x,))`), then run its three stages under `torchrun`. Here is
# the same walkthrough, from one notebook:
#
# 1. **trace** the model once and look at its layers,
# 2. **split** it and preview every stage (parameters, FLOPs, bytes sent, memory) without building anything,
# 3. **simulate** a training step,
# 4. **launch** the three stages as real processes and watch the timeline fill in live,
# 5. **check the numerics** against the unsplit model.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import tempfile
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
print("rank 0 runs:", " ".join(sim.order(0)))
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
print("rank 0 ran:", " ".join(measured.order(0, step=1)))

# %% [markdown]
# On a laptop CPU the measured step is dominated by process and communication overheads; the *shape* (who waits
# for whom) is what the chart shows. Export it for [Perfetto](https://ui.perfetto.dev) if you like:

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
