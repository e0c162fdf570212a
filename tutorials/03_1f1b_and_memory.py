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
# # Lesson 3 · 1F1B and memory
#
# **You will learn:** why GPipe's memory grows with the number of microbatches, how the 1F1B schedule caps it at
# the number of stages, and how to see both in pipeviz: simulated, and measured on real runs.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese); the
# [schedules cheat sheet](../docs/schedules.md) (every schedule's bubble, memory and traffic on one page).
#
# **Lessons:** ← [Lesson 2 · Microbatches and the bubble](02_microbatches_and_the_bubble.ipynb) ·
# [Lesson 4 · Interleaving and zero bubble](04_interleaving_and_zero_bubble.ipynb) →
#
# ## Activations wait for their backward
#
# A stage must keep each microbatch's activations from its forward until its backward. GPipe runs all *m* forwards
# first, so every stage holds **m** microbatches of activations at its peak: more microbatches (smaller bubble)
# means more memory. (The GPipe paper also keeps only each stage's input and recomputes the rest during the
# backward pass, trading compute for memory; torch's `ScheduleGPipe` does not.)
#
# ## 1F1B
#
# The *one-forward-one-backward* schedule starts each backward as early as possible. In torch's `Schedule1F1B`,
# stage *s* of *p* warms up with min(*m*, *p* − *s*) forwards (its `warmup_chunks`), then alternates one backward,
# one forward (the loop runs the backward first, "1B1F") until the forwards run out, and finally drains the
# remaining backwards. So stage 0 never holds more than **min(m, p)** microbatches, stage *s* at most min(*m*, *p* −
# *s*): with *m* ≥ *p*, that is *p* − *s* whatever *m* is. Its synchronous form, with one optimizer step after
# all microbatches, is PipeDream-Flush (Narayanan et al., *Memory-Efficient Pipeline-Parallel DNN Training*, ICML
# 2021); it is torch's `Schedule1F1B`. Against GPipe it has **exactly the same bubble** but a **lower activation
# peak**: min(*m*, *p*) microbatches on rank 0 instead of GPipe's *m* (both asserted below). (The PipeDream-Flush
# paper writes the warm-up as *p* − *s* − 1 forwards followed by forward-then-backward pairs; its first pair's
# forward brings stage *s* to the same *p* − *s* microbatches, so it is the same schedule with the same peak as
# torch's order.)
#
# Let's measure activations in units of "one microbatch on one stage" with `Costs.uniform(...,
# activation_bytes=1)`:

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

p, m = 4, 8
unit = pv.Costs.uniform(p, activation_bytes=1)  # F = 1, B = 2, one "byte" per microbatch and stage
gpipe = pv.simulate(None, "GPipe", microbatches=m, costs=unit, num_stages=p)
one_f_one_b = pv.simulate(None, "1F1B", microbatches=m, costs=unit, num_stages=p)
print("microbatches alive at the peak, per stage:")
print("  GPipe:", gpipe.peak_activation_bytes)
print("  1F1B: ", one_f_one_b.peak_activation_bytes)
print(f"step time: GPipe {gpipe.step_time}, 1F1B {one_f_one_b.step_time}; bubble: GPipe "
      f"{gpipe.bubble_fraction:.1%}, 1F1B {one_f_one_b.bubble_fraction:.1%}")
assert gpipe.step_time == one_f_one_b.step_time                                      # the same bubble ...
assert abs(gpipe.bubble_fraction - one_f_one_b.bubble_fraction) < 1e-12
assert abs(gpipe.bubble_fraction - (p - 1) / (m + p - 1)) < 1e-12                   # ... GPipe's (lesson 2)
assert gpipe.peak_activation_bytes[0] == m and one_f_one_b.peak_activation_bytes[0] == min(p, m)   # lower peak

# %% [markdown]
# The orders show the difference: GPipe's rank 0 runs all forwards first, 1F1B's alternates after min(m, p) = 4
# warm-up forwards, and rank 3 (the last stage) after min(m, p − 3) = 1.

# %%
for name, tl in (("GPipe", gpipe), ("1F1B", one_f_one_b)):
    print(f"{name:5} rank 0:", " ".join(map(str, tl.order(0))))   # each action prints in torch's notation, 0F0
    print(f"{name:5} rank 3:", " ".join(map(str, tl.order(3))))
for s in range(p):  # warm-up: the forwards before the first backward, min(m, p - s) as in torch's Schedule1F1B
    order = one_f_one_b.order(s)
    assert next(i for i, action in enumerate(order) if action.kind == "B") == min(m, p - s), order
pv.timeline_figure(one_f_one_b)

# %% [markdown]
# ## Rank 0 holds a whole model's activations, whatever *p*
#
# Count in a bigger unit: one microbatch's activations for the **whole model**. With *p* balanced stages, each
# stage keeps 1/*p* of that per microbatch, and 1F1B's rank 0 keeps *p* microbatches at its peak (*m* ≥ *p*):
# *p* × 1/*p*, one whole model's worth, however many stages there are. More stages spread the parameters over
# more devices; they do not lower the first rank's activation memory. This is how Korthikanti et al. (*Reducing
# Activation Recomputation in Large Transformer Models*, 2022, §4.2.3) put it: the first stage stores *p*
# microbatches of *L*/*p* layers, as much as *L* layers for one microbatch, independent of *p*. The simulator, with
# the model's activations as 12 units split evenly over *p* stages:

# %%
WHOLE = 12  # one microbatch's activations for the whole model, in units; each of p stages keeps WHOLE / p
for stages in (2, 3, 4):
    tl = pv.simulate(None, "1F1B", microbatches=12, num_stages=stages,
                     costs=pv.Costs.uniform(stages, activation_bytes=WHOLE // stages))
    print(f"p = {stages}: each stage keeps {WHOLE // stages:2} per microbatch; peak per rank "
          f"{tl.peak_activation_bytes}")
    assert tl.peak_activation_bytes[0] == WHOLE   # p microbatches x 1/p of the model: the whole model's worth

# %% [markdown]
# ## On a real model
#
# With real activation sizes, `peak_activation_bytes` and `memory_bytes` (parameters, gradients, optimizer state
# and peak activations, per rank) are in bytes:

# %%
torch.manual_seed(0)
model = MyNetwork(1024, [1024] * 6)
x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
graph = pv.trace(model, example_args=(x,))
plan = pv.balance(graph, num_stages=3, by="params")
for schedule in ("GPipe", "1F1B"):
    tl = pv.simulate(plan, schedule, microbatches=8)
    print(f"{schedule:5} peak activations (MiB): {[round(b / 2**20, 1) for b in tl.peak_activation_bytes]}"
          f"   total memory (MiB): {[round(b / 2**20, 1) for b in tl.memory_bytes]}")

# %% [markdown]
# The same count on this model, balanced over 1, 2, 3 and 6 stages (1F1B, 8 microbatches of 32 rows). Its six
# blocks each keep one tensor of 32 × 1024 floats (128 KiB, its ReLU's output) for the backward, and the first
# block keeps the input too: 7 such tensors for the whole model and one microbatch. Split, a stage keeps its
# blocks' tensors *and its own input*, so rank 0 holds *p* × (6/*p* + 1) = 6 + *p* tensors: the six blocks'
# activations of the whole model, as above, plus an input per microbatch in flight where the unsplit model keeps
# one. In a
# transformer layer the input is a small part (a layer keeps at least 17 times its input: *sbh*(34 + 5*as*/*h*)
# bytes against 2*sbh*, Korthikanti et al. §4.1); in this model, whose blocks keep one tensor each, it is not.

# %%
tensor = graph.layers[0].out_bytes // 8            # one block's output for one microbatch: 32 x 1024 x 4 bytes
for stages in (1, 2, 3, 6):
    rank0 = pv.simulate(pv.balance(graph, num_stages=stages, by="params"), "1F1B", 8).peak_activation_bytes[0]
    print(f"p = {stages}: rank 0 holds {rank0 / tensor:5.2f} x 128 KiB")
    if stages == 1:   # the whole model: 7 tensors, and its 32 x 10 output
        assert rank0 == 7 * tensor + 32 * 10 * 4, rank0
    else:             # p microbatches x (6 / p blocks + the stage's input)
        assert rank0 == stages * (6 // stages + 1) * tensor == (6 + stages) * tensor, rank0


# %% [markdown]
# ## On a real run: count the microbatches in flight
#
# pipeviz records the order in which each rank really ran its actions. Replaying rank 0's order and counting
# forwards whose backward has not run yet gives the number of microbatches whose activations it held at once.

# %%
def in_flight_peak(order):
    """Most microbatches forwarded but not yet backwarded, replaying a rank's actions (0F3, 0B1)."""
    alive = peak = 0
    for action in order:
        alive += 1 if action.kind == "F" else -1
        peak = max(peak, alive)
    return peak


run = pv.launch(plan, schedule="1F1B", microbatches=8, steps=2, inputs=(x,), target=y, loss_fn=F.cross_entropy)
assert run.wait(180) == "done", run.error
measured = run.timeline()
simulated = pv.simulate(plan, "1F1B", microbatches=8)
for rank in range(3):
    order = measured.order(rank, step=1)
    print(f"rank {rank}: {in_flight_peak(order)} microbatches at most   {' '.join(map(str, order))}")
    assert order == simulated.order(rank)          # the processes ran torch's order, as simulated
    assert in_flight_peak(order) == 3 - rank       # p - s: 3, 2, 1, not m = 8
pv.TimelineView(run)

# %% [markdown]
# ## On a real run: measure the bytes
#
# The count above is what the order requires. `run.activation_memory` is what each process really kept: the
# tensors autograd saved for backward, sampled as every action starts and ends. Run GPipe on the same plan and
# compare each rank's peak: 1F1B's should be (*p* − *s*)/*m* of GPipe's, that is 3/8, 2/8 and 1/8.

# %%
gpipe_run = pv.launch(plan, schedule="GPipe", microbatches=8, steps=2, inputs=(x,), target=y,
                      loss_fn=F.cross_entropy)
assert gpipe_run.wait(180) == "done", gpipe_run.error
for rank in range(3):
    peak = {name: max(b for _, b in r.activation_memory[rank]) for name, r in (("GPipe", gpipe_run), ("1F1B", run))}
    print(f"rank {rank}: GPipe {peak['GPipe'] / 2**20:5.2f} MiB   1F1B {peak['1F1B'] / 2**20:5.2f} MiB   "
          f"ratio {peak['1F1B'] / peak['GPipe']:.3f}")
    assert abs(peak["1F1B"] / peak["GPipe"] - (3 - rank) / 8) < 0.02   # measured: (p - s) / m

# %% [markdown]
# 1F1B keeps GPipe's bubble; lesson 4 shrinks it.
#
# ## Exercise
#
# Under **1F1B** with **p = 4** stages and **m = 8** microbatches, how many microbatches' activations does **stage
# 1** (the second stage) hold at its peak? Set `my_answer` to that integer.

# %%
my_answer = None  # your answer here: an integer


# %%
def check(answer):
    """Stage 1's peak from pipeviz's simulation, counting one unit per microbatch."""
    costs = pv.Costs.uniform(4, activation_bytes=1)
    expected = pv.simulate(None, "1F1B", microbatches=8, costs=costs, num_stages=4).peak_activation_bytes[1]
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: how many warm-up forwards does stage s run first?")
    elif answer == expected:
        print(f"✅ Correct: stage 1 holds {expected} = p - 1 microbatches; stage s holds p - s.")
    elif answer == 8:
        print("❌ Not yet: that is GPipe, which keeps all m. Hint: 1F1B's stage s holds at most p - s.")
    else:
        print(f"❌ Not yet: not {answer!r}. Hint: stage 0 holds p = 4, and each later stage one fewer.")


check(my_answer)
