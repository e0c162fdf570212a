"""Published large training runs: model shape, layout and the throughput their authors measured.

Every row was read in the source it cites (the line or table cell is quoted beside it); nothing here is
estimated. Where a source leaves a setting out, the row says what ``benchmarks/accuracy/published_runs.py`` assumes, in
``assumed``. Sources:

- ``narayanan2021``: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC21 (arXiv 2104.04473), Table 1, as published in NVIDIA/Megatron-LM's README from April 2021
  (``images/cases_april2021.png``, last in the tree at commit 937571cfd4); the layouts (tensor/pipeline degree,
  microbatch, heads, virtual stages, recomputation) are the paper's reproduction script,
  ``examples/academic_paper_scripts/sc21/run_table_1.sh`` (Megatron-LM), with ``CONFIG.sh`` (seq 2048, fp16).
  TFLOP/s per GPU are the paper's eq. 3 with recomputation: ``96 B s l h^2 (1 + s/6h + V/16lh)``.
- ``megatron_readme_2024``: NVIDIA/Megatron-LM README at commit f00732caea (2024-03), "GPT-3 Example", with
  ``examples/pretrain_gpt3_175B.sh`` at the same commit.
- ``megatron_readme_2026``: NVIDIA/Megatron-LM README at commit 71e2246e1a (2026-06), "Performance Benchmarking",
  ``images/model_table.png`` (H100, Megatron-Core r0.8.0 per ``images/strong_scaling.png``). Vocab 131,072, seq
  4,096 (README text). TFLOP/s are model FLOPs (the MFU column is TFLOP/s / 989.5): Megatron-Core r0.8.0's
  ``num_floating_point_operations`` (tag core_r0.8.0, ``megatron/training/training.py``).
- ``torchtitan_2024``: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Table 5), torchtitan
  commit 9dec370 (``train_configs/llama3_405b.toml``: seq_len 8192; ``torchtitan/models/llama/__init__.py``: the
  405B shape; ``torchtitan/parallelisms/pipeline_llama.py``: ``microbatches =
  job_config.experimental.pipeline_parallel_microbatches or parallel_dims.pp``, i.e. as many microbatches as
  pipeline *ranks* by default, whatever ``config_manager.py``'s help says ("the number of pipeline stages");
  ``pipelining_utils.py``, ``generate_split_points``: 2 stages per rank for a multi-stage schedule, the first
  stage ``layers // stages`` blocks, a remainder to the next ones). H100 96 GB HBM2e at 500 W, float8 linears,
  async TP, torch.compile.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement and the setting it was measured in.

    Attributes:
        key: a short name for the row.
        source: which source (see the module docstring) and where in it.
        quote: the source's own line or table cells for this row.
        family: ``"gpt"`` (GPT-2/3 style: learned positions, LayerNorm, GELU MLP of ``ffn``) or ``"llama"``.
        layers, hidden, heads, kv_heads, ffn, vocab, seq_len: the model's shape.
        gpu: a ``pv.hardware`` preset name.
        gpus: GPUs in the run; ``tp x pp x dp == gpus``.
        global_batch: sequences per optimizer step; micro_batch: sequences per microbatch.
        schedule, stages_per_rank: the pipeline schedule (torch's names) and virtual stages per rank.
        recompute: ``"none"``, ``"selective"`` or ``"full"`` activation recomputation.
        dtype: the training dtype (the peak the prediction uses).
        metric: ``"tflops_per_gpu"``, ``"tokens_per_gpu_s"`` or ``"step_s"``; value: the published figure.
        flops_formula: how the source turns a step into FLOPs (for ``tflops_per_gpu``).
        group: rows sharing a group and a layout are a schedule comparison.
        assumed: settings the source does not give, with what the benchmark assumes.
        attention: HF ``attn_implementation`` matching the run's attention kernel: ``"eager"`` for Megatron-LM
            2021 (scores materialised, its fused scale-mask-softmax kernel), ``"sdpa"`` for flash attention.
        dp_reduce, grad_dtype, tp_overlap, scatter_gather: how the run did its collectives
            (``pipeviz.sim.simulate.Collectives``), as its framework version did them; ``framework`` says why.
        framework: the framework settings the four above are read from.
        split: how the blocks are split over the stages: ``"even"`` (Megatron-LM: every stage as many blocks; the
            benchmark gives a remainder to the later stages) or ``"torchtitan"`` (torchtitan's
            ``generate_split_points``: the first stage ``layers // stages`` blocks, the next ones one more each
            while a remainder lasts, the rest ``layers // stages``; the embedding and the head get lighter stages).
        dropout: hidden and attention dropout (Megatron-LM's defaults, ``--hidden-dropout 0.1
            --attention-dropout 0.1``, where the scripts set none): element-wise ops the roofline charges.
        tp_layout: what tensor parallelism sharded (``Collectives.tp_layout``): ``"megatron"`` for every row, as
            each of these frameworks shards a block: Megatron-LM and Megatron-Core's column- and row-parallel
            attention and MLP with a vocabulary-parallel embedding and output (2 all-reduces per block, or their
            reduce-scatter / all-gather halves under sequence parallelism), torchtitan's ``parallelize_llama`` the
            same (colwise q/k/v and w1/w3, rowwise o and w2, rowwise embedding, colwise output).
    """

    key: str
    source: str
    quote: str
    family: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    gpu: str
    gpus: int
    global_batch: int
    micro_batch: int
    tp: int
    pp: int
    schedule: str
    recompute: str
    metric: str
    value: float
    kv_heads: int | None = None
    stages_per_rank: int | None = None
    dtype: str = "bfloat16"
    flops_formula: str | None = None
    group: str | None = None
    assumed: tuple[str, ...] = field(default_factory=tuple)
    attention: str = "sdpa"
    dp_reduce: str = "ddp"
    grad_dtype: str | None = None
    tp_overlap: bool = False
    scatter_gather: bool = False
    framework: str = ""
    dropout: float = 0.0
    split: str = "even"
    tp_layout: str = "megatron"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline per step: the global batch over replicas and microbatch size."""
        return self.global_batch // (self.dp * self.micro_batch)


_N21 = "narayanan2021 Table 1 (Megatron-LM images/cases_april2021.png) + sc21/run_table_1.sh"
# Megatron-LM as of 2021 (the sc21 scripts; pretrain_gpt3_175B.sh runs the nvcr.io pytorch:20.12 container):
# megatron/arguments.py defaults --DDP-impl local (megatron/model/distributed.py: one contiguous gradient buffer,
# allreduce_gradients() called by train_step after the whole forward_backward_func, i.e. after the pipeline
# flush, nothing overlapped), --accumulate-allreduce-grads-in-fp32 off (fp16 runs reduce fp16 gradients), the
# scatter/gather optimization on (--no-scatter-gather-tensors-in-pipeline turns it off; paper sec. 4.1), no
# flash attention (QK^T materialised, FusedScaleMaskSoftmax), no tensor-parallel overlap, and --hidden-dropout /
# --attention-dropout at their default 0.1 (neither script sets them).
_MEGATRON21 = {"attention": "eager", "dp_reduce": "after_flush", "grad_dtype": "float16", "scatter_gather": True,
               "dropout": 0.1,
               "framework": "Megatron-LM 2021: --DDP-impl local (all-reduce after the flush), fp16 grads, "
                            "scatter/gather hand-offs, materialised attention scores, TP not overlapped"}
_GPT21 = {"family": "gpt", "vocab": 51200, "seq_len": 2048, "gpu": "a100", "dtype": "float16", "recompute": "full",
          "metric": "tflops_per_gpu", "flops_formula": "narayanan_eq3_recompute", **_MEGATRON21}

RUNS: tuple[PublishedRun, ...] = (
    # --- Narayanan et al. 2021, Table 1 (A100 80 GB, DGX A100 nodes; every row: --activations-checkpoint-method
    # uniform, i.e. full recomputation; --fp16). Columns quoted: model size | hidden | layers | params (B) |
    # model-parallel size | GPUs | batch | achieved TFLOP/s per GPU | % of peak | aggregate PFLOP/s.
    PublishedRun("N21 1.7B", _N21, "1.7B | 2304 | 24 | 1.7 | 1 | 32 | 512 | 137 | 44% | 4.4; script: TP=1 PP=1 "
                 "MBS=16 GBS=512 NLS=24 HS=2304 NAH=24 NNODES=4", layers=24, hidden=2304, heads=24, ffn=4 * 2304,
                 gpus=32, global_batch=512, micro_batch=16, tp=1, pp=1, schedule="1F1B", value=137, **_GPT21),
    PublishedRun("N21 3.6B", _N21, "3.6B | 3072 | 30 | 3.6 | 2 | 64 | 512 | 138 | 44% | 8.8; script: TP=2 PP=1 "
                 "MBS=16 GBS=512 NLS=30 HS=3072 NAH=32 NNODES=8", layers=30, hidden=3072, heads=32, ffn=4 * 3072,
                 gpus=64, global_batch=512, micro_batch=16, tp=2, pp=1, schedule="1F1B", value=138, **_GPT21),
    PublishedRun("N21 7.5B", _N21, "7.5B | 4096 | 36 | 7.5 | 4 | 128 | 512 | 142 | 46% | 18.2; script: TP=4 PP=1 "
                 "MBS=16 GBS=512 NLS=36 HS=4096 NAH=32 NNODES=16", layers=36, hidden=4096, heads=32, ffn=4 * 4096,
                 gpus=128, global_batch=512, micro_batch=16, tp=4, pp=1, schedule="1F1B", value=142, **_GPT21),
    PublishedRun("N21 18B", _N21, "18B | 6144 | 40 | 18.4 | 8 | 256 | 1024 | 135 | 43% | 34.6; script: TP=8 PP=1 "
                 "MBS=8 GBS=1024 NLS=40 HS=6144 NAH=48 NNODES=32", layers=40, hidden=6144, heads=48, ffn=4 * 6144,
                 gpus=256, global_batch=1024, micro_batch=8, tp=8, pp=1, schedule="1F1B", value=135, **_GPT21),
    PublishedRun("N21 39B", _N21, "39B | 8192 | 48 | 39.1 | 16 | 512 | 1536 | 138 | 44% | 70.8; script: TP=8 PP=2 "
                 "MBS=4 GBS=1536 NLS=48 HS=8192 NAH=64 NNODES=64", layers=48, hidden=8192, heads=64, ffn=4 * 8192,
                 gpus=512, global_batch=1536, micro_batch=4, tp=8, pp=2, schedule="1F1B", value=138, **_GPT21),
    PublishedRun("N21 76B", _N21, "76B | 10240 | 60 | 76.1 | 32 | 1024 | 1792 | 140 | 45% | 143.8; script: TP=8 PP=4 "
                 "MBS=2 GBS=1792 NLS=60 HS=10240 NAH=80 NNODES=128 --num-layers-per-virtual-pipeline-stage 5",
                 layers=60, hidden=10240, heads=80, ffn=4 * 10240, gpus=1024, global_batch=1792, micro_batch=2, tp=8,
                 pp=4, schedule="Interleaved1F1B", stages_per_rank=3, value=140, **_GPT21),
    PublishedRun("N21 145B", _N21, "145B | 12288 | 80 | 145.6 | 64 | 1536 | 2304 | 148 | 47% | 227.1; script: TP=8 "
                 "PP=8 MBS=2 GBS=2304 NLS=80 HS=12288 NAH=96 NNODES=192 --num-layers-per-virtual-pipeline-stage 5",
                 layers=80, hidden=12288, heads=96, ffn=4 * 12288, gpus=1536, global_batch=2304, micro_batch=2, tp=8,
                 pp=8, schedule="Interleaved1F1B", stages_per_rank=2, value=148, **_GPT21),
    PublishedRun("N21 310B", _N21, "310B | 16384 | 96 | 310.1 | 128 | 1920 | 2160 | 155 | 50% | 297.4; script: TP=8 "
                 "PP=16 MBS=1 GBS=2160 NLS=96 HS=16384 NAH=128 NNODES=240 --num-layers-per-virtual-pipeline-stage 3",
                 layers=96, hidden=16384, heads=128, ffn=4 * 16384, gpus=1920, global_batch=2160, micro_batch=1, tp=8,
                 pp=16, schedule="Interleaved1F1B", stages_per_rank=2, value=155, **_GPT21),
    PublishedRun("N21 530B", _N21, "530B | 20480 | 105 | 529.6 | 280 | 2520 | 2520 | 163 | 52% | 410.2; script: "
                 "TP=8 PP=35 MBS=1 GBS=2520 NLS=105 HS=20480 NAH=128 NNODES=315 "
                 "--num-layers-per-virtual-pipeline-stage 1", layers=105, hidden=20480, heads=128, ffn=4 * 20480,
                 gpus=2520, global_batch=2520, micro_batch=1, tp=8, pp=35, schedule="Interleaved1F1B",
                 stages_per_rank=3, value=163, **_GPT21),
    PublishedRun("N21 1T", _N21, "1T | 25600 | 128 | 1008.0 | 512 | 3072 | 3072 | 163 | 52% | 502.0; script: TP=8 "
                 "PP=64 MBS=1 GBS=3072 NLS=128 HS=25600 NAH=160 NNODES=384", layers=128, hidden=25600, heads=160,
                 ffn=4 * 25600, gpus=3072, global_batch=3072, micro_batch=1, tp=8, pp=64, schedule="1F1B", value=163,
                 **_GPT21),
    # --- Megatron-LM README (2024-03), "GPT-3 Example": the 175B run on A100s.
    PublishedRun("MLM GPT-3 175B", "megatron_readme_2024 (README 'GPT-3 Example' + examples/pretrain_gpt3_175B.sh, "
                 "f00732caea)", "With full global batch size of 1536 on 1024 A100 GPUs, each iteration takes around "
                 "32 seconds resulting in 138 teraFLOPs per GPU which is 44% of the theoretical peak FLOPs; script: "
                 "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --num-layers 96 --hidden-size "
                 "12288 --num-attention-heads 96 --seq-length 2048 --micro-batch-size 1 --global-batch-size 1536 "
                 "--fp16", family="gpt", layers=96, hidden=12288, heads=96, ffn=4 * 12288, vocab=51200, seq_len=2048,
                 gpu="a100", gpus=1024, global_batch=1536, micro_batch=1, tp=8, pp=16, schedule="1F1B",
                 recompute="full", dtype="float16", metric="step_s", value=32.0, **_MEGATRON21,
                 assumed=("recompute=full: the script names none, but 138 TFLOP/s at 32 s is eq. 3's 4-pass count "
                          "(3.38e18 x 4/3 FLOPs / 32 s / 1024 = 137.7 TFLOP/s)",
                          "schedule 1F1B: no virtual stages in the script")),
)

_MLM26 = "megatron_readme_2026 (images/model_table.png, 71e2246e1a)"
_GPT26 = {"family": "gpt", "vocab": 131072, "seq_len": 4096, "gpu": "h100", "dtype": "bfloat16",
          "metric": "tflops_per_gpu", "flops_formula": "megatron_core_r0.8", "micro_batch": 4, "schedule": "1F1B",
          "recompute": "none",
          # README: "--overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap" with the distributed
          # optimizer; megatron/training/arguments.py forces accumulate_allreduce_grads_in_fp32 for bf16; flash
          # attention (Transformer Engine); sequence parallelism hands on 1/tp of each activation.
          "attention": "sdpa", "dp_reduce": "distributed", "grad_dtype": "float32", "tp_overlap": True,
          "scatter_gather": True,
          "framework": "Megatron-Core r0.8: distributed optimizer with overlapped grad reduce-scatter and param "
                       "all-gather, fp32 grads, --tp-comm-overlap, sequence parallelism, flash attention",
          "assumed": ("no recomputation: the README gives layout and batch only",
                      "without pipelining, a replica's 4 sequences in one microbatch of 4 (unpublished; NVIDIA's own "
                      "H100 performance config for the same width, heads and layout, NeMo-Framework-Launcher "
                      "conf/training/gpt3/20b_bf16_performance.yaml: hidden 6144, 48 heads, tp 4, pp 1, Megatron-Core, "
                      "distributed Adam with overlapped grad and param sync, has micro_batch_size 4). With 4 "
                      "microbatches of 1 the fp32 reduce-scatter (r0.8.0 overlaps it with the last microbatch's "
                      "backward only) predicts the 16B / 32B rows at -17 % / -31 %",
                      "sequence parallelism modelled only as 1/tp hand-offs (its element-wise ops already divide "
                      "by tp in pipeviz) and --tp-comm-overlap as tensor-parallel collectives hidden behind the "
                      "stage's compute")}

# The pipelined rows (pp > 1) ran Megatron-Core r0.8.0's interleaved schedule, one block per virtual stage:
# - the README (text above the table, since 937571cfd4, 2024-07): "We perform fine-grained overlapping of
#   data-parallel (--overlap-grad-reduce --overlap-param-gather), tensor-parallel (--tp-comm-overlap) and
#   pipeline-parallel communication (enabled by default)"; in r0.8.0 (megatron/training/arguments.py) that
#   pipeline overlap, --overlap-p2p-communication, is on by default only with the interleaved schedule:
#   "Setting args.overlap_p2p_comm to False since non-interleaved schedule does not support overlapping p2p
#   communication";
# - r0.8.0 interleaves only with whole blocks per virtual stage: "number of layers per pipeline stage must be
#   divisible number of layers per virtual pipeline stage". The 119B (92 blocks on 4 ranks: 23 each) and 462B (112
#   on 16: 7 each) rows have a prime number of blocks per rank, so their only interleaved layout is one block per
#   virtual stage; the benchmark assumes the same for the 70B, 177B and 314B rows (the 2021 paper's largest runs
#   also used one or a few: run_table_1.sh's --num-layers-per-virtual-pipeline-stage 1 for 530B).
# - with interleaving, r0.8.0 reduces each virtual stage's gradients once that stage's last backward is done
#   (schedules.py, backward_step_helper: grad_sync_func per model chunk) and all-gathers each one's parameters
#   before its first forward (param_sync_func per model chunk): pipeviz's "distributed" reduction does both per
#   stage.
_GPT26_PP = {**{k: v for k, v in _GPT26.items() if k not in ("schedule", "assumed")},
             "schedule": "Interleaved1F1B", "micro_batch": 1,
             "assumed": ("micro_batch 1, no recomputation: the README gives layout and batch only",
                         "one block per virtual stage (see above: forced for 119B and 462B by r0.8.0's rules, "
                         "assumed for the others)",
                         "sequence parallelism modelled only as 1/tp hand-offs and --tp-comm-overlap as "
                         "tensor-parallel collectives hidden behind the stage's compute")}

RUNS += (
    # --- Megatron-LM README (2026-06), weak scaling on H100. Columns quoted: model size | attention heads |
    # hidden | layers | tensor MP | pipeline MP | data-parallel | GPUs | batch | per-GPU TFLOP/s | MFU |
    # aggregate PFLOP/s.
    PublishedRun("MLM26 1.7B", _MLM26, "1.7B | 16 | 2048 | 24 | 1 | 1 | 48 | 48 | 192 | 408.8 | 41% | 19.6",
                 layers=24, hidden=2048, heads=16, ffn=4 * 2048, gpus=48, global_batch=192, tp=1, pp=1, value=408.8,
                 **_GPT26),
    PublishedRun("MLM26 7.1B", _MLM26, "7.1B | 32 | 4096 | 30 | 2 | 1 | 48 | 96 | 192 | 465.9 | 47% | 44.7",
                 layers=30, hidden=4096, heads=32, ffn=4 * 4096, gpus=96, global_batch=192, tp=2, pp=1, value=465.9,
                 **_GPT26),
    PublishedRun("MLM26 16B", _MLM26, "16B | 48 | 6144 | 32 | 4 | 1 | 48 | 192 | 192 | 489.1 | 49% | 93.9",
                 layers=32, hidden=6144, heads=48, ffn=4 * 6144, gpus=192, global_batch=192, tp=4, pp=1, value=489.1,
                 **_GPT26),
    PublishedRun("MLM26 32B", _MLM26, "32B | 56 | 7168 | 48 | 8 | 1 | 48 | 384 | 192 | 459.6 | 46% | 176.5",
                 layers=48, hidden=7168, heads=56, ffn=4 * 7168, gpus=384, global_batch=192, tp=8, pp=1, value=459.6,
                 **_GPT26),
    PublishedRun("MLM26 70B", _MLM26, "70B | 64 | 8192 | 84 | 8 | 2 | 48 | 768 | 384 | 419.7 | 42% | 322.3",
                 layers=84, hidden=8192, heads=64, ffn=4 * 8192, gpus=768, global_batch=384, tp=8, pp=2, value=419.7,
                 stages_per_rank=42, **_GPT26_PP),
    PublishedRun("MLM26 119B", _MLM26, "119B | 80 | 10240 | 92 | 8 | 4 | 48 | 1536 | 768 | 420.5 | 43% | 645.9",
                 layers=92, hidden=10240, heads=80, ffn=4 * 10240, gpus=1536, global_batch=768, tp=8, pp=4,
                 value=420.5, stages_per_rank=23, **_GPT26_PP),
    PublishedRun("MLM26 177B", _MLM26, "177B | 96 | 12288 | 96 | 8 | 6 | 48 | 2304 | 1152 | 432.8 | 44% | 997.2",
                 layers=96, hidden=12288, heads=96, ffn=4 * 12288, gpus=2304, global_batch=1152, tp=8, pp=6,
                 value=432.8, stages_per_rank=16, **_GPT26_PP),
    PublishedRun("MLM26 314B", _MLM26, "314B | 128 | 16384 | 96 | 8 | 8 | 48 | 3072 | 1536 | 474.4 | 48% | 1457.4",
                 layers=96, hidden=16384, heads=128, ffn=4 * 16384, gpus=3072, global_batch=1536, tp=8, pp=8,
                 value=474.4, stages_per_rank=12, **_GPT26_PP),
    PublishedRun("MLM26 462B", _MLM26, "462B | 144 | 18432 | 112 | 8 | 16 | 48 | 6144 | 3072 | 459.9 | 47% | 2825.6",
                 layers=112, hidden=18432, heads=144, ffn=4 * 18432, gpus=6144, global_batch=3072, tp=8, pp=16,
                 value=459.9, stages_per_rank=7, **_GPT26_PP),
)

_TT = "torchtitan_2024 (benchmarks/llama3_h100_202412_torchtitan.md, Table 5)"
_L405 = {"family": "llama", "layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248,
         "vocab": 128256, "seq_len": 8192, "gpu": "h100-hbm2e-500w", "gpus": 512, "global_batch": 256, "tp": 8, "pp": 8,
         "recompute": "full", "dtype": "fp8", "metric": "tokens_per_gpu_s", "group": "torchtitan 405B schedules",
         "split": "torchtitan",
         # torchtitan: FSDP2 (gradients reduce-scattered in float32, mixed_precision_reduce's default; parameters
         # all-gathered), async TP overlapping the tensor-parallel collectives, SDPA attention.
         "attention": "sdpa", "dp_reduce": "distributed", "grad_dtype": "float32", "tp_overlap": True,
         "framework": "torchtitan: FSDP2 costed as a reduce-scatter of fp32 grads and one parameter all-gather, "
                      "async TP, SDPA"}

RUNS += (
    # --- torchtitan, Table 5: "3D parallelism (FSDP + TP + PP) + torch.compile + Float8 + AsyncTP. Llama 3.1 405B
    # model. 512 GPUs (FSDP 8, TP 8, PP8). Local batch size 32, global batch size 256. Full activation
    # checkpointing." | Schedule | TPS/GPU | Memory(GiB) |
    PublishedRun("TT 405B 1F1B", _TT, "| 1F1B | 100 | 82.5 |", micro_batch=4, schedule="1F1B", value=100,
                 assumed=("8 microbatches of 4 (torchtitan's default: as many microbatches as pipeline ranks)",
                          "float8 on every matmul (torchtitan: linears only)"), **_L405),
    PublishedRun("TT 405B Interleaved1F1B", _TT, "| Interleaved 1F1B | 128 | 72.7 |", micro_batch=4,
                 schedule="Interleaved1F1B", stages_per_rank=2, value=128,
                 assumed=("2 stages per rank and 8 microbatches of 4 (torchtitan's defaults: generate_split_points, "
                          "and as many microbatches as pipeline ranks)",
                          "float8 on every matmul (torchtitan: linears only)"),
                 **_L405),
)

# GPU types that are no pv.hardware preset: name -> (the preset whose datasheet figures stand in, why).
# torchtitan's H100s are not the SXM5 part of the preset (80 GB HBM3, 700 W) but "H100 96 GB HBM2e at 500 W",
# and they run float8 linears (pipeviz prices every matmul at the float8 peak, and activations in one byte):
# a GPU type of its own, with its own constant, fitted on one of its two rows.
GPU_TYPES = {"h100-hbm2e-500w": ("h100", "torchtitan's H100 96 GB HBM2e at 500 W with float8 linears; the H100 "
                                         "SXM preset's figures, its own efficiency constant")}

# The one row per GPU type the efficiency constant is fitted on: for the A100 and the H100 SXM, the smallest
# runs, with neither tensor nor pipeline parallelism; for torchtitan's H100, its 1F1B row (the Interleaved1F1B
# row and the schedule ranking test it).
CALIBRATION = {"a100": "N21 1.7B", "h100": "MLM26 1.7B", "h100-hbm2e-500w": "TT 405B 1F1B"}
