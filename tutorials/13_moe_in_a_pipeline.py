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
# # Lesson 13 · Mixture of experts in a pipeline: expert parallelism
#
# **You will learn:** how a mixture-of-experts (MoE) block routes each token to its top-*k* experts, why the experts
# are shared out over processes (memory, not compute), the two all-to-alls that send tokens to their experts and
# back (dispatch and combine), that a pipeline × data × expert parallel run trains exactly like the unsplit model,
# how to read load imbalance from a run, and why DualPipe-style schedules pair one microbatch's forward with
# another's backward.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) and its glossary;
# [docs/experts.md](../docs/experts.md) (what runs, what is refused, what is not done yet); the
# [schedules cheat sheet](../docs/schedules.md) (DualPipeV beside the other schedules).
#
# **Lessons:** ← [Lesson 12 · Long sequences](12_long_sequences.ipynb)
#
# ## Routing: each token picks its experts
#
# An MoE block replaces one feed-forward network by *E* of them, the **experts**, and a small **router**: a Linear
# that scores every token against every expert. Each token keeps its top-*k* scores (*k* = 2 in Mixtral and here),
# runs only through those *k* experts and adds their outputs, weighted by the scores. The parameters grow with *E*,
# the compute per token only with *k*.
#
# `pipeviz.zoo.MoENet` is such a model, small: an embedding, 4 MoE blocks of 4 experts (top-2), a head. Counting
# the rows each expert receives in one forward (a hook on each expert) shows the routing:

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import itertools

import torch

import pipeviz as pv
from pipeviz.zoo import MoENet

torch.manual_seed(0)
model = MoENet(vocab=32, d=16, layers=4, experts=4)
ids = torch.randint(0, 32, (16, 8))  # 16 sequences of 8 tokens: 128 tokens
E, K = 4, model.blocks[0].k


def tokens_per_expert(model, ids):
    """{block: rows each of its experts computed} in one forward of ``model`` on ``ids`` (forward hooks)."""
    counts, hooks = {}, []
    for b, block in enumerate(model.blocks):
        name = f"blocks.{b}.experts"
        counts[name] = [0] * len(block.experts)
        for e, expert in enumerate(block.experts):
            def count(module, args, out, name=name, e=e):
                counts[name][e] += args[0].shape[0]
            hooks.append(expert.register_forward_hook(count))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:  # removed before tracing: the traced model is the plain one
            h.remove()
    return counts


unsplit = tokens_per_expert(model, ids)
for name, counts in unsplit.items():
    print(f"{name}: rows per expert {counts}")
assert all(sum(c) == K * ids.numel() for c in unsplit.values())  # every token to exactly k = 2 experts

# %% [markdown]
# Every token went to exactly 2 of the 4 experts (256 rows per block), but not evenly: the router is a learned
# Linear, and nothing here asks it to balance. We come back to that below.
#
# ## Why the experts are shared out: memory
#
# Almost all of an MoE model's parameters are experts, and each token uses only *k* of them. Mixtral 8x7B (its
# `config.json`: 32 layers, hidden 4096, experts of 14336 with a gated MLP, 8 experts, top-2, grouped-query
# attention with 8 key/value heads of 128, a 32000-word vocabulary, untied head) counted from its shapes:

# %%
n_params = sum(p.numel() for p in model.parameters())
n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
print(f"MoENet: {n_expert / n_params:.0%} of its {n_params} parameters are experts")

d, ff, layers, experts, k, vocab, kv = 4096, 14336, 32, 8, 2, 32000, 8 * 128
expert = 3 * d * ff                              # gate, up and down projections
rest = 2 * d * d + 2 * d * kv + 2 * d + d * experts  # attention (q, o; k, v), two RMSNorms, the router
total = layers * (experts * expert + rest) + 2 * vocab * d + d  # embedding, head, final norm
active = layers * (k * expert + rest) + 2 * vocab * d + d
print(f"Mixtral 8x7B: {total / 1e9:.1f} B parameters, {active / 1e9:.1f} B used per token, "
      f"{layers * experts * expert / total:.1%} of them in experts")
assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9  # Mistral AI's published figures

# 16 bytes per parameter to train: bf16 weights and gradients, fp32 master weights and Adam's two moments (ZeRO)
print("\ntraining state per process (weights, gradients, optimizer), GB:")
print("          " + "".join(f"   ep={ep}" for ep in (1, 2, 4, 8)))
for pp in (1, 4):
    row = [(total - layers * experts * expert + layers * experts * expert / ep) * 16 / pp / 1e9 for ep in (1, 2, 4, 8)]
    print(f"pp={pp}:    " + "".join(f"{gb:8.0f}" for gb in row))

# %% [markdown]
# Data parallelism alone would put all 46.7 B parameters (747 GB of training state) on every GPU while each token
# uses 28 % of them. **Expert parallelism** (ep) shares each block's experts out over *ep* processes that would
# otherwise be data-parallel replicas: process *r* of an ep group keeps experts [*r*·*E*/*ep*, (*r*+1)·*E*/*ep*), so
# the experts' memory divides by *ep*, and the compute per token stays what it was. A pipeline divides the layers
# on top of that: ep = 8 with pp = 4 takes Mixtral to about 29 GB per process.
#
# pipeviz runs that layout: each process keeps only its own experts' weights, gradients and optimizer state (the
# run below measures it), and gathers them whole only where the whole model is read (`run.state_dict()`, a
# checkpoint): [docs/experts.md](../docs/experts.md), "Held".
#
# ## The all-to-all: dispatch and combine
#
# A token's experts may now live on another process. Per MoE block and microbatch, every process of an ep group
# sends each of its routed rows to the process that owns the row's expert (**dispatch**), every process runs its
# own experts on all the rows it received, and the results go back to where their tokens live (**combine**). Both
# are an `all_to_all_single`: process *r* sends `send[r][s]` rows to process *s*, and receives `send[s][r]`. The
# backward runs the same two exchanges reversed (the gradients of the rows go out, those of the expert inputs
# come back): **four all-to-alls per block and microbatch**.
#
# With ep = 2 over 2 replicas, each replica holding half the batch, the rows each sends to each owner (experts
# 0–1 on process 0, 2–3 on process 1) for the first block:

# %%
EP = 2
halves = [tokens_per_expert(model, half)["blocks.0.experts"] for half in ids.chunk(2)]
send = [[sum(c[s * E // EP:(s + 1) * E // EP]) for s in range(EP)] for c in halves]
for r in range(EP):
    print(f"process {r} routes {halves[r]} rows to experts 0-3: sends {send[r]} rows to processes 0, 1; "
          f"computes {sum(send[s][r] for s in range(EP))} rows")
assert [sum(col) for col in zip(*halves, strict=True)] == unsplit["blocks.0.experts"]

# %% [markdown]
# Each process keeps `send[r][r]` rows and exchanges the others. The process whose experts are more popular
# computes more rows, and the combine cannot finish before it does.
#
# ## A real pp × dp × ep run, checked exact
#
# `pv.launch(..., dp=2, ep=2)` starts 2 stages × 2 replicas = 4 processes (gloo on the CPU); each stage's two
# replicas form an ep group, so each process computes 2 of the 4 experts of every block of its stage, for both
# replicas' tokens. Routing is dropless (every routed token is computed, no capacity limit), so the run is exact:
# `pv.check_numerics` trains the unsplit model on the same batches and compares the losses and every parameter.
# Each all-to-all is an `A2A` action on the timeline, inside the `F` or `B` it belongs to; `run.expert_tokens`
# holds, per forward, block and replica, the rows routed to each expert.

# %%
STEPS, M = 2, 4
plan = pv.trace(model, example_args=(ids[:2],)).split(["blocks.1"])  # blocks 0-1 | blocks 2-3
run = pv.launch(plan, "1F1B", M, steps=STEPS, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy,
                optimizer=pv.sgd(lr=0.1), dp=2, ep=2)
assert run.wait(300) == "done", run.error
print(run.mesh.describe())
numerics = pv.check_numerics(run)
print(numerics)
assert numerics.ok

a2a = [e for e in run.events if e.kind == "A2A"]
per_process = {r: sum(e.rank == r for e in a2a) for r in range(run.mesh.world)}
print(f"A2A actions per process over {STEPS} steps: {per_process}")
assert set(per_process.values()) == {2 * M * 4 * STEPS}  # 2 blocks per stage x 4 microbatches x 4 exchanges
# each process holds its stage's parameters less the other share's experts (the memory meter's bytes before the
# first gradients: the run's memory less the tensors saved for backward)
for r in range(run.mesh.world):
    me = run.mesh.coords(r)
    layers = plan.stages[me.pp].layers
    mine = range(me.dp * E // 2, (me.dp + 1) * E // 2)  # share dp of the ep group: experts 2·dp and 2·dp + 1
    want = sum(t.numel() * t.element_size() for n, t in model.named_parameters()
               if any(n == x or n.startswith(x + ".") for x in layers)
               and not (".experts." in n and int(n.split(".experts.")[1].split(".")[0]) not in mine))
    held = min(m - a for (_, m), (_, a) in zip(run.memory[r], run.activation_memory[r], strict=True))
    stage_bytes = plan.stages[me.pp].param_bytes
    print(f"process {r} (stage {me.pp}, experts {mine.start}-{mine.stop - 1}): {held:,} parameter bytes "
          f"of its stage's {stage_bytes:,}")
    assert held == want < stage_bytes
# the first step routed the same rows as the unsplit model's forward above (routing is per token)
step0 = {name: [sum(ld.counts[e] for ld in run.expert_tokens if ld.step == 0 and ld.block == name) for e in range(E)]
         for name in unsplit}
assert step0 == unsplit, step0

# %%
pv.timeline_figure(run.timeline())

# %% [markdown]
# Zoom into a forward: its `A2A` bars (red) sit inside it, and each process waits in them until its partner, the
# other replica of its stage, reaches the same exchange. How much of each process's compute time went there:

# %%
tl = run.timeline()
for r in range(run.mesh.world):
    busy = sum(e.end - e.start for e in tl.events if e.rank == r and e.kind in ("F", "B"))
    waiting = sum(e.end - e.start for e in tl.events if e.rank == r and e.kind == "A2A")
    print(f"{run.mesh.label(r):32} {waiting / busy:5.0%} of its F and B time in all-to-alls")
    assert 0 < waiting < busy

# %% [markdown]
# ## Load imbalance
#
# `run.expert_tokens` says how evenly the router spread the work. Summed over the first step's microbatches and
# both replicas, the busiest expert of each block against the mean:

# %%
for name, counts in step0.items():
    mean = sum(counts) / E
    print(f"{name}: rows per expert {counts}   max / mean {max(counts) / mean:.2f}")
assert all(max(c) > sum(c) / E for c in step0.values())  # no block perfectly balanced

# %% [markdown]
# An all-to-all is a meeting point: the combine ends when the busiest process has computed its rows, so a block's
# time follows its **most loaded** expert's process, not the mean; the others wait in the `A2A`. At scale this is
# the first thing MoE training fights: an auxiliary loss that rewards even routing (GShard, Switch Transformer), a
# capacity per expert beyond which tokens are dropped (fast, but no longer exact; pipeviz routes dropless), or a
# per-expert bias on the router's scores adjusted between steps (DeepSeek-V3's auxiliary-loss-free balancing).
#
# ## Why DualPipe overlaps one microbatch's forward with another's backward
#
# Within one microbatch the all-to-all cannot hide: the experts need the dispatched rows, the next layer needs the
# combined ones. Across nodes it is long: DeepSeek-V3's report puts cross-node expert parallelism's computation to
# communication at about 1 : 1. Two *different* microbatches are independent, though: while one's forward waits
# for its dispatch, another's backward can compute, and the other way round. **DualPipe** (DeepSeek-V3) is built
# for that: in its steady state every device runs a forward chunk and a backward chunk of different microbatches
# as one pair, their attention, dispatch, MLP and combine interleaved so that each one's all-to-all runs under the
# other's compute.
#
# **DualPipeV**, its V-shaped variant (torch's `ScheduleDualPipeV`), puts 2 stages on each device, the first and
# the last on the same one. Its order, from the simulator (4 stages on 2 devices, 8 microbatches): a forward
# followed by the backward of another microbatch is such a pair (torch's `ScheduleDualPipeV` groups the steady
# state's pairs into one `OVERLAP_F_B` action). 1F1B's steady state alternates F and B as well, but its last stage
# runs each microbatch's backward right after that microbatch's own forward, which it needs: nothing to overlap
# there.

# %%
def pairs(acts):
    """Forwards directly followed by the backward of another microbatch: what DualPipe overlaps."""
    return [f"{a}&{b}" for a, b in itertools.pairwise(acts) if a.kind == "F" and b.kind == "B" and a.mb != b.mb]


dualpipev, one_f_one_b = pv.schedule.orders("DualPipeV", 4, 8), pv.schedule.orders("1F1B", 2, 8)
for r, acts in enumerate(dualpipev):
    print(f"DualPipeV rank {r}: {' '.join(str(a) for a in acts)}")
    print(f"    {len(pairs(acts))} of its {sum(a.kind == 'F' for a in acts)} forwards in a pair: "
          f"{' '.join(pairs(acts)[:4])} ...")
for r, acts in enumerate(one_f_one_b):
    print(f"1F1B rank {r}: {len(pairs(acts))} of its {sum(a.kind == 'F' for a in acts)} forwards in a pair")
assert all(len(pairs(acts)) >= 10 for acts in dualpipev) and not pairs(one_f_one_b[-1])

# %%
pv.timeline_figure(pv.simulate(None, "DualPipeV", 8, costs=pv.Costs.uniform(4), num_stages=4, stages_per_rank=2))

# %% [markdown]
# **The overlap in pipeviz:** `pv.launch(..., schedule="DualPipeV", dp=2, ep=2, ep_overlap=True)` runs each
# `OVERLAP_F_B` pair's backward in a second thread while its forward runs (torchtitan's way, its PR #1721; torch
# 2.13's runtime, installed here, would run the two in turn), each half's all-to-alls over its own process group so
# that the two threads' collectives never pair up wrongly. The same ops on the same values: exact, the losses equal
# bit for bit to the run without it (`tests/test_ep_overlap.py`). The halves interleave as the threads wait, not
# chunk by chunk as DualPipe's hand-written pairs do. On these CPUs an all-to-all of a few hundred bytes takes a
# millisecond, so `ep_delay` slows the link for the demonstration: 20 ms more per all-to-all. The simulator prices a
# pair as the longer half, or both halves' compute when that is longer (one device computes both):

# %%
plan4 = pv.trace(model, example_args=(ids[:2],)).split(["blocks.0", "blocks.1", "blocks.2"])  # 2 stages per rank
slowed = pv.LaunchConfig(schedule="DualPipeV", microbatches=8, loss_fn=pv.cross_entropy, dp=2, ep=2, ep_delay=0.02)
alone, overlapped = pv.simulate(plan4, slowed), pv.simulate(plan4, slowed.replace(ep_overlap=True))
print(f"DualPipeV, all-to-alls 20 ms slower: step {alone.step_time:.3f} s in turn, {overlapped.step_time:.3f} s "
      f"overlapped ({overlapped.step_time / alone.step_time:.0%})")
assert overlapped.step_time < alone.step_time

# %% [markdown]
# Under 1F1B, `ep_overlap=True` runs a **combined 1F1B** (Megatron-Core's idea): every stage warms up with
# more forwards, then runs each forward beside the backward of an earlier microbatch, the last stage's beside the
# previous microbatch's. The price is memory: the first of p stages holds up to 2p microbatches' activations
# instead of p. Other schedules are refused before any process starts, naming DualPipeV and 1F1B.
#
# ## Exercise
#
# In the real run above, take **step 0, block `blocks.0.experts`, microbatch 0**. Stage 0's two processes form one
# ep group: process 0 computes experts 0 and 1, process 1 experts 2 and 3, each on the rows of **both** replicas.
# How many rows does the **busier** of the two compute for that block and microbatch? Set `my_answer` to that
# number (read it from `run.expert_tokens`, by hand or in code).

# %%
my_answer = None  # your answer here: an integer


# %%
def check(answer):
    """The busier share's rows: experts [2s, 2s + 2) summed over both replicas, the larger of the two shares."""
    loads = [ld for ld in run.expert_tokens if (ld.step, ld.block, ld.mb) == (0, "blocks.0.experts", 0)]
    shares = [sum(sum(ld.counts[2 * s:2 * s + 2]) for ld in loads) for s in range(2)]
    expected = max(shares)
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: keep the two ExpertLoads with step 0, that block and mb 0.")
    elif answer == expected:
        print(f"✅ Correct: {shares[0]} and {shares[1]} rows; the busier computes {expected}, "
              f"{expected / (sum(shares) / 2):.2f}x the mean, and its partner waits for it in the combine.")
    elif answer == sum(shares) / 2:
        print("❌ Not yet: that is the mean, what a perfectly balanced router would give each process.")
    elif answer == max(sum(ld.counts[e] for ld in loads) for e in range(4)):
        print("❌ Not yet: that is the busiest expert. Hint: each process computes two experts.")
    elif answer in [sum(ld.counts[2 * s:2 * s + 2]) for ld in loads for s in range(2)]:
        print("❌ Not yet: that counts one replica's rows. Hint: the dispatch brings both replicas' rows.")
    else:
        print(f"❌ Not yet: not {answer!r}. Hint: process s computes experts 2s and 2s + 1 for both replicas.")


check(my_answer)
