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
# # Lesson 8 · Choosing the number of microbatches
#
# **You will learn:** how to pick *m* when the global batch is fixed: more microbatches shrink the bubble and
# 1F1B's memory, but each microbatch gets smaller, so the hardware works less efficiently and every hand-off pays
# its latency more often. Measured on real sweeps, with a link-speed sweep in the simulator, and on an H100's roofline.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese); the
# [schedules cheat sheet](../docs/schedules.md) (every schedule's bubble, memory and traffic on one page).
#
# **Lessons:** ← [Lesson 7 · Balancing stages](07_balancing_stages.ipynb) ·
# [Lesson 9 · Inference pipelining](09_inference_pipelining.ipynb) →
#
# ## Three forces
#
# The optimizer wants a **global batch** of *B* samples per step; the pipeline cuts it into *m* microbatches of
# *B*/*m*.
#
# 1. **Bubble**: (*p* − 1)/(*m* + *p* − 1) (lesson 2) — falls with *m*.
# 2. **Memory**: under 1F1B rank 0 holds min(*m*, *p*) microbatches of *B*/*m* samples each, so its activations
#    *fall* like 1/*m* once *m* ≥ *p*; GPipe holds all *m*, i.e. the whole batch, whatever *m* is.
# 3. **Efficiency**: a microbatch of a few samples leaves a GPU's (or a CPU's) arithmetic units idle, and each
#    of the *m* hand-offs between stages pays the link's latency. Both grow with *m*.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import itertools

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

torch.manual_seed(0)
BATCH = 128
model = MyNetwork(512, [512] * 5)        # layer0 .. layer4, output_proj
x, y = torch.randn(BATCH, 512), torch.randint(0, 10, (BATCH,))
plan = pv.balance(pv.trace(model, example_args=(x,)), num_stages=2)
print(plan)

# %% [markdown]
# ## Bubble and memory, simulated
#
# The simulator's costs here come from FLOPs: a microbatch half the size takes half the time, exactly. That is the
# ideal hardware, where only the bubble and the hand-offs matter.

# %%
MS = (2, 4, 8, 16, 32, 64)
print("  m   bubble   1F1B rank-0 activations   GPipe rank-0 activations")
sims = {}
for m in MS:
    one, gpipe = pv.simulate(plan, "1F1B", m), pv.simulate(plan, "GPipe", m)
    sims[m] = one
    print(f"{m:3}   {one.bubble_fraction:5.0%}    {one.peak_activation_bytes[0] / 2**10:8.0f} KiB"
          f"              {gpipe.peak_activation_bytes[0] / 2**10:8.0f} KiB")
    assert gpipe.peak_activation_bytes[0] == pv.simulate(plan, "GPipe", MS[0]).peak_activation_bytes[0]  # flat
for a, b in itertools.pairwise(MS):
    assert sims[b].peak_activation_bytes[0] < sims[a].peak_activation_bytes[0]   # 1F1B: falls like 1/m

# %% [markdown]
# ### Another memory knob: activation recomputation
#
# When even 1F1B's activations do not fit, a stage can keep only each layer's *input* and run the layer's forward
# again during the backward (GPipe's paper does this; `torch.utils.checkpoint`). `pv.simulate(...,
# recompute="full")` prices it: a longer backward, and the activations the layers save for their backward (what
# the simulator counts, as a run's memory meter does) replaced by their inputs. (Simulated only: `pv.launch` runs
# the stages as traced, without recomputation.)
#
# What that buys depends on the layer. A Linear + ReLU block, like the model above, saves little more than its
# input (the Linear needs it for its weight gradient; the ReLU's output is the next block's input): recomputing it
# would cost time for no memory. A transformer block saves many times its input (attention's inputs and output,
# the MLP's 4x-wide hidden activations, the norms'):

# %%
from pipeviz.zoo import TinyTransformer

kept = {}
for name, p in (("MLP (above)", plan),
                ("transformer", pv.balance(pv.trace(TinyTransformer(vocab=256, dim=128, heads=4, depth=4, seq=32),
                                                    example_args=(torch.randint(0, 256, (64, 32)),)), 2))):
    plain, recomputed = pv.simulate(p, "1F1B", 8), pv.simulate(p, "1F1B", 8, recompute="full")
    kept[name] = [r / a for r, a in zip(recomputed.peak_activation_bytes, plain.peak_activation_bytes, strict=True)]
    print(f"{name:12} 1F1B, m = 8: peak activations {[b // 2**10 for b in plain.peak_activation_bytes]} KiB -> "
          f"{[b // 2**10 for b in recomputed.peak_activation_bytes]} KiB with recomputation "
          f"({[f'{x:.0%}' for x in kept[name]]}); step {plain.step_time * 1e3:.1f} -> "
          f"{recomputed.step_time * 1e3:.1f} ms")
    assert recomputed.step_time > plain.step_time      # the price: every backward runs the forward again
assert all(x > 0.7 for x in kept["MLP (above)"])        # next to nothing saved (the rebuilt layer can even add)
assert all(x < 0.2 for x in kept["transformer"])        # a fifth or less

# %% [markdown]
# ## The cost of communication
#
# Every microbatch crosses each boundary twice (its activation forward, its gradient back): 2·*m* messages per
# boundary and step, each costing latency + bytes/bandwidth. `pv.simulate` takes the link's `bandwidth` (bytes/s)
# and `latency` (s). On a slow link the per-message latency soon outweighs the shrinking bubble:

# %%
LINKS = {"default (gloo, local)": {}, "1 GB/s, 0.1 ms": {"bandwidth": 1e9, "latency": 1e-4},
         "100 MB/s, 1 ms": {"bandwidth": 1e8, "latency": 1e-3}}
best = {}
for name, link in LINKS.items():
    steps = {m: pv.simulate(plan, "1F1B", m, **link).step_time for m in MS}
    best[name] = min(steps, key=steps.get)
    print(f"{name:22}", "  ".join(f"m={m}: {t * 1e3:5.1f} ms" for m, t in steps.items()), f"  best m = {best[name]}")
assert best["100 MB/s, 1 ms"] < best["1 GB/s, 0.1 ms"]   # slower links want fewer, larger microbatches

# %% [markdown]
# ## A real sweep
#
# The same global batch on two real processes, with 2, 8 and 32 microbatches (64, 16 and 4 samples each). Besides
# the step we add up the time the ranks spent computing: the same samples and the same arithmetic every time, so
# any growth is lost efficiency.

# %%
real = {}
for m in (2, 8, 32):
    run = pv.launch(plan, "1F1B", microbatches=m, steps=3, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(180) == "done", run.error
    tl = run.timeline()
    compute = sorted(sum(e.duration for e in tl.step_events(s) if e.kind in ("F", "B")) for s in tl.steps[1:])
    real[m] = (tl.step_time, compute[len(compute) // 2])
    print(f"m = {m:2} ({BATCH // m:3} samples each): step {tl.step_time * 1e3:6.1f} ms   "
          f"compute {real[m][1] * 1e3:6.1f} ms   bubble {tl.bubble_fraction:4.0%}   "
          f"(simulated from FLOPs: {sims[m].step_time * 1e3:5.1f} ms)")
# What the text claims: the same work costs more in small pieces, and so many microbatches lose on the real step.
assert real[32][1] > 1.5 * real[2][1], real
assert real[32][0] > min(real[2][0], real[8][0]), real

# %% [markdown]
# On the real runs the computing time grows as the microbatches shrink (the cell asserts more than 1.5× from 64 to
# 4 samples): each operation has a fixed cost that a small microbatch cannot hide. The simulator from FLOPs does
# not know that; `pv.profile` at the microbatch size you plan to use (lesson 7) does. With 32 microbatches the real
# step is longer than with fewer, although the bubble formula keeps improving.
#
# ## On a GPU: small microbatches fall off the roofline
#
# A GPU's matmul reaches its peak only when it does enough arithmetic per byte it moves. pipeviz's GPU presets
# price each op on a roofline (`pipeviz.cost.roofline`): an (*t* × *k*) @ (*k* × *n*) matmul costs its FLOPs at the
# achieved rate plus its bytes (both inputs and the output) at the memory bandwidth, so its efficiency
# (`matmul_efficiency`) rises with the tokens *t* in the microbatch towards the preset's ceiling (55 % of the H100's
# dense peak). Take a transformer layer of hidden size 4096 (its four matmuls: QKV, the output projection, the
# MLP's two; attention's score matmuls left out), a stage of 8 such layers on each of *p* = 4 H100s in bf16, and a
# global batch of 32768 tokens (64 sequences of 512) cut into *m* microbatches:

# %%
from pipeviz.cost.roofline import matmul_efficiency

h100 = pv.hardware("h100")
H, LAYERS, P_GPU, TOKENS = 4096, 8, 4, 32768
SHAPES = ((H, 3 * H), (H, H), (H, 4 * H), (4 * H, H))   # (k, n) of QKV, output projection, MLP up, MLP down


def stage_forward(tokens):
    """Seconds of one stage's forward on a microbatch of ``tokens`` tokens, on the H100's roofline (bf16)."""
    return LAYERS * sum(2 * tokens * k * n / (h100.peak("bfloat16") * matmul_efficiency(tokens, k, n, h100, "bfloat16"))
                        for k, n in SHAPES)


gpu = {}
print("   m   tokens/microbatch   matmul efficiency   time per token   simulated 1F1B step")
for m in (4, 8, 16, 32, 64, 128):
    t = TOKENS // m
    fwd = stage_forward(t)
    step = pv.simulate(None, "1F1B", m, costs=pv.Costs.uniform(P_GPU, forward=fwd, backward=2 * fwd),
                       num_stages=P_GPU).step_time
    gpu[m] = (fwd / t, step)
    print(f"{m:4}   {t:17}   {matmul_efficiency(t, H, H, h100, 'bfloat16'):17.0%}   {fwd / t * 1e6:11.2f} µs"
          f"   {step * 1e3:14.1f} ms")
best_gpu, runner_up = sorted(gpu, key=lambda m: gpu[m][1])[:2]
print(f"shortest steps: m = {best_gpu} ({gpu[best_gpu][1] * 1e3:.0f} ms) and m = {runner_up} "
      f"({gpu[runner_up][1] * 1e3:.0f} ms), {gpu[runner_up][1] / gpu[best_gpu][1] - 1:.1%} apart")
assert h100.efficiency == 0.55 and gpu[128][0] > 1.5 * gpu[4][0]   # 256-token microbatches: 1.5x+ per token
assert all(gpu[a][0] < gpu[b][0] for a, b in itertools.pairwise(sorted(gpu)))   # dearer with every halving
assert {best_gpu, runner_up} == {16, 32}                              # the middle of the range ...
assert gpu[runner_up][1] < 1.03 * gpu[best_gpu][1]                    # ... within a few percent of each other,
assert min(gpu[4][1], gpu[128][1]) > 1.2 * gpu[best_gpu][1]           # the ends a fifth slower or more

# %% [markdown]
# With few microbatches the bubble (*p* − 1)/(*m* + *p* − 1) dominates; with many, every token costs more because
# each microbatch's matmuls fall down the roofline; the shortest steps lie between: *m* = 16 and 32 within a few
# percent of each other (about 1.5 % here: too close to call a winner for real hardware, on a model this rough),
# 4 and 128 a fifth slower or more (the cell asserts it). On a real
# GPU the small end is worse still: each kernel also pays its launch, and the preset's ceiling is only reached by
# the largest matmuls. Measure with `pv.profile` at your microbatch size before trusting either.
#
# **A recipe:** take the largest *m* whose microbatch still keeps the hardware efficient (on GPUs, often a few
# samples or a few thousand tokens; measure), check that 1F1B's memory fits (it only falls with *m*), and with a
# slow link between stages prefer fewer, larger microbatches. Schedules that shrink the bubble another way
# (interleaving, zero bubble: lessons 4 and 5) need less *m* for the same bubble.
#
# ## Exercise
#
# Back on the GPU roofline: the same stage of 8 layers on **p = 4 H100s**, but the global batch is only **4096
# tokens** (8 sequences of 512). Which *m* among 4, 8, 16, 32, 64 gives the shortest simulated 1F1B step? Before
# computing, guess whether it is more or fewer than the 16 to 32 microbatches that did best above, and why; then
# check your guess with the section's tools. Set `my_answer` to that *m*.

# %%
my_answer = None  # your answer here: one of 4, 8, 16, 32, 64


# %%
def check(answer):
    """The m with the shortest simulated 1F1B step for 4096 tokens on 4 H100s (the roofline section's stage)."""
    steps = {}
    for m in (4, 8, 16, 32, 64):
        fwd = stage_forward(4096 // m)
        steps[m] = pv.simulate(None, "1F1B", m, costs=pv.Costs.uniform(4, forward=fwd, backward=2 * fwd),
                               num_stages=4).step_time
    expected = min(steps, key=steps.get)
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: the bubble still wants many microbatches, but each one now "
              "has 8x fewer tokens than at the same m above.")
    elif answer not in steps:
        print(f"❌ Not yet: choose one of {sorted(steps)}, got {answer!r}.")
    elif answer == expected:
        print(f"✅ Correct: m = {expected} ({steps[expected] * 1e3:.1f} ms): {4096 // expected} tokens per "
              "microbatch; a smaller batch reaches the roofline's slope with fewer microbatches.")
    elif answer > expected:
        print(f"❌ Not yet: m = {answer} takes {steps[answer] * 1e3:.1f} ms: its {4096 // answer}-token "
              "microbatches fall too far down the roofline.")
    else:
        print(f"❌ Not yet: m = {answer} takes {steps[answer] * 1e3:.1f} ms: the bubble is still large.")


check(my_answer)
