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
# # 05 · Scale out: export a torchrun script, run it, watch it
#
# `pv.launch` runs every rank on this machine. For many hosts, `pv.export_torchrun` writes a script (plus a
# payload file with the stages, inputs, loss and optimizer) that `torchrun` starts on each host. Every rank
# appends its events to `<script>_events/rank<R>.jsonl`; `pv.watch` follows that folder live, so a notebook can
# chart a run it did not start.
#
# Here the "cluster" is this machine: three processes on 127.0.0.1.

# %%
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code

# %%
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
model = MyNetwork(256, [256, 256, 256])
x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
plan = pv.trace(model, example_args=(x,)).split(["layer0", "layer1"])
workdir = Path(tempfile.mkdtemp(prefix="pipeviz_scale_out_"))  # keep exports out of the repository

# %%
script = pv.export_torchrun(plan, workdir / "train_pp.py", schedule="1F1B", microbatches=4, steps=10,
                            inputs=(x,), target=y, loss_fn=F.cross_entropy)
print(sorted(p.name for p in workdir.iterdir()))
print(script.read_text())


# %% [markdown]
# Start `torchrun` (as `python -m torch.distributed.run`, with this kernel's interpreter) in the background, and
# watch the events folder while it runs.

# %%
def free_port() -> int:
    """A TCP port nobody listens on now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

port = free_port()
command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)]
print(" ".join(command[1:]))
watch = pv.watch(workdir / "train_pp_events", timeout=180)
proc = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
view = pv.TimelineView(watch)     # redraws (throttled) whenever the rank files grow
view

# %%
output, _ = proc.communicate(timeout=240)
assert proc.returncode == 0, output
assert watch.wait(60) == "done", watch.error
print("torchrun losses:", [round(v, 4) for v in watch.losses])
tl = watch.timeline()
print(f"{tl.num_ranks} ranks, {len(tl.events)} events, step {tl.step_time * 1e3:.1f} ms")

# %% [markdown]
# ## Same plan, same numbers as `pv.launch`
#
# The exported script builds the same stages and relays and runs the same schedule, so its losses match a
# `pv.launch` of the same plan.

# %%
run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=10, inputs=(x,), target=y, loss_fn=F.cross_entropy)
assert run.wait(180) == "done", run.error
gap = max(abs(a - b) for a, b in zip(watch.losses, run.losses, strict=True))
print(f"largest loss difference, torchrun vs pv.launch: {gap:.1e}")
assert gap < 1e-6
shutil.rmtree(workdir)  # the exports were for this demo; a kernel's shutdown would leave them

# %% [markdown]
# On real hosts: copy `train_pp.py` and `train_pp.payload.pkl` to each (pipeviz installed), then on host *i* of
# *N*
#
# ```bash
# torchrun --nnodes N --node-rank i --nproc-per-node K --master-addr HOST0 --master-port 29500 train_pp.py
# ```
#
# and point `pv.watch` at the events folder (a shared filesystem, or copy the `rank*.jsonl` files back).
# `tutorials/10_going_multi_host` walks through two nodes.
