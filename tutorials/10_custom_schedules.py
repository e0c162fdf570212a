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
# # Lesson 10 · Write your own schedule
#
# **You will learn:** torch's action notation, how to write a schedule as per-rank action lists, how
# `pipeviz.schedules.validate` and `pv.simulate(..., order=...)` judge and draw it (deadlocks included), and how a
# zero-bubble order (ZB-H1) comes from 1F1B by splitting each backward.
#
# ## The notation
#
# A schedule is, for every rank, the list of actions it runs in order. torch writes an action as
# **stage, kind, microbatch**: `0F0` is stage 0's forward of microbatch 0, `1B3` stage 1's backward of microbatch
# 3; zero-bubble schedules split a backward into `I` (gradient of the input, which the previous stage waits for)
# and `W` (gradient of the weights, which only the optimizer needs). Sends and receives follow from the order: a
# forward needs the previous stage's forward of the same microbatch, a backward the next stage's backward.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.schedules import ScheduleError, validate
from pipeviz.zoo import MyNetwork

print(pv.schedules.orders("1F1B", 2, 3))   # what torch's Schedule1F1B runs: 2 stages (= ranks), 3 microbatches

# %% [markdown]
# ## 1F1B by hand
#
# Rank *r* of *p* warms up with min(*m*, *p* − *r*) forwards, then runs one backward and one forward until the
# forwards run out, then the remaining backwards (torch's `Schedule1F1B`, lesson 3):

# %%
def one_f_one_b(p, m):
    """Per-rank action lists of 1F1B, stage r on rank r."""
    orders = []
    for r in range(p):
        warm = min(m, p - r)
        acts = [f"{r}F{i}" for i in range(warm)]
        next_f = warm
        for b in range(m):
            acts.append(f"{r}B{b}")
            if next_f < m:
                acts.append(f"{r}F{next_f}")
                next_f += 1
        orders.append(acts)
    return orders


p, m = 4, 8
mine = one_f_one_b(p, m)
assert mine == pv.schedules.orders("1F1B", p, m)   # the same order torch runs
for r, acts in enumerate(mine):
    print(f"rank {r}:", " ".join(acts))

# %% [markdown]
# ## Judged before it runs
#
# `validate(order, num_stages, microbatches, stage_ranks)` checks the rules every schedule must keep (each
# stage's forward and backward of each microbatch exactly once, on the rank holding the stage, forward first;
# `I` before `W`). `pv.simulate(..., order=...)` plays the order and reports a **deadlock**: ranks each waiting for
# an action another rank will only run later.

# %%
stage_ranks = tuple(range(p))
validate(mine, p, m, stage_ranks)                               # no error: a valid schedule

broken = [acts[:] for acts in mine]
broken[2].remove("2B5")                                         # a backward forgotten
try:
    validate(broken, p, m, stage_ranks)
except ScheduleError as err:
    print("validate:", err)

# Rank 0 backs up each microbatch before starting the next one; rank 1 wants two forwards first.
deadlocked = [["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
validate(deadlocked, 2, 2, (0, 1))                              # every rule kept...
try:
    pv.simulate(None, "1F1B", 2, costs=pv.Costs.uniform(2), num_stages=2, order=deadlocked)
    raise AssertionError("the deadlock went unnoticed")
except ScheduleError as err:                                    # ...but it cannot run
    print("simulate:", err)

# %% [markdown]
# ## A zero-bubble order: ZB-H1
#
# Qi et al. (*Zero Bubble Pipeline Parallelism*, arXiv 2401.10241) start from 1F1B: replace each backward `B` by
# its input-grad pass `I` at the same place, and run the weight-grad passes `W` later, where the rank would wait.
# The later a rank is in the pipeline, the sooner its last input-grad pass is done and the longer it would sit
# idle at the end of the step, so here rank *r* keeps *r* weight-grad passes pending and runs them there. A `W`
# that falls due runs *before* the rank's next forward: that is what keeps ZB-H1's memory at 1F1B's (the paper
# defines ZB-H1 by never exceeding 1F1B's peak). With *F* = 1 and *I* = *W* = 1 the bubble time falls from
# (*p* − 1)·(*F* + *B*) = 9 to (*p* − 1)·(*F* + *I* − *W*) = 3, the paper's ZB-H1 figure.

# %%
def zb_h1(p, m):
    """1F1B with each B split: I in B's place, W postponed (rank r keeps r of them pending); a W that falls due runs
    before the next F."""
    orders = []
    for r in range(p):
        warm = min(m, p - r)
        acts = [f"{r}F{i}" for i in range(warm)]
        next_f, pending = warm, []
        for b in range(m):
            acts.append(f"{r}I{b}")              # where 1F1B runs B: the input grad the previous stage waits for
            pending.append(f"{r}W{b}")
            if len(pending) > r:                 # rank r keeps r weight-grad passes pending; the due one goes now,
                acts.append(pending.pop(0))      # before the next forward adds a microbatch's activations
            if next_f < m:
                acts.append(f"{r}F{next_f}")
                next_f += 1
        orders.append(acts + pending)           # the rest fill the cool-down
    return orders


h1 = zb_h1(p, m)
validate(h1, p, m, stage_ranks)
costs = pv.Costs.uniform(p, activation_bytes=2)                 # F = 1, B = 2 (I = W = 1); 2 units per microbatch
results = {name: pv.simulate(None, "1F1B", m, costs=costs, num_stages=p, order=order)
           for name, order in (("1F1B", mine), ("ZB-H1", h1))}
torch_zb = pv.simulate(None, "InterleavedZeroBubble", m, costs=costs, num_stages=p, stages_per_rank=1)
for name, tl in (*results.items(), ("torch's InterleavedZeroBubble, 1 stage/rank", torch_zb)):
    print(f"{name:44} step {tl.step_time:5.1f}  bubble time {tl.step_time - 3 * m:4.1f}  "
          f"activations held {[b / 2 for b in tl.peak_activation_bytes]}")
assert results["1F1B"].step_time - 3 * m == (p - 1) * 3
assert results["ZB-H1"].step_time - 3 * m == (p - 1) * 1 == torch_zb.step_time - 3 * m
assert max(torch_zb.peak_activation_bytes) == results["1F1B"].peak_activation_bytes[0]
# ZB-H1's memory: no rank above 1F1B's rank 0 (4 microbatches), each later rank half a microbatch less
assert [b / 2 for b in results["ZB-H1"].peak_activation_bytes] == [4.0, 3.5, 3.0, 2.5]
# the due W after the next F instead: the same bubble, rank 0 holding 4.5 microbatches, above 1F1B
late = [[a for a in acts] for acts in h1]
for acts in late:
    for i in range(len(acts) - 1):
        if "W" in acts[i] and "F" in acts[i + 1]:
            acts[i], acts[i + 1] = acts[i + 1], acts[i]
w_late = pv.simulate(None, "1F1B", m, costs=costs, num_stages=p, order=late)
print("W after the next F:", w_late.step_time - 3 * m, [b / 2 for b in w_late.peak_activation_bytes])
assert w_late.step_time == results["ZB-H1"].step_time and w_late.peak_activation_bytes[0] / 2 == 4.5
print("rank 3:", " ".join(h1[3]))
pv.timeline_figure(results["ZB-H1"])

# %% [markdown]
# A postponed `W` keeps half of a microbatch's activations alive a little longer, but because the due one runs
# before the next forward, the peak never passes 1F1B's: rank 0 holds 4 microbatches as in 1F1B, each later rank
# half a microbatch less ([4, 3.5, 3, 2.5]). ZB-H1 takes most of the bubble away at no memory cost; run the due `W`
# after the next forward instead and the step is the same but rank 0 holds 4.5 (the last lines above). torch's
# `ScheduleInterleavedZeroBubble` with one stage per rank reaches the same step with the same memory per rank.
#
# ## Running a schedule for real
#
# `pv.launch` runs torch's own schedules by name, and a hand-written order as `LaunchConfig(order=...)` (checked
# before any process starts, then run through torch's runtime, which adds the sends, receives and reductions;
# torch's documented way to write a schedule of your own is a subclass of `PipelineScheduleSingle` or
# `PipelineScheduleMulti`). Here, torch's zero-bubble schedule with one stage per rank, whose order the simulator
# predicts action for action:

# %%
torch.manual_seed(0)
model = MyNetwork(256, [256] * 3)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
plan = pv.balance(pv.trace(model, example_args=(x,)), num_stages=2)
run = pv.launch(plan, "InterleavedZeroBubble", microbatches=4, steps=2, inputs=(x,), target=y,
                loss_fn=F.cross_entropy, stages_per_rank=1)
assert run.wait(180) == "done", run.error
measured = run.timeline()
for rank in range(2):
    print(f"rank {rank}:", " ".join(measured.order(rank, step=1)))
    assert measured.order(rank, step=1) == pv.schedules.orders("InterleavedZeroBubble", 2, 4, 1)[rank]
numerics = pv.check_numerics(run)
print(numerics)
assert numerics.ok
pv.TimelineView(run)

# %% [markdown]
# ## Exercise
#
# Write **1F1B for p = 3 stages and m = 4 microbatches** by hand, as a list of three lists of actions (rank 0's
# first), without calling `one_f_one_b`. Set `my_answer` to it; the check validates it, simulates it and compares
# it with torch's order.

# %%
my_answer = None  # your answer here: [["0F0", ...], ["1F0", ...], ["2F0", ...]]


# %%
def check(answer):
    """Your order against torch's 1F1B for 3 stages and 4 microbatches: rules, deadlocks, then the order."""
    expected = pv.schedules.orders("1F1B", 3, 4)
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: rank r starts with min(m, p - r) forwards.")
        return
    if not (isinstance(answer, list) and len(answer) == 3 and all(isinstance(a, list) for a in answer)):
        print("❌ Not yet: my_answer should be a list of 3 lists of actions such as '0F0'.")
        return
    try:
        validate(answer, 3, 4, (0, 1, 2))
        pv.simulate(None, "1F1B", 4, costs=pv.Costs.uniform(3), num_stages=3, order=answer)
    except (ScheduleError, ValueError) as err:
        print(f"❌ Not yet: {err}")
        return
    if answer == expected:
        print("✅ Correct: that is torch's Schedule1F1B order, action for action.")
    elif answer == pv.schedules.orders("GPipe", 3, 4):
        print("❌ Not yet: that is GPipe (all forwards first). Hint: start a backward once the warm-up is done.")
    else:
        wrong = next(r for r in range(3) if answer[r] != expected[r])
        print(f"❌ Not yet: a valid schedule, but not 1F1B: rank {wrong} differs. Hint: after the warm-up, one "
              "backward, then one forward.")


check(my_answer)
