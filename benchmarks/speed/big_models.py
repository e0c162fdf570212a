"""Big models: trace time by layer count on the meta device, Explorer click -> preview latency on the
largest graph, and a run started from a safetensors checkpoint: each rank's peak resident memory against
the whole model's bytes and its own stage's, and launch -> first event as the model grows.

Goals (issue 14): Llama-3-8B traced in under 30 s on a 2-core machine, an 80-layer 70B-sized config
practical, the Explorer usable on 80 layers; each rank's peak about its stage plus gradients and optimizer
state (never the whole model).

    python benchmarks/speed/big_models.py                    # all three parts
    python benchmarks/speed/big_models.py --part trace --layers 8 16 32 80
    python benchmarks/speed/big_models.py --part checkpoint --hidden 1024 --blocks 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import warnings
from typing import Any

import torch
from preview_latency import click_latencies  # the sibling benchmark (this folder is on sys.path when run)

import pipeviz as pv
from pipeviz.plan.preview import human_bytes

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256}
LLAMA3_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
              "vocab_size": 128256}


def llama(layers: int, shape: dict[str, int], device: str = "meta", **kw: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **shape, **kw))


def part_trace(layer_counts: list[int]) -> None:
    print("== trace on the meta device (Llama-3 shapes; batch 1 x 128 tokens) ==")
    print(f"{'model':<22}{'params':>16}{'trace s':>9}{'balance s':>11}{'simulate s':>12}{'click ms':>10}"
          f"{'Explorer click ms':>19}")
    ids = torch.randint(0, 1000, (1, 128))
    for n in layer_counts:
        shape = LLAMA3_70B if n >= 80 else LLAMA3_8B
        model = llama(n, shape)
        t = time.perf_counter()
        graph = pv.trace(model, example_args=(ids,))
        trace_s = time.perf_counter() - t
        t = time.perf_counter()
        plan = pv.balance(graph, 8, by="params")
        balance_s = time.perf_counter() - t
        t = time.perf_counter()
        pv.simulate(plan, "1F1B", 8)
        sim_s = time.perf_counter() - t
        cands = [c for c in graph.split_candidates if c.startswith("model.layers.") and c.count(".") == 2]
        clicks = click_latencies(plan, cands, 40, 7)
        ex_ms = float("nan")
        try:
            ex = pv.Explorer(graph, splits=plan)
            ex_clicks = []
            for i in range(10):
                t = time.perf_counter()
                ex.click(cands[(i * 5) % len(cands)])
                ex_clicks.append(time.perf_counter() - t)
            ex_ms = statistics.median(ex_clicks) * 1e3
        except ImportError:  # the notebook extra is not installed
            pass
        name = f"{'70B' if n >= 80 else '8B'}-shape, {n} layers"
        print(f"{name:<22}{graph.total_params:>16,}{trace_s:>9.1f}{balance_s:>11.2f}{sim_s:>12.3f}"
              f"{statistics.median(clicks) * 1e3:>10.1f}{ex_ms:>19.0f}")


def _peak_rss(pids: list[int], peaks: dict[int, int], stop: threading.Event) -> None:
    """Each process's peak resident set (VmHWM, the kernel's high-water mark), read until it exits."""
    while not stop.is_set():
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peaks[pid] = max(peaks.get(pid, 0), int(line.split()[1]) * 1024)
            except OSError:
                pass
        time.sleep(0.05)


def measured_run(plan: pv.SplitPlan, ids: torch.Tensor, **kw: Any) -> tuple[pv.Run, list[int], float]:
    t0 = time.perf_counter()
    run = pv.launch(plan, "1F1B", 2, steps=1, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4), timeout=600, **kw)
    while len(run._procs) < plan.num_stages and not run.done:  # 1F1B: one rank per stage
        time.sleep(0.01)
    pids = [p.pid for p in run._procs if p.pid]
    peaks: dict[int, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_peak_rss, args=(pids, peaks, stop), daemon=True)
    watcher.start()
    first = float("nan")
    while not run.done:
        if run.events and first != first:
            first = time.perf_counter() - t0
        time.sleep(0.01)
    stop.set()
    watcher.join()
    assert run.status == "done", run.error
    return run, [peaks.get(p, 0) for p in pids], first


def part_checkpoint(hidden: int, blocks: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"\n== a run from a safetensors checkpoint: Llama, hidden {hidden}, {blocks} layers, 2 ranks, Adam ==")
    shape = {"hidden_size": hidden, "intermediate_size": int(hidden * 2.75), "num_attention_heads": hidden // 64,
             "num_key_value_heads": hidden // 128, "vocab_size": 32000}
    ids = torch.randint(0, 32000, (2, 64))
    baseline_plan = pv.balance(pv.trace(llama(4, {**shape, "hidden_size": 64, "intermediate_size": 128,
                                                 "num_attention_heads": 4, "num_key_value_heads": 2}, "cpu"),
                                        example_args=(ids,)), 2)
    _, base, _ = measured_run(baseline_plan, ids)  # a rank of a tiny model: torch, gloo, the runtime
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        real = LlamaForCausalLM(LlamaConfig(num_hidden_layers=blocks, **shape))
        real.save_pretrained(tmp, max_shard_size="200MB")
        whole = sum(p.numel() * p.element_size() for p in real.parameters())
        del real
        meta = llama(blocks, shape)
        plan = pv.balance(pv.trace(meta, example_args=(ids,)), 2, by="params")
        stage = [s.param_bytes for s in plan.stages]
        run, peaks, first = measured_run(plan, ids, weights=tmp)
        print(f"model {human_bytes(whole)} ({whole / 4:,.0f} params, float32); stages "
              f"{', '.join(map(human_bytes, stage))}; checkpoint: {len(os.listdir(tmp))} files")
        print(f"a rank of a tiny model (torch + gloo + runtime): {', '.join(human_bytes(b) for b in base)}")
        print(f"{'rank':<6}{'stage bytes':>13}{'peak RSS':>12}{'peak - tiny':>13}{'/ stage':>9}{'/ model':>9}")
        for r, (peak, sb) in enumerate(zip(peaks, stage, strict=True)):
            extra = peak - base[r]
            print(f"{r:<6}{human_bytes(sb):>13}{human_bytes(peak):>12}{human_bytes(extra):>13}{extra / sb:>9.2f}"
                  f"{extra / whole:>9.2f}")
        print("(goal: peak - tiny ~ 4 x stage: weights, gradients, Adam's two states; plus activations)")
        print(f"launch -> first event: {first:.1f} s; losses {run.losses}")


def part_first_event(hidden: int, sizes: list[int]) -> None:
    print(f"\n== launch -> first event as the model grows (hidden {hidden}; 2 ranks) ==")
    print(f"{'layers':>7}{'model':>11}{'weights= s':>12}{'shipped s':>11}")
    shape = {"hidden_size": hidden, "intermediate_size": int(hidden * 2.75), "num_attention_heads": hidden // 64,
             "num_key_value_heads": hidden // 128, "vocab_size": 32000}
    ids = torch.randint(0, 32000, (2, 64))
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            real = llama(n, shape, "cpu")
            real.save_pretrained(tmp)
            whole = sum(p.numel() * p.element_size() for p in real.parameters())
            plan_meta = pv.balance(pv.trace(llama(n, shape), example_args=(ids,)), 2, by="params")
            _, _, from_ckpt = measured_run(plan_meta, ids, weights=tmp)
            plan_real = pv.balance(pv.trace(real, example_args=(ids,)), 2, by="params")
            _, _, shipped = measured_run(plan_real, ids)
            print(f"{n:>7}{human_bytes(whole):>11}{from_ckpt:>12.1f}{shipped:>11.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["trace", "checkpoint", "first-event", "all"], default="all")
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 80])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bars would break the tables
    torch.manual_seed(0)
    if args.part in ("trace", "all"):
        part_trace(args.layers)
    if args.part in ("checkpoint", "all"):
        part_checkpoint(args.hidden, args.blocks)
    if args.part in ("first-event", "all"):
        part_first_event(512, [2, 4, 8])


if __name__ == "__main__":
    main()
