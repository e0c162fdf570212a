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
# # Lesson 9 · Inference pipelining
#
# **You will learn:** how a pipeline runs forward only, as the PiPPy walkthrough (*PiPPy实战*, the tutorial this
# project started from, redone in notebook 01) does; what its bubble and memory are without backwards; why
# pipelining raises throughput (a batch even finishes sooner) but not the latency of one microbatch or one request;
# how autoregressive decode fills a pipeline (and what each request's KV cache costs); and which schedules can run
# without a backward.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese); the
# [schedules cheat sheet](../docs/schedules.md) (every schedule's bubble, memory and traffic on one page).
#
# **Lessons:** ← [Lesson 8 · Choosing the number of microbatches](08_choosing_microbatches.ipynb) ·
# [Lesson 10 · Going multi-host](10_going_multi_host.ipynb) →
#
# ## Forward only
#
# Serving a model too big for one device splits it the same way training does, but each microbatch only flows
# *down* the pipeline: no backward, no gradients, no optimizer state. With *p* equal stages of forward time *F*
# and *m* microbatches the step takes (*m* + *p* − 1)·*F*, so the bubble is the same (*p* − 1)/(*m* + *p* − 1) as
# GPipe's; the memory per rank is its stage's weights plus the activations of the microbatch it is computing
# (nothing waits for a backward).

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import torch

import pipeviz as pv
from pipeviz.zoo import MyNetwork

p = 3
for m in (1, 2, 4, 8):
    tl = pv.simulate(None, "GPipe", m, costs=pv.Costs.uniform(p), num_stages=p, forward_only=True)
    assert tl.step_time == m + p - 1 and abs(tl.bubble_fraction - (p - 1) / (m + p - 1)) < 1e-9
    print(f"m = {m}: step {tl.step_time:g} F, bubble {tl.bubble_fraction:.0%}")

# %% [markdown]
# ## Throughput, not the latency of a request
#
# One microbatch alone still crosses all *p* stages one after the other: *p*·*F*, no faster than one device would
# be (plus the hand-offs). What the pipeline adds is **throughput**: once full, it finishes a microbatch every *F*.
# A batch whose forward takes *F*<sub>b</sub> per stage, cut into *m* microbatches, is done after (*m* + *p* −
# 1)·*F*<sub>b</sub>/*m*: from *p*·*F*<sub>b</sub> at *m* = 1 towards *F*<sub>b</sub> — as long as small
# microbatches stay efficient and each rank has its own device (lesson 8). The simulator, with ideal costs:

# %%
for m in (1, 2, 4, 8):
    tl = pv.simulate(None, "GPipe", m, costs=pv.Costs.uniform(p, forward=1 / m), num_stages=p, forward_only=True)
    assert abs(tl.step_time - (m + p - 1) / m) < 1e-9
    print(f"batch in {m} microbatch(es): done after {tl.step_time:.2f} F_b")

# %% [markdown]
#
# ## A real forward-only run
#
# `pv.launch` without a `loss_fn` runs torch's schedule forward only; `run.outputs[step]` is the model's output for
# the whole batch, the microbatches joined back, and `pv.check_numerics` compares it with the unsplit model's. The
# real runs use two stages, one rank per core of a 2-core machine (three ranks on two cores would share a core
# whenever two could work at once, and the measured idle time would say more about the cores than the schedule);
# the simulations below keep *p* = 3.

# %%
torch.manual_seed(0)
model = MyNetwork(1024, [1024] * 6).eval()
x = torch.randn(256, 1024)
plan = pv.balance(pv.trace(model, example_args=(x,)), num_stages=p, by="params")
plan2 = pv.balance(pv.trace(model, example_args=(x,)), num_stages=2, by="params")   # the real runs: 2 ranks

runs = {}
for m in (1, 4):
    run = pv.launch(plan2, "GPipe", microbatches=m, steps=3, inputs=(x,))   # no loss_fn: forward only
    assert run.wait(180) == "done", run.error
    runs[m] = run
with torch.no_grad():
    expected = model(x)
for m, run in runs.items():
    tl = run.timeline()
    gap = float((run.outputs[-1] - expected).abs().max())
    print(f"m = {m}: output {tuple(run.outputs[-1].shape)}, max |difference| from model(x) {gap:.1e}; "
          f"step {tl.step_time * 1e3:6.1f} ms, bubble {tl.bubble_fraction:4.0%}")
    assert gap < 1e-5
    assert {e.kind for e in tl.events} & {"B", "I", "W"} == set()          # forwards only
    assert tl.order(0, step=1) == pv.simulate(plan2, "GPipe", m, forward_only=True).order(0)
numerics = pv.check_numerics(runs[4])
print(numerics)
assert numerics.ok
# What the text claims: more microbatches leave less of the devices idle on the real run too.
assert runs[4].timeline().bubble_fraction < runs[1].timeline().bubble_fraction

# %% [markdown]
# The outputs equal the unsplit model's, only forwards ran, in the order the simulator plays, and the devices
# idled less with 4 microbatches than with 1 (the cell asserts each: on two ranks the formula says 50 % against
# 20 %; the real runs add the hand-offs and the joining of the output).

# %%
pv.TimelineView(runs[4])

# %% [markdown]
# ## Memory without training
#
# `pv.simulate(..., forward_only=True)` counts weights and one microbatch's activations per rank; training adds
# gradients and Adam's two states (16 bytes per parameter instead of 4, lesson 1; the lessons' own runs train
# with plain SGD, which keeps no state) and every activation a backward still needs: about 4× here.

# %%
infer_mem = pv.simulate(plan, "GPipe", 4, forward_only=True).memory_bytes
train_mem = pv.simulate(plan, "GPipe", 4).memory_bytes
print("forward only (MiB):", [round(b / 2**20, 1) for b in infer_mem])
print("training     (MiB):", [round(b / 2**20, 1) for b in train_mem])
assert all(3.5 * i < t for i, t in zip(infer_mem, train_mem, strict=True))   # weights vs weights x 4 + acts

# %% [markdown]
# ## Autoregressive decode: keep *p* requests in flight
#
# A language model generates one token at a time: token *t* + 1 of a request needs token *t*, which must leave the
# last stage first. One request alone therefore keeps one stage busy at a time: a token every *p*·*F*, each rank
# idle (*p* − 1)/*p* of the time. With **several requests in flight**, one per stage, each stage works on another
# request's token: **one token per request per pass** through the pipeline, and with *p* requests the pipe is full.
# More than *p* gains nothing but wait. (pipeviz's simulator treats microbatches as independent, so it cannot hold
# token *t* + 1 back until token *t* is out; the few lines below play the pipeline with that dependency, each stage
# serving tokens in arrival order, *F* = 1 per token and stage.)

# %%
def decode(p, requests, tokens):
    """Each request generates ``tokens`` tokens through ``p`` stages (1 time unit each, first come first served):
    (tokens per time unit over the whole run, time between a request's last two tokens)."""
    free, out = [0] * p, [0] * requests          # when each stage is next free; when each request's token left
    for _ in range(tokens):
        before = out[0]
        for r in range(requests):
            t = out[r]
            for s in range(p):
                t = max(t, free[s]) + 1
                free[s] = t
            out[r] = t
    return requests * tokens / max(out), out[0] - before


for requests in (1, 2, p, 2 * p):
    rate, gap = decode(p, requests, tokens=64)
    print(f"{requests} request(s) in flight: {rate:.2f} tokens per F, a request's next token every {gap} F")
assert decode(p, 1, 64) == (1 / p, p)                      # one request: a token every p F
rate_p, gap_p = decode(p, p, 64)
assert rate_p > 0.98 and gap_p == p                        # p requests: the pipe full, each still a token per p F
rate_2p, gap_2p = decode(p, 2 * p, 64)
assert rate_2p - rate_p < 0.01 and gap_2p == 2 * p         # beyond p: no more throughput, a longer wait per token

# %% [markdown]
# Each request in flight keeps its **KV cache**: every attention layer's keys and values for every token so far,
#
# 2 (keys and values) × layers × kv_heads × head_dim × sequence × bytes per element,
#
# and under pipelining each stage keeps the cache of its own layers for every request in flight. A small
# Llama-shaped model (4 layers, 2 key-value heads of dimension 16, float32) after a 12-token prompt, measured from
# the cache Hugging Face's model returns:

# %%
from transformers import LlamaConfig, LlamaForCausalLM

llama_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256)
torch.manual_seed(0)
llama = LlamaForCausalLM(llama_config).eval()
with torch.no_grad():
    cache = llama(torch.randint(0, 256, (1, 12)), use_cache=True)[1]   # the output's cache (its second field)
measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
head_dim = llama_config.hidden_size // llama_config.num_attention_heads
per_request = 2 * llama_config.num_hidden_layers * llama_config.num_key_value_heads * head_dim * 12 * 4
print(f"KV cache of one 12-token request: measured {measured} bytes, formula {per_request}")
assert measured == per_request == 12288
# A Llama-2-7B-shaped model (32 layers, 32 key-value heads of 128, float16) at 4096 tokens: 2 GiB per request; on
# p = 4 stages with p requests in flight, each stage holds its 8 layers' share of 4 requests: one request's worth.
big = 2 * 32 * 32 * 128 * 4096 * 2
assert big == 2 * 2**30 and big // 4 * 4 == big
print(f"Llama-2-7B shape, 4096 tokens: {big / 2**30:g} GiB per request; per stage with 4 requests in flight on "
      f"4 stages: {big / 4 * 4 / 2**30:g} GiB")

# %% [markdown]
# That cache, not the weights, is what limits how many requests a serving pipeline keeps in flight: filling the
# pipe takes *p* of them, and each costs its full cache, spread over the stages.
#
# ## Which schedules run forward only
#
# GPipe and 1F1B are the same without backwards. The V-shaped schedules (ZBVZeroBubble, DualPipeV) are built
# around split backwards; torch's implementation needs one, so pipeviz refuses them before starting anything,
# and `pv.compare(..., forward_only=True)` lists them as skipped:

# %%
print(pv.compare(plan, microbatches=4, forward_only=True).table())
plan4 = pv.balance(pv.trace(model, example_args=(x,)), num_stages=4, by="params")
try:
    pv.launch(plan4, "ZBVZeroBubble", microbatches=4, steps=1, inputs=(x,))
    raise AssertionError("a V-shaped schedule ran forward only")
except pv.LaunchError as err:
    print("refused:", err)

# %% [markdown]
# ## Exercise
#
# A forward-only pipeline of **p = 4** equal stages serves a batch cut into **m = 8** microbatches. What share of
# the devices' time is idle? Set `my_answer` to a number between 0 and 1.

# %%
my_answer = None  # your answer here: a number


# %%
def check(answer):
    """The forward-only GPipe bubble of 4 equal stages and 8 microbatches, from pipeviz's simulation."""
    expected = pv.simulate(None, "GPipe", 8, costs=pv.Costs.uniform(4), num_stages=4,
                           forward_only=True).bubble_fraction
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: the step is (m + p - 1) F; each rank computes m F of it.")
    elif not isinstance(answer, (int, float)):
        print(f"❌ Not yet: my_answer should be a number, got {answer!r}.")
    elif abs(answer - expected) < 1e-3:
        print(f"✅ Correct: (p - 1) / (m + p - 1) = 3 / 11 = {expected:.3f}, as for GPipe's training step.")
    elif abs(answer - 3 / 8) < 1e-3:
        print("❌ Not yet: 3/8 is (p - 1) / m, the bubble measured against the ideal time. Hint: share of the step.")
    else:
        print(f"❌ Not yet: not {answer!r}. Hint: (p - 1) / (m + p - 1).")


check(my_answer)
