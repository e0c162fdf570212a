"""Predicted vs published: ``pv.simulate`` on the layouts of large published training runs.

Each row of ``published_runs_data.RUNS`` (Megatron-LM on A100 and H100, torchtitan on H100; 22 rows, pipeline
degrees 1 to 64) is rebuilt and predicted:

1. the model at the row's shape is built on the meta device (``GPT2Config`` / ``LlamaConfig``, no weights) and
   traced with ``pv.trace`` on one sequence of the row's length, at its full depth (so every stage's layers are
   the real ones; tracing costs about 0.2-0.4 s per layer here, the benchmark's main cost);
2. it is split as its framework split it (``PublishedRun.split``): Megatron-LM's transformer blocks evenly over
   ``pp x stages_per_rank`` stages (a remainder to the later stages), torchtitan's ``generate_split_points``
   (a remainder to the stages after the first); the embeddings on the first stage, the final norm and head on
   the last;
3. ``pv.simulate(plan, schedule, microbatches, stages_per_rank, hardware=<gpu>, dtype, recompute, dp, tp,
   options=CostOptions(batch_scale=global_batch), collectives=Collectives(...))`` predicts the step: the traced
   sequence scaled to the global batch, each replica's microbatch costed at its size, and the collectives done as
   the row's framework did them (``published_runs_data``: ``framework``): Megatron-LM 2021's gradient all-reduce
   after the pipeline flush in fp16 with scatter/gather hand-offs; Megatron-Core's distributed optimizer
   (overlapped fp32 reduce-scatter, parameter all-gather), ``--tp-comm-overlap`` and sequence-parallel
   hand-offs; torchtitan's FSDP and async TP. The model's attention is built as the run computed it (``eager``:
   Megatron-LM 2021's materialised scores, with its default dropout 0.1; ``sdpa``: flash attention), and every
   run's element-wise chains are costed as fused kernels (``Hardware.fused``);
4. the published figure is turned into a step time the same way its source computed it (Megatron's FLOPs
   formulas, or tokens per GPU per second), and the two are printed side by side with the error in throughput
   (``published step / predicted step - 1``: positive means pipeviz predicts faster than was measured).

One efficiency constant per GPU type (``Hardware.efficiency``: the ceiling a large matmul approaches; a smaller
one reaches less, ``pipeviz.hardware.matmul_efficiency``) is fitted on one named row
(``published_runs_data.CALIBRATION``), on its whole predicted step, and used unchanged for every other row of that
GPU type. The "no DP" column is the same pipeline alone, without the replicas' gradient reduction: what the
reduction adds. Rows that share a ``group`` are a schedule comparison at a fixed layout: predicted order and ratio
beside the published ones.

``--attention`` builds every row with one attention instead of its own; ``--cache DIR`` keeps the traced graphs
(pickled) between runs: tracing is the benchmark's main cost (6 minutes here; 20 s from the cache). Measured:
docs/benchmarks.md, "Checked against published training runs".

    python benchmarks/accuracy/published_runs.py [--only N21] [--cache /tmp/pv_graphs]

--only keeps the rows whose key has this text.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import pickle
import time
import warnings
from dataclasses import replace
from typing import Any

import torch

import pipeviz as pv
from pipeviz.costs import CostOptions
from pipeviz.sim.simulate import Collectives

try:  # run as a script (python benchmarks/accuracy/published_runs.py) or as a module
    from published_runs_data import CALIBRATION, GPU_TYPES, RUNS, PublishedRun
except ImportError:  # pragma: no cover
    from benchmarks.published_runs_data import CALIBRATION, GPU_TYPES, RUNS, PublishedRun

TARGET = 0.15  # the goal: every row within 15 %


def build(row: PublishedRun, attention: str = "sdpa") -> tuple[torch.nn.Module, str]:
    """The row's model on the meta device, and the name prefix of its transformer blocks.

    ``attention``: HF's ``attn_implementation``. ``"sdpa"`` is one fused op, as the flash/cuDNN attention of
    these runs (Megatron 2021 fused scale-mask-softmax); ``"eager"`` materialises the scores and runs the
    scaling, masking, softmax and casts as separate ops, each charged its memory traffic by the roofline."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if row.family == "gpt":
        # Megatron 2021 ties the output layer to the word embedding (its default); the 2026 table's parameter
        # counts (e.g. 1.7B at hidden 2048 x 24 layers, vocab 131,072) need an untied head.
        cfg = GPT2Config(n_layer=row.layers, n_embd=row.hidden, n_head=row.heads, n_inner=row.ffn,
                         vocab_size=row.vocab, n_positions=row.seq_len, use_cache=False,
                         tie_word_embeddings=row.vocab == 51200, activation_function="gelu",
                         resid_pdrop=row.dropout, embd_pdrop=row.dropout, attn_pdrop=row.dropout,
                         attn_implementation=attention)
        cls: Any = GPT2LMHeadModel
        prefix = "transformer.h"
    else:
        cfg = LlamaConfig(num_hidden_layers=row.layers, hidden_size=row.hidden, num_attention_heads=row.heads,
                          num_key_value_heads=row.kv_heads or row.heads, intermediate_size=row.ffn,
                          vocab_size=row.vocab, max_position_embeddings=row.seq_len, use_cache=False,
                          tie_word_embeddings=False, attn_implementation=attention)
        cls = LlamaForCausalLM
        prefix = "model.layers"
    with torch.device("meta"):
        return cls(cfg), prefix


def even_split(graph: pv.ModelGraph, prefix: str, layers: int, stages: int) -> pv.SplitPlan:
    """Blocks evenly over ``stages`` (later stages take the remainder), as Megatron-LM and torchtitan split."""
    base, extra = divmod(layers, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    ends, at = [], 0
    for size in sizes[:-1]:
        at += size
        ends.append(f"{prefix}.{at - 1}")
    return graph.split(ends)


def torchtitan_split(graph: pv.ModelGraph, prefix: str, layers: int, stages: int) -> pv.SplitPlan:
    """torchtitan's default split (``generate_split_points``, commit 9dec370): the first stage ``layers //
    stages`` blocks, each next one a block more while the remainder lasts, the rest ``layers // stages``: the
    stages holding the embedding and the head are the lighter ones."""
    base, extra = divmod(layers, stages)
    ends, at = [], 0
    for s in range(stages - 1):
        size = base + (1 if 0 < s <= extra else 0)
        at += size
        ends.append(f"{prefix}.{at - 1}")
    return graph.split(ends)


def split(row: PublishedRun, graph: pv.ModelGraph, prefix: str) -> pv.SplitPlan:
    """The row's stages, split as its framework split them (``PublishedRun.split``)."""
    stages = row.pp * (row.stages_per_rank or 1)
    if row.split == "torchtitan":
        return torchtitan_split(graph, prefix, row.layers, stages)
    return even_split(graph, prefix, row.layers, stages)


def flops_per_step(row: PublishedRun) -> float:
    """FLOPs of one step as the row's source counts them (for a published TFLOP/s per GPU)."""
    b, s, l_, h, v = row.global_batch, row.seq_len, row.layers, row.hidden, row.vocab
    if row.flops_formula == "narayanan_eq3_recompute":
        # Narayanan et al. 2021, eq. 3 (with activation recomputation: 4 passes of 24 B s l h^2 ...)
        return 96 * b * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))
    if row.flops_formula == "megatron_core_r0.8":
        # Megatron-Core r0.8.0 num_floating_point_operations: 12 B s l h^2 ((1 + groups/heads + s/h) x q/h
        # + ffn/h + V / (2 l h)), MHA and a GELU MLP here
        return 12 * b * s * l_ * h * h * ((1 + 1 + s / h) + row.ffn / h + v / (2 * l_ * h))
    raise ValueError(f"{row.key}: no FLOPs formula for metric {row.metric}")


def published_step(row: PublishedRun) -> float:
    """The step time, in seconds, that the published figure implies."""
    if row.metric == "step_s":
        return row.value
    if row.metric == "tokens_per_gpu_s":
        return row.global_batch * row.seq_len / (row.value * row.gpus)
    return flops_per_step(row) / (row.value * 1e12 * row.gpus)


def collectives(row: PublishedRun) -> Collectives:
    """How the row's framework did its collectives (``published_runs_data``: ``framework`` says which), and what its
    tensor parallelism sharded (``tp_layout``: Megatron's layout; ``pv.simulate``'s default prices ``pv.launch``'s)."""
    return Collectives(dp_reduce=row.dp_reduce, grad_dtype=row.grad_dtype, tp_overlap=row.tp_overlap,
                       scatter_gather=row.scatter_gather, tp_layout=row.tp_layout)


def predict(plan: pv.SplitPlan, row: PublishedRun, hw: pv.Hardware, reduce: bool = True) -> pv.Timeline:
    """The simulated step of ``row``; ``reduce=False``: one replica alone (its batch, no gradient reduction), to
    show what the replicas' reduction adds to the prediction."""
    dp = row.dp if reduce else 1
    batch = row.global_batch / row.dp * dp
    opts = CostOptions(hardware=hw, dtype=row.dtype, recompute=row.recompute, batch_scale=batch)
    return pv.simulate(plan, row.schedule, row.microbatches, stages_per_rank=row.stages_per_rank, dp=dp,
                       tp=row.tp, options=opts, collectives=collectives(row))


def calibrate(plan: pv.SplitPlan, row: PublishedRun, hw: pv.Hardware) -> pv.Hardware:
    """``hw`` with the efficiency at which ``row``'s predicted step (the whole run: its replicas' gradient
    reduction placed as its framework placed it) equals the published one. A few fixed-point steps: the step is
    nearly inversely proportional to the efficiency, not exactly, as memory-bound ops and links do not speed up
    with it."""
    target = published_step(row)
    for _ in range(8):
        ratio = predict(plan, row, hw).step_time / target
        hw = replace(hw, efficiency=min(1.0, hw.efficiency * ratio))
    return hw


def traced(row: PublishedRun, attention: str, cache: str | None) -> tuple[pv.ModelGraph, str]:
    """The row's model traced (``build``), or read from ``cache`` (a folder of pickled graphs, one per shape and
    attention; delete it after changing ``pipeviz.capture.export`` or ``pipeviz.graph.model``)."""
    shape = (row.family, row.layers, row.hidden, row.heads, row.kv_heads, row.ffn, row.vocab, row.seq_len)
    path = None
    if cache:
        os.makedirs(cache, exist_ok=True)
        path = os.path.join(cache, "_".join(map(str, shape)) + ("" if attention == "sdpa" else f"_{attention}")
                            + (f"_drop{row.dropout}" if row.dropout else "") + ".pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                return pickle.load(f)
    model, prefix = build(row, attention)
    ids = torch.zeros(1, row.seq_len, dtype=torch.long)
    with contextlib.redirect_stderr(io.StringIO()):
        out = (pv.trace(model, example_args=(ids,)), prefix)
    if path:
        with open(path, "wb") as f:
            pickle.dump(out, f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose key contains this text (the calibration rows always)")
    ap.add_argument("--attention", default=None, choices=("sdpa", "eager"),
                    help="HF attn_implementation for every row (default: each row's, as its run computed attention)")
    ap.add_argument("--cache", default=None, help="a folder to keep traced graphs in between runs (pickled)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    rows = [r for r in RUNS if a.only in r.key or r.key in CALIBRATION.values()]
    plans: dict[str, pv.SplitPlan] = {}
    graphs: dict[tuple[Any, ...], tuple[pv.ModelGraph, str]] = {}  # one trace per model shape
    for row in rows:
        t = time.perf_counter()
        attention = a.attention or row.attention
        shape = (row.family, row.layers, row.hidden, row.heads, row.kv_heads, row.ffn, row.vocab, row.seq_len,
                 attention, row.dropout)
        if shape not in graphs:
            graphs[shape] = traced(row, attention, a.cache)
        graph, prefix = graphs[shape]
        plans[row.key] = split(row, graph, prefix)
        print(f"traced {row.key:<24} {row.layers:>4} layers, {sum(x.params for x in graph.layers) / 1e9:7.1f} B "
              f"params in {time.perf_counter() - t:5.1f} s", flush=True)

    hws: dict[str, pv.Hardware] = {}
    for gpu, key in CALIBRATION.items():
        row = next(r for r in rows if r.key == key)
        # Every run here fuses its element-wise chains: Megatron-LM's fused kernels (bias-GeLU, scale-mask-softmax,
        # bias-dropout-add; Transformer Engine in Megatron-Core), torchtitan's torch.compile.
        base = pv.hardware(GPU_TYPES[gpu][0]) if gpu in GPU_TYPES else pv.hardware(gpu)
        hws[gpu] = calibrate(plans[key], row, replace(base, name=gpu, fused=True))
        note = f" ({GPU_TYPES[gpu][1]})" if gpu in GPU_TYPES else ""
        print(f"{gpu}: efficiency {hws[gpu].efficiency:.3f} of the dense peak, fitted on {key!r} (its whole step)"
              f"{note}")

    print("\nthroughput in the source's unit; error = published step / predicted step - 1 (+: predicted faster); "
          "no DP: one replica alone, without the replicas' gradient reduction (what it adds)")
    head = (f"{'row':<25}{'source':>7}{'gpu':>6}{'GPUs':>6}{'tp':>3}{'pp':>4}{'dp':>4}{'v':>3}{'m':>5}"
            f"{'schedule':>16}{'recomp':>7}{'dp reduce':>12}{'tp layout':>10}{'unit':>10}{'published':>10}"
            f"{'predicted':>10}"
            f"{'error':>8}{'bubble':>8}{'no DP':>8}{'error':>8}")
    print(head)
    results: dict[str, tuple[float, float]] = {}
    for row in rows:
        hw = hws[row.gpu]
        tl = predict(plans[row.key], row, hw)
        alone = predict(plans[row.key], row, hw, reduce=False).step_time
        pub = published_step(row)
        pred_value = row.value * pub / tl.step_time
        err = pub / tl.step_time - 1
        results[row.key] = (pred_value, err)
        unit = {"tflops_per_gpu": "TFLOP/s", "tokens_per_gpu_s": "tok/s/GPU", "step_s": "s/step"}[row.metric]
        shown_pred = tl.step_time if row.metric == "step_s" else pred_value
        mark = "  (fit)" if row.key in CALIBRATION.values() else ""
        source = row.source.split()[0].replace("narayanan2021", "N21").replace("megatron_readme_", "MLM")
        source = source.replace("torchtitan_", "TT")
        gpu = row.gpu.split("-")[0] + ("*" if row.gpu in GPU_TYPES else "")  # *: not a preset (GPU_TYPES)
        print(f"{row.key:<25}{source:>7}{gpu:>6}{row.gpus:>6}{row.tp:>3}{row.pp:>4}{row.dp:>4}"
              f"{row.stages_per_rank or 1:>3}{row.microbatches:>5}{row.schedule:>16}{row.recompute:>7}"
              f"{row.dp_reduce:>12}{tl.tp_layout or '-':>10}{unit:>10}{row.value:>10.1f}{shown_pred:>10.1f}{err:>+8.1%}"
              f"{tl.bubble_fraction:>8.1%}"
              f"{(alone if row.metric == 'step_s' else row.value * pub / alone):>8.1f}{pub / alone - 1:>+8.1%}{mark}")

    tested = [(k, e) for k, (_, e) in results.items() if k not in CALIBRATION.values()]
    if tested:
        within = sum(abs(e) <= TARGET for _, e in tested)
        errs = [abs(e) for _, e in tested]
        print(f"\n{within} of {len(tested)} rows (calibration rows aside) within {TARGET:.0%}; max |error| "
              f"{max(errs):.1%}, mean {sum(errs) / len(errs):.1%}")
        for prefix in ("N21", "MLM ", "MLM26", "TT"):
            sub = [abs(e) for k, e in tested if k.startswith(prefix)]
            if sub:
                print(f"  {prefix.strip():<6} {len(sub):>2} rows: max {max(sub):6.1%}, mean "
                      f"{sum(sub) / len(sub):6.1%}, {sum(e <= TARGET for e in sub)} within {TARGET:.0%}")

    groups: dict[str, list[PublishedRun]] = {}
    for row in rows:
        if row.group:
            groups.setdefault(row.group, []).append(row)
    for name, members in groups.items():
        pub_order = sorted(members, key=lambda r: -r.value)
        pred_order = sorted(members, key=lambda r: -results[r.key][0])
        best = pub_order[0]
        print(f"\nschedule comparison, {name}:")
        for r in members:
            print(f"  {r.schedule:<18} published {r.value:>7.1f}  predicted {results[r.key][0]:>7.1f}   "
                  f"vs the published best: published {r.value / best.value:.2f}x, predicted "
                  f"{results[r.key][0] / results[best.key][0]:.2f}x")
        same = [r.key for r in pub_order] == [r.key for r in pred_order]
        print(f"  order: published {' > '.join(r.schedule for r in pub_order)}; predicted "
              f"{' > '.join(r.schedule for r in pred_order)} ({'same' if same else 'DIFFERENT'})")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if any(math.isnan(e) for _, e in results.values()):
        raise SystemExit("a prediction was not a number")


if __name__ == "__main__":
    main()
