"""Predicted vs published for a mixture-of-experts run: DeepSeek-V3's pre-training layout, simulated by ``pv.simulate``
with expert parallelism (``LaunchConfig(ep=64)``) as ``pv.plan_cluster`` prices it.

Source: DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437v1, Dec 2024):

- sec. 3.1 / 3.2: "trained on a cluster equipped with 2048 NVIDIA H800 GPUs"; "16-way Pipeline Parallelism (PP),
  64-way Expert Parallelism (EP) spanning 8 nodes, and ZeRO-1 Data Parallelism (DP)"; no tensor parallelism;
  DualPipe, whose overlap of forward and backward chunks hides the all-to-alls; NVLink 160 GB/s, IB 50 GB/s
  (measured figures of the report); FP8 mixed precision (GEMMs in FP8, sec. 3.3);
- sec. 4.2: 4,096 tokens per sequence in pre-training, "batch size ... gradually increased from 3072 to 15360 in
  the training of the first 469B tokens, and then keeps 15360" (of 14.8T tokens: 15360 is the figure compared);
- table 1 / sec. 1: "each trillion tokens ... 180K H800 GPU hours": 10^12 / (180,000 x 3600 s) = 1,543 tokens per
  GPU per second, so 15,360 x 4,096 tokens a step take 19.9 s on 2,048 GPUs.

What the prediction assumes (the report does not say, or pipeviz does not model):

- the model: ``pipeviz.zoo.CONFIGS["deepseek-v3"]`` (transformers' DeepseekV3 on the meta device: MLA, the first 3
  blocks dense, 1 shared + 256 routed experts, top 8), traced at 4,096 tokens; its multi-token-prediction module
  (one more block and the shared head: about 2 % of the compute) is not in transformers' model, so not priced;
- the H800: the H100 SXM preset with NVLink at 200 GB/s a direction (400 GB/s both ways: the H800's export limit)
  and 50 GB/s InfiniBand a GPU, element-wise chains fused; the efficiency constant one of the two already fitted on
  published dense runs (``published_runs_data.CALIBRATION``), not fitted here: torchtitan's float8 fit (0.345 of
  the FP8 peak, the run whose linears were float8 like DeepSeek's) for the FP8 row, Megatron-Core's BF16 fit
  (0.503) for the BF16 row;
- DualPipe as torch's ``DualPipeV`` (its V-shaped form: 2 stages per rank, one copy of the weights, 32 stages of
  ``pv.balance``'s optimum split); microbatches of 1 sequence, 120 per replica (15,360 over 128 replicas);
  ZeRO-1 as ``Collectives(dp_reduce="distributed")``; no recomputation (the report recomputes only RMSNorm and
  MLA's up-projections); balanced routing (``expert_imbalance=1``: the auxiliary-loss-free balancing);
- the all-to-alls: pipeviz charges each MoE block's dispatch and combine in every forward and backward on the
  64-way group's link (InfiniBand here), tokens x top-8 x hidden x dtype bytes. DeepSeek's dispatch is node-limited
  (a token reaches at most 4 nodes over IB, then NVLink) and hidden behind DualPipe's paired chunks. So each row is
  printed three times: priced and not overlapped, priced with ``ep_overlap=True`` (DualPipeV's F/B pairs as
  ``pv.simulate`` prices them), and with the all-to-alls free (``ep_bandwidth`` 10^15 B/s), the bound of a perfect
  overlap. Measured 2026-12-06: FP8 -40.5 / -12.8 / -8.7 %, BF16 -65.1 / -47.6 / -40.9 %.

    python benchmarks/accuracy/published_moe.py

Prints each row's predicted step and throughput and the error against the published throughput
(``published step / predicted step - 1``: positive means pipeviz predicts faster than the run). Measured:
docs/experts.md, "Planned".
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import pipeviz as pv
from pipeviz import zoo
from pipeviz.costs import CostOptions
from pipeviz.sim.simulate import Collectives

GPUS, PP, EP, GLOBAL_BATCH, SEQ, MICROBATCH = 2048, 16, 64, 15360, 4096, 1
PUBLISHED_TOKENS_PER_GPU_S = 1e12 / (180_000 * 3600)  # "180K H800 GPU hours" per trillion tokens
TARGET = 0.20
# (label, dtype, efficiency): the two efficiency constants fitted on published dense runs (docs/benchmarks.md)
ROWS = [("FP8 GEMMs (torchtitan's float8 fit, 0.345)", "fp8", 0.345),
        ("BF16 (Megatron-Core's H100 fit, 0.503)", "bfloat16", 0.503)]


def h800(efficiency: float) -> pv.Hardware:
    """The H100 SXM preset as an H800: NVLink at 200 GB/s a direction (400 both ways), 50 GB/s InfiniBand a GPU."""
    h100 = pv.hardware("h100")
    return dataclasses.replace(h100, name="h800", intra_node=(200e9, h100.intra_node[1]), fused=True,
                               efficiency=efficiency)


def predict(plan: pv.SplitPlan, dtype: str, efficiency: float, a2a: str) -> pv.Timeline:
    """``pv.simulate`` of DeepSeek-V3's layout on the H800s: pp 16 (DualPipeV) x dp 128, ep 64 carved of the dp;
    ``a2a``: "priced" (every all-to-all on the critical path), "overlapped" (``ep_overlap=True``: DualPipeV's
    paired forward and backward, each pair priced ``max(F, B, F's compute + B's compute)``) or "free"."""
    dp = GPUS // PP
    m = GLOBAL_BATCH // dp // MICROBATCH
    cfg = pv.LaunchConfig(schedule="DualPipeV", microbatches=m, dp=dp, ep=EP, loss_fn=pv.cross_entropy,
                          ep_overlap=a2a == "overlapped")
    per_token = 1 / (plan.graph.batch_size or 1)  # the trace is one sequence at the run's length
    opts = CostOptions(hardware=h800(efficiency), dtype=dtype, recompute="none",
                       batch_scale=MICROBATCH * per_token * dp * m)
    return pv.simulate(plan, cfg, options=opts, collectives=Collectives(dp_reduce="distributed"),
                       ep_bandwidth=1e15 if a2a == "free" else None)


def main() -> None:
    warnings.filterwarnings("ignore")
    t = time.time()
    graph, seq = zoo.planning_graph("deepseek-v3", SEQ)
    took = time.time() - t
    print(f"DeepSeek-V3: {graph.total_params / 1e9:.0f} B parameters, traced at {seq} tokens in {took:.0f} s")
    published_step = GLOBAL_BATCH * SEQ / (GPUS * PUBLISHED_TOKENS_PER_GPU_S)
    print(f"published: {PUBLISHED_TOKENS_PER_GPU_S:,.0f} tokens/GPU/s (180K H800 GPU hours per 10^12 tokens): "
          f"{published_step:.2f} s per step of {GLOBAL_BATCH} x {SEQ} tokens on {GPUS} GPUs")
    plans: dict[str, pv.SplitPlan] = {}
    for label, dtype, eff in ROWS:
        t = time.time()
        if dtype not in plans:  # balanced on the row's roofline
            plans[dtype] = pv.balance(graph, 2 * PP, options=CostOptions(hardware=h800(eff), dtype=dtype))
        for mode in ("priced", "overlapped", "free"):
            tl = predict(plans[dtype], dtype, eff, mode)
            err = published_step / tl.step_time - 1
            a2a = max(sum(e.duration for e in tl.events if e.kind == "A2A" and e.rank == r) for r in range(PP))
            mem = max(tl.meta["memory_bytes"]) / 2**30
            how = {"free": "A2A free (perfect overlap)", "overlapped": "A2A priced, ep_overlap (DualPipeV's pairs)",
                   "priced": f"A2A priced (up to {a2a:.2f} s a rank)"}[mode]
            print(f"{label}, {how}: {tl.step_time:.2f} s per step, "
                  f"{GLOBAL_BATCH * SEQ / tl.step_time / GPUS:,.0f} tokens/GPU/s, bubble {tl.bubble_fraction:.0%}, "
                  "peak "
                  f"{mem:.1f} GiB; vs published {err:+.1%} {'within' if abs(err) <= TARGET else 'OUTSIDE'} "
                  f"{TARGET:.0%} ({time.time() - t:.0f} s)")


if __name__ == "__main__":
    main()
