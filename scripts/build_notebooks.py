#!/usr/bin/env python
"""Write the demo notebooks (``notebooks/``) and the lessons (``tutorials/``) from the cells defined here.

The .ipynb files are generated, never edited by hand: change a cell here and run

    .venv/bin/python scripts/build_notebooks.py            # writes every notebook, without outputs
    .venv/bin/python scripts/build_notebooks.py --check    # exit 1 if a committed notebook is out of date

Cell ids are deterministic, so a rebuild without changes leaves the files byte-identical.
``SOLUTIONS`` holds a right and a wrong answer for every tutorial's exercise; ``tests/test_notebooks.py``
runs each lesson with both appended and checks that its ``check()`` cell tells them apart.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]

Cell = tuple[str, str]  # ("md" | "code", source)


def md(text: str) -> Cell:
    return ("md", textwrap.dedent(text).strip("\n"))


def code(*parts: str) -> Cell:
    """A code cell; several parts (e.g. a shared helper, then the cell's own code) are joined by a blank line."""
    return ("code", "\n\n".join(textwrap.dedent(part).strip("\n") for part in parts))


# Shared first code cell: quiet torch.export's deprecation chatter, nothing else.
SETUP = """\
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export internals; not about your code
"""

FREE_PORT = '''\
def free_port() -> int:
    """A TCP port nobody listens on now (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
'''

# ================================================================================================ notebooks/

QUICKSTART: list[Cell] = [
    md("""
    # 01 · Quickstart: the PiPPy walkthrough, redone in a notebook

    PiPPy, the project that became `torch.distributed.pipelining`, introduced itself with a small network,
    `MyNetwork(512, [512, 1024, 256])`: mark split points after `layer0` and `layer1`
    (`annotate_split_points(mn, {'layer0': SplitPoint.END, 'layer1': SplitPoint.END})`), build the `Pipe` for a batch
    of 32 in 4 chunks (`pipeline(mn, chunks, example_args=(x,))`), then run its three stages under `torchrun`. Here is
    the same walkthrough, from one notebook:

    1. **trace** the model once and look at its layers,
    2. **split** it and preview every stage (parameters, FLOPs, bytes sent, memory) without building anything,
    3. **simulate** a training step,
    4. **launch** the three stages as real processes and watch the timeline fill in live,
    5. **check the numerics** against the unsplit model.
    """),
    code(SETUP),
    code("""
    import tempfile
    from pathlib import Path

    import torch
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.zoo import MyNetwork

    torch.manual_seed(0)
    model = MyNetwork(512, [512, 1024, 256])  # blocks layer0, layer1, layer2 (Linear + ReLU), then output_proj
    x = torch.randn(32, 512)                  # one full batch of inputs
    y = torch.randint(0, 10, (32,))           # its class labels
    """),
    md("""
    ## 1. Trace once

    `pv.trace` captures the model with `torch.export` (what torch's `pipeline()` uses, so every offered split really
    splits) and measures each layer: parameters, forward FLOPs for this batch, and the bytes of the activation it
    hands on. Your `model` is never modified; pipeviz works on deep copies.
    """),
    code("""
    graph = pv.trace(model, example_args=(x,))
    for layer in graph.layers:
        print(f"{layer.name:12} {layer.kind:15} params={layer.params:>9,}  MFLOPs={layer.flops / 1e6:6.1f}"
              f"  out={layer.out_bytes / 1024:6.1f} KiB")
    print("valid split points:", graph.split_candidates)
    """),
    md("""
    ## 2. Split after `layer0` and `layer1`

    In today's torch this is `pipeline(model, mb_args=..., split_spec={"layer0": SplitPoint.END, "layer1":
    SplitPoint.END})`. `graph.split` validates the names and previews the three stages straight from the graph (well
    under a millisecond; no tracing).
    """),
    code("""
    plan = graph.split(["layer0", "layer1"])
    print(plan)
    print("torch split_spec:", plan.split_spec)
    """),
    md("""
    The preview is computed, but the real thing is one call away: `plan.pipe()` runs torch's `pipeline()` on a fresh
    deep copy and returns its `Pipe`, one `submod_pp_<i>` per stage.
    """),
    code("""
    pipe = plan.pipe(microbatches=4)
    print(pipe.num_stages, "stages")
    print(pipe.split_gm.code)
    """),
    md("""
    ## 3. Simulate a step

    Before starting any process, `pv.simulate` plays the schedule's per-rank order (torch's own) with costs
    estimated from FLOPs and bytes. Each row of the chart is a rank; `0F1` is stage 0's forward of microbatch 1,
    `2B3` stage 2's backward of microbatch 3.
    """),
    code("""
    sim = pv.simulate(plan, "1F1B", microbatches=4)
    print(f"predicted step {sim.step_time * 1e3:.2f} ms, idle share (bubble) {sim.bubble_fraction:.0%}")
    print("rank 0 runs:", " ".join(sim.order(0)))
    sim.figure()
    """),
    md("""
    ## 4. Launch the three stages

    `pv.launch` starts one process per rank (gloo on CPU), runs torch's real `Schedule1F1B` and returns at once.
    `pv.TimelineView(run)` draws the measured events while they arrive, with the simulation as a thin overlay.
    """),
    code("""
    def sgd(params):  # built again on every rank
        return torch.optim.SGD(params, lr=0.1)

    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=5, inputs=(x,), target=y,
                    loss_fn=F.cross_entropy, optimizer=sgd)
    view = pv.TimelineView(run, overlay=sim)
    view
    """),
    code("""
    status = run.wait(120)
    assert status == "done", run.error
    print("losses per step:", [round(loss, 4) for loss in run.losses])
    measured = run.timeline()
    print(f"measured step {measured.step_time * 1e3:.2f} ms, bubble {measured.bubble_fraction:.0%}")
    # The processes ran exactly the order the simulator played:
    assert measured.order(0, step=1) == sim.order(0)
    print("rank 0 ran:", " ".join(measured.order(0, step=1)))
    """),
    md("""
    On a laptop CPU the measured step is dominated by process and communication overheads; the *shape* (who waits
    for whom) is what the chart shows. Export it for [Perfetto](https://ui.perfetto.dev) if you like:
    """),
    code("""
    trace_path = measured.to_chrome_trace(Path(tempfile.mkdtemp()) / "quickstart_trace.json")
    print("Chrome trace written to", trace_path)
    """),
    md("""
    ## 5. Numerics: the pipeline trains exactly like the unsplit model

    `pv.train_reference` trains a deep copy of the unsplit model the way the schedule does (same microbatches,
    gradients summed then divided by their count). Losses and every trained parameter must agree.
    """),
    code("""
    ref_losses, ref_state = pv.train_reference(model, (x,), y, F.cross_entropy, sgd, microbatches=4, steps=5)
    trained = run.state_dict()  # gathered from all stages, keyed by the original model's names
    loss_gap = max(abs(a - b) for a, b in zip(run.losses, ref_losses, strict=True))
    param_gap = max((trained[name] - value).abs().max().item() for name, value in ref_state.items())
    print(f"largest loss difference {loss_gap:.1e}, largest parameter difference {param_gap:.1e}")
    assert loss_gap < 1e-5 and param_gap < 1e-5
    """),
    md("""
    Next: `02_exploring_splits` (the Explorer widget on GPT-2 and BERT), or start the lessons in `tutorials/`.
    """),
]

EXPLORING: list[Cell] = [
    md("""
    # 02 · Exploring splits: GPT-2 and BERT in the Explorer

    Where to cut a transformer? The Explorer traces a model once, then every click (split after this layer / remove
    the split) previews the stages in under a millisecond. This notebook drives it from code too, so it runs top to
    bottom; click around in the widgets as you go.
    """),
    code(SETUP),
    code("""
    import torch

    import pipeviz as pv
    from pipeviz.zoo import bert, gpt2

    torch.manual_seed(0)
    gpt = gpt2(n_layer=4, n_embd=64, n_head=2, vocab_size=256)  # HF GPT2LMHeadModel, random weights
    ids = torch.randint(0, 256, (8, 32))                         # 8 sequences of 32 tokens
    ex = pv.Explorer(gpt, example_args=(ids,))
    ex
    """),
    md("""
    The layers are the model's natural blocks: embeddings, the four transformer blocks `transformer.h.<i>`, the
    final norm and the LM head. A click is `ex.click(name)`:
    """),
    code("""
    print([layer.name for layer in ex.graph.layers])
    ex.click("transformer.h.1")   # split after block 1 -> 2 stages
    print(ex.plan)
    """),
    md("""
    ## Auto-balance

    `pv.balance` finds the contiguous split that minimises the slowest stage (exact dynamic programming). The
    Explorer's *Auto-balance* button calls it with the controls' values.
    """),
    code("""
    ex.auto_balance(4)
    print(ex.plan)
    costs = [stage.flops for stage in ex.plan.stages]
    print(f"slowest / mean stage FLOPs: {max(costs) / (sum(costs) / len(costs)):.2f}")
    """),
    md("""
    ## Tied weights

    GPT-2's LM head reuses the token embedding matrix (`transformer.wte.weight`). Split across stages, each end
    holds a copy: the preview names it in `shared_params`, and `pv.launch` sums the two copies' gradients every step
    so they stay identical (torch's pipelining alone would let them drift apart).
    """),
    code("""
    for stage in ex.plan.stages:
        print(stage.index, stage.layers, "shares:", stage.shared_params or "-")
    """),
    md("""
    ## Finer granularity

    A block can be opened into its modules (attention, MLP, norms) without tracing again; `collapse` merges it back.
    """),
    code("""
    fine = ex.graph.expand("transformer.h.0")
    print([layer.name for layer in fine.layers][:8], "...")
    print(len(ex.graph.layers), "->", len(fine.layers), "layers")
    """),
    md("""
    ## Memory

    Each stage holds its parameters, their gradients and optimizer state, plus the activations of every microbatch
    that has run forward but not yet backward. How many that is depends on the schedule: GPipe keeps all `m`, 1F1B
    at most the number of stages. `pv.simulate` reports the peak per rank:
    """),
    code("""
    for schedule in ("GPipe", "1F1B"):
        tl = pv.simulate(ex.plan, schedule, microbatches=8)
        print(f"{schedule:5} memory per rank (MiB):", [round(b / 2**20, 2) for b in tl.memory_bytes])
    """),
    md("""
    `pv.balance(..., memory_limit=...)` only accepts splits that fit; when none does, the error says the smallest
    limit that would.
    """),
    code("""
    try:
        pv.balance(ex.graph, 4, memory_limit=4e6, schedule="GPipe", microbatches=8)
    except pv.PlanError as err:
        print("PlanError:", err)
    fitting = pv.balance(ex.graph, 4, memory_limit=8e6, schedule="1F1B", microbatches=8)
    print(fitting)
    """),
    md("""
    ## Train it

    *Launch* (here `ex.launch()`) trains the current plan in background processes with the controls' schedule; when
    it ends, the widget compares losses and parameters against the unsplit model.
    """),
    code("""
    ex.plan = ex.graph.split(["transformer.h.1"])  # back to 2 stages: 2 processes
    ex.launch()
    assert ex.wait(180) == "done", ex.run.error
    print("losses:", [round(loss, 3) for loss in ex.run.losses])
    """),
    md("""
    ## BERT

    The same for a tiny BERT encoder. Its embedding block holds many parameters (the vocabulary table) but does
    almost no arithmetic, so balancing by parameters (memory) and by FLOPs (time) disagree.
    """),
    code("""
    encoder = bert(num_hidden_layers=4, hidden_size=64, num_attention_heads=2, vocab_size=2048)
    bx = pv.Explorer(encoder, example_args=(ids,))
    for by in ("params", "flops"):
        plan = pv.balance(bx.graph, 3, by=by)
        print(f"by {by:6}:", [list(stage.layers) for stage in plan.stages])
    bx.auto_balance(3, by="flops")
    bx
    """),
]

SCHEDULES: list[Cell] = [
    md("""
    # 03 · Schedules compared

    torch ships seven pipeline schedules. pipeviz simulates each with the same costs, so you can compare step time,
    bubble (idle share) and memory before running anything, then check a couple against real runs.

    | schedule | stages/rank | idea |
    |---|---|---|
    | GPipe | 1 | all forwards, then all backwards (Huang et al. 2019) |
    | 1F1B | 1 | one forward, one backward: at most *p* microbatches alive (PipeDream-Flush, Narayanan et al. 2021) |
    | Interleaved1F1B | *v* | 1F1B over *v* model chunks per rank: bubble / *v* (Narayanan et al. 2021) |
    | LoopedBFS | *v* | breadth-first over the chunks (Lamy-Poirier 2023) |
    | InterleavedZeroBubble | *v* | backward = input-grad *I* + weight-grad *W*; *W* fills bubbles (Qi et al. 2024) |
    | ZBVZeroBubble | 2, V-shaped | zero bubble with rank 0 holding the first and the last stage (Qi et al. 2024, §6) |
    | DualPipeV | 2, V-shaped | overlaps a forward and a backward (DeepSeek-V3, 2024) |
    """),
    code(SETUP),
    code("""
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
    """),
    md("""
    ## Every schedule on one plan

    With 4 stages, single-stage schedules use 4 ranks and multi-stage ones 2 ranks holding 2 stages each, so compare
    *step time* and *memory per rank*, not just bubbles.
    """),
    code("""
    cmp = pv.compare(plan4, microbatches=8)
    print(cmp.table())
    cmp.figure()
    """),
    md("""
    ## The textbook picture: equal stages, F = 1, B = 2

    `pv.Costs.uniform` drops real costs and communication; what remains is the schedules' structure. Here every
    schedule runs 4 ranks; multi-stage ones split each rank's work into 2 chunks of half the cost.
    """),
    code("""
    p, m = 4, 8
    for schedule in pv.schedules.ALL:
        v = 1 if schedule in ("GPipe", "1F1B") else 2
        tl = pv.simulate(None, schedule, m, costs=pv.Costs.uniform(p * v, forward=1 / v, backward=2 / v),
                         num_stages=p * v, stages_per_rank=None if v == 1 else v)
        print(f"{schedule:22} step {tl.step_time:5.2f}  ideal {m * 3}  bubble {tl.bubble_fraction:5.1%}")
    """),
    md("""
    ## Bubble against microbatches

    More microbatches shrink the bubble of every schedule (GPipe's is (p−1)/(m+p−1)), but each microbatch gets
    smaller and per-microbatch overheads grow. Simulated on the real plan; combinations a schedule cannot run (1F1B
    needs m ≥ stages) are left out.
    """),
    code("""
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
    """),
    md("""
    ## Two real runs

    1F1B on a 2-stage plan and ZBVZeroBubble on the 4-stage plan: both on 2 processes. `pv.profile` first measures
    each layer at the microbatch size (one thread, as each rank gets on this machine), so the simulation uses
    measured costs. The ranks run exactly the simulated order; times differ by communication and by what else the
    machine is doing.
    """),
    code("""
    plan2 = pv.balance(graph, num_stages=2)
    pv.profile(graph, microbatches=4, threads=1)
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
    print("rank 0 under ZBV:", " ".join(runs["ZBVZeroBubble"][0].timeline().order(0, step=1)))
    """),
    code("""
    pv.TimelineView(runs["ZBVZeroBubble"][0], overlay=runs["ZBVZeroBubble"][1])
    """),
]

SKIPS: list[Cell] = [
    md("""
    # 04 · Skip connections and shared weights train correctly

    Two things torch's pipelining does not handle on its own:

    * **a skip connection across stages** (a layer's output used several stages later): forward works, but training
      raises *"Backward of skip connections not supported yet"*, and multi-stage schedules reject any non-adjacent
      stage communication. pipeviz relays the skipped tensor through the stages in between (and its gradient back).
    * **tied weights** (one `Parameter` used in two stages, like an embedding and an output head): each stage gets a
      copy and their gradients are never combined, so after one step the copies diverge. pipeviz sums the copies'
      gradients every step.

    Below, each model trains pipelined under several schedules and is compared with `pv.train_reference`, the
    unsplit model trained the same way.
    """),
    code(SETUP),
    code("""
    import torch
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.zoo import SkipNet, TiedNet


    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)


    def gaps(run, reference):
        \"\"\"Largest loss and parameter differences between a finished run and the reference training.\"\"\"
        ref_losses, ref_state = reference
        trained = run.state_dict()
        loss_gap = max(abs(a - b) for a, b in zip(run.losses, ref_losses, strict=True))
        param_gap = max((trained[k] - v).abs().max().item() for k, v in ref_state.items())
        return loss_gap, param_gap
    """),
    md("""
    ## SkipNet: `layer0`'s output is added after `layer2`

    Split after `layer0` and `layer1` and the skip crosses two boundaries: stage 0 sends it along with its regular
    output, stage 1 passes it on. `send_bytes` counts it.
    """),
    code("""
    torch.manual_seed(0)
    skipnet, x = SkipNet(16), torch.randn(8, 16)
    y = torch.randint(0, 4, (8,))
    skip_graph = pv.trace(skipnet, example_args=(x,))
    print("skip edges:", skip_graph.skip_edges)
    skip3 = skip_graph.split(["layer0", "layer1"])
    print(skip3)
    """),
    md("""
    Two runs at once (they are background processes): GPipe on 3 stages / 3 ranks, and Interleaved1F1B on 4 stages /
    2 ranks (rank 0 holds stages 0 and 2, rank 1 stages 1 and 3): the skip from stage 0 to stage 3 is relayed through
    stages 1 and 2, back and forth between the two ranks.
    """),
    code("""
    skip4 = skip_graph.split(["layer0", "layer1", "layer2"])
    skip_runs = {
        "GPipe": pv.launch(skip3, "GPipe", microbatches=4, steps=3, inputs=(x,), target=y,
                           loss_fn=F.cross_entropy, optimizer=sgd),
        "Interleaved1F1B": pv.launch(skip4, "Interleaved1F1B", microbatches=4, steps=3, inputs=(x,), target=y,
                                     loss_fn=F.cross_entropy, optimizer=sgd),
    }
    skip_ref = pv.train_reference(skipnet, (x,), y, F.cross_entropy, sgd, microbatches=4, steps=3)
    for schedule, run in skip_runs.items():
        assert run.wait(180) == "done", run.error
        loss_gap, param_gap = gaps(run, skip_ref)
        print(f"SkipNet {schedule:16} losses {[round(v, 4) for v in run.losses]}  "
              f"max diff: loss {loss_gap:.1e}, params {param_gap:.1e}")
        assert loss_gap < 1e-5 and param_gap < 1e-5
    """),
    md("""
    ## TiedNet: `embed.weight` is `head.weight`

    A tiny language model whose output head reuses the embedding matrix (as GPT-2 does). The graph marks the shared
    tensor; so does every stage holding a copy.
    """),
    code("""
    torch.manual_seed(0)
    tiednet = TiedNet(vocab=32, dim=16, depth=2)   # embed, blocks.0, blocks.1, head
    ids = torch.randint(0, 32, (4, 8))
    next_ids = torch.randint(0, 32, (4, 8))


    def lm_loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


    tied_graph = pv.trace(tiednet, example_args=(ids,))
    print({layer.name: layer.shared for layer in tied_graph.layers})
    tied2 = tied_graph.split(["blocks.0"])
    tied4 = tied_graph.split(["embed", "blocks.0", "blocks.1"])
    for stage in tied2.stages:
        print(stage.index, stage.layers, "shares:", stage.shared_params)
    print("ZBV puts stages on ranks:", pv.schedules.layout("ZBVZeroBubble", 4).stage_ranks)
    """),
    md("""
    1F1B on 2 stages (the copies live on two ranks), and ZBVZeroBubble on 4 stages, whose V shape places `embed`
    (stage 0) and `head` (stage 3) on the same rank, as two stage modules with one copy each.
    """),
    code("""
    tied_runs = {
        "1F1B": pv.launch(tied2, "1F1B", microbatches=4, steps=3, inputs=(ids,), target=next_ids,
                          loss_fn=lm_loss, optimizer=sgd),
        "ZBVZeroBubble": pv.launch(tied4, "ZBVZeroBubble", microbatches=4, steps=3, inputs=(ids,),
                                   target=next_ids, loss_fn=lm_loss, optimizer=sgd),
    }
    tied_ref = pv.train_reference(tiednet, (ids,), next_ids, lm_loss, sgd, microbatches=4, steps=3)
    for schedule, run in tied_runs.items():
        assert run.wait(180) == "done", run.error
        loss_gap, param_gap = gaps(run, tied_ref)
        print(f"TiedNet {schedule:14} losses {[round(v, 4) for v in run.losses]}  "
              f"max diff: loss {loss_gap:.1e}, params {param_gap:.1e}")
        assert loss_gap < 1e-5 and param_gap < 1e-5
    state = tied_runs["1F1B"].state_dict()
    print("after training, embed.weight == head.weight:", torch.equal(state["embed.weight"], state["head.weight"]))
    """),
]

SCALE_OUT: list[Cell] = [
    md("""
    # 05 · Scale out: export a torchrun script, run it, watch it

    `pv.launch` runs every rank on this machine. For many hosts, `pv.export_torchrun` writes a script (plus a
    payload file with the stages, inputs, loss and optimizer) that `torchrun` starts on each host. Every rank
    appends its events to `<script>_events/rank<R>.jsonl`; `pv.watch` follows that folder live, so a notebook can
    chart a run it did not start.

    Here the "cluster" is this machine: three processes on 127.0.0.1.
    """),
    code(SETUP),
    code("""
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
    """),
    code("""
    script = pv.export_torchrun(plan, workdir / "train_pp.py", schedule="1F1B", microbatches=4, steps=10,
                                inputs=(x,), target=y, loss_fn=F.cross_entropy)
    print(sorted(p.name for p in workdir.iterdir()))
    print(script.read_text())
    """),
    md("""
    Start `torchrun` (as `python -m torch.distributed.run`, with this kernel's interpreter) in the background, and
    watch the events folder while it runs.
    """),
    code(FREE_PORT, """
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
               "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)]
    print(" ".join(command[1:]))
    watch = pv.watch(workdir / "train_pp_events", timeout=180)
    proc = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    view = pv.TimelineView(watch)     # redraws (throttled) whenever the rank files grow
    view
    """),
    code("""
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    assert watch.wait(60) == "done", watch.error
    print("torchrun losses:", [round(v, 4) for v in watch.losses])
    tl = watch.timeline()
    print(f"{tl.num_ranks} ranks, {len(tl.events)} events, step {tl.step_time * 1e3:.1f} ms")
    """),
    md("""
    ## Same plan, same numbers as `pv.launch`

    The exported script builds the same stages and relays and runs the same schedule, so its losses match a
    `pv.launch` of the same plan.
    """),
    code("""
    run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=10, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(180) == "done", run.error
    gap = max(abs(a - b) for a, b in zip(watch.losses, run.losses, strict=True))
    print(f"largest loss difference, torchrun vs pv.launch: {gap:.1e}")
    assert gap < 1e-6
    """),
    md("""
    On real hosts: copy `train_pp.py` and `train_pp.payload.pkl` to each (pipeviz installed), then on host *i* of
    *N*

    ```bash
    torchrun --nnodes N --node-rank i --nproc-per-node K --master-addr HOST0 --master-port 29500 train_pp.py
    ```

    and point `pv.watch` at the events folder (a shared filesystem, or copy the `rank*.jsonl` files back).
    `tutorials/06_going_multi_host` walks through two nodes.
    """),
]

# ================================================================================================ tutorials/

WHY: list[Cell] = [
    md("""
    # Lesson 1 · Why pipelines?

    **You will learn:** why a model may not fit on one device, how pipeline parallelism splits it into *stages*, and
    why the naive pipeline leaves most devices idle.

    ## A model too big for one device

    Training keeps, for every parameter, the weight, its gradient and the optimizer's state. With Adam in fp32 that
    is 4 + 4 + 8 = **16 bytes per parameter** before any activations: a 7-billion-parameter model needs about 112
    GB, more than an 80 GB GPU holds.

    *Pipeline parallelism* cuts the model's layers into consecutive groups, **stages**, and puts each on its own
    device (a *rank*). Stage 0 computes the first layers and sends its output activation to stage 1, and so on; the
    backward pass sends gradients the other way. Each device holds only its stage's parameters.

    Let's do that with a small model and a pretend device of 24 MiB.
    """),
    code(SETUP),
    code("""
    import torch
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.zoo import MyNetwork

    torch.manual_seed(0)
    model = MyNetwork(1024, [1024] * 6)    # six Linear+ReLU blocks layer0..layer5, then output_proj
    x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    graph = pv.trace(model, example_args=(x,))
    print(f"{graph.total_params:,} parameters")

    DEVICE_MEMORY = 24 * 2**20             # our pretend device: 24 MiB
    whole = graph.split([])                # one stage: the whole model on one device
    print(whole)
    print(f"needs {whole.stages[0].memory_bytes / 2**20:.1f} MiB; fits on one device:",
          whole.stages[0].memory_bytes <= DEVICE_MEMORY)
    """),
    md("""
    The `memory` column is a rough training footprint: parameters + gradients + activations. Split into three stages
    with about equal parameters (`pv.balance` picks the cut points), each stage fits:
    """),
    code("""
    plan = pv.balance(graph, num_stages=3, by="params")
    print(plan)
    print("MiB per stage:", [round(stage.memory_bytes / 2**20, 1) for stage in plan.stages])
    print("every stage fits:", all(stage.memory_bytes <= DEVICE_MEMORY for stage in plan.stages))
    """),
    md("""
    ## The naive pipeline

    Push the whole batch through as **one microbatch**: stage 0 runs its forward (`F`), hands the activation to
    stage 1, which runs its forward, and so on; then the backward passes (`B`) run in reverse, from the last stage
    to the first. Only one stage works at any moment. The simulator shows it (one row per rank; costs estimated from
    FLOPs):
    """),
    code("""
    naive = pv.simulate(plan, "GPipe", microbatches=1)
    print(f"idle share of the devices' time (the 'bubble'): {naive.bubble_fraction:.0%}")
    naive.figure()
    """),
    md("""
    ## The same, for real

    `pv.launch` starts the three stages as three processes running torch's `ScheduleGPipe` and streams back when
    each forward and backward ran. Watch the staircase appear:
    """),
    code("""
    run = pv.launch(plan, schedule="GPipe", microbatches=1, steps=3, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    pv.TimelineView(run)
    """),
    code("""
    assert run.wait(180) == "done", run.error
    measured = run.timeline()
    step = measured.steps[-1]
    compute = [e for e in measured.step_events(step) if e.kind in ("F", "B")]
    span = max(e.end for e in compute) - min(e.start for e in compute)
    for rank in range(measured.num_ranks):
        busy = sum(e.duration for e in compute if e.rank == rank)
        print(f"rank {rank}: busy {busy / span:4.0%} of the step  ({' '.join(measured.order(rank, step=step))})")
    print(f"measured bubble: {measured.bubble_fraction:.0%}")
    """),
    md("""
    Each rank is busy only for its own share of the step: with *p* equal stages and a single microbatch, every rank
    idles (*p* − 1)/*p* of the time. We bought memory capacity and paid with utilisation. (Measured numbers also
    contain communication, and on a small machine processes share CPU cores, so they wobble around the ideal.)

    The fix, in the next lesson: split the batch into **microbatches** so that the stages can work on different
    microbatches at the same time (GPipe, Huang et al. 2019).

    ## Exercise

    Suppose the model is split into **4 equal stages** and the batch goes through as **one microbatch** (the naive
    pipeline). What fraction of the total device time is idle? Set `my_answer` to a number between 0 and 1, then run
    the check cell.
    """),
    code("""
    my_answer = None  # your answer here, e.g. 0.5
    """),
    code("""
    def check(answer):
        \"\"\"Compare with pipeviz's simulation of 4 equal stages (F = 1, B = 2), GPipe, one microbatch.\"\"\"
        expected = pv.simulate(None, "GPipe", microbatches=1, costs=pv.Costs.uniform(4), num_stages=4).bubble_fraction
        if answer is None:
            print("❌ Not yet: set my_answer above. Hint: for how many of the 4 stages' turns is one device busy?")
        elif not isinstance(answer, (int, float)):
            print(f"❌ Not yet: my_answer should be a number, got {answer!r}.")
        elif abs(answer - expected) < 1e-3:
            print(f"✅ Correct: {expected:.2f} of the time is idle, (p - 1) / p with p = 4.")
        elif abs(answer - (1 - expected)) < 1e-3:
            print("❌ Not yet: that is the busy share. Hint: the question asks for the idle share.")
        else:
            print("❌ Not yet: hint: one device works 1 of every p equal slices of the step; the other p - 1 wait.")


    check(my_answer)
    """),
]

MICROBATCHES: list[Cell] = [
    md("""
    # Lesson 2 · Microbatches and the bubble

    **You will learn:** how GPipe fills the pipeline with microbatches, the formula for its bubble, and how to check
    it against the simulator and a real run.

    ## GPipe

    GPipe (Huang et al., *GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism*, NeurIPS
    2019) splits each batch into *m* **microbatches**. Stage 0 runs the forward of microbatch 0, passes it on and
    immediately starts microbatch 1, so after a short fill-up all stages work at once. When every forward is done,
    the backwards drain the pipeline the other way. Gradients of all microbatches are accumulated and the optimizer
    steps once: the update is the same as for the whole batch (for a mean-reduced loss, torch divides the summed
    gradients by *m*).

    ## The bubble formula

    Take *p* stages that each need time *F* for a microbatch's forward and *B* for its backward. The forward phase
    takes (*m* + *p* − 1)·*F*: the last stage starts after *p* − 1 forwards, then does *m*. Likewise the backward
    phase takes (*m* + *p* − 1)·*B*. Each rank is busy *m*·(*F* + *B*) of the step (*m* + *p* − 1)·(*F* + *B*), so
    the idle share, the **bubble**, is

    $$\\text{bubble} = \\frac{p - 1}{m + p - 1}.$$

    It does not depend on *F* or *B*, only on how many microbatches fill the pipe. The GPipe paper writes the
    overhead as O((*K* − 1)/(*M* + *K* − 1)) for *K* partitions and *M* microbatches and found it negligible when
    *M* ≥ 4·*K*. (The Megatron-LM papers measure the bubble against the ideal time instead of the whole step: (*p* −
    1)/*m*. Same bubble, another denominator.)
    """),
    code(SETUP),
    code("""
    import torch
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.zoo import MyNetwork


    def gpipe_bubble(p, m):
        return (p - 1) / (m + p - 1)
    """),
    md("""
    ## Check the formula against the simulator

    `pv.Costs.uniform(p)` gives every stage the textbook costs *F* = 1, *B* = 2 and free communication;
    `pv.simulate` then plays torch's GPipe order. The cell fails if the two ever disagree.
    """),
    code("""
    print(" p   m   formula  simulated")
    for p in (2, 3, 4):
        for m in (1, 2, 4, 8):
            sim = pv.simulate(None, "GPipe", microbatches=m, costs=pv.Costs.uniform(p), num_stages=p)
            assert abs(sim.bubble_fraction - gpipe_bubble(p, m)) < 1e-9
            assert sim.step_time == (m + p - 1) * (1 + 2)
            print(f"{p:2} {m:3}   {gpipe_bubble(p, m):6.1%}    {sim.bubble_fraction:6.1%}")
    """),
    code("""
    pv.simulate(None, "GPipe", microbatches=4, costs=pv.Costs.uniform(3), num_stages=3).figure()
    """),
    md("""
    ## On a real run

    The same three-stage model as lesson 1, trained with 1 and then 4 microbatches (one run after the other, so they
    do not compete for the CPU).
    """),
    code("""
    torch.manual_seed(0)
    model = MyNetwork(1024, [1024] * 6)
    x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    graph = pv.trace(model, example_args=(x,))
    plan = pv.balance(graph, num_stages=3, by="params")

    measured = {}
    for m in (1, 4):
        run = pv.launch(plan, schedule="GPipe", microbatches=m, steps=3, inputs=(x,), target=y, loss_fn=F.cross_entropy)
        assert run.wait(180) == "done", run.error
        measured[m] = run.timeline()
    for m, tl in measured.items():
        print(f"m = {m}: measured bubble {tl.bubble_fraction:4.0%}   formula {gpipe_bubble(3, m):4.0%}   "
              f"step {tl.step_time * 1e3:6.1f} ms")
    """),
    code("""
    pv.TimelineView(measured[4])
    """),
    md("""
    The measured bubble falls with *m* as the formula says, but sits above it: every send and receive, and every
    rank waiting for a CPU core on a small machine, counts as idle; stages are not exactly equal; and small
    microbatches use the hardware less efficiently, so more microbatches are not free. The larger the work per
    microbatch compared with these overheads, the closer a measurement gets to the formula.

    The catch: every stage keeps the activations of all *m* microbatches until their backward. Lesson 3 fixes that.

    ## Exercise

    With **p = 4** stages under GPipe, what is the **smallest number of microbatches m** for which the bubble is
    **at most 8 %**? Set `my_answer` to that integer.
    """),
    code("""
    my_answer = None  # your answer here: an integer
    """),
    code("""
    def check(answer):
        \"\"\"The smallest m whose simulated GPipe bubble (4 equal stages) is at most 8 %.\"\"\"
        def bubble(m):
            return pv.simulate(None, "GPipe", microbatches=m, costs=pv.Costs.uniform(4), num_stages=4).bubble_fraction

        expected = next(m for m in range(1, 200) if bubble(m) <= 0.08)
        if answer is None:
            print("❌ Not yet: set my_answer above. Hint: solve (p - 1) / (m + p - 1) <= 0.08 for m, with p = 4.")
        elif not isinstance(answer, int):
            print(f"❌ Not yet: m is a whole number of microbatches, got {answer!r}.")
        elif answer == expected:
            print(f"✅ Correct: m = {expected} gives a bubble of {bubble(expected):.2%}; m = {expected - 1} gives "
                  f"{bubble(expected - 1):.2%}.")
        elif answer > 0 and bubble(answer) <= 0.08:
            print(f"❌ Not yet: m = {answer} is enough ({bubble(answer):.2%}), but a smaller m is too.")
        else:
            print(f"❌ Not yet: with m = {answer} the bubble is still above 8 %. Hint: 3 / (m + 3) <= 0.08.")


    check(my_answer)
    """),
]

ONE_F_ONE_B: list[Cell] = [
    md("""
    # Lesson 3 · 1F1B and memory

    **You will learn:** why GPipe's memory grows with the number of microbatches, how the 1F1B schedule caps it at
    the number of stages, and how to see both in pipeviz.

    ## Activations wait for their backward

    A stage must keep each microbatch's activations from its forward until its backward. GPipe runs all *m* forwards
    first, so every stage holds **m** microbatches of activations at its peak: more microbatches (smaller bubble)
    means more memory. (The GPipe paper also keeps only each stage's input and recomputes the rest during the
    backward pass, trading compute for memory; torch's `ScheduleGPipe` does not.)

    ## 1F1B

    The *one-forward-one-backward* schedule starts each backward as early as possible. Stage *s* of *p* runs *p* −
    *s* forwards to warm up, then alternates one forward, one backward, and finally drains the remaining backwards.
    So stage 0 never holds more than **p** microbatches, stage *s* at most *p* − *s*, whatever *m* is. Its
    synchronous form, with one optimizer step after all microbatches, is PipeDream-Flush (Narayanan et al.,
    *Memory-Efficient Pipeline-Parallel DNN Training*, ICML 2021); it is torch's `Schedule1F1B`, and it has exactly
    the same bubble as GPipe.

    Let's measure activations in units of "one microbatch on one stage" with `Costs.uniform(...,
    activation_bytes=1)`:
    """),
    code(SETUP),
    code("""
    import torch
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.zoo import MyNetwork

    p, m = 4, 8
    unit = pv.Costs.uniform(p, activation_bytes=1)  # F = 1, B = 2, one "byte" per microbatch and stage
    gpipe = pv.simulate(None, "GPipe", microbatches=m, costs=unit, num_stages=p)
    one_f_one_b = pv.simulate(None, "1F1B", microbatches=m, costs=unit, num_stages=p)
    print("microbatches alive at the peak, per stage:")
    print("  GPipe:", gpipe.peak_activation_bytes)
    print("  1F1B: ", one_f_one_b.peak_activation_bytes)
    print(f"step time: GPipe {gpipe.step_time}, 1F1B {one_f_one_b.step_time}  (same bubble)")
    assert gpipe.peak_activation_bytes[0] == m and one_f_one_b.peak_activation_bytes[0] == min(p, m)
    """),
    md("""
    The orders show the difference: GPipe's rank 0 runs all forwards first, 1F1B's alternates after 4 warm-up
    forwards.
    """),
    code("""
    for name, tl in (("GPipe", gpipe), ("1F1B", one_f_one_b)):
        print(f"{name:5} rank 0:", " ".join(tl.order(0)))
        print(f"{name:5} rank 3:", " ".join(tl.order(3)))
    one_f_one_b.figure()
    """),
    md("""
    ## On a real model

    With real activation sizes, `peak_activation_bytes` and `memory_bytes` (parameters, gradients, optimizer state
    and peak activations, per rank) are in bytes:
    """),
    code("""
    torch.manual_seed(0)
    model = MyNetwork(1024, [1024] * 6)
    x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    plan = pv.balance(pv.trace(model, example_args=(x,)), num_stages=3, by="params")
    for schedule in ("GPipe", "1F1B"):
        tl = pv.simulate(plan, schedule, microbatches=8)
        print(f"{schedule:5} peak activations (MiB): {[round(b / 2**20, 1) for b in tl.peak_activation_bytes]}"
              f"   total memory (MiB): {[round(b / 2**20, 1) for b in tl.memory_bytes]}")
    """),
    md("""
    ## On a real run: count the microbatches in flight

    pipeviz records the order in which each rank really ran its actions. Replaying rank 0's order and counting
    forwards whose backward has not run yet gives the number of microbatches whose activations it held at once.
    """),
    code("""
    def in_flight_peak(order):
        \"\"\"Most microbatches forwarded but not yet backwarded, replaying a rank's actions ("0F3", "0B1").\"\"\"
        alive = peak = 0
        for action in order:
            alive += 1 if "F" in action else -1
            peak = max(peak, alive)
        return peak


    run = pv.launch(plan, schedule="1F1B", microbatches=8, steps=2, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(180) == "done", run.error
    measured = run.timeline()
    for rank in range(3):
        order = measured.order(rank, step=1)
        print(f"rank {rank}: {in_flight_peak(order)} microbatches at most   {' '.join(order)}")
    assert in_flight_peak(measured.order(0, step=1)) == 3   # p, not m = 8
    pv.TimelineView(run)
    """),
    md("""
    1F1B keeps GPipe's bubble; lesson 4 shrinks it.

    ## Exercise

    Under **1F1B** with **p = 4** stages and **m = 8** microbatches, how many microbatches' activations does **stage
    1** (the second stage) hold at its peak? Set `my_answer` to that integer.
    """),
    code("""
    my_answer = None  # your answer here: an integer
    """),
    code("""
    def check(answer):
        \"\"\"Stage 1's peak from pipeviz's simulation, counting one unit per microbatch.\"\"\"
        costs = pv.Costs.uniform(4, activation_bytes=1)
        expected = pv.simulate(None, "1F1B", microbatches=8, costs=costs, num_stages=4).peak_activation_bytes[1]
        if answer is None:
            print("❌ Not yet: set my_answer above. Hint: how many warm-up forwards does stage s run first?")
        elif answer == expected:
            print(f"✅ Correct: stage 1 holds {expected} = p - 1 microbatches; stage s holds p - s.")
        elif answer == 8:
            print("❌ Not yet: that is GPipe, which keeps all m. Hint: 1F1B's stage s holds at most p - s.")
        else:
            print(f"❌ Not yet: not {answer!r}. Hint: stage 0 holds p = 4, and each later stage one fewer.")


    check(my_answer)
    """),
]

INTERLEAVING: list[Cell] = [
    md("""
    # Lesson 4 · Interleaving and zero bubble

    **You will learn:** two ways to shrink the bubble without more microbatches: give each rank several smaller
    stages (*interleaved 1F1B*), and split the backward pass so that its weight-gradient half fills the gaps (*zero
    bubble*).

    ## Interleaved 1F1B

    Narayanan et al. (*Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*, SC 2021)
    cut the model into *v*·*p* stages and give rank *r* the stages *r*, *r* + *p*, *r* + 2*p*, … (*v* "model chunks"
    per rank). Each stage is *v* times smaller, so filling and draining the pipeline costs *v* times less: with
    per-rank forward and backward times *F* and *B*, the bubble time falls from (*p* − 1)·(*F* + *B*) to (*p* −
    1)·(*F* + *B*)/*v*. The price: *v* times more sends between ranks, and the schedule needs *m* to suit *p*
    (torch's rule: *m* % max(1, *m* // *p*) == 0).
    """),
    code(SETUP),
    code("""
    import torch
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.zoo import MyNetwork

    p, m = 4, 8      # 4 ranks, 8 microbatches; each rank's work per microbatch: F = 1, B = 2
    ideal = m * 3    # time a rank spends computing
    print(" v  schedule          step   bubble time")
    bubble_time = {}
    for v in (1, 2, 4):
        schedule = "1F1B" if v == 1 else "Interleaved1F1B"
        tl = pv.simulate(None, schedule, m, costs=pv.Costs.uniform(p * v, forward=1 / v, backward=2 / v),
                         num_stages=p * v, stages_per_rank=None if v == 1 else v)
        bubble_time[v] = tl.step_time - ideal
        print(f"{v:2}  {schedule:16} {tl.step_time:5.2f}  {bubble_time[v]:5.2f}")
    assert abs(bubble_time[2] - bubble_time[1] / 2) < 1e-9 and abs(bubble_time[4] - bubble_time[1] / 4) < 1e-9
    """),
    code("""
    print("Interleaved1F1B, 8 stages on 4 ranks:", pv.schedules.layout("Interleaved1F1B", 8, 2).stage_ranks)
    pv.simulate(None, "Interleaved1F1B", m, costs=pv.Costs.uniform(8, forward=0.5, backward=1.0), num_stages=8,
                stages_per_rank=2).figure()
    """),
    md("""
    ## Zero bubble

    Qi et al. (*Zero Bubble Pipeline Parallelism*, ICLR 2024) observe that a layer's backward is two computations:
    the gradient with respect to its **input** (needed at once by the previous stage: on the critical path) and the
    gradient with respect to its **weights** (needed only by the optimizer step). torch calls them **I** and **W**
    (the paper: B and W). Running I first and postponing W lets W fill the slots where a rank would otherwise wait.
    Their ZB-V schedule (§6) also places stages in a V: rank 0 holds the first *and* the last stage, so the pipeline
    turns around on the same rank.

    With I = W = half a backward, compare the four-rank schedules:
    """),
    code("""
    def textbook(schedule, v):
        return pv.simulate(None, schedule, m, costs=pv.Costs.uniform(p * v, forward=1 / v, backward=2 / v),
                           num_stages=p * v, stages_per_rank=None if v == 1 else v)


    for schedule, v in (("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)):
        tl = textbook(schedule, v)
        print(f"{schedule:22} bubble time {tl.step_time - ideal:5.2f}   idle share {tl.bubble_fraction:5.1%}")
    zbv = textbook("ZBVZeroBubble", 2)
    print("ZBV stage -> rank:", pv.schedules.layout("ZBVZeroBubble", 8).stage_ranks)
    print("ZBV rank 0:", " ".join(zbv.order(0)))
    zbv.figure()
    """),
    md("""
    ## A real zero-bubble run

    Four stages on two processes under torch's `ScheduleZBVZeroBubble`: the recorded events include `I` and `W`, in
    the order the simulator predicted.
    """),
    code("""
    torch.manual_seed(0)
    model = MyNetwork(1024, [1024] * 6)
    x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    plan = pv.balance(pv.trace(model, example_args=(x,)), num_stages=4)
    run = pv.launch(plan, schedule="ZBVZeroBubble", microbatches=4, steps=2, inputs=(x,), target=y,
                    loss_fn=F.cross_entropy)
    assert run.wait(180) == "done", run.error
    measured, sim = run.timeline(), pv.simulate(plan, "ZBVZeroBubble", microbatches=4)
    print("kinds recorded:", sorted({e.kind for e in measured.events}))
    for rank in range(2):
        assert measured.order(rank, step=1) == sim.order(rank)
        print(f"rank {rank}:", " ".join(measured.order(rank, step=1)))
    pv.TimelineView(run, overlay=sim)
    """),
    md("""
    ## Exercise

    With **p = 4** ranks, **m = 8** microbatches and per-rank costs **F = 1**, **B = 2** per microbatch (free
    communication), what is the **bubble time** (step time minus the 24 units of compute) of **Interleaved1F1B with
    v = 4** stages per rank? Set `my_answer` to a number.
    """),
    code("""
    my_answer = None  # your answer here: a number of time units
    """),
    code("""
    def check(answer):
        \"\"\"Bubble time of Interleaved1F1B, 16 stages on 4 ranks, from pipeviz's simulation.\"\"\"
        tl = pv.simulate(None, "Interleaved1F1B", 8, costs=pv.Costs.uniform(16, forward=0.25, backward=0.5),
                         num_stages=16, stages_per_rank=4)
        expected = tl.step_time - 8 * 3
        if answer is None:
            print("❌ Not yet: set my_answer above. Hint: 1F1B's bubble time is (p - 1)(F + B); then divide.")
        elif not isinstance(answer, (int, float)):
            print(f"❌ Not yet: my_answer should be a number, got {answer!r}.")
        elif abs(answer - expected) < 1e-6:
            print(f"✅ Correct: (p - 1)(F + B) / v = 9 / 4 = {expected}.")
        elif abs(answer - 9) < 1e-6:
            print("❌ Not yet: 9 is plain 1F1B's bubble time. Hint: interleaving divides it by v.")
        else:
            print(f"❌ Not yet: not {answer!r}. Hint: the bubble time is (p - 1)(F + B) / v.")


    check(my_answer)
    """),
]

BALANCING: list[Cell] = [
    md("""
    # Lesson 5 · Balancing stages

    **You will learn:** why the slowest stage sets the pace, how to measure per-layer times with `pv.profile`, and
    how `pv.balance` finds the best contiguous split.

    ## The slowest stage sets the pace

    In a pipeline every microbatch passes through every stage, so in the steady state each rank waits for the
    slowest one: with GPipe or 1F1B the step takes about (*m* + *p* − 1) × (the slowest stage's *F* + *B*).
    Splitting by **layer count** is only right when layers cost the same. This model's layers do not: `layer1` and
    `layer2` are 2048 × 2048 (16× the work of a 512 × 512 layer).
    """),
    code(SETUP),
    code("""
    import torch
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.balance import layer_costs
    from pipeviz.zoo import MyNetwork

    torch.manual_seed(0)
    model = MyNetwork(512, [2048, 2048, 2048, 512, 512, 512])   # heavy layers first
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    graph = pv.trace(model, example_args=(x,))
    print([layer.name for layer in graph.layers])
    """),
    md("""
    ## Measure

    `pv.profile` times each layer's forward and backward on one microbatch (medians of several repeats) and stores
    the result in the graph; `pv.simulate` and `pv.balance(by="time")` then use measured times instead of FLOP
    estimates. We time with one thread because `pv.launch` gives each of the two ranks one of this machine's two
    cores.
    """),
    code("""
    prof = pv.profile(graph, microbatches=4, threads=1)
    for name in graph.layer_names:
        print(f"{name:12} forward {prof.forward[name] * 1e3:6.2f} ms   backward {prof.backward[name] * 1e3:6.2f} ms")
    """),
    md("""
    ## Naive split against balanced split

    Naive: half the layers on each of 2 stages. Balanced: `pv.balance` solves the *linear partition* problem exactly
    (dynamic programming over all contiguous splits), minimising the slowest stage's time.
    """),
    code("""
    naive = graph.split(["layer2"])                      # layers 0-2 | layers 3-5 + output_proj
    balanced = pv.balance(graph, num_stages=2, by="time")
    cost = dict(zip(graph.layer_names, layer_costs(graph, by="time"), strict=True))
    predicted = {}
    for name, plan in (("naive", naive), ("balanced", balanced)):
        stage_ms = [sum(cost[layer] for layer in stage.layers) * 1e3 for stage in plan.stages]
        predicted[name] = pv.simulate(plan, "1F1B", microbatches=4).step_time
        print(f"{name:8} {[list(s.layers) for s in plan.stages]}")
        print(f"         stage F+B per microbatch (ms): {[round(t, 2) for t in stage_ms]}"
              f"   simulated step {predicted[name] * 1e3:.1f} ms")
    """),
    md("""
    ## Run both

    One run after the other so they do not share the CPU. `step_time` is the median over steps, leaving out the
    first (warm-up).
    """),
    code("""
    measured = {}
    for name, plan in (("naive", naive), ("balanced", balanced)):
        run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=4, inputs=(x,), target=y, loss_fn=F.cross_entropy)
        assert run.wait(180) == "done", run.error
        measured[name] = run.timeline()
    for name, tl in measured.items():
        print(f"{name:8} measured step {tl.step_time * 1e3:6.1f} ms   (simulated {predicted[name] * 1e3:6.1f} ms)"
              f"   bubble {tl.bubble_fraction:4.0%}")
    print(f"speed-up from balancing: measured {measured['naive'].step_time / measured['balanced'].step_time:.2f}x, "
          f"predicted {predicted['naive'] / predicted['balanced']:.2f}x")
    """),
    code("""
    pv.TimelineView(measured["naive"])
    """),
    md("""
    Measured times on a shared 2-core machine are noisy, but the naive split's second rank idles visibly while the
    first works. Balancing also has limits: a single layer cannot be cut (here `layer1` alone is a large share of
    the model), so more stages eventually stop helping; `graph.expand(name)` offers finer split points inside a
    block. Memory matters too: `pv.balance(..., memory_limit=...)` only accepts splits whose stages fit.

    ## Exercise

    Using the measured times (`prof`, or `cost[name]` above: forward + backward per layer), choose where to split
    this model into **3 stages** so that the **slowest stage is as fast as possible**. Set `my_answer` to the list
    of the two layer names to split after, e.g. `["layer0", "layer3"]`.
    """),
    code("""
    my_answer = None  # your answer here: a list of two layer names
    """),
    code("""
    def check(answer):
        \"\"\"Compare your split's slowest stage with the optimum pv.balance finds for the same measured costs.\"\"\"
        per_layer = dict(zip(graph.layer_names, layer_costs(graph, by="time"), strict=True))

        def slowest(plan):
            return max(sum(per_layer[layer] for layer in stage.layers) for stage in plan.stages)

        best = slowest(pv.balance(graph, num_stages=3, by="time"))
        if answer is None:
            print("❌ Not yet: set my_answer above. Hint: add up cost[name] for each candidate group of layers.")
            return
        try:
            mine = graph.split(list(answer))
        except (pv.PlanError, TypeError, ValueError) as err:
            print(f"❌ Not yet: that is not a valid split: {err}")
            return
        if mine.num_stages != 3:
            print(f"❌ Not yet: that makes {mine.num_stages} stages; name exactly two layers to split after.")
        elif slowest(mine) <= best * (1 + 1e-9):
            print(f"✅ Correct: your slowest stage takes {slowest(mine) * 1e3:.2f} ms per microbatch, the optimum.")
        else:
            print(f"❌ Not yet: your slowest stage takes {slowest(mine) * 1e3:.2f} ms; {best * 1e3:.2f} ms is possible."
                  " Hint: give the heaviest layers a stage each.")


    check(my_answer)
    """),
]

MULTI_HOST: list[Cell] = [
    md("""
    # Lesson 6 · Going multi-host

    **You will learn:** how `torchrun` starts pipeline ranks on several machines, how ranks are numbered, and how to
    export a pipeviz plan and watch it run.

    ## torchrun, nodes and ranks

    On each machine (a *node*), one `torchrun` agent starts `--nproc-per-node` worker processes. The agents meet at
    a rendezvous (`--master-addr`, `--master-port`, the same on every node), agree on `--nnodes`, and give each
    worker a global **rank**:

    rank = node_rank × nproc_per_node + local_rank,   world size = nnodes × nproc_per_node.

    A pipeline places stage *s* on a rank (single-stage schedules: stage *s* on rank *s*), so consecutive stages on
    the same node talk over fast local links and only the stages at a node boundary cross the network: one
    activation per microbatch, which is why pipelining suits slow links between machines better than tensor
    parallelism.

    We pretend to have two nodes by starting two `torchrun` agents on this machine, each with two workers: 4 ranks
    for 4 stages.
    """),
    code(SETUP),
    code("""
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
    """),
    md("""
    ## Export

    `pv.export_torchrun` validates everything `pv.launch` would (schedule, microbatches, loss), then writes a small
    script and a payload with the stages, inputs, targets, loss and optimizer. Copy both to every node; each needs
    pipeviz installed.
    """),
    code("""
    script = pv.export_torchrun(plan, workdir / "train_pp.py", schedule="1F1B", microbatches=4, steps=5,
                                inputs=(x,), target=y, loss_fn=F.cross_entropy)
    print(sorted(p.name for p in workdir.iterdir()))
    """),
    md("""
    ## Two nodes on one machine

    Both agents get the same rendezvous address; only `--node-rank` differs. (On real machines `--master-addr` is
    node 0's address, reachable from all.) Every rank writes its events to `train_pp_events/rank<R>.jsonl`, and
    `pv.watch` follows them live.
    """),
    code(FREE_PORT, """
    NNODES, NPROC_PER_NODE = 2, 2
    port = free_port()
    agents = []
    for node_rank in range(NNODES):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NNODES),
                   "--node-rank", str(node_rank), "--nproc-per-node", str(NPROC_PER_NODE),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)]
        print("node", node_rank, ":", " ".join(command[3:]))
        agents.append(subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
    watch = pv.watch(workdir / "train_pp_events", timeout=180)
    view = pv.TimelineView(watch)     # redraws (throttled) whenever the rank files grow
    view
    """),
    code("""
    for agent in agents:
        output, _ = agent.communicate(timeout=240)
        assert agent.returncode == 0, output
    assert watch.wait(60) == "done", watch.error
    tl = watch.timeline()
    print(f"{tl.num_ranks} ranks; losses {[round(v, 4) for v in watch.losses]}")
    for rank in range(tl.num_ranks):
        node, local = divmod(rank, NPROC_PER_NODE)
        print(f"rank {rank} = node {node}, local rank {local}: {' '.join(tl.order(rank, step=0))}")
    """),
    md("""
    ## Numerics

    Four processes on two "nodes" trained exactly like the unsplit model:
    """),
    code("""
    ref_losses, _ = pv.train_reference(model, (x,), y, F.cross_entropy, None, microbatches=4, steps=5)
    gap = max(abs(a - b) for a, b in zip(watch.losses, ref_losses, strict=True))
    print(f"largest loss difference against the unsplit model: {gap:.1e}")
    assert gap < 1e-5
    """),
    md("""
    ## Exercise

    Schedules decide which rank holds which stage. Suppose you re-export a **ZBVZeroBubble** plan with **8 stages**
    and start it on the same **2 nodes × 2 processes**. Which **node** (0 or 1) holds the **last stage**, the one
    that computes the loss? Set `my_answer` to 0 or 1. (`pv.schedules.layout` answers it, but try to reason first:
    ZB-V places stages in a V.)
    """),
    code("""
    my_answer = None  # your answer here: 0 or 1
    """),
    code("""
    def check(answer):
        \"\"\"Node of the rank holding ZBV's last stage, 8 stages on 2 nodes x 2 processes.\"\"\"
        last_rank = pv.schedules.layout("ZBVZeroBubble", num_stages=8).stage_ranks[-1]
        expected = last_rank // 2
        if answer is None:
            print("❌ Not yet: set my_answer above. Hint: draw the V: stages 0-3 go down ranks 0-3, 4-7 come back.")
        elif answer == expected:
            print(f"✅ Correct: stage 7 is on rank {last_rank}, node {expected}: the V turns at the last rank.")
        elif answer in (0, 1):
            print("❌ Not yet: hint: with 4 ranks, stage s < 4 is on rank s and stage s >= 4 on rank 7 - s.")
        else:
            print(f"❌ Not yet: there are only nodes 0 and 1, got {answer!r}.")


    check(my_answer)
    """),
]

NOTEBOOKS: dict[str, list[Cell]] = {
    "notebooks/01_quickstart.ipynb": QUICKSTART,
    "notebooks/02_exploring_splits.ipynb": EXPLORING,
    "notebooks/03_schedules_compared.ipynb": SCHEDULES,
    "notebooks/04_skips_and_shared_weights.ipynb": SKIPS,
    "notebooks/05_scale_out.ipynb": SCALE_OUT,
    "tutorials/01_why_pipelines.ipynb": WHY,
    "tutorials/02_microbatches_and_the_bubble.ipynb": MICROBATCHES,
    "tutorials/03_1f1b_and_memory.ipynb": ONE_F_ONE_B,
    "tutorials/04_interleaving_and_zero_bubble.ipynb": INTERLEAVING,
    "tutorials/05_balancing_stages.ipynb": BALANCING,
    "tutorials/06_going_multi_host.ipynb": MULTI_HOST,
}

# For each tutorial: (a right answer, a wrong answer), as code that sets ``my_answer`` in the executed notebook.
SOLUTIONS: dict[str, tuple[str, str]] = {
    "tutorials/01_why_pipelines.ipynb": ("my_answer = 0.75", "my_answer = 0.25"),
    "tutorials/02_microbatches_and_the_bubble.ipynb": ("my_answer = 35", "my_answer = 34"),
    "tutorials/03_1f1b_and_memory.ipynb": ("my_answer = 3", "my_answer = 8"),
    "tutorials/04_interleaving_and_zero_bubble.ipynb": ("my_answer = 2.25", "my_answer = 4.5"),
    "tutorials/05_balancing_stages.ipynb": (
        "my_answer = [name for name, _ in pv.balance(graph, num_stages=3, by='time').splits]",
        "my_answer = ['layer3', 'layer4']",
    ),
    "tutorials/06_going_multi_host.ipynb": ("my_answer = 0", "my_answer = 1"),
}


def build(name: str, cells: list[Cell]) -> nbformat.NotebookNode:
    """One notebook, no outputs, deterministic cell ids."""
    stem = Path(name).stem.replace(".", "-")
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(cells):
        new = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(new(source, id=f"{stem[:50]}-{i:02d}"))
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name, NOTEBOOKS[name])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report notebooks that differ from the cells here")
    parser.add_argument("--root", type=Path, default=ROOT, help="write under this folder (default: the repository)")
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = args.root / name
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print("wrote", path)
    if stale:
        print("out of date (run scripts/build_notebooks.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
