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
# # Lesson 4 · Interleaving and zero bubble
#
# **You will learn:** two ways to shrink the bubble without more microbatches: give each rank several smaller
# stages (*interleaved 1F1B*), and split the backward pass so that its weight-gradient half fills the gaps (*zero
# bubble*).
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese); the
# [schedules cheat sheet](../docs/schedules.md) (every schedule's bubble, memory and traffic on one page).
#
# **Lessons:** ← [Lesson 3 · 1F1B and memory](03_1f1b_and_memory.ipynb) ·
# [Lesson 5 · Zero bubble and its memory price](05_zero_bubble_and_its_memory.ipynb) →
#
# ## Interleaved 1F1B
#
# Narayanan et al. (*Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*, SC 2021)
# cut the model into *v*·*p* stages and give rank *r* the stages *r*, *r* + *p*, *r* + 2*p*, … (*v* "model chunks"
# per rank). Each stage is *v* times smaller, so filling and draining the pipeline costs *v* times less: with
# per-rank forward and backward times *F* and *B*, the bubble time falls from (*p* − 1)·(*F* + *B*) to (*p* −
# 1)·(*F* + *B*)/*v*. The price: more messages between ranks, and the schedule needs *m* to suit *p* (torch's rule:
# *m* % max(1, *m* // *p*) == 0). Each microbatch now crosses from one rank to the next *vp* − 1 times each way
# instead of *p* − 1 (consecutive stages always sit on different ranks), so a step sends (*vp* − 1)/(*p* − 1)
# times as many activations and gradients: at least *v* times, and close to *v* when *p* is large. Each message
# is as big as before (the activation at a boundary has the same shape wherever the boundary is). The cell
# counts them in the simulation: every forward whose next stage lives on another rank sends its output, every
# backward whose previous stage does sends its input gradient.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

p, m = 4, 8      # 4 ranks, 8 microbatches; each rank's work per microbatch: F = 1, B = 2
ideal = m * 3    # time a rank spends computing


def sends_per_step(tl):
    """Messages from one rank to another in a step of a simulated timeline: a forward whose next stage is on
    another rank sends its output; a backward whose previous stage is on another rank sends its input gradient."""
    rank_of = {e.stage: e.rank for e in tl.events}
    last = max(rank_of)
    return sum(1 for e in tl.events
               if (e.kind == "F" and e.stage < last and rank_of[e.stage + 1] != e.rank)
               or (e.kind in ("B", "I") and e.stage > 0 and rank_of[e.stage - 1] != e.rank))


print(" v  schedule          step   bubble time   sends per step")
bubble_time, sends = {}, {}
for v in (1, 2, 4):
    schedule = "1F1B" if v == 1 else "Interleaved1F1B"
    tl = pv.simulate(None, schedule, m, costs=pv.Costs.uniform(p * v, forward=1 / v, backward=2 / v),
                     num_stages=p * v, stages_per_rank=None if v == 1 else v)
    bubble_time[v], sends[v] = tl.step_time - ideal, sends_per_step(tl)
    print(f"{v:2}  {schedule:16} {tl.step_time:5.2f}  {bubble_time[v]:5.2f}         {sends[v]:4}"
          f"  ({sends[v] / sends[1]:.2f}x 1F1B's)")
assert abs(bubble_time[2] - bubble_time[1] / 2) < 1e-9 and abs(bubble_time[4] - bubble_time[1] / 4) < 1e-9
# Each microbatch crosses vp - 1 rank boundaries each way: 48, 112 and 240 messages, (vp - 1) / (p - 1) >= v times.
assert all(sends[v] == 2 * m * (v * p - 1) and sends[v] / sends[1] >= v for v in (1, 2, 4)), sends

# %%
print("Interleaved1F1B, 8 stages on 4 ranks:", pv.schedule.layout("Interleaved1F1B", 8, 2).stage_ranks)
interleaved = pv.simulate(None, "Interleaved1F1B", m, costs=pv.Costs.uniform(8, forward=0.5, backward=1.0),
                          num_stages=8, stages_per_rank=2)
pv.timeline_figure(interleaved)


# %% [markdown]
# ## Zero bubble
#
# Qi, Wan, Huang and Lin (*Zero Bubble (Almost) Pipeline Parallelism*, ICLR 2024; its arXiv version,
# 2401.10241, is titled *Zero Bubble Pipeline Parallelism*) observe that a layer's backward is two computations:
# the gradient with respect to its **input** (needed at once by the previous stage: on the critical path) and the
# gradient with respect to its **weights** (needed only by the optimizer step). torch calls them **I** and **W**
# (the paper: B and W). Running I first and postponing W lets W fill the slots where a rank would otherwise wait.
#
# The ICLR paper's first schedule, **ZB-H1**, is 1F1B with every backward split that way: I where 1F1B runs its
# backward, W postponed into the gaps, never holding more than 1F1B's memory. Its bubble time is (*p* − 1)·(*F* +
# *I* − *W*) against 1F1B's (*p* − 1)·(*F* + *I* + *W*): with *F* = *I* = *W* (the paper's *F* = *B* = *W*),
# **about a third of 1F1B's** — exactly a third in the simulator's equal-cost world (asserted below), about a third
# on real hardware, where the three are only roughly equal. torch runs it as `InterleavedZeroBubble` with one stage
# per rank (lesson 6 builds it by hand).
#
# Their ZB-V schedule (added in the arXiv version; not in the ICLR paper) also places 2*p* stages in a V: stages 0
# … *p* − 1 go down ranks 0 … *p* − 1, the V turns at rank *p* − 1 (which holds stages *p* − 1 and *p*), and
# stages *p* … 2*p* − 1 come back up, so rank 0 holds the first *and* the last stage (and computes the loss).
#
# With I = W = half a backward (so *F* = *I* = *W* = 1 per rank and microbatch), compare the four-rank schedules:

# %%
def textbook(schedule, v):
    return pv.simulate(None, schedule, m, costs=pv.Costs.uniform(p * v, forward=1 / v, backward=2 / v),
                       num_stages=p * v, stages_per_rank=None if v == 1 else v)


bubbles = {}
for schedule, v in (("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)):
    tl = textbook(schedule, v)
    bubbles[schedule] = tl.step_time - ideal
    print(f"{schedule:22} bubble time {tl.step_time - ideal:5.2f}   idle share {tl.bubble_fraction:5.1%}")
# ZB-H1: torch's InterleavedZeroBubble with one stage per rank, F = I = W = 1
zb_h1 = pv.simulate(None, "InterleavedZeroBubble", m, costs=pv.Costs.uniform(p, forward=1, backward=2), num_stages=p,
                    stages_per_rank=1)
bubbles["ZB-H1"] = zb_h1.step_time - ideal
print(f"{'ZB-H1 (1 stage/rank)':22} bubble time {bubbles['ZB-H1']:5.2f}   idle share {zb_h1.bubble_fraction:5.1%}"
      f"   = {bubbles['ZB-H1'] / bubbles['1F1B']:.3f} of 1F1B's")
assert bubbles["1F1B"] == (p - 1) * (1 + 1 + 1) and bubbles["ZB-H1"] == (p - 1) * (1 + 1 - 1)   # 9 and 3
assert abs(bubbles["ZB-H1"] / bubbles["1F1B"] - 1 / 3) < 1e-9                                       # a third
zbv = textbook("ZBVZeroBubble", 2)
print("ZBV stage -> rank:", pv.schedule.layout("ZBVZeroBubble", 8).stage_ranks)
assert pv.schedule.layout("ZBVZeroBubble", 8).stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)  # the V, as the text says
print("ZBV rank 0:", " ".join(map(str, zbv.order(0))))
pv.timeline_figure(zbv)

# %% [markdown]
# ## A real zero-bubble run
#
# Four stages on two processes under torch's `ScheduleZBVZeroBubble`: the recorded events include `I` and `W`, in
# the order the simulator predicted.

# %%
torch.manual_seed(0)
model = MyNetwork(1024, [1024] * 6)
x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
plan = pv.balance(pv.trace(model, example_args=(x,)), num_stages=4)
run = pv.launch(plan, schedule="ZBVZeroBubble", microbatches=4, steps=2, inputs=(x,), target=y,
                loss_fn=F.cross_entropy)
assert run.wait(180) == "done", run.error
measured, sim = run.timeline(), pv.simulate(plan, "ZBVZeroBubble", microbatches=4)
print("kinds recorded:", sorted({e.kind for e in measured.events}))
for rank in range(2):
    assert measured.order(rank, step=1) == sim.order(rank)
    print(f"rank {rank}:", " ".join(map(str, measured.order(rank, step=1))))
pv.TimelineView(run, overlay=sim)

# %% [markdown]
# ## Exercise
#
# With **p = 4** ranks, **m = 8** microbatches and per-rank costs **F = 1**, **B = 2** per microbatch (free
# communication), what is the **bubble time** (step time minus the 24 units of compute) of **Interleaved1F1B with
# v = 4** stages per rank? Set `my_answer` to a number.

# %%
my_answer = None  # your answer here: a number of time units


# %%
def check(answer):
    """Bubble time of Interleaved1F1B, 16 stages on 4 ranks, from pipeviz's simulation."""
    tl = pv.simulate(None, "Interleaved1F1B", 8, costs=pv.Costs.uniform(16, forward=0.25, backward=0.5),
                     num_stages=16, stages_per_rank=4)
    expected = tl.step_time - 8 * 3
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: 1F1B's bubble time is (p - 1)(F + B); then divide.")
    elif not isinstance(answer, (int, float)):
        print(f"❌ Not yet: my_answer should be a number, got {answer!r}.")
    elif abs(answer - expected) < 1e-6:
        print(f"✅ Correct: (p - 1)(F + B) / v = 9 / 4 = {expected}.")
    elif abs(answer - 9) < 1e-6:
        print("❌ Not yet: 9 is plain 1F1B's bubble time. Hint: interleaving divides it by v.")
    else:
        print(f"❌ Not yet: not {answer!r}. Hint: the bubble time is (p - 1)(F + B) / v.")


check(my_answer)
