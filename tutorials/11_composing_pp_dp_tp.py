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
# # Lesson 11 · Composing pipeline, data and tensor parallelism
#
# **You will learn:** how pipeline parallelism (PP) combines with data parallelism (DP) and tensor parallelism
# (TP) on a mesh of processes, what each costs (the simulator), that the combination trains exactly like the
# unsplit model (real runs), the global batch gbs = mbs × m × dp, ZeRO-1 against ZeRO-3 under a pipeline, and how
# `plan_cluster` chooses the degrees for a cluster.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese); the
# [schedules cheat sheet](../docs/schedules.md) (every schedule's bubble, memory and traffic on one page).
#
# **Lessons:** ← [Lesson 10 · Going multi-host](10_going_multi_host.ipynb) ·
# [Lesson 12 · Long sequences](12_long_sequences.ipynb) →
#
# ## Three ways to cut the work
#
# - **PP** cuts the model by layers: stages talk once per microbatch and boundary (one activation forward, one
#   gradient back), so it tolerates slow links — across nodes.
# - **DP** copies the whole pipeline: each replica trains on 1/*dp* of every batch, and after the backward the
#   replicas average their gradients: an all-reduce of each stage's gradients per step. It can start no earlier
#   than the stage's last backward of the step (only then are the gradients final), so it hides behind at most
#   that backward and the work left after it (the rank's other stages, the other ranks' drain): on a slow link it
#   shows (the slow-link row below).
#   `pv.launch(..., dp=)` runs it with pipeviz's own overlapped all-reduce by default, `dp_reduce="overlap"`
#   (the real runs below say how, and what else it can run).
# - **TP** cuts each layer's matrices (Megatron-LM: a column-wise Linear, then a row-wise one): each shard computes
#   and stores 1/*tp* of a stage (of its activations only with sequence parallelism: without it the norms' and
#   dropouts' inputs are whole on every shard) but pays an all-reduce of the layer's output on the critical path,
#   in every forward and backward — it needs the fastest links, inside a node.
#
# A run with all three has *pp* × *dp* × *tp* processes on a mesh; pipeviz numbers them like torchtitan, `pp`
# outermost and `tp` innermost, and names each by its coordinates:

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

mesh = pv.Mesh(pp=2, dp=2, tp=2)
print(f"{mesh.world} processes")
for rank in range(mesh.world):
    print(f"rank {rank}: {mesh.label(rank)}")
c = mesh.coords(3)
assert mesh.rank(pp=1, dp=0, tp=0) == 4 and (c.pp, c.dp, c.tp) == (0, 1, 1)

# %% [markdown]
# ## What each costs, simulated
#
# One small model in two stages, 1F1B, 4 microbatches: `pv.simulate(..., dp=, tp=)` shows replica 0's pipeline.
# With `dp=2` each replica computes on half the batch and adds the gradients' all-reduce; with `tp=2` each shard
# holds half the stage and pays an all-reduce per row-wise projection, in the forward and again in the backward,
# on the critical path (here one per pair of Linears; a transformer block has two: attention and MLP).
# `dp_bandwidth=` / `tp_bandwidth=` set those links (bytes/s).

# %%
torch.manual_seed(0)
model = MyNetwork(256, [256] * 3)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
plan = pv.balance(pv.trace(model, example_args=(x,)), num_stages=2)

cases = {"pp=2": {}, "pp=2 dp=2": {"dp": 2}, "pp=2 dp=2, slow DP link (100 MB/s)": {"dp": 2, "dp_bandwidth": 1e8},
         "pp=2 tp=2": {"tp": 2}, "pp=2 dp=2 tp=2": {"dp": 2, "tp": 2}}
sims = {}
for name, options in cases.items():
    tl = sims[name] = pv.simulate(plan, "1F1B", 4, **options)
    print(f"{name:36} step {tl.step_time * 1e3:6.2f} ms   memory per rank "
          f"{[round(b / 2**20, 2) for b in tl.memory_bytes]} MiB")

# %% [markdown]
# What the table says (asserted below):
#
# - **DP** keeps each rank's memory (every replica holds the whole stage) and shortens the step by about a tenth,
#   not a half. Here each replica gets half of the same batch (the global batch stays), so each rank computes half
#   as much; but the gradients' all-reduce (`DP` on the timeline) can start only after a stage's last backward of
#   the step, and with one stage per rank nothing of that rank's work is left to hide it: rank 0, the last to
#   finish its backwards under 1F1B, waits it out whole, and the step ends with it. The halved compute and the
#   exposed all-reduce nearly cancel. Played on this machine's 2 cores (`cores=2`: the 4 processes share them,
#   each pipeline's idle time leaving a core to the other replica) the step is again about a tenth shorter, no
#   more. (At a fixed global batch, more replicas also mean fewer microbatches per pipeline, or smaller ones, and a
#   bigger bubble.) On a slow DP link the all-reduce dominates.
# - **TP** halves each rank's memory, but on this small model and these links its all-reduces cost more than the
#   halved compute saves, and on a CPU so does DTensor's dispatch of every op of a shard's stage (priced from a
#   measurement: `pipeviz.sim.tensor_parallel`): TP pays off for large layers on fast links (NVLink inside a node),
#   not here.

# %%
base, dp2 = sims["pp=2"], sims["pp=2 dp=2"]


def busy(tl, rank, kinds=("F", "B")):
    """Seconds ``rank`` spends on actions of ``kinds`` in a simulated step."""
    return sum(e.end - e.start for e in tl.events if e.rank == rank and e.kind in kinds)


on_2_cores = {name: pv.simulate(plan, "1F1B", 4, cores=2, **cases[name]).step_time for name in ("pp=2", "pp=2 dp=2")}
print(f"dp=2: compute per rank {[round(busy(dp2, r) / busy(base, r), 2) for r in range(2)]} of pp=2's; "
      f"all-reduce {[round(busy(dp2, r, ('DP',)) * 1e3, 2) for r in range(2)]} ms per rank; step "
      f"{dp2.step_time / base.step_time:.2f} of pp=2's ({on_2_cores['pp=2 dp=2'] / on_2_cores['pp=2']:.2f} on 2 cores)")
assert all(abs(busy(dp2, r) / busy(base, r) - 0.5) < 0.01 for r in range(2))       # half the compute per rank ...
last_b = max(e.end for e in dp2.events if e.rank == 0 and e.kind == "B")
assert any(e.kind == "DP" and e.rank == 0 and e.start >= last_b and e.end == dp2.step_time for e in dp2.events)
assert 0.8 < dp2.step_time / base.step_time < 1                                      # ... a step a tenth shorter
assert 0.8 < on_2_cores["pp=2 dp=2"] / on_2_cores["pp=2"] < 1                       # the same on 2 cores
assert all(abs(a - b) / b < 0.1 for a, b in zip(dp2.memory_bytes, base.memory_bytes, strict=True))
assert sims["pp=2 dp=2, slow DP link (100 MB/s)"].step_time > sims["pp=2 dp=2"].step_time
assert all(a < 0.6 * b for a, b in zip(sims["pp=2 tp=2"].memory_bytes, base.memory_bytes, strict=True))
assert sims["pp=2 tp=2"].step_time > base.step_time

# %% [markdown]
# ## Real runs: exact, whatever the layout
#
# `pv.launch(..., dp=2)` starts 2 replicas of the 2-stage pipeline (4 processes). How the replicas average their
# gradients is the launch option `dp_reduce` (`pipeviz.schedule.config`):
#
# - `"overlap"`, the default: pipeviz's own overlapped all-reduce (`pipeviz.runtime.overlap`). As soon as a
#   stage's last backward of the step has run, its gradients start an asynchronous all-reduce, in DDP-sized
#   buckets, while the rank goes on with the rest of its work; the step waits for them once, before the optimizer
#   (what Megatron-Core's `--overlap-grad-reduce` does per model chunk).
# - `"zero1"`: the same moment, but a reduce-scatter: each replica keeps the optimizer state of 1/*dp* of every
#   parameter and the updated parameters are all-gathered after the step (ZeRO-1, below).
# - `"ddp"`: torch's `DistributedDataParallel` around each stage, which reduces inside the stage's last backward
#   and waits there (not under a split backward: the zero-bubble schedules).
# - `"after_flush"`: one all-reduce of the rank's gradients after the step's last action (the default with
#   `tp` > 1).
# - `dp_shard=True` instead: torch's FSDP2 `fully_shard` (ZeRO-3, below), with its own reduce-scatter.
#
# `tp=2` shards each stage over 2 processes with torch's DTensor. `pv.check_numerics` trains the unsplit model on
# the same batches and compares losses and every parameter: every mode above averages the same gradients, only
# at another moment or into other shards.

# %%
from pipeviz.schedule.config import DP_REDUCE_MODES, dp_reduce_mode

print("dp_reduce:", DP_REDUCE_MODES, "  default with dp=2:", dp_reduce_mode(pv.LaunchConfig(dp=2)),
      "  with dp=2, tp=2:", dp_reduce_mode(pv.LaunchConfig(dp=2, tp=2)))
assert dp_reduce_mode(pv.LaunchConfig(dp=2)) == "overlap"
assert dp_reduce_mode(pv.LaunchConfig(dp=2, tp=2)) == "after_flush"
runs = {}
for name, options in (("pp=2 dp=2", {"dp": 2}), ("pp=2 tp=2", {"tp": 2})):
    run = pv.launch(plan, "1F1B", microbatches=4, steps=2, inputs=(x,), target=y, loss_fn=F.cross_entropy,
                    **options)
    assert run.wait(240) == "done", run.error
    runs[name] = run
    numerics = pv.check_numerics(run)
    print(f"{name}: {run.mesh}, losses {[round(v, 4) for v in run.losses]}")
    print("   ", numerics)
    assert numerics.ok and run.mesh.world == 4
assert dp_reduce_mode(runs["pp=2 dp=2"].spec.config) == "overlap"      # what the dp=2 run averaged with
pv.TimelineView(runs["pp=2 dp=2"])

# %% [markdown]
# Each row of the timeline is a process named by its coordinates (`pp1 dp0`: stage 1 of replica 0); the `DP` bars
# are the overlapped all-reduce's buckets, from launch to completion.
#
# ## The global batch, and ZeRO under a pipeline
#
# The samples one optimizer step sees are **gbs = mbs × m × dp**: each of the *dp* pipelines runs *m* microbatches
# of *mbs* samples. At a fixed global batch, doubling *dp* halves *m* × *mbs*: fewer microbatches (a bigger bubble)
# or smaller ones (lesson 8). The runs above: 64 = 16 × 4 × 1 without replicas, 64 = 8 × 4 × 2 with two.
#
# Replicas also multiply the model's state: under plain DP (`dp_reduce="overlap"`, `"ddp"` or `"after_flush"`
# alike) every replica keeps every weight, gradient and
# optimizer state (4 + 4 + 8 bytes per float32 parameter with Adam). **ZeRO-1** (`dp_reduce="zero1"`, Megatron's
# distributed optimizer) shards the optimizer state over the *dp* replicas; **ZeRO-3** (`dp_shard=True`, torch's
# FSDP2) shards weights and gradients too. What each keeps per rank for this plan, at rest, *dp* = 2 (pipeviz's
# simulated `memory_bytes` does not shard yet: it prices ZeRO's collectives, not its memory, so it shows plain
# DP's figure for all three; the lesson computes the shares from the same rule):

# %%
assert 64 == (64 // 4) * 4 * 1 == (64 // 4 // 2) * 4 * 2          # gbs = mbs x m x dp, as launched above
DP = 2
layouts = {"DP": {"dp": DP}, "ZeRO-1": {"dp": DP, "dp_reduce": "zero1"}, "ZeRO-3": {"dp": DP, "dp_shard": True}}
state = {}
for name, options in layouts.items():
    tl = pv.simulate(plan, "1F1B", 4, **options)
    params = [stage.param_bytes for stage in plan.stages]                    # float32 weights, bytes
    share = {"DP": (1, 1, 1), "ZeRO-1": (1, 1, 1 / DP), "ZeRO-3": (1 / DP, 1 / DP, 1 / DP)}[name]
    state[name] = [w * share[0] + w * share[1] + 2 * w * share[2] for w in params]   # weights, grads, Adam's 2
    print(f"{name:9} weights + gradients + optimizer per rank {[round(b / 2**20, 2) for b in state[name]]} MiB"
          f"   (simulated memory_bytes {[round(b / 2**20, 2) for b in tl.memory_bytes]} MiB)")
    assert [m - a for m, a in zip(tl.memory_bytes, tl.peak_activation_bytes, strict=True)] == state["DP"]
assert all(z1 == 0.75 * d and z3 == 0.5 * d for d, z1, z3 in zip(state["DP"], state["ZeRO-1"],
                                                                 state["ZeRO-3"], strict=True))

# %% [markdown]
# With *dp* = 2, ZeRO-1 keeps 3/4 of plain DP's state per rank and ZeRO-3 half (the asserts; with *dp* → ∞,
# 1/2 and 0). Under a pipeline ZeRO-3's saving has a price: its weights are sharded at rest, so every forward and
# every backward of a microbatch needs the stage's whole weights **gathered** first. FSDP frees them after each
# forward by default (`reshard_after_forward=True`), so a stage running *m* = 4 microbatches gathers its weights
# for each forward and again for the backwards (torch's pipeline stage keeps them gathered between backwards until
# the step's last one): up to 2*m* = 8 all-gathers of the stage per step where ZeRO-1 does one, after the
# optimizer step. Keeping them gathered for the whole step (`reshard_after_forward=False`) makes it one gather again
# but holds the full weights through the step, giving back most of the saving. That is why pipelines usually pair
# with ZeRO-1 (Megatron-LM's distributed optimizer), and ZeRO-3 with few microbatches or none.
#
# ## Choosing the degrees
#
# A common recipe (the Ultra-Scale Playbook, torchtitan): TP inside a node up to its fast-link size, PP across
# nodes until each stage's weights and activations fit, DP for everything left, to grow the global batch. The
# simulator prices each choice before any process starts.
#
# `plan_cluster` (`pipeviz.planner.search`) searches them all for a GPU count, a hardware preset and a global batch:
# every *pp* × *dp* × *tp* (TP within a node), schedule, microbatch size and recomputation mode, each balanced and
# simulated on the hardware's roofline, keeping only what fits in memory, fastest first. A 0.6 B-parameter
# Llama-shaped model on the meta device (no memory), 32 H100s, 256 sequences of 2048 tokens per step:

# %%
from transformers import LlamaConfig, LlamaForCausalLM

from pipeviz.planner.search import plan_cluster

config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000)
with torch.device("meta"):
    llama = LlamaForCausalLM(config)
llama_graph = pv.trace(llama, example_args=(torch.zeros(1, 2048, dtype=torch.long),))
roomy = plan_cluster(llama_graph, gpus=32, hardware="h100-sxm", global_batch=256, top=5)
print(roomy.table())

# %% [markdown]
# Each row's `reduce` says how it averages its replicas' gradients (the planner searches the modes above per row;
# `distributed`, Megatron's distributed optimizer, launches as `dp_reduce="zero1"`), and `exposed` is the part of
# that reduction the step waits for, which no computation hides.
#
# A model this small fits on one GPU, so the planner may need no pipeline at all. Give each device only 8 GiB
# (a bigger model, in effect): the fastest layout that fitted no longer does, and the fastest one that fits
# pipelines (the assert checks that; a layout without pipelining may still fit lower in the table).

# %%
LIMIT = 8 * 2**30
tight = plan_cluster(llama_graph, gpus=32, hardware="h100-sxm", global_batch=256, memory_limit=LIMIT, top=5)
print(tight.table())
assert all(row.peak_memory <= LIMIT for row in tight.rows)
assert roomy.rows[0].peak_memory > LIMIT and tight.rows[0].pp > 1
print("fastest within 8 GiB:", tight.rows[0].label())

# %% [markdown]
#
# ## Exercise
#
# 32 GPUs train with **pp = 4, tp = 2** and the rest data-parallel, on a global batch of **256 sequences** with
# microbatches of **4 sequences**. Each pipeline runs 1F1B over its share of the batch. What fraction of each
# step is bubble, (*p* − 1)/(*m* + *p* − 1) with equal stages? Set `my_answer` to that number (work out *dp* and
# *m* first).

# %%
my_answer = None  # your answer here: a number between 0 and 1


# %%
def check(answer):
    """The 1F1B bubble of one pipeline: dp = 32 / (pp x tp), m = gbs / (mbs x dp), simulated on equal stages."""
    pp, tp, gbs, mbs = 4, 2, 256, 4
    dp = 32 // (pp * tp)
    m = gbs // (mbs * dp)
    expected = pv.simulate(None, "1F1B", m, costs=pv.Costs.uniform(pp), num_stages=pp).bubble_fraction
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: the 32 GPUs are pp x dp x tp; gbs = mbs x m x dp.")
    elif not isinstance(answer, (int, float)):
        print(f"❌ Not yet: my_answer should be a number, got {answer!r}.")
    elif abs(answer - expected) < 1e-3:
        print(f"✅ Correct: dp = {dp}, m = {m}, bubble (p - 1)/(m + p - 1) = 3/{m + pp - 1} = {expected:.3f}.")
    elif abs(answer - 3 / (gbs // mbs + 3)) < 1e-3:
        print("❌ Not yet: that is one pipeline taking the whole batch. Hint: each of the dp replicas takes 1/dp.")
    else:
        print(f"❌ Not yet: not {answer!r}. Hint: dp = 32 / (pp · tp), then m = gbs / (mbs · dp).")


check(my_answer)
