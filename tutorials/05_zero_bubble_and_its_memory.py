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
# # Lesson 5 · Zero bubble and its memory price
#
# **You will learn:** what each bubble-shrinking schedule costs in activation memory — interleaving's factor
# 1 + (*p* − 1)/(*p*·*v*), breadth-first's memory growing with *m*, ZB-V's flat and balanced memory — what is left
# of the bubble under "zero bubble", and why, under the simulator's assumptions (a dense model, free
# communication), DualPipeV brings nothing, and what DualPipe's own bubble formula says; on the simulator and on
# real runs.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese); the
# [schedules cheat sheet](../docs/schedules.md) (every schedule's bubble, memory and traffic on one page).
#
# **Lessons:** ← [Lesson 4 · Interleaving and zero bubble](04_interleaving_and_zero_bubble.ipynb) ·
# [Lesson 6 · Write your own schedule](06_custom_schedules.ipynb) →
#
# Lesson 4 measured bubbles in time only. Every schedule also decides **how many microbatches' activations each
# rank keeps alive at once** (lesson 3: GPipe all *m*, 1F1B at most *p* on rank 0): a forward adds a microbatch's
# activations, its backward frees them. Split backwards free in two steps: the input-grad pass `I` frees part
# (we count half), the weight-grad pass `W` the rest — postponing `W` keeps memory alive longer.
#
# The units: **one microbatch's activations for a rank's whole share of the model**. A rank holding *v* stages of
# a *v*·*p*-stage model keeps 1/*v* of that per stage and microbatch.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

p = 4  # ranks
SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4), ("LoopedBFS", 2),
             ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2))


def textbook(schedule, v, m):
    """p ranks, each with per-microbatch work F = 1, B = 2 (I = W = 1) and 12 units of activations, cut into v
    stages; free communication."""
    costs = pv.Costs.uniform(p * v, forward=1 / v, backward=2 / v, activation_bytes=12 // v)
    return pv.simulate(None, schedule, m, costs=costs, num_stages=p * v, stages_per_rank=None if v == 1 else v)


rows = {}
print(f"{'schedule':22} v    m   bubble time   activations held per rank (microbatches)")
for schedule, v in SCHEDULES:
    for m in (8, 16, 32):
        tl = textbook(schedule, v, m)
        held = [b / 12 for b in tl.peak_activation_bytes]
        rows[schedule, v, m] = (tl.step_time - 3 * m, held)
        print(f"{schedule:22} {v}  {m:3}   {tl.step_time - 3 * m:8.2f}      {held}")

# %% [markdown]
# ## What the table says (each claim asserted below)
#
# - **1F1B** holds *p* − *r* microbatches on rank *r*: rank 0 is the bottleneck, with *p*.
# - **Interleaved1F1B** (depth-first: each microbatch runs through a rank's chunks as early as possible) divides
#   the bubble time by *v* but holds *more* on rank 0: *p*·(1 + (*p* − 1)/(*p*·*v*)) microbatches — its warm-up
#   runs extra forwards of the later chunks (the factor 1 + (*p* − 1)/(*p*·*v*) is Korthikanti et al. 2022,
#   *Reducing Activation Recomputation in Large Transformer Models*, §4.2.3).
# - **LoopedBFS** (breadth-first: every microbatch through chunk 0, then every one through chunk 1) has the same
#   bubble as interleaving but holds **all *m*** microbatches, like GPipe: its memory grows with *m*.
# - **ZBVZeroBubble** leaves a bubble of (*p* − 1)·*F*, with *F* the forward of one stage (here 1/2): the first
#   microbatch must travel down the V before any backward exists, and no weight-grad pass can fill that fill-up.
#   Its memory is **flat in *m***, **equal on every rank** and at **1F1B's rank-0 level, *p***: the V gives rank 0
#   the last stage, whose backward frees memory early, and rank *p* − 1 the middle.
# - **InterleavedZeroBubble** reaches the same bubble with a 1F1B-like memory slope (rank 0 holds *p*, each
#   later rank less).
# - **DualPipeV** (the "cut-in-half" V-shaped variant of DualPipe in DeepSeek's DualPipe repository, credited there
#   to Sea AI Lab; DeepSeek-V3 itself describes bidirectional DualPipe, which holds two copies of the parameters)
#   has ZB-V's bubble here and holds slightly more (more than *p*, at most a quarter more, on every rank). Its
#   point is elsewhere: it runs the forward of one microbatch and the backward of another *together*, so that a
#   mixture-of-experts model's all-to-all communication of one hides behind the other's compute. A dense model
#   with free communication has nothing to hide, so the simulator shows no gain.

# %%
for m in (8, 16, 32):
    bubble, held = rows["1F1B", 1, m]
    assert held == [p - r for r in range(p)]
    for v in (2, 4):
        bubble_i, held_i = rows["Interleaved1F1B", v, m]
        assert abs(bubble_i - bubble / v) < 1e-9                       # bubble time / v
        assert abs(held_i[0] - p * (1 + (p - 1) / (p * v))) < 1e-9     # memory factor 1 + (p-1)/(pv)
    bubble_l, held_l = rows["LoopedBFS", 2, m]
    assert held_l == [m] * p                                           # breadth-first: all m ...
    assert abs(bubble_l - rows["Interleaved1F1B", 2, m][0]) < 1e-9     # ... with interleaving's bubble
    bubble_z, held_z = rows["ZBVZeroBubble", 2, m]
    assert abs(bubble_z - (p - 1) * 0.5) < 1e-9                         # (p - 1) F, F = one stage's forward
    assert held_z == [p] * p                                           # flat in m, balanced, 1F1B's rank 0
    bubble_iz, held_iz = rows["InterleavedZeroBubble", 2, m]
    assert abs(bubble_iz - bubble_z) < 1e-9                            # ZB-V's bubble ...
    assert held_iz[0] == p and all(held_iz[r] > held_iz[r + 1] for r in range(p - 1))   # ... falling like 1F1B's
    bubble_d, held_d = rows["DualPipeV", 2, m]
    assert abs(bubble_d - bubble_z) < 1e-9                             # no gain here ...
    assert all(p < h <= 1.25 * p for h in held_d)                      # ... and slightly more memory (4.5 vs 4)
print("all claims hold for m = 8, 16, 32")

# %% [markdown]
# ## What the textbook numbers leave out
#
# - **ZB-V's (*p* − 1)·*F*.** The fill stays above because every step here ends in a synchronisation: the optimizer
#   waits for every gradient. Qi et al. report ZB-V (and ZB-H2) with almost no bubble because of *optimizer
#   post-validation*: each rank steps at once and the global checks (the gradient norm, NaNs) are validated
#   afterwards, rolling back in the rare case they fail, so the next step's forwards need not wait at the boundary
#   and fill it. torch's schedules and pipeviz's simulator keep the synchronous boundary, so the (*p* − 1)·*F*
#   remains.
# - **ZB-V sends twice the messages.** Its V of 2*p* stages crosses from one rank to another 2(*p* − 1) times per
#   microbatch each way, 1F1B's *p* stages *p* − 1 times: twice the pipeline traffic, which the free links above
#   hide. Priced at *F*/4 per hand-off below, both steps grow; ZB-V keeps the smaller bubble here, but on slow or
#   shared links its doubled traffic is what to weigh.
# - **"I frees half" is a toy.** In a transformer layer the weight-grad pass needs most of what the backward keeps:
#   per layer the backward holds *M*<sub>B</sub> ≈ 34*sbh* + 5*as*²*b* bytes and the weight-grad pass alone
#   *M*<sub>W</sub> ≈ 32*sbh* (Qi et al., §3), so an input-grad pass frees little. Replayed with `I` freeing 1/17
#   of a stage's activations (`Costs.input_freed`), the conclusions above survive: ZB-V still holds 1F1B's rank 0
#   on every rank, flat in *m*, and InterleavedZeroBubble's rank 0 holds no more.

# %%
import dataclasses


def variant(schedule, v, m, **changes):
    """``textbook`` with some of its costs changed (``pv.Costs`` fields)."""
    costs = dataclasses.replace(pv.Costs.uniform(p * v, forward=1 / v, backward=2 / v, activation_bytes=12 // v),
                                **changes)
    return pv.simulate(None, schedule, m, costs=costs, num_stages=p * v, stages_per_rank=None if v == 1 else v)


m = 8
for schedule, v in (("1F1B", 1), ("ZBVZeroBubble", 2)):
    tl = textbook(schedule, v, m)
    rank_of = {e.stage: e.rank for e in tl.events}
    crossings = sum(rank_of[s] != rank_of[s + 1] for s in range(p * v - 1))
    priced = variant(schedule, v, m, comm=(0.25,) * (p * v - 1))
    print(f"{schedule:14} rank crossings per microbatch each way: {crossings}   bubble time free links "
          f"{tl.step_time - 3 * m:5.2f}, at F/4 per hand-off {priced.step_time - 3 * m:5.2f}")
    rows[schedule, "crossings"] = crossings
    rows[schedule, "priced"] = priced.step_time - 3 * m
assert rows["ZBVZeroBubble", "crossings"] == 2 * rows["1F1B", "crossings"] == 2 * (p - 1)
assert rows["ZBVZeroBubble", "priced"] > rows["ZBVZeroBubble", 2, m][0]      # its hand-offs cost
assert rows["ZBVZeroBubble", "priced"] < rows["1F1B", "priced"]              # still the smaller bubble here
for m in (8, 16):
    freed = {s: [b / 12 for b in variant(s, 2, m, input_freed=(1 / 17,) * (2 * p)).peak_activation_bytes]
             for s in ("ZBVZeroBubble", "InterleavedZeroBubble")}
    print(f"m = {m}, I frees 1/17:", {s: [round(x, 2) for x in h] for s, h in freed.items()})
    assert freed["ZBVZeroBubble"] == [p] * p and freed["InterleavedZeroBubble"][0] == p

# %% [markdown]
# ## DualPipe and DualPipeV: the formula and the simulation
#
# DeepSeek-V3's **DualPipe** is bidirectional: every device holds two stages, *i* and *PP* − 1 − *i*, so the
# model's parameters twice (2×), and microbatches enter from both ends at once; it pairs one microbatch's forward
# chunk with another's backward chunk so that each one's communication (a mixture-of-experts model's all-to-all)
# hides behind the other's compute. **DualPipeV** is the "cut-in-half" variant in DeepSeek's DualPipe repository,
# credited there to Sea AI Lab: fold DualPipe's two directions into one V, *PP* stages on *PP*/2 devices, one copy
# of the parameters. The repository gives both the same bubble, counted on the same *PP* stages:
#
# (*PP*/2 − 1)·(*F*&*B* + *B* − 3*W*), against 1F1B's (*PP* − 1)·(*F* + *B*) and ZB-H1's (*PP* − 1)·(*F* + *B* − 2*W*),
#
# with *F*, *B*, *W* one chunk's forward, full backward and weight-grad pass and *F*&*B* an overlapped forward and
# backward pair: between *B* (the forward hidden entirely) and *F* + *B* (no overlap). On this lesson's numbers:
#
# - *p* = 4 devices with one stage each (*F* = 1, *B* = 2, *W* = 1): 1F1B 9, ZB-H1 3 (both simulated, below);
#   DualPipe on those 4 devices, *PP* = 4: (1)·(*F*&*B* − 1), **1 to 2** — the formula only: pipeviz cannot
#   simulate DualPipe (two copies of each stage and microbatches entering at both ends; torch ships no such
#   schedule either).
# - DualPipeV on the same 4 devices, *PP* = 8 chunks of half a stage (*F* = ½, *B* = 1, *W* = ½): (3)·(*F*&*B* −
#   ½), **1.5 to 3**. pipeviz simulates torch's `ScheduleDualPipeV` order, one action at a time per rank (no
#   overlap, no all-to-all), and finds **1.5**, the bottom of that range, as ZB-V. What it cannot show is what
#   DualPipeV is for: the forward-backward overlap hiding a mixture-of-experts model's all-to-all.

# %%
m = 8
formula = {"1F1B": (p - 1) * (1 + 2), "ZB-H1": (p - 1) * (1 + 2 - 2 * 1),
           "DualPipe": [(p // 2 - 1) * (fb + 2 - 3 * 1) for fb in (2, 3)],              # F&B from B to F + B
           "DualPipeV": [(2 * p // 2 - 1) * (fb + 1 - 3 * 0.5) for fb in (1, 1.5)]}      # PP = 2p chunks
simulated = {"1F1B": rows["1F1B", 1, m][0],
             "ZB-H1": pv.simulate(None, "InterleavedZeroBubble", m, costs=pv.Costs.uniform(p, activation_bytes=12),
                                  num_stages=p, stages_per_rank=1).step_time - 3 * m,   # lesson 6: ZB-H1's bubble
             "DualPipe": None, "DualPipeV": rows["DualPipeV", 2, m][0]}
for name, value in formula.items():
    shown = "not simulated" if simulated[name] is None else f"{simulated[name]:g}"
    print(f"{name:10} formula {value!s:12} simulated bubble time {shown}")
assert simulated["1F1B"] == formula["1F1B"] == 9 and simulated["ZB-H1"] == formula["ZB-H1"] == 3
assert formula["DualPipe"] == [1, 2] and formula["DualPipeV"] == [1.5, 3]
assert simulated["DualPipeV"] == formula["DualPipeV"][0] == rows["ZBVZeroBubble", 2, m][0]

# %%
pv.timeline_figure(textbook("ZBVZeroBubble", 2, 8))

# %% [markdown]
# ## On real runs
#
# A small model, 4 stages on **2 processes** (ZB-V, interleaving and LoopedBFS hold 2 stages per rank) or 2
# stages (1F1B), with 4 and 8 microbatches. pipeviz records the order in which each process really ran its actions;
# replaying it with the rule above (`F` +1, `B` −1, `I` and `W` −½ each, per stage divided by the stages a rank
# holds) counts the activations the order that really ran requires each rank to keep. (This counts microbatches,
# not bytes, and assumes a runtime frees each microbatch's tensors as soon as the order allows; what the
# processes really keep, the tensors saved for backward, is `run.activation_memory`.)

# %%
def held_by(order, stages_per_rank):
    """Most microbatches' activations alive at once, replaying one rank's actions (0F3, 1I0, 1W0)."""
    alive = peak = 0.0
    for action in order:
        alive += {"F": 1.0, "B": -1.0, "I": -0.5, "W": -0.5}[action.kind] / stages_per_rank
        peak = max(peak, alive)
    return peak


torch.manual_seed(0)
model = MyNetwork(256, [256] * 7)          # layer0 .. layer6, output_proj
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
graph = pv.trace(model, example_args=(x,))
plans = {1: pv.balance(graph, num_stages=2), 2: pv.balance(graph, num_stages=4)}

real, kept, predicted = {}, {}, {}
for schedule, v, m in (("1F1B", 1, 4), ("Interleaved1F1B", 2, 4), ("LoopedBFS", 2, 4), ("LoopedBFS", 2, 8),
                       ("ZBVZeroBubble", 2, 4), ("ZBVZeroBubble", 2, 8)):
    run = pv.launch(plans[v], schedule=schedule, microbatches=m, steps=2, inputs=(x,), target=y,
                    loss_fn=F.cross_entropy)
    assert run.wait(180) == "done", run.error
    tl, sim = run.timeline(), pv.simulate(plans[v], schedule, microbatches=m)
    orders = [tl.order(rank, step=1) for rank in range(2)]
    assert orders == [sim.order(rank) for rank in range(2)]           # the processes ran the simulated order
    real[schedule, m] = [held_by(order, v) for order in orders]
    kept[schedule, m] = [max(b for _, b in run.activation_memory[rank]) for rank in range(2)]  # bytes, measured
    predicted[schedule, m] = sim.peak_activation_bytes                                          # bytes, simulated
    print(f"{schedule:15} m = {m}: the order requires {real[schedule, m]}   measured step {tl.step_time * 1e3:6.1f} ms")

# %% [markdown]
# The orders the real processes ran require the same pattern, *p* = 2: 1F1B 2 and 1; interleaving 2·(1 + 1/4) =
# 2.5 on rank 0; LoopedBFS all *m* (4, then 8); ZB-V 2 on both ranks for 4 and for 8 microbatches.

# %%
assert real["1F1B", 4] == [2, 1]
assert real["Interleaved1F1B", 4][0] == 2 * (1 + 1 / 4)
assert real["LoopedBFS", 4] == [4, 4] and real["LoopedBFS", 8] == [8, 8]
assert real["ZBVZeroBubble", 4] == real["ZBVZeroBubble", 8] == [2, 2]
pv.TimelineView(run)

# %% [markdown]
# ## What the processes really kept
#
# `run.activation_memory` measures the tensors each process saved for backward. The batch is fixed (64 samples),
# so 8 microbatches are half the size of 4: an order that keeps 2 microbatches alive (ZB-V) should keep half the
# bytes at *m* = 8, one that keeps all of them (LoopedBFS) the same bytes. The simulator's peak
# (`peak_activation_bytes`, the bytes autograd saves, counted when the model was traced) stands beside each.

# %%
for schedule in ("LoopedBFS", "ZBVZeroBubble"):
    ratio = [b8 / b4 for b4, b8 in zip(kept[schedule, 4], kept[schedule, 8], strict=True)]
    required = [a8 / 2 / a4 for a4, a8 in zip(real[schedule, 4], real[schedule, 8], strict=True)]
    print(f"{schedule:14} peak bytes kept, m = 8 over m = 4, per rank: measured {[round(r, 2) for r in ratio]}"
          f"   the order requires {required}")
    for m in (4, 8):
        print(f"{'':14} m = {m}: measured {kept[schedule, m]} bytes, simulated {predicted[schedule, m]}")
looped = [b8 / b4 for b4, b8 in zip(kept["LoopedBFS", 4], kept["LoopedBFS", 8], strict=True)]
zbv = [b8 / b4 for b4, b8 in zip(kept["ZBVZeroBubble", 4], kept["ZBVZeroBubble", 8], strict=True)]
assert all(r > 0.9 for r in looped)      # every microbatch kept: the same bytes
assert all(r < 0.65 for r in zbv)        # two microbatches kept: half the bytes (plus what does not scale)
assert all(abs(sim / real_bytes - 1) < 0.1 for key in kept
           for sim, real_bytes in zip(predicted[key], kept[key], strict=True))

# %% [markdown]
# LoopedBFS keeps every microbatch, as its order requires; ZB-V about half at *m* = 8 of what it kept at *m* = 4:
# its flat memory is real, because the runtime frees each microbatch's saved tensors as its `W` pass finishes
# (pipeviz makes sure nothing holds them longer: torch 2.13 kept the last stage's output graph until the step
# ended). And every measured peak is within 10 % of the simulator's, which counts what autograd saves.
#
# ## The price, summed up
#
# Zero bubble is not free: ZB-V needs exactly two stages per rank in a V, weight-grad passes that keep part of
# each microbatch's activations alive until they run, a runtime that splits every backward in two (torch does,
# with `stage.backward_weight_one_chunk`), and **twice 1F1B's pipeline traffic**: its 2*p* stages cross between
# ranks 2(*p* − 1) times per microbatch each way, 1F1B's *p* stages *p* − 1 times, each message as big (the
# activation, or its gradient, at a boundary). What it buys is 1F1B's worst-rank memory on *every* rank with a
# bubble of only the fill-up. Interleaving pays with memory on the first ranks and (*vp* − 1)/(*p* − 1) ≥ *v*
# times 1F1B's messages; breadth-first pays with memory growing like GPipe's. Every schedule's bill, counted on
# the textbook timelines above (*p* = 4, *m* = 8; messages: a forward whose next stage is on another rank sends
# its output, a backward whose previous stage is sends its input gradient):

# %%
def messages_per_step(tl):
    """Activations and gradients sent from one rank to another in a simulated step (as lesson 4 counts them)."""
    rank_of = {e.stage: e.rank for e in tl.events}
    last = max(rank_of)
    return sum(1 for e in tl.events
               if (e.kind == "F" and e.stage < last and rank_of[e.stage + 1] != e.rank)
               or (e.kind in ("B", "I") and e.stage > 0 and rank_of[e.stage - 1] != e.rank))


m = 8
bill = {}
print(f"{'schedule':22} v   bubble time   most held on a rank   messages per step")
for schedule, v in SCHEDULES:
    tl = textbook(schedule, v, m)
    bill[schedule, v] = (rows[schedule, v, m][0], max(rows[schedule, v, m][1]), messages_per_step(tl))
    bubble, held, sent = bill[schedule, v]
    print(f"{schedule:22} {v}   {bubble:8.2f}      {held:12.2f}          {sent:5} "
          f"({sent / bill['1F1B', 1][2]:.2f}x 1F1B's)")
assert bill["1F1B", 1][2] == 2 * m * (p - 1) == 48                          # p - 1 crossings each way
assert bill["ZBVZeroBubble", 2][2] == 2 * m * 2 * (p - 1) == 2 * bill["1F1B", 1][2]   # ZB-V: twice 1F1B's traffic
assert all(bill[s, v][2] == 2 * m * (v * p - 1) >= v * bill["1F1B", 1][2]             # interleaving: (vp-1)/(p-1)
           for s, v in SCHEDULES if s in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"))

# %% [markdown]
# ## Exercise
#
# Choosing a schedule is choosing under a memory limit. Take a small transformer split in **2 stages**, trained
# with **8 microbatches**, and a device that holds only **15.5 MiB**: which schedule fits (every rank's peak
# memory at most the limit) with the **shortest step**? `pv.compare(plan4, microbatches=8)` simulates every
# schedule on the same 2 devices and gives each row's `schedule`, `step_time` and `memory_bytes` per rank. Set
# `my_answer` to the schedule's name.

# %%
from pipeviz.zoo import TinyTransformer

torch.manual_seed(0)
tiny = TinyTransformer(vocab=256, dim=128, heads=4, depth=4, seq=32)
plan4 = pv.balance(pv.trace(tiny, example_args=(torch.randint(0, 256, (64, 32)),)), num_stages=2)
LIMIT = 15.5 * 2**20
my_answer = None  # your answer here: a schedule name, e.g. "1F1B"


# %%
def check(answer):
    """The fastest schedule whose every rank fits in LIMIT, by pv.compare on plan4 with 8 microbatches."""
    table = pv.compare(plan4, microbatches=8)
    fits = [row for row in table.rows if max(row.memory_bytes) <= LIMIT]
    best = min(fits, key=lambda row: row.step_time)
    fastest = min(table.rows, key=lambda row: row.step_time)
    assert fastest.schedule != best.schedule          # the limit matters: the fastest overall does not fit
    names = {row.schedule: row for row in table.rows}
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: first drop every row whose largest per-rank memory exceeds "
              "the limit, then compare steps.")
    elif answer not in names:
        print(f"❌ Not yet: choose one of {sorted(names)}, got {answer!r}.")
    elif answer == best.schedule:
        print(f"✅ Correct: {best.schedule}, {best.step_time * 1e3:.1f} ms at {max(best.memory_bytes) / 2**20:.2f} "
              f"MiB; the fastest, {fastest.schedule}, needs {max(fastest.memory_bytes) / 2**20:.2f} MiB.")
    elif max(names[answer].memory_bytes) > LIMIT:
        print(f"❌ Not yet: {answer} needs {max(names[answer].memory_bytes) / 2**20:.2f} MiB on its fullest rank, "
              "above the limit.")
    else:
        print(f"❌ Not yet: {answer} fits but takes {names[answer].step_time * 1e3:.1f} ms; another schedule that "
              "fits is faster.")


check(my_answer)
