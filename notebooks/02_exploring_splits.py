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
# # 02 · Exploring splits: GPT-2 and BERT in the Explorer
#
# Where to cut a transformer? The Explorer traces a model once, then every click (split after this layer / remove
# the split) previews the stages in under a millisecond. This notebook drives it from code too, so it runs top to
# bottom; click around in the widgets as you go.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch

import pipeviz as pv
from pipeviz.zoo import bert, gpt2

torch.manual_seed(0)
gpt = gpt2(n_layer=4, n_embd=64, n_head=2, vocab_size=256)  # HF GPT2LMHeadModel, random weights
ids = torch.randint(0, 256, (8, 32))                         # 8 sequences of 32 tokens
ex = pv.Explorer(gpt, example_args=(ids,))
ex

# %% [markdown]
# The layers are the model's natural blocks: embeddings, the four transformer blocks `transformer.h.<i>`, the
# final norm and the LM head. A click is `ex.click(name)`:

# %%
print(ex.graph.layer_names)
ex.click("transformer.h.1")   # split after block 1 -> 2 stages
print(ex.plan)

# %% [markdown]
# ## Balance
#
# `pv.balance` finds the contiguous split that minimises the slowest stage (exact dynamic programming). The
# Explorer's *Balance* button (it reads *Balance into N* while the stage count differs from the plan's) calls it
# with the controls' values; in code, `ex.auto_balance(n)`.

# %%
ex.auto_balance(4)
print(ex.plan)
costs = [stage.flops for stage in ex.plan.stages]
print(f"slowest / mean stage FLOPs: {max(costs) / (sum(costs) / len(costs)):.2f}")

# %% [markdown]
# ## Tied weights
#
# GPT-2's LM head reuses the token embedding matrix (`transformer.wte.weight`). Split across stages, each end
# holds a copy: the preview names it in `shared_params`, and `pv.launch` sums the two copies' gradients every step
# so they stay identical (torch's pipelining alone would let them drift apart).

# %%
for stage in ex.plan.stages:
    print(stage.index, stage.layers, "shares:", stage.shared_params or "-")

# %% [markdown]
# ## Finer granularity
#
# A block can be opened into its modules (attention, MLP, norms) without tracing again; `collapse` merges it back.

# %%
fine = ex.graph.expand("transformer.h.0")
print(fine.layer_names[:8], "...")
print(len(ex.graph.layers), "->", len(fine.layers), "layers")

# %% [markdown]
# ## Memory
#
# Each stage holds its parameters, their gradients and optimizer state, plus the activations of every microbatch
# that has run forward but not yet backward. How many that is depends on the schedule: GPipe keeps all `m`, 1F1B
# at most the number of stages. `pv.simulate` reports the peak per rank:

# %%
for schedule in ("GPipe", "1F1B"):
    tl = pv.simulate(ex.plan, schedule, microbatches=8)
    print(f"{schedule:5} memory per rank (MiB):", [round(b / 2**20, 2) for b in tl.memory_bytes])

# %% [markdown]
# `pv.balance(..., memory_limit=...)` only accepts splits that fit; when none does, the error says the smallest
# limit that would.

# %%
try:
    pv.balance(ex.graph, 4, memory_limit=4e6, schedule="GPipe", microbatches=8)
except pv.PlanError as err:
    print("PlanError:", err)
fitting = pv.balance(ex.graph, 4, memory_limit=8e6, schedule="1F1B", microbatches=8)
print(fitting)

# %% [markdown]
# ## Train it
#
# *Launch* (here `ex.launch()`) trains the current plan in background processes with the controls' schedule; when
# it ends, the widget compares losses and parameters against the unsplit model.

# %%
ex.plan = ex.graph.split(["transformer.h.1"])  # back to 2 stages: 2 processes
ex.launch()
assert ex.wait(180) == "done", ex.run.error
print("losses:", [round(loss, 3) for loss in ex.run.losses])

# %% [markdown]
# ## BERT
#
# The same for a tiny BERT encoder. Its embedding block holds many parameters (the vocabulary table) but does
# almost no arithmetic, so balancing by parameters (memory) and by FLOPs (time) disagree.

# %%
encoder = bert(num_hidden_layers=4, hidden_size=64, num_attention_heads=2, vocab_size=2048)
bx = pv.Explorer(encoder, example_args=(ids,))
for by in ("params", "flops"):
    plan = pv.balance(bx.graph, 3, by=by)
    print(f"by {by:6}:", [list(stage.layers) for stage in plan.stages])
bx.auto_balance(3, by="flops")
bx
