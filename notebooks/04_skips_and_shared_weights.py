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
# # 04 · Skip connections and shared weights train correctly
#
# Two things torch's pipelining does not handle on its own:
#
# * **a skip connection across stages** (a layer's output used several stages later): forward works, but training
#   raises *"Backward of skip connections not supported yet"*, and multi-stage schedules reject any non-adjacent
#   stage communication. pipeviz relays the skipped tensor through the stages in between (and its gradient back).
# * **tied weights** (one `Parameter` used in two stages, like an embedding and an output head): each stage gets a
#   copy and their gradients are never combined, so after one step the copies diverge. pipeviz sums the copies'
#   gradients every step.
#
# Below, each model trains pipelined under several schedules, and `pv.check_numerics` compares every run with the
# unsplit model trained the same way (`pv.train_reference`).

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import SkipNet, TiedNet

sgd = pv.sgd(lr=0.1)  # an optimizer factory: each rank builds its own SGD over the parameters it holds

# %% [markdown]
# ## SkipNet: `layer0`'s output is added after `layer2`
#
# Split after `layer0` and `layer1` and the skip crosses two boundaries: stage 0 sends it along with its regular
# output, stage 1 passes it on. `send_bytes` counts it.

# %%
torch.manual_seed(0)
skipnet, x = SkipNet(16), torch.randn(8, 16)
y = torch.randint(0, 4, (8,))
skip_graph = pv.trace(skipnet, example_args=(x,))
print("skip edges:", skip_graph.skip_edges)
skip3 = skip_graph.split(["layer0", "layer1"])
print(skip3)

# %% [markdown]
# Two runs at once (they are background processes): GPipe on 3 stages / 3 ranks, and Interleaved1F1B on 4 stages /
# 2 ranks (rank 0 holds stages 0 and 2, rank 1 stages 1 and 3): the skip from stage 0 to stage 3 is relayed through
# stages 1 and 2, back and forth between the two ranks.

# %%
skip4 = skip_graph.split(["layer0", "layer1", "layer2"])
skip_runs = {
    "GPipe": pv.launch(skip3, "GPipe", microbatches=4, steps=3, inputs=(x,), target=y,
                       loss_fn=F.cross_entropy, optimizer=sgd),
    "Interleaved1F1B": pv.launch(skip4, "Interleaved1F1B", microbatches=4, steps=3, inputs=(x,), target=y,
                                 loss_fn=F.cross_entropy, optimizer=sgd),
}
for schedule, run in skip_runs.items():
    assert run.wait(180) == "done", run.error
    check = pv.check_numerics(run)
    print(f"SkipNet {schedule:16} losses {[round(v, 4) for v in run.losses]}  "
          f"max diff: loss {check.loss_diff:.1e}, params {check.param_diff:.1e}")
    assert check.ok, check

# %% [markdown]
# ## TiedNet: `embed.weight` is `head.weight`
#
# A tiny language model whose output head reuses the embedding matrix (as GPT-2 does). The graph marks the shared
# tensor; so does every stage holding a copy.

# %%
torch.manual_seed(0)
tiednet = TiedNet(vocab=32, dim=16, depth=2)   # embed, blocks.0, blocks.1, head
ids = torch.randint(0, 32, (4, 8))
next_ids = torch.randint(0, 32, (4, 8))
# pv.cross_entropy averages over every token: logits (batch, seq, vocab), targets (batch, seq)
tied_graph = pv.trace(tiednet, example_args=(ids,))
print({layer.name: layer.shared for layer in tied_graph.layers})
tied2 = tied_graph.split(["blocks.0"])
tied4 = tied_graph.split(["embed", "blocks.0", "blocks.1"])
for stage in tied2.stages:
    print(stage.index, stage.layers, "shares:", stage.shared_params)
print("ZBV puts stages on ranks:", pv.schedule.layout("ZBVZeroBubble", 4).stage_ranks)

# %% [markdown]
# 1F1B on 2 stages (the copies live on two ranks), and ZBVZeroBubble on 4 stages, whose V shape places `embed`
# (stage 0) and `head` (stage 3) on the same rank, as two stage modules with one copy each.

# %%
tied_runs = {
    "1F1B": pv.launch(tied2, "1F1B", microbatches=4, steps=3, inputs=(ids,), target=next_ids,
                      loss_fn=pv.cross_entropy, optimizer=sgd),
    "ZBVZeroBubble": pv.launch(tied4, "ZBVZeroBubble", microbatches=4, steps=3, inputs=(ids,),
                               target=next_ids, loss_fn=pv.cross_entropy, optimizer=sgd),
}
for schedule, run in tied_runs.items():
    assert run.wait(180) == "done", run.error
    check = pv.check_numerics(run)
    print(f"TiedNet {schedule:14} losses {[round(v, 4) for v in run.losses]}  "
          f"max diff: loss {check.loss_diff:.1e}, params {check.param_diff:.1e}")
    assert check.ok, check
state = tied_runs["1F1B"].state_dict()
print("after training, embed.weight == head.weight:", torch.equal(state["embed.weight"], state["head.weight"]))
