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
# # Lesson 12 · Long sequences: context parallelism
#
# **You will learn:** why a stage's activations grow with the sequence, how context parallelism (CP) splits every
# sequence over processes (the zig-zag shares that balance causal attention), what it costs (an exchange of keys and
# values per attention) and what it hides, and that a pipeline × cp run trains exactly like the unsplit model.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) and its glossary;
# [docs/composing.md](../docs/composing.md) (the cp section: what runs, what is refused).
#
# **Lessons:** ← [Lesson 11 · Composing pipeline, data and tensor parallelism](11_composing_pp_dp_tp.ipynb) ·
# [Lesson 13 · Mixture of experts in a pipeline](13_moe_in_a_pipeline.ipynb) →
#
# ## Activations grow with the sequence
#
# A transformer block keeps, per token, its inputs to every matmul, norm and activation function: tens of values
# per hidden unit and token. Double the sequence and a microbatch's activations double; microbatches of one
# sequence cannot shrink further, so at 32k–128k tokens one sequence's activations no longer fit a GPU whatever the
# schedule. Pipeline stages split the *layers*, data parallelism the *batch*, tensor parallelism the *matrices*;
# only context parallelism splits the *sequence*.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch

import pipeviz as pv
from pipeviz.adapter.context_graph import zigzag_positions
from pipeviz.costs import stage_costs
from pipeviz.zoo import gpt2

torch.manual_seed(0)
for seq in (16, 32, 64):
    model = gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    plan = pv.trace(model, example_args=(torch.randint(0, 128, (4, seq)),)).split(["transformer.h.1"])
    acts = stage_costs(plan, 1).activation_bytes
    print(f"{seq:>3} tokens: activations per stage {[f'{a / 1024:.0f} KiB' for a in acts]}")

# %% [markdown]
# ## Shares of a sequence, balanced
#
# With `cp` shares each process of a stage holds 1/cp of every sequence. Cutting it into cp contiguous pieces
# would leave causal attention unbalanced: the last piece's queries see every key, the first's almost none. So the
# sequence is cut into 2·cp chunks and share *r* holds chunks *r* and 2·cp−1−*r* (Megatron-LM's and torchtitan's
# "zig-zag"): every share sees the same number of keys.

# %%
for r in range(2):
    pos = zigzag_positions(16, 2, r).tolist()
    print(f"share {r}: tokens {pos}; keys its queries see: {sum(p + 1 for p in pos)}")

# %% [markdown]
# ## What CP costs, and what it hides
#
# Everything in a block but attention works token by token, so each share computes 1/cp of it and keeps 1/cp of
# its activations. Attention needs every key: each attention op all-gathers the shares' keys and values (one
# exchange per forward; its backward reduce-scatters their gradients). Those bytes grow with the sequence as the
# compute grows with its square, so at long sequences the exchange hides behind the attention it feeds; at short
# ones it shows. `pv.simulate(..., cp=2)` prices it:

# %%
model = gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
ids = torch.randint(0, 128, (8, 16))
plan = pv.trace(model, example_args=(ids,)).split(["transformer.h.1"])
one = pv.simulate(plan, "1F1B", 4, bandwidth=1e8, latency=1e-4)
two = pv.simulate(plan, "1F1B", 4, cp=2, bandwidth=1e8, latency=1e-4)
print(f"cp=1: step {one.step_time * 1e3:.2f} ms, activations {one.meta['peak_activation_bytes']}")
print(f"cp=2: step {two.step_time * 1e3:.2f} ms, activations {two.meta['peak_activation_bytes']}")

# %% [markdown]
# ## A real pp × cp run, checked exact
#
# `pv.launch(..., cp=2)` starts 2 stages × 2 shares = 4 processes. Each runs its stage on its share's tokens: the
# position ids, rotary tables and masks are computed over the whole sequence and cut to the share's global
# positions; each attention gathers the keys and values (a timed `CP` action on the timeline). The gradients are
# averaged over the shares, as over replicas.

# %%
run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, cp=2)
assert run.wait(300) == "done", run.error
print(run.mesh.describe())
numerics = pv.check_numerics(run)
print(numerics)
assert numerics.ok
cp_actions = [e for e in run.timeline().events if e.kind == "CP"]
print(f"{len(cp_actions)} CP exchanges over 4 processes and 2 steps")

# %% [markdown]
#
# ## Exercise
#
# A sequence of **4096 tokens** runs with **cp = 4**. Which global positions does share **1** hold? Set
# `my_answer` to the list of its first and last position of each of its two chunks: `[first1, last1, first2,
# last2]`.

# %%
my_answer = None  # your answer here: four integers


# %%
def check(answer):
    """Share r holds chunks r and 2·cp−1−r of 2·cp equal chunks."""
    pos = zigzag_positions(4096, 4, 1)
    c = 4096 // 8
    expected = [int(pos[0]), int(pos[c - 1]), int(pos[c]), int(pos[-1])]
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: 2·cp = 8 chunks of 512 tokens.")
    elif list(answer) == expected:
        print(f"✅ Correct: chunks 1 and 6: {expected}.")
    elif list(answer) == [1024, 2047, 0, 0] or list(answer)[:2] == [1024, 2047]:
        print("❌ Not yet: that is a contiguous quarter. Hint: the shares hold two chunks of 2·cp each.")
    else:
        print(f"❌ Not yet: not {answer!r}. Hint: chunk k covers 512·k to 512·k + 511; share r holds r and 7 − r.")


check(my_answer)
