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
# # 06 · LLaMA, mixture of experts, and models too big for one process
#
# The other examples of the PiPPy walkthrough (*PiPPy实战*, the tutorial this project grew from; notebook 01 runs
# its first), end to end: a LLaMA (HF `LlamaForCausalLM`: RoPE, grouped-query attention, RMSNorm) and a
# mixture-of-experts model split and trained pipelined, checked against the unsplit model; a forward-only run (as
# the walkthrough itself runs); and a Llama-3-8B built on the **meta device**, which
# traces, balances and simulates without allocating its 32 GB, then starts from a checkpoint where each rank
# reads only its own stage. All configs are tiny or meta; weights are random (nothing is downloaded).

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import shutil
import tempfile
from pathlib import Path

import torch

import pipeviz as pv
from pipeviz import zoo

torch.manual_seed(0)
ids, target = torch.randint(0, 512, (8, 32)), torch.randint(0, 512, (8, 32))

# %% [markdown]
# ## LLaMA
# The rotary-embedding module takes no inputs (it reads only position ids); its tables are non-persistent
# buffers. pipeviz places it with the stage that uses it and trains the split model exactly.

# %%
llama = zoo.llama()  # 4 layers, 128 wide, 4 query / 2 key-value heads
graph = pv.trace(llama, example_args=(ids,))
plan = pv.balance(graph, 2)
print(plan)
run = pv.launch(plan, "1F1B", 4, steps=3, inputs=(ids,), target=target, loss_fn=pv.cross_entropy)
assert run.wait(240) == "done", run.error
print(run.status, [round(x, 4) for x in run.losses])
numerics = pv.check_numerics(run)
print(numerics)
assert numerics.ok  # trained exactly like the unsplit model (pipeviz's one tolerance, 1e-5)

# %% [markdown]
# The same plan, **forward only**: no `loss_fn`. `run.outputs[step]` is the model's output for the whole batch
# (HF's output class, logits joined back from the microbatches), equal to `llama(ids)`.

# %%
infer = pv.launch(plan, "1F1B", 4, steps=1, inputs=(ids,))
assert infer.wait(240) == "done", infer.error
out = infer.outputs[0]
with torch.no_grad():
    gap = float((out.logits - llama(ids).logits).abs().max())
print(type(out).__name__, tuple(out.logits.shape), "max |difference| from llama(ids):", gap)
assert tuple(out.logits.shape) == (8, 32, 512) and gap < 1e-5

# %% [markdown]
# ## Mixture of experts
# A learned router sends each token to its top-2 of 4 experts; each expert runs only on its tokens (shapes
# that depend on the data). `torch.export` captures that dispatch, and each MoE block stays one layer.

# %%
moe = zoo.MoENet(layers=4)
moe_graph = pv.trace(moe, example_args=(ids,))
print(moe_graph.layer_names)
moe_plan = pv.balance(moe_graph, 2)
moe_run = pv.launch(moe_plan, "GPipe", 4, steps=3, inputs=(ids,), target=target, loss_fn=pv.cross_entropy)
assert moe_run.wait(240) == "done", moe_run.error
moe_numerics = pv.check_numerics(moe_run)
print(moe_numerics)
assert moe_numerics.ok

# %% [markdown]
# ## Llama-3-8B on the meta device
# Built under `torch.device("meta")`, the model has shapes but no values: tracing, the preview, balancing and
# the simulator need nothing more. (Tracing takes a few seconds: `torch.export` walks all 32 layers.)

# %%
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256)
with torch.device("meta"):
    big = LlamaForCausalLM(config)
big_graph = pv.trace(big, example_args=(torch.randint(0, 128256, (1, 128)),))
print(f"{big_graph.total_params:,} parameters, {len(big_graph.layers)} layers")
assert big_graph.total_params == 8_030_261_248  # Llama-3-8B's count
big_plan = pv.balance(big_graph, 8, by="params")
print(big_plan)
print(pv.compare(big_plan, microbatches=16).table())

# %% [markdown]
# The Explorer works on it as on any model (click a layer to move a split; containers start collapsed).

# %%
pv.Explorer(big_graph, splits=big_plan)

# %% [markdown]
# ## Starting from a checkpoint
# `weights=` takes a safetensors file or a folder of shards with its index (what HF `save_pretrained` and
# `run.save` write). The model can stay on the meta device: each rank builds only its own stage and reads only
# its own tensors. Here: save the trained tiny LLaMA, then start a meta copy of it from that checkpoint. This is a
# warm start: the weights only, with a fresh optimizer at step 0. To continue the run itself (its optimizer and
# scheduler state, its step and data position) pass `resume=ckpt` instead (README, "Checkpoint and resume").

# %%
ckpt = Path(tempfile.mkdtemp(prefix="pipeviz_ckpt_"))  # keep checkpoints out of the repository
print([Path(f).name for f in run.save(ckpt)])
with torch.device("meta"):
    meta_llama = zoo.llama()
meta_plan = pv.balance(pv.trace(meta_llama, example_args=(ids,)), 2)
warm = pv.launch(meta_plan, "1F1B", 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy, weights=ckpt)
assert warm.wait(240) == "done", warm.error
print("first run:", [round(x, 4) for x in run.losses], " warm start:", [round(x, 4) for x in warm.losses])
warm_numerics = pv.check_numerics(warm)
print(warm_numerics)
assert warm_numerics.ok
shutil.rmtree(ckpt)  # a kernel's shutdown skips exit handlers: temporary folders go explicitly
