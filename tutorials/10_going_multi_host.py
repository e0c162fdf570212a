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
# # Lesson 10 · Going multi-host
#
# **You will learn:** how `torchrun` starts pipeline ranks on several machines, how ranks are numbered, and how to
# export a pipeviz plan and watch it run.
#
# **See also:** [notebook 01, the quickstart](../notebooks/01_quickstart.ipynb) (the PiPPy walkthrough, redone)
# and its glossary (*Glossary · 术语表*, the notebook's last section: every term in English and Chinese); the
# [schedules cheat sheet](../docs/schedules.md) (every schedule's bubble, memory and traffic on one page).
#
# **Lessons:** ← [Lesson 9 · Inference pipelining](09_inference_pipelining.ipynb) ·
# [Lesson 11 · Composing pipeline, data and tensor parallelism](11_composing_pp_dp_tp.ipynb) →
#
# ## torchrun, nodes and ranks
#
# On each machine (a *node*), one `torchrun` agent starts `--nproc-per-node` worker processes. The agents meet at
# a rendezvous (`--master-addr`, `--master-port`, the same on every node), agree on `--nnodes`, and give each
# worker a global **rank**:
#
# rank = node_rank × nproc_per_node + local_rank,   world size = nnodes × nproc_per_node.
#
# A pipeline places stage *s* on a rank (single-stage schedules: stage *s* on rank *s*), so consecutive stages on
# the same node talk over fast local links and only the stages at a node boundary cross the network: one
# activation per microbatch, which is why pipelining suits slow links between machines better than tensor
# parallelism.
#
# We pretend to have two nodes by starting two `torchrun` agents on this machine, each with two workers: 4 ranks
# for 4 stages.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

torch.manual_seed(0)
model = MyNetwork(64, [64, 64, 64])       # layer0..layer2, output_proj: 4 stages of one layer
x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
plan = pv.trace(model, example_args=(x,)).split(["layer0", "layer1", "layer2"])
workdir = Path(tempfile.mkdtemp(prefix="pipeviz_multi_host_"))

# %% [markdown]
# ## Export
#
# `pv.export_torchrun` validates everything `pv.launch` would (schedule, microbatches, loss), then writes a small
# script and a payload with the stages, inputs, targets, loss and optimizer. Copy both to every node; each needs
# pipeviz installed.

# %%
script = pv.export_torchrun(plan, workdir / "train_pp.py", schedule="1F1B", microbatches=4, steps=5,
                            inputs=(x,), target=y, loss_fn=F.cross_entropy)
print(sorted(p.name for p in workdir.iterdir()))


# %% [markdown]
# ## Two nodes on one machine
#
# Both agents get the same rendezvous address; only `--node-rank` differs. (With the static rendezvous used here
# `--node-rank` is each node's rank; under a c10d rendezvous (`--rdzv-backend c10d`) the rendezvous assigns the node
# ranks and `--node-rank` is ignored. On real machines `--master-addr` is
# node 0's address, reachable from all.) Every rank writes its events to `train_pp_events/rank<R>.jsonl`, and
# `pv.watch` follows them live. torchrun tells each worker where it is through its environment: `RANK` (global),
# `GROUP_RANK` (its node's rank) and `LOCAL_RANK`; a small wrapper records them before running the exported script,
# so we can check the numbering below.

# %%
WRAPPER = '''import json, os, runpy
here = os.path.dirname(os.path.abspath(__file__))
who = {key: int(os.environ[key]) for key in ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE")}
with open(os.path.join(here, f"whoami_rank{who['RANK']}.json"), "w") as f:
    json.dump(who, f)
runpy.run_path(os.path.join(here, "train_pp.py"), run_name="__main__")
'''
(workdir / "whoami_then_train.py").write_text(WRAPPER)


def free_port() -> int:
    """A TCP port nobody listens on now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

NNODES, NPROC_PER_NODE = 2, 2
port = free_port()
agents = []
for node_rank in range(NNODES):
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NNODES),
               "--node-rank", str(node_rank), "--nproc-per-node", str(NPROC_PER_NODE),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "whoami_then_train.py"]
    print("node", node_rank, ":", " ".join(command[3:]))
    agents.append(subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True))
watch = pv.watch(workdir / "train_pp_events", timeout=180)
view = pv.TimelineView(watch)     # redraws (throttled) whenever the rank files grow
view

# %%
for agent in agents:
    output, _ = agent.communicate(timeout=240)
    assert agent.returncode == 0, output
assert watch.wait(60) == "done", watch.error
tl = watch.timeline()
print(f"{tl.num_ranks} ranks; losses {[round(v, 4) for v in watch.losses]}")
for rank in range(tl.num_ranks):
    who = json.loads((workdir / f"whoami_rank{rank}.json").read_text())   # what torchrun told the worker
    node, local = who["GROUP_RANK"], who["LOCAL_RANK"]
    print(f"rank {rank} = node {node}, local rank {local}: {' '.join(map(str, tl.order(rank, step=0)))}")
    assert rank == node * NPROC_PER_NODE + local and who["WORLD_SIZE"] == NNODES * NPROC_PER_NODE  # the formula
    assert str(tl.order(rank, step=0)[0]) == f"{rank}F0"                    # single-stage schedule: stage s on rank s

# %% [markdown]
# ## Numerics
#
# Four processes on two "nodes" trained exactly like the unsplit model. A torchrun job is not a `pv.launch` run,
# so `pv.check_numerics(run)` (which retrains from the run's own recipe) does not apply; `pv.train_reference`
# trains the unsplit model the way the schedule does (same inputs, loss and microbatches; `None` is the default
# optimizer, as in the export), and the losses must agree:

# %%
ref_losses, _ = pv.train_reference(model, (x,), y, loss_fn=F.cross_entropy, optimizer=None, microbatches=4, steps=5)
gap = max(abs(a - b) for a, b in zip(watch.losses, ref_losses, strict=True))
print(f"largest loss difference against the unsplit model: {gap:.1e}")
assert gap < 1e-5
shutil.rmtree(workdir)  # the exports were for this lesson; a kernel's shutdown would leave them

# %% [markdown]
# ## Exercise
#
# Schedules decide which rank holds which stage. Suppose you re-export a **ZBVZeroBubble** plan with **8 stages**
# and start it on the same **2 nodes × 2 processes**. Which **rank** holds each stage? Set `my_answer` to a list of
# 8 ranks, stage 0's first. (`pv.schedule.layout` answers it, but reason first: ZB-V places stages in a V; then
# say which stages' hand-offs cross between the nodes.)

# %%
my_answer = None  # your answer here: [rank of stage 0, rank of stage 1, ..., rank of stage 7]


# %%
def check(answer):
    """The rank of each of ZBV's 8 stages on 2 nodes x 2 processes."""
    expected = list(pv.schedule.layout("ZBVZeroBubble", num_stages=8).stage_ranks)
    if answer is None:
        print("❌ Not yet: set my_answer above. Hint: draw the V over ranks 0-3: down, then back up.")
    elif not (isinstance(answer, (list, tuple)) and len(answer) == 8):
        print(f"❌ Not yet: my_answer should be a list of 8 ranks, got {answer!r}.")
    elif list(answer) == expected:
        crossing = [s for s in range(7) if expected[s] // 2 != expected[s + 1] // 2]
        print(f"✅ Correct: {expected}: rank 0 holds the first and the last stage; only the hand-offs after stages "
              f"{crossing} cross between the nodes.")
    elif list(answer) == [s % 4 for s in range(8)]:
        print("❌ Not yet: that is the looped placement of interleaved schedules. Hint: a V comes back.")
    else:
        wrong = [s for s in range(8) if answer[s] != expected[s]]
        print(f"❌ Not yet: stages {wrong} are elsewhere. Hint: stage s < 4 is on rank s; the V turns at rank 3.")


check(my_answer)
