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
# # Lesson 1 · Why pipelines?
#
# **You will learn:** why a model may not fit on one device, how pipeline parallelism splits it into *stages*, and
# why the naive pipeline leaves most devices idle.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese);
# [notebook 04, skip connections and shared weights](../notebooks/04_skips_and_shared_weights.ipynb) (a split
# across a skip connection or between tied weights, and how pipeviz still trains it exactly).
#
# **Lessons:** [Lesson 2 · Microbatches and the bubble](02_microbatches_and_the_bubble.ipynb) →
#
# ## A model too big for one device
#
# Training keeps, for every parameter, the weight, its gradient and the optimizer's state. With Adam in fp32 that
# is 4 + 4 + 8 = **16 bytes per parameter** before any activations: a 7-billion-parameter model needs about 112
# GB, more than an 80 GB GPU holds.
#
# *Pipeline parallelism* cuts the model's layers into consecutive groups, **stages**, and puts each on its own
# device (a *rank*). Stage 0 computes the first layers and sends its output activation to stage 1, and so on; the
# backward pass sends gradients the other way. Each device holds only its stage's parameters.
#
# Let's do that with a small model and a pretend device of 40 MiB.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import os

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

torch.manual_seed(0)
model = MyNetwork(1024, [1024] * 6)    # six Linear+ReLU blocks layer0..layer5, then output_proj
x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
graph = pv.trace(model, example_args=(x,))
print(f"{graph.total_params:,} parameters")

DEVICE_MEMORY = 40 * 2**20             # our pretend device: 40 MiB
whole = graph.split([])                # one stage: the whole model on one device
print(whole)
print(f"needs {whole.stages[0].memory_bytes / 2**20:.1f} MiB; fits on one device:",
      whole.stages[0].memory_bytes <= DEVICE_MEMORY)
assert whole.stages[0].memory_bytes > DEVICE_MEMORY  # what the text says: the whole model does not fit

# %% [markdown]
# The `memory` column is the training footprint of `pipeviz.costs`, the one memory model every lesson uses:
# parameters + gradients + Adam's two states (16 bytes per parameter, as above) + the activations kept for the
# backward: the footprint of a real training run. (The small runs these lessons launch train with `pv.launch`'s
# default, plain SGD, which keeps no state: they hold 8 bytes per parameter, not 16; pass `optimizer=` for Adam.)
# Split into three stages with about equal parameters (`pv.balance` picks the cut points), each stage fits:

# %%
plan = pv.balance(graph, num_stages=3, by="params")
print(plan)
print("MiB per stage:", [round(stage.memory_bytes / 2**20, 1) for stage in plan.stages])
print("every stage fits:", all(stage.memory_bytes <= DEVICE_MEMORY for stage in plan.stages))
assert all(stage.memory_bytes <= DEVICE_MEMORY for stage in plan.stages)  # what the text says

# %% [markdown]
# ## The naive pipeline
#
# Push the whole batch through as **one microbatch**: stage 0 runs its forward (`F`), hands the activation to
# stage 1, which runs its forward, and so on; then the backward passes (`B`) run in reverse, from the last stage
# to the first. Only one stage works at any moment. The simulator shows it (one row per rank; costs estimated from
# FLOPs):

# %%
naive = pv.simulate(plan, "GPipe", microbatches=1)
print(f"idle share of the devices' time (the 'bubble'): {naive.bubble_fraction:.0%}")
pv.timeline_figure(naive)

# %% [markdown]
# ## The same, for real
#
# `pv.launch` starts the three stages as three processes running torch's `ScheduleGPipe` and streams back when
# each forward and backward ran. Watch the staircase appear:

# %%
run = pv.launch(plan, schedule="GPipe", microbatches=1, steps=3, inputs=(x,), target=y, loss_fn=F.cross_entropy)
pv.TimelineView(run)

# %%
assert run.wait(180) == "done", run.error
measured = run.timeline()
step = measured.steps[-1]
compute = [e for e in measured.step_events(step) if e.kind in ("F", "B")]
span = max(e.end for e in compute) - min(e.start for e in compute)
for rank in range(measured.num_ranks):
    busy = sum(e.duration for e in compute if e.rank == rank)
    print(f"rank {rank}: busy {busy / span:4.0%} of the step  ({' '.join(map(str, measured.order(rank, step=step)))})")
print(f"measured bubble: {measured.bubble_fraction:.0%}")
# The simulator "as run here": the same plan, its ranks sharing this machine's cores.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
here = pv.simulate(plan, "GPipe", microbatches=1, cores=CORES)
print(f"simulated bubble on {CORES} core(s): {here.bubble_fraction:.0%}; (p - 1) / p = {2 / 3:.0%}")
# What the text below claims: every rank is busy for only its share of the step, and the measured bubble is near
# the simulated one (loose bounds: communication and a busy machine move it).
assert all(sum(e.duration for e in compute if e.rank == r) / span < 0.6 for r in range(measured.num_ranks))
assert abs(measured.bubble_fraction - here.bubble_fraction) < 0.2, (measured.bubble_fraction, here.bubble_fraction)

# %% [markdown]
# Each rank is busy only for its own share of the step (the cell checks that none is busy for more than 60 % of
# it): with *p* equal stages and a single microbatch, every rank idles (*p* − 1)/*p* of the time, and the measured
# bubble lies within 20 points of the simulator's. We bought memory capacity and paid with utilisation. (Measured
# numbers also contain communication, and on a small machine processes share CPU cores, so they wobble around the
# ideal.)
#
# The fix, in the next lesson: split the batch into **microbatches** so that the stages can work on different
# microbatches at the same time (GPipe, Huang et al. 2019).
#
# ## Exercise
#
# Suppose the model is split into **4 equal stages** and the batch goes through as **one microbatch** (the naive
# pipeline). What fraction of the total device time is idle? Set `my_answer` to a number between 0 and 1, then run
# the check cell.

# %%
my_answer = None  # your answer here, e.g. 0.5


# %%
def check(answer):
    """Compare with pipeviz's simulation of 4 equal stages (F = 1, B = 2), GPipe, one microbatch."""
    expected = pv.simulate(None, "GPipe", microbatches=1, costs=pv.Costs.uniform(4), num_stages=4).bubble_fraction
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: for how many of the 4 stages' turns is one device busy?")
    elif not isinstance(answer, (int, float)):
        print(f"❌ Not yet: my_answer should be a number, got {answer!r}.")
    elif abs(answer - expected) < 1e-3:
        print(f"✅ Correct: {expected:.2f} of the time is idle, (p - 1) / p with p = 4.")
    elif abs(answer - (1 - expected)) < 1e-3:
        print("❌ Not yet: that is the busy share. Hint: the question asks for the idle share.")
    else:
        print("❌ Not yet: hint: one device works 1 of every p equal slices of the step; the other p - 1 wait.")


check(my_answer)
