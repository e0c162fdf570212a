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
# # 03 · Schedules compared
#
# torch ships seven pipeline schedules. pipeviz simulates each with the same costs, so you can compare step time,
# bubble (idle share) and memory before running anything, then check a couple against real runs.
#
# | schedule | stages/rank | idea |
# |---|---|---|
# | GPipe | 1 | all forwards, then all backwards (Huang et al. 2019) |
# | 1F1B | 1 | one forward, one backward: at most *p* microbatches alive (PipeDream-Flush, Narayanan et al. 2021) |
# | Interleaved1F1B | *v* | 1F1B over *v* model chunks per rank: bubble / *v* (Narayanan et al. 2021) |
# | LoopedBFS | *v* | breadth-first over the chunks (Lamy-Poirier 2023) |
# | InterleavedZeroBubble | *v* | backward = input-grad *I* + weight-grad *W*; *W* fills bubbles (Qi et al. 2024) |
# | ZBVZeroBubble | 2, V-shaped | zero bubble, V: rank 0 holds the first and last stage (Qi et al., arXiv 2401.10241) |
# | DualPipeV | 2, V-shaped | overlaps a forward and a backward: DualPipe "cut in half" (note below) |
#
# DualPipeV is the V-shaped variant in DeepSeek's DualPipe repository, credited there to Sea AI Lab; the DeepSeek-V3
# report describes DualPipe itself, bidirectional, which holds two copies of the parameters.
#
# Each one's bubble formula, peak memory, pipeline traffic and needs are on one page: the
# [schedules cheat sheet](../docs/schedules.md).

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import os

import plotly.graph_objects as go
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

torch.manual_seed(0)
model = MyNetwork(512, [512] * 7)   # layer0 .. layer6, output_proj
x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
graph = pv.trace(model, example_args=(x,))
plan4 = pv.balance(graph, num_stages=4)   # 4 stages: 4 ranks, or 2 ranks x 2 stages
print(plan4)

# %% [markdown]
# ## Every schedule on one plan
#
# `pv.compare` holds the device count fixed: on the plan's 4 ranks, single-stage schedules run its 4 stages and
# multi-stage ones an 8-stage split balanced the same way (2 stages per rank), so every row answers "which schedule
# for these 4 devices?" — compare *step time* and *memory per rank*, not just bubbles.

# %%
cmp = pv.compare(plan4, microbatches=8)
print(cmp.table())
pv.comparison_figure(cmp)

# %% [markdown]
# ## The textbook picture: equal stages, F = 1, B = 2
#
# `pv.Costs.uniform` drops real costs and communication; what remains is the schedules' structure. Here every
# schedule runs 4 ranks; multi-stage ones split each rank's work into 2 chunks of half the cost.

# %%
p, m = 4, 8
for schedule in pv.schedule.ALL:
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    tl = pv.simulate(None, schedule, m, costs=pv.Costs.uniform(p * v, forward=1 / v, backward=2 / v),
                     num_stages=p * v, stages_per_rank=None if v == 1 else v)
    print(f"{schedule:22} step {tl.step_time:5.2f}  ideal {m * 3}  bubble {tl.bubble_fraction:5.1%}")

# %% [markdown]
# ## Bubble against microbatches
#
# More microbatches shrink the bubble of every schedule (GPipe's is (p−1)/(m+p−1)), but each microbatch gets
# smaller and per-microbatch overheads grow. Simulated on the real plan; combinations a schedule cannot run (1F1B
# needs m ≥ stages) are left out.

# %%
fig = go.Figure()
for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
    ms, bubbles = [], []
    for m in (1, 2, 4, 8, 16, 32):
        try:
            bubbles.append(pv.simulate(plan4, schedule, microbatches=m).bubble_fraction)
            ms.append(m)
        except pv.ScheduleError:
            pass
    fig.add_scatter(x=ms, y=bubbles, name=schedule, mode="lines+markers")
fig.update_layout(xaxis_type="log", xaxis_title="microbatches", yaxis_title="bubble (idle share)",
                  yaxis_tickformat=".0%", height=380)
fig

# %% [markdown]
# ## Two real runs
#
# 1F1B on a 2-stage plan and ZBVZeroBubble on the 4-stage plan: both on 2 processes. `pv.profile` first measures
# each layer at the microbatch size (with the threads each of the 2 ranks gets: the cores this process may use,
# halved, at least one); `graph.with_profile` attaches
# the measurements, so plans made from that graph, or moved onto it with `plan.onto`, simulate with measured
# costs. The ranks run exactly the simulated order; times differ by communication and by what else the machine is
# doing.

# %%
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
graph = graph.with_profile(pv.profile(graph, microbatches=4, threads=max(1, CORES // 2)))
plan2 = pv.balance(graph, num_stages=2)   # balanced by measured time
plan4 = plan4.onto(graph)                 # the same 4 stages as above, now with measured costs
runs = {}
for schedule, plan in (("1F1B", plan2), ("ZBVZeroBubble", plan4)):
    run = pv.launch(plan, schedule=schedule, microbatches=4, steps=3, inputs=(x,), target=y,
                    loss_fn=F.cross_entropy)
    assert run.wait(180) == "done", run.error
    runs[schedule] = (run, pv.simulate(plan, schedule, microbatches=4))
for schedule, (run, sim) in runs.items():
    tl = run.timeline()
    assert tl.order(0, step=1) == sim.order(0)
    print(f"{schedule:14} measured {tl.step_time * 1e3:6.1f} ms, bubble {tl.bubble_fraction:4.0%} | "
          f"simulated {sim.step_time * 1e3:6.1f} ms, bubble {sim.bubble_fraction:4.0%}")
print("rank 0 under ZBV:", " ".join(map(str, runs["ZBVZeroBubble"][0].timeline().order(0, step=1))))

# %%
pv.TimelineView(runs["ZBVZeroBubble"][0], overlay=runs["ZBVZeroBubble"][1])
