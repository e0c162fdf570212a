"""``pipeviz`` command line.

    pipeviz demo [--model classic|gpt2|llama|moe|all] [--stages N] [--schedule 1F1B] [--microbatches 4]
                 [--steps 5] [--devices auto] [--output pipeviz-report.html]
                 [--cluster-hardware h100] [--cluster-gpus 8]
    pipeviz lab  [notebook]      # JupyterLab on the notebooks and tutorials
    pipeviz fuzz --seconds 120 --seed 0 --out fuzz-out [--model FILE_OR_NAME] [--cases N]
    pipeviz plan --model llama-3-8b --gpus 64 --hardware h100 --global-batch 512 [--seq-len 8192]
                 [--config path/to/config.json] [--memory-gib 80] [--dtype bfloat16] [--efficiency 0.55] [--top 10]
                 [--full-trace] [--no-synthesize] [--export torchtitan|megatron] [--export-path torchtitan.toml]

``pipeviz demo`` is the headless main job: trace, auto-balance, simulate every schedule, launch a real
run with a progress bar, check numerics against the unsplit model, write one HTML report.
``pipeviz plan`` builds a well-known model (or any HF config) on the meta device, traces it without weights and
prints ``pv.plan_cluster``'s ranked layouts for a cluster, then the best pipelined layout with a synthesized schedule
(``pv.synthesize_schedule``: the fastest order found within the memory limit) as one more candidate; ``--export``
writes the best row for torchtitan (a TOML fragment, ``pv.export_torchtitan``) or prints it as Megatron-LM's flags
(``pv.megatron_layout``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz import zoo
from pipeviz.plan.preview import human_bytes
from pipeviz.runtime.loss import LOSS_REDUCTIONS
from pipeviz.schedule import traits as sched

if TYPE_CHECKING:
    from pipeviz.planner.cluster import LayoutOption
    from pipeviz.widgets.report import Section

__all__ = ["main"]


def _model(name: str) -> tuple[str, torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor,
                             Callable[..., torch.Tensor], int]:
    """(title, model, inputs, target, loss, default stages)."""
    torch.manual_seed(0)
    if name == "classic":
        x = torch.randn(64, 512)
        return ("MyNetwork (the classic PiPPy example)", zoo.MyNetwork(512, [512, 1024, 256]), (x,),
                torch.randint(0, 10, (64,)), F.cross_entropy, 3)
    if name == "gpt2":
        ids = torch.randint(0, 512, (16, 32))
        return ("GPT-2, tiny config (4 blocks, 128 wide, random weights)",
                zoo.gpt2(n_layer=4, n_embd=128, n_head=4, vocab_size=512), (ids,), torch.randint(0, 512, (16, 32)),
                pv.cross_entropy, 4)
    if name == "llama":
        ids = torch.randint(0, 512, (16, 32))
        return ("LLaMA, tiny config (HF LlamaForCausalLM: 4 layers, 128 wide, RoPE, GQA 4/2 heads, random weights)",
                zoo.llama(), (ids,), torch.randint(0, 512, (16, 32)), pv.cross_entropy, 4)
    if name == "moe":
        ids = torch.randint(0, 512, (16, 32))
        return ("Mixture of experts (6 routed MoE blocks, 4 experts, top-2, tokens dispatched to their experts)",
                zoo.MoENet(), (ids,), torch.randint(0, 512, (16, 32)), pv.cross_entropy, 4)
    raise SystemExit(f"Unknown model {name!r}; valid: {', '.join(MODELS)}, all.")


MODELS = ("classic", "gpt2", "llama", "moe")
NEEDS_TRANSFORMERS = ("gpt2", "llama")


def _progress(run: pv.Run, label: str) -> None:
    """A text progress bar on stdout until the run ends (a new line per step when not on a terminal)."""
    width, last = 30, ""
    tty = sys.stdout.isatty()
    while True:
        finished = run.done
        frac = run.step / run.steps if run.steps else 0.0
        loss = f" loss {run.losses[-1]:.4f}" if run.losses else ""
        bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
        text = f"  {label} [{bar}] step {run.step}/{run.steps}{loss} ({run.status})"
        if text != last:
            print(("\r" + text) if tty else text, end="" if tty else "\n", flush=True)
            last = text
        if finished:
            break
        run.wait(0.2)
    if tty:
        print()


def _section(name: str, a: argparse.Namespace) -> Section:
    from pipeviz.widgets.report import Section

    title, model, inputs, target, loss, default_stages = _model(name)
    stages = a.stages or default_stages
    print(f"\n== {title}")
    t = time.time()
    graph = pv.trace(model, example_args=inputs)
    print(f"  traced {len(graph.layers)} layers in {time.time() - t:.1f} s: {', '.join(graph.layer_names)}")
    threads = max(1, (os.cpu_count() or 1) // stages)
    graph = graph.with_profile(pv.profile(graph, microbatches=a.microbatches, threads=threads, repeats=5))
    plan = pv.balance(graph, stages, by="time")
    print(f"  auto-balanced (measured time): {plan!r}")
    print("\n".join("    " + line for line in plan.table().splitlines()))
    cmp = pv.compare(plan, microbatches=a.microbatches)
    print(f"  simulated schedules, every one on {plan.num_stages} ranks (2 stages per rank: a "
          f"{2 * plan.num_stages}-stage split balanced the same way):\n"
          + "\n".join("    " + line for line in cmp.table().splitlines()))
    spr = sched.info(a.schedule).stages_per_rank if sched.info(a.schedule).multi else None
    run_plan = plan
    row = cmp.row(a.schedule)
    if spr is not None and row is not None:
        run_plan = row.plan  # the comparison's split: the same ranks as the table
    elif spr is not None and plan.num_stages % 2:
        run_plan = pv.balance(graph, plan.num_stages + 1, by="time")
        print(f"  {a.schedule} needs an even stage count: running {run_plan!r}")
    cluster = None
    if a.cluster_gpus:
        batch = (graph.batch_size or 1) * a.cluster_gpus
        cluster = pv.plan_cluster(graph, a.cluster_gpus, a.cluster_hardware, global_batch=batch, top=5)
        print(f"  planned for {a.cluster_gpus} x {cluster.hardware.name}, global batch {batch}:\n"
              + "\n".join("    " + line for line in cluster.table(3).splitlines()))
    config = pv.LaunchConfig(schedule=a.schedule, microbatches=a.microbatches, steps=a.steps, devices=a.devices,
                             stages_per_rank=spr, loss_fn=loss, optimizer=pv.sgd(lr=0.05),
                             clip_grad_norm=a.clip_grad_norm, loss_reduction=a.loss_reduction,
                             accumulate=a.accumulate, eval_every=a.eval_every, compile=a.compile or False,
                             mixed_precision=a.mixed_precision, recompute=a.recompute,
                             lr_scheduler=pv.warmup_cosine(a.lr_warmup, a.steps) if a.lr_warmup is not None else None)
    simulated = pv.simulate(run_plan, config)  # the run's own description: what is simulated is what launches
    held_out = None
    if a.eval_every is not None and isinstance(target, torch.Tensor):  # a held-out batch: the target's permutation
        held_out = [(inputs, target[torch.randperm(target.shape[0], generator=torch.Generator().manual_seed(1))])]
    run = pv.launch(run_plan, config=config, inputs=inputs, target=target, eval_data=held_out)
    _progress(run, f"{a.schedule} on {run.layout.num_ranks} processes")
    if run.status != "done":
        print(f"  run {run.status}: {run.error}")
        return Section(title, run_plan, cmp, run.timeline(), simulated, None, [f"The run {run.status}: {run.error}"],
                       cluster)
    check = pv.check_numerics(run)
    tl = run.timeline()
    print(f"  measured step {tl.step_time * 1e3:.2f} ms (simulated {simulated.step_time * 1e3:.2f} ms), "
          f"bubble {tl.bubble_fraction:.0%}; losses {', '.join(f'{x:.4f}' for x in run.losses)}")
    if run.learning_rates:
        print(f"  learning rates: {', '.join(f'{x:.4g}' for x in run.learning_rates)}")
    if run.eval_losses:
        print(f"  held-out losses: {', '.join(f'step {s}: {x:.4f}' for s, x in run.eval_losses)}")
    if run.grad_norms:
        print(f"  gradient norms before clipping at {a.clip_grad_norm}: "
              f"{', '.join(f'{x:.4f}' for x in run.grad_norms)}")
    print(f"  {check}")
    notes = list(graph.notes)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = run.layout.num_ranks
    if all(d == "cpu" for d in run.devices) and ranks > cores:
        notes.append(f"{ranks} processes shared {cores} CPU cores; the simulation gives each rank a core of its "
                     "own, so the measured step is longer. Use --stages at most the core count to compare.")
        print("  note: " + notes[-1])
    return Section(title, run_plan, cmp, tl, simulated, check, notes, cluster)


def demo(a: argparse.Namespace) -> int:
    """Trace, balance, simulate, launch, check, report."""
    warnings.filterwarnings("ignore")
    from pipeviz.widgets.report import write_report

    a.schedule = sched.canonical(a.schedule)  # bad options fail before any work

    names = list(MODELS) if a.model == "all" else [a.model]
    if importlib.util.find_spec("transformers") is None and any(n in NEEDS_TRANSFORMERS for n in names):
        print("note: the GPT-2 and LLaMA parts need `transformers` (pip install transformers); skipping them.")
        names = [n for n in names if n not in NEEDS_TRANSFORMERS] or ["classic"]
    sections = [_section(n, a) for n in names]
    path = write_report(sections, a.output)
    ok = all(s.check is not None and s.check.ok for s in sections)
    print(f"\nreport: {path.resolve()}")
    return 0 if ok else 1


def plan(a: argparse.Namespace) -> int:
    """Trace a model on the meta device and print the ranked cluster layouts."""
    import dataclasses

    warnings.filterwarnings("ignore")
    hw = pv.hardware(a.hardware)  # bad options fail before any work
    if a.efficiency is not None:
        hw = dataclasses.replace(hw, efficiency=a.efficiency)
    source = a.config or a.model
    t = time.time()
    try:
        graph, seq = zoo.planning_graph(source, a.seq_len, blocks=None if a.full_trace else 2)
    except ValueError as exc:
        print(f"pipeviz: {exc}", file=sys.stderr)
        return 2
    traced = next((n.split()[5] for n in graph.notes if "repeat_layers" in n), None)  # "Planned from a trace of k"
    how = "" if a.full_trace or traced is None else \
        f" ({traced} blocks traced, the last repeated: --full-trace to trace every block)"
    print(f"{source}: {graph.total_params / 1e9:.2f} B parameters, {len(graph.layers)} layers, traced on the meta "
          f"device at {seq} tokens in {time.time() - t:.1f} s{how}")
    t = time.time()
    limit = a.memory_gib * 2**30 if a.memory_gib else None
    try:
        cp = pv.plan_cluster(graph, a.gpus, hw, global_batch=a.global_batch, memory_limit=limit, dtype=a.dtype,
                             top=a.top, dp_reduce=a.dp_reduce, cp=a.cp, ep=a.ep)
    except ValueError as exc:  # a bad --cp or --ep (or other degree): named by the planner's own message
        print(f"pipeviz: {exc}", file=sys.stderr)
        return 2
    print(f"planned in {time.time() - t:.1f} s\n")
    print(cp.table(a.top))
    if not a.no_synthesize:
        _synthesized(cp)
    if a.export and cp.rows:
        _export(a, cp.rows[0], cp.global_batch)
    return 0 if cp.rows else 1


SYNTHESIS_ACTIONS = 12_000  # a larger layout takes the search tens of seconds: it is offered as a call instead


def _synthesized(cp: pv.ClusterPlan) -> None:
    """The best pipelined row's layout with a synthesized order in place of its schedule: one more candidate."""
    found = next(((i, r) for i, r in enumerate(cp.rows, 1) if r.pp > 1), None)
    if found is None:
        return
    i, row = found
    call = ("pv.synthesize_schedule(row.plan, row.config, memory_limit, options=row.options, "
            "collectives=row.collectives)")
    actions = row.plan.num_stages * row.microbatches * 3
    if actions > SYNTHESIS_ACTIONS:
        print(f"\nsynthesized schedule for #{i}: not searched here ({actions:,} actions); {call} finds it.")
        return
    t = time.time()
    syn = pv.synthesize_schedule(row.plan, row.config, cp.memory_limit, options=row.options,
                                 collectives=row.collectives)
    took = time.time() - t
    own = syn.baselines.get(row.schedule)
    versus = (f"{row.schedule}'s {_secs(own.step_time)} ({syn.step_time / own.step_time - 1:+.1%}; both simulated "
              f"in full at {row.microbatches} microbatches)" if own is not None else row.schedule)
    placed = "in a V" if syn.placement == "v" else "looped"
    print(f"\nsynthesized schedule for #{i} ({row.label()}): {_secs(syn.step_time)} per step against {versus}, "
          f"peak memory {human_bytes(max(syn.memory_bytes))}, stages placed {placed}; {syn.evaluated} candidate "
          f"orders searched in {took:.1f} s. {call} returns it, launchable (.config) and as torch's schedule CSV "
          "(.to_csv(path)).")


def _secs(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def _export(a: argparse.Namespace, row: LayoutOption, global_batch: int) -> None:
    """The best row for torchtitan (a TOML fragment) or Megatron-LM (its command-line flags)."""
    if a.export == "torchtitan":
        path = pv.export_torchtitan(row.plan, row.config, a.export_path, microbatch_size=row.microbatch_size)
        print(f"\nthe best row ({row.label()}) for torchtitan: {path}")
        return
    flags = [f"--pipeline-model-parallel-size {row.pp}",
             f"--pipeline-model-parallel-layout '{pv.megatron_layout(row.plan)}'",
             f"--tensor-model-parallel-size {row.tp}", f"--context-parallel-size {row.cp}",
             f"--micro-batch-size {row.microbatch_size}", f"--global-batch-size {global_batch}"]
    if row.ep > 1:
        flags.append(f"--expert-model-parallel-size {row.ep}")
    if row.dp_reduce == "distributed":
        flags.append("--use-distributed-optimizer")
    print(f"\nthe best row ({row.label()}) for Megatron-LM:\n  " + " \\\n  ".join(flags))
    if sched.info(row.schedule).v_shape:
        print(f"  note: Megatron runs stage i on pipeline rank i % {row.pp}, not in {row.schedule}'s V.")


def lab(a: argparse.Namespace) -> int:
    """Start JupyterLab in the project's notebooks folder."""
    here = Path(__file__).resolve().parent.parent
    target = a.path or str(here / "notebooks")
    return subprocess.call([sys.executable, "-m", "jupyterlab", target])


def fuzz(a: argparse.Namespace) -> int:
    """Draw compositions, run and check each, shrink the first failure (pipeviz.fuzz)."""
    warnings.filterwarnings("ignore")
    from pipeviz.fuzz import fuzz as run_fuzz

    try:
        report = run_fuzz(a.seconds, a.seed, a.out, model=a.model, cases=a.cases)
    except ValueError as exc:  # a --model that cannot be built
        print(f"pipeviz: {exc}", file=sys.stderr)
        return 2
    return 1 if report.failed else 0


FUZZ_HELP = (
    "Check a model across layouts: draw compositions pipeviz accepts (a model, its split, a schedule or a custom "
    "order, microbatches, pp x dp x tp and every mesh dimension pv.launch takes, accumulation, clipping, loss "
    "reduction, mixed precision, recompute, compile, frozen parameters, overlapped or sharded gradient reduction, "
    "resume across layouts) and check each: a refusal before any process starts must be a LaunchError naming the "
    "setting, a run must match the unsplit model (pv.check_numerics). The first failure is shrunk to a minimal case "
    "and written to --out as repro.py and repro_torchrun.py; exits 1 then. The same --seed draws the same cases. "
    "See docs/fuzz.md.")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pipeviz", description="See, split, simulate and run pipeline parallelism.")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="headless main job: trace, balance, simulate, launch, check, HTML report")
    d.add_argument("--model", default="all", choices=[*MODELS, "all"])
    d.add_argument("--stages", type=int, default=None, help="default: 3 for classic, 4 for gpt2")
    launch = pv.LaunchConfig()  # the one set of defaults pv.launch, export_torchrun and the Explorer share
    d.add_argument("--schedule", default=launch.schedule, help=f"one of {', '.join(sched.ALL)}")
    d.add_argument("--microbatches", type=int, default=launch.microbatches)
    d.add_argument("--steps", type=int, default=5, help="optimizer steps of the demo run (default 5: a timeline "
                   "with steady steps to compare with the simulation)")
    d.add_argument("--accumulate", type=int, default=launch.accumulate,
                   help="batches per optimizer step (gradient accumulation; default 1)")
    d.add_argument("--lr-warmup", type=int, default=None,
                   help="a learning-rate schedule: this many warm-up steps, then a cosine decay (pv.warmup_cosine)")
    d.add_argument("--eval-every", type=int, default=launch.eval_every,
                   help="evaluate a held-out batch every this many steps and after the last (run.eval_losses)")
    d.add_argument("--mixed-precision", default=None, choices=["bf16", "fp16"],
                   help="compute under autocast in bfloat16 (or float16, with a dynamic loss scale) with float32 "
                   "master weights")
    d.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="activation recomputation at run time: each layer's (full) or attention's scores (selective)")
    d.add_argument("--compile", default=None, metavar="BACKEND",
                   help="run every stage through torch.compile with this backend (inductor, aot_eager, ...)")
    d.add_argument("--devices", default=launch.devices, help="auto, cpu, cuda, or a comma-separated list per rank")
    d.add_argument("--clip-grad-norm", type=float, default=launch.clip_grad_norm,
                   help="clip the gradients by their global norm across stages (default: no clipping)")
    d.add_argument("--loss-reduction", default=launch.loss_reduction, choices=list(LOSS_REDUCTIONS),
                   help="mean: each microbatch's mean averaged; token_mean: over the whole step's valid tokens")
    d.add_argument("--output", default="pipeviz-report.html")
    d.add_argument("--cluster-hardware", default="h100", help="the named cluster the report also plans for")
    d.add_argument("--cluster-gpus", type=int, default=8, help="its GPU count (0: no cluster plan)")
    d.set_defaults(func=demo)
    p = sub.add_parser("plan", help="rank pp x dp x tp layouts, schedules and microbatches for a cluster")
    p.add_argument("--model", default="llama-3-8b", help=f"one of {', '.join(zoo.CONFIGS)}")
    p.add_argument("--config", default=None, help="an HF config.json instead of --model")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--hardware", default="h100", help="a100, h100, h200, b200, cpu (pv.HARDWARE)")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--memory-gib", type=float, default=None, help="per device (default: the hardware's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--efficiency", type=float, default=None, help="achieved fraction of peak (default: preset's)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--dp-reduce", nargs="+", default=None, choices=["ddp", "overlap", "after_flush", "distributed"],
                   help="how replicas may reduce their gradients, searched per row (default: ddp overlap)")
    p.add_argument("--cp", nargs="+", type=int, default=None, metavar="N",
                   help="context-parallel degrees to consider (default: 1, and 2..16 where each share keeps 8,192 "
                        "tokens or more)")
    p.add_argument("--ep", nargs="+", type=int, default=None, metavar="N",
                   help="expert-parallel degrees to consider for a mixture-of-experts model (default: every divisor "
                        "of its routed experts' count; 1 for a dense model)")
    p.add_argument("--full-trace", action="store_true", help="trace every block (default: 2, the last repeated)")
    p.add_argument("--no-synthesize", action="store_true",
                   help="skip the synthesized schedule for the best pipelined layout (pv.synthesize_schedule)")
    p.add_argument("--export", default=None, choices=["torchtitan", "megatron"],
                   help="the best row for torchtitan (a TOML fragment at --export-path) or Megatron-LM (its flags)")
    p.add_argument("--export-path", default="torchtitan.toml", help="where --export torchtitan writes")
    p.set_defaults(func=plan)
    lb = sub.add_parser("lab", help="JupyterLab on the notebooks")
    lb.add_argument("path", nargs="?")
    lb.set_defaults(func=lab)
    fz = sub.add_parser("fuzz", help="check a model across layouts: random compositions against the unsplit model",
                        description=FUZZ_HELP)
    fz.add_argument("--seconds", type=float, default=120.0, help="time budget (a case started runs to its end)")
    fz.add_argument("--seed", type=int, default=0, help="the cases drawn (the same seed, the same cases)")
    fz.add_argument("--out", default="fuzz-out", help="where a failure's repro.py and repro_torchrun.py go")
    fz.add_argument("--model", default=None, help="one model instead of the built-in ones: a name (mlp, skip, "
                    "batchnorm, tied, transformer, gpt2, llama), a .py file defining fuzz_model() -> (model, inputs, "
                    "target), or package.module:function")
    fz.add_argument("--cases", type=int, default=None, help="at most this many cases")
    fz.set_defaults(func=fuzz)
    args = ap.parse_args(argv)
    if getattr(args, "devices", None) and "," in args.devices:
        args.devices = args.devices.split(",")
    try:
        return int(args.func(args))
    except (pv.PlanError, pv.ScheduleError, pv.LaunchError, pv.HardwareError) as exc:
        print(f"pipeviz: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
