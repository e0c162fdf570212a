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
# # Lesson 6 · Write your own schedule
#
# **You will learn:** torch's action notation, how to write a schedule as per-rank action lists, how
# `pipeviz.schedule.traits.validate` and `pv.simulate(..., order=...)` judge and draw it (deadlocks included), and how a
# zero-bubble order (ZB-H1) comes from 1F1B by splitting each backward, what ZB-H2 adds with more
# memory and optimizer post-validation, and how `pv.synthesize_schedule` searches for the fastest order that fits a
# memory limit (and launches it).
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese); the
# [schedules cheat sheet](../docs/schedules.md) (every schedule's bubble, memory and traffic on one page).
#
# **Lessons:** ← [Lesson 5 · Zero bubble and its memory price](05_zero_bubble_and_its_memory.ipynb) ·
# [Lesson 7 · Balancing stages](07_balancing_stages.ipynb) →
#
# ## The notation
#
# A schedule is, for every rank, the list of actions it runs in order. torch writes an action as
# **stage, kind, microbatch**: `0F0` is stage 0's forward of microbatch 0, `1B3` stage 1's backward of microbatch
# 3; zero-bubble schedules split a backward into `I` (gradient of the input, which the previous stage waits for)
# and `W` (gradient of the weights, which only the optimizer needs). Sends and receives follow from the order: a
# forward needs the previous stage's forward of the same microbatch, a backward the next stage's backward.
# pipeviz holds each action as a `pv.schedule.Action(stage, kind, microbatch)` whose `str()` is torch's text; an
# order you write yourself can be that text, as below.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.schedule.traits import ScheduleError, validate
from pipeviz.zoo import MyNetwork

# what torch's Schedule1F1B runs, 2 stages (= ranks), 3 microbatches: per rank, Actions (stage, kind, microbatch)
# that print in torch's notation
for r, acts in enumerate(pv.schedule.orders("1F1B", 2, 3)):
    print(f"rank {r}:", " ".join(map(str, acts)))
print(repr(pv.schedule.orders("1F1B", 2, 3)[1][0]))

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
assert mine == [[str(a) for a in acts] for acts in pv.schedule.orders("1F1B", p, m)]   # the order torch runs
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
# ## ZB-H2: more memory, no bubble
#
# ZB-H1 still leaves (*p* − 1)·(*F* + *I* − *W*). Qi et al.'s **ZB-H2** lets rank 0 hold up to **2*p* − 1**
# microbatches (rank *r*: 2*p* − 1 − *r*): rank 0 runs forwards until the first input gradient returns (after
# 2*p* − 1 forward times), and every rank runs `I` as soon as it can, then a forward, and a `W` only where it
# would otherwise wait. Written as a greedy rule over unit-time actions (the paper builds its schedules with a
# heuristic of the same kind), each rank then computes without a single gap from its first action to its last:
# rank *r* works from *r*·*F* to 3*m* + *r*·*F*, a **parallelogram**.
#
# Its step still measures (*p* − 1)·*F* more than the work, because this step, like every step here, ends in a
# synchronisation: the optimizer waits for every rank's gradients (for the global gradient norm, the NaN check).
# The paper removes it by **optimizer post-validation** (lesson 5): each rank steps as soon as its own gradients
# are ready and the global checks are validated afterwards, rolling the step back in the rare case one fails. Then
# the next step's forwards start on rank *r* at 3*m* + *r*·*F*, exactly when its previous step ends: consecutive
# parallelograms tile with **no bubble**. ZB-H1 could not do that: its rank *r* idles *p* − 1 − *r* inside its
# span (3, 2, 1, 0 below).

# %%
def zb_h2(p, m):
    """ZB-H2 by a greedy rule over unit-time actions: each free rank runs an I if one is ready, else a forward
    (keeping at most 2p - 1 microbatches whose W has not run), else a pending W."""
    orders, end = [[] for _ in range(p)], {}               # end[(rank, kind, microbatch)]: when it finished
    free_at, n_f, n_i, n_w, pending = [0] * p, [0] * p, [0] * p, [0] * p, [[] for _ in range(p)]
    t = 0
    while any(len(acts) < 3 * m for acts in orders):
        for r in range(p):
            if free_at[r] > t or len(orders[r]) == 3 * m:
                continue
            b, f = n_i[r], n_f[r]
            grad_in = (r + 1, "I", b) if r < p - 1 else (r, "F", b)        # what this rank's I of b waits for
            if b < f and end.get(grad_in, t + 1) <= t:
                kind, mb = "I", b
                n_i[r] += 1
                pending[r].append(b)
            elif f < m and f - n_w[r] < 2 * p - 1 and (r == 0 or end.get((r - 1, "F", f), t + 1) <= t):
                kind, mb = "F", f
                n_f[r] += 1
            elif pending[r]:
                kind, mb = "W", pending[r].pop(0)
                n_w[r] += 1
            else:
                continue
            end[r, kind, mb] = free_at[r] = t + 1
            orders[r].append(f"{r}{kind}{mb}")
        t += 1
    return orders


h2 = zb_h2(p, m)
validate(h2, p, m, stage_ranks)
results["ZB-H2"] = pv.simulate(None, "1F1B", m, costs=costs, num_stages=p, order=h2)
print(f"{'schedule':8} step  bubble  held (microbatches)     each rank: [first start, last end], idle inside")
spans = {}
for name, tl in results.items():
    spans[name] = [(min(e.start for e in tl.events if e.rank == r), max(e.end for e in tl.events if e.rank == r))
                   for r in range(p)]
    idle = [(b - a) - sum(e.end - e.start for e in tl.events if e.rank == r) for r, (a, b) in enumerate(spans[name])]
    print(f"{name:8} {tl.step_time:4.0f}  {tl.step_time - 3 * m:6.0f}  {[b / 2 for b in tl.peak_activation_bytes]}   "
          f"{spans[name]}, {idle}")
    spans[name, "idle"] = idle
assert results["ZB-H2"].step_time - 3 * m == (p - 1) * 1                   # the (p - 1) F the boundary leaves
assert spans["ZB-H2"] == [(r, 3 * m + r) for r in range(p)]               # a parallelogram: rank r from r F ...
assert spans["ZB-H2", "idle"] == [0] * p                                   # ... with no gap inside
assert spans["ZB-H1", "idle"] == [p - 1 - r for r in range(p)]           # ZB-H1: rank r idles p-1-r inside
held_h2 = [b / 2 for b in results["ZB-H2"].peak_activation_bytes]
assert held_h2 == [2 * p - 1 - r for r in range(p)]                        # [7, 6, 5, 4]: 2p - 1 on rank 0
assert held_h2[0] / results["1F1B"].peak_activation_bytes[0] * 2 == (2 * p - 1) / p   # 7/4 of 1F1B's peak
pv.timeline_figure(results["ZB-H2"])

# %% [markdown]
# ZB-H2's price is memory: rank 0 holds 2*p* − 1 = 7 microbatches, (2*p* − 1)/*p* = 7/4 of 1F1B's peak, each later
# rank one less ([7, 6, 5, 4]); and a runtime that steps without a global synchronisation, which neither torch's
# schedules nor pipeviz's simulator provide (both keep the synchronous boundary, so the (*p* − 1)·*F* stays in the
# measured step). ZB-V (lesson 5) keeps 1F1B's memory, at the price of two stages per rank (and twice the pipeline
# traffic); **with optimizer post-validation** it too reaches the bubble-free step ZB-H2 does, as Qi et al.
# report. Without it, as here, neither does: each leaves its fill-up, ZB-H2 (*p* − 1)·*F* = 3 and ZB-V (*p* −
# 1)·*F*/2 = 1.5, its stages being half a rank's work (the cell below, on the same costs).

# %%
zbv = pv.simulate(None, "ZBVZeroBubble", m, costs=pv.Costs.uniform(2 * p, forward=0.5, backward=1.0,
                                                                      activation_bytes=1), num_stages=2 * p)
print(f"ZB-V, same work per rank: bubble time {zbv.step_time - 3 * m:.1f}, "
      f"activations held {[b / 2 for b in zbv.peak_activation_bytes]}   "
      f"(ZB-H2: {results['ZB-H2'].step_time - 3 * m:.0f}, {held_h2})")
assert results["ZB-H2"].step_time - 3 * m == (p - 1) * 1 and zbv.step_time - 3 * m == (p - 1) * 0.5
assert [b / 2 for b in zbv.peak_activation_bytes] == [p] * p == [results["1F1B"].peak_activation_bytes[0] / 2] * p

# %% [markdown]
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
    print(f"rank {rank}:", " ".join(map(str, measured.order(rank, step=1))))
    assert measured.order(rank, step=1) == pv.schedule.orders("InterleavedZeroBubble", 2, 4, 1)[rank]
numerics = pv.check_numerics(run)
print(numerics)
assert numerics.ok
pv.TimelineView(run)

# %% [markdown]
# ## Let a search write it: `pv.synthesize_schedule`
#
# ZB-H1 and ZB-H2 are rules people wrote for one setting (*F* = *I* = *W*, a given memory). `pv.synthesize_schedule(
# plan, config, memory_limit)` searches for the order instead. A **list scheduler** plays the ranks forward in time,
# as the simulator does; whenever a rank is free it picks, among the actions whose inputs have arrived, by a rule:
# backward first, a `W` deferred until it falls due or fills a gap, a new microbatch admitted only while the memory
# rule leaves room for it. A grid of such rules (looped and V-shaped placements where there are 2 stages per rank),
# refined rank by rank, is played by the simulator's own rules; torch's own orders join the pool; the fastest
# candidate that fits the limit and that `pv.simulate` accepts (its sends and receives played for deadlock, as torch's
# runtime will issue them) wins. So the answer is never slower than a torch schedule that fits, and it exists
# whenever any order fits (the error names the least limit that does). The same textbook costs as above, for limits
# from 1F1B's peak (4 microbatches) down:

# %%
cfg = pv.LaunchConfig(schedule="1F1B", microbatches=m)     # the schedule only places the stages: one per rank
synthesized = {}
print("limit (microbatches)  step  bubble  held per rank")
for held in (4, 3.5, 3, 2):
    syn = pv.synthesize_schedule(None, cfg, memory_limit=2 * held, costs=costs)   # 2 units per microbatch
    synthesized[held] = syn
    print(f"{held:20}  {syn.step_time:4.0f}  {syn.step_time - 3 * m:6.0f}  "
          f"{[b / 2 for b in syn.timeline.peak_activation_bytes]}")
assert synthesized[4].step_time == results["ZB-H1"].step_time == 3 * m + (p - 1)  # ZB-H1's step: the bound
assert all(max(s.timeline.peak_activation_bytes) <= 2 * held for held, s in synthesized.items())
assert synthesized[3].step_time < results["1F1B"].step_time       # less memory than 1F1B, and still faster
try:
    pv.synthesize_schedule(None, cfg, memory_limit=1, costs=costs)
except ScheduleError as err:
    print(err)                                                    # the least limit any order fits: 1 microbatch
    assert err.smallest == 2
pv.timeline_figure(synthesized[3].timeline)

# %% [markdown]
# At 1F1B's memory the search lands on ZB-H1's step, which is the bound here: rank 3 cannot start before 3
# forwards have passed, then has 3*m* of work. Below it there is no torch schedule at all (1F1B already holds 4
# microbatches on rank 0), yet the search still finds orders: 31 at 3 microbatches, 2 below 1F1B's 33. The figure
# shows the 3-microbatch order: rank 0 warms up with 3 forwards instead of 4 and runs each backward in two halves
# where the memory allows.
#
# Where the costs are not the textbook's, the hand-written rules stop being optimal. Make the weight-grad pass the
# cheap half (*I* = 1.5, *W* = 0.5, as when the input gradient also recomputes something): ZB-H1's bubble grows to
# (*p* − 1)·(*F* + *I* − *W*) = 6, and ZB-H2's rule, with 7 microbatches on rank 0, reaches 28.5. The search, given
# each schedule's memory as its limit:

# %%
import dataclasses

cheap_w = dataclasses.replace(costs, weight_fraction=0.25)       # a backward of 2: I = 1.5, W = 0.5
by_hand = {name: pv.simulate(None, "1F1B", m, costs=cheap_w, num_stages=p, order=order)
           for name, order in (("1F1B", mine), ("ZB-H1", h1), ("ZB-H2", h2))}
print("schedule  its step  its memory   synthesized within that memory")
for name, tl in by_hand.items():
    limit = max(tl.peak_activation_bytes)
    syn = pv.synthesize_schedule(None, cfg, memory_limit=limit, costs=cheap_w)
    print(f"{name:8}  {tl.step_time:8.1f}  {limit / 2:10.1f}   {syn.step_time:.1f}")
    assert syn.step_time <= tl.step_time
assert by_hand["ZB-H1"].step_time == 3 * m + (p - 1) * (1 + 1.5 - 0.5)
assert pv.synthesize_schedule(None, cfg, memory_limit=14, costs=cheap_w).step_time < by_hand["ZB-H2"].step_time

# %% [markdown]
# ### A wider search: V-Min's memory
#
# V-shaped placements (2 stages per rank, as ZBVZeroBubble) have their own known points (Qi et al. 2024,
# "Pipeline Parallelism with Controllable Memory"): at V-Min's memory, (*p* + 4)//3 microbatches of a rank's
# activations (a third of 1F1B's *p*), about 2/3 of 1F1B's bubble. `pv.synthesize_schedule`'s interactive grid does
# not get there on 4 ranks; `Search(problem).widen(restarts, seed)` (local searches from random rules: each rank its
# own number of pending `W` and of microbatches in flight, forward or backward first) does, in a second or two:

# %%
from pipeviz.planner.list_schedule import Search, build_problem
from pipeviz.schedule import traits

vp, vm = 4, 8                                                   # 4 ranks, 8 stages in a V, 8 microbatches
v_units = (vp + 4) // 3                                         # V-Min's memory: 2 microbatches of a rank
v_costs = pv.Costs.uniform(2 * vp, forward=0.5, backward=1.0, activation_bytes=1)   # F = I = W = 0.5 per chunk
v_cfg = pv.LaunchConfig(schedule="ZBVZeroBubble", microbatches=vm)
grid = pv.synthesize_schedule(None, v_cfg, memory_limit=2 * v_units, costs=v_costs, placement="v")
problem = build_problem(v_costs, traits.layout("ZBVZeroBubble", 2 * vp, 2), "v", vm, 2 * v_units, True, 0)
wide = Search(problem).widen(40, seed=2)[0]
print(f"bubble at V-Min's memory: the grid {grid.step_time - 3 * vm:g}, the widened search {wide.step - 3 * vm:g}; "
      f"1F1B's {3 * (vp - 1)} with twice the memory, V-Min's about {2 * (vp - 1)}")
assert wide.step - 3 * vm <= 2 * (vp - 1) < grid.step_time - 3 * vm

# %% [markdown]
# ### On a real plan, launched
#
# On the two-stage MLP above, with the limit set to 1F1B's peak memory (weights, gradients, Adam's state and the
# activations, as `pv.simulate` counts them): `syn.table()` puts the synthesized order beside every torch schedule on
# the same 2 ranks, `syn.config` is the launch configuration with `order=syn.order`, and `syn.to_csv(path)` writes
# torch's schedule CSV (one row per rank, torchtitan's `pipeline_parallel_schedule_csv` reads it). The run trains
# exactly as the unsplit model and runs the order action for action:

# %%
import tempfile
from pathlib import Path

launch_cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=2, loss_fn=F.cross_entropy)
limit = max(pv.simulate(plan, launch_cfg).meta["memory_bytes"])             # 1F1B's peak on these 2 ranks
syn = pv.synthesize_schedule(plan, launch_cfg, memory_limit=limit)
print(syn.table())
# (chosen by its step with each receive charged where torch's runtime posts it: the "as posted" column)
assert all(syn.charged_step <= syn.charged_baselines[name] for name in syn.fits)
run = pv.launch(plan, syn.config, inputs=(x,), target=y)
assert run.wait(180) == "done", run.error
for rank in range(2):
    assert run.timeline().order(rank, step=1) == list(syn.order[rank])
numerics = pv.check_numerics(run)
print(numerics)
assert numerics.ok
csv_path = syn.to_csv(Path(tempfile.mkdtemp()) / "schedule.csv")
print(csv_path.read_text().splitlines()[0])                     # rank 0's row, as torch's _load_csv reads it

# %% [markdown]
# ## Exercise: the memory ZB-H2's speed needs
#
# With the cheap weight-grad pass (`cheap_w`), ZB-H2's rule takes 28.5 and holds 7 microbatches on rank 0. What is
# the **least memory limit**, in microbatches of activations per rank (a multiple of 0.5), at which
# `pv.synthesize_schedule(None, cfg, memory_limit=2 * held, costs=cheap_w)` finds an order **at least as fast**
# (a step of at most 28.5)? Set `my_limit`; the check scans the limits itself.

# %%
my_limit = None  # your answer here: microbatches, e.g. 7.0


# %%
def check_limit(answer):
    """The least limit (a multiple of 0.5 microbatches) at which the search matches ZB-H2's step with W cheap."""
    target = by_hand["ZB-H2"].step_time
    steps = {}
    for k in range(2, 15):
        try:
            steps[k / 2] = pv.synthesize_schedule(None, cfg, memory_limit=k, costs=cheap_w).step_time
        except ScheduleError:
            continue
    least = min(held for held, step in steps.items() if step <= target)
    assert 4 < least < 7    # more than ZB-H1's memory buys, less than ZB-H2's rule holds
    if answer is None:
        print("❌ Not yet: set my_limit above. Hint: try limits from 4 microbatches up, in steps of half a microbatch.")
    elif answer not in steps:
        print(f"❌ Not yet: a multiple of 0.5 between 1 and 7, please; got {answer!r}.")
    elif steps[answer] > target:
        print(f"❌ Not yet: at {answer} microbatches the search takes {steps[answer]:g}, above ZB-H2's {target:g}.")
    elif answer > least:
        print(f"❌ Not yet: {answer} is enough, but less memory is too.")
    else:
        print(f"✅ Correct: {least} microbatches reach {steps[least]:g}, where ZB-H2's rule holds 7 for {target:g}.")


check_limit(my_limit)

# %% [markdown]
# ## Exercise
#
# Write **ZB-H1 for p = 3 stages and m = 4 microbatches** by hand, as a list of three lists of actions (rank 0's
# first), without calling `zb_h1`: start from 1F1B's order (`pv.schedule.orders("1F1B", 3, 4)`), put an `I` where
# each `B` was, and **place each `W`** so that the step keeps ZB-H1's bubble, (*p* − 1)·1 = 2 with *F* = *I* = *W* =
# 1 (1F1B's is 6), and **no rank ever holds more than 1F1B's peak**, 3 microbatches (a forward adds one, an `I`
# and a `W` free half each). Set `my_answer` to it; the check validates it and plays it with `simulate(order=...)`.

# %%
my_answer = None  # your answer here: [["0F0", ...], ["1F0", ...], ["2F0", ...]]


# %%
def check(answer):
    """Your order, played on F = I = W = 1: valid, no deadlock, ZB-H1's bubble of 2, and no rank above 1F1B's peak."""
    costs = pv.Costs.uniform(3, activation_bytes=2)
    plain = pv.simulate(None, "1F1B", 4, costs=costs, num_stages=3)
    limit = plain.peak_activation_bytes[0] / 2                                 # 1F1B's rank 0: 3 microbatches
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: rank r may keep r weight-grad passes pending.")
        return
    if not (isinstance(answer, list) and len(answer) == 3 and all(isinstance(a, list) for a in answer)):
        print("❌ Not yet: my_answer should be a list of 3 lists of actions such as '0F0', '0I0', '0W0'.")
        return
    if any("B" in action for acts in answer for action in acts):
        print("❌ Not yet: split every backward: an I where 1F1B runs B, and a W somewhere after it.")
        return
    try:
        validate(answer, 3, 4, (0, 1, 2))
        tl = pv.simulate(None, "1F1B", 4, costs=costs, num_stages=3, order=answer)
    except (ScheduleError, ValueError) as err:
        print(f"❌ Not yet: {err}")
        return
    bubble, held = tl.step_time - 3 * 4, [b / 2 for b in tl.peak_activation_bytes]
    if bubble > 2 + 1e-9:
        print(f"❌ Not yet: a bubble of {bubble:g} (ZB-H1's is 2). Hint: the last ranks finish their I passes first; "
              "let them keep W passes for the end, where they would otherwise wait.")
    elif max(held) > limit + 1e-9:
        print(f"❌ Not yet: the bubble is 2, but the ranks hold {held} microbatches, above 1F1B's {limit:g}. Hint: "
              "run a W that falls due before the rank's next forward.")
    else:
        print(f"✅ Correct: bubble 2 (1F1B: {plain.step_time - 12:g}), at most {max(held):g} microbatches held "
              f"({held}): ZB-H1 at 1F1B's peak.")


check(my_answer)
