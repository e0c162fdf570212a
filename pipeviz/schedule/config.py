"""One launch configuration: the options of a run, shared by ``pv.launch``, ``pv.export_torchrun``, the CLI and the
Explorer, with one set of defaults.

A ``LaunchConfig`` says *how* to run a plan (schedule, microbatches, steps, loss and optimizer, layout, devices,
time limits); the data a run trains on (``inputs=``/``target=``/``data=``/``weights=``) is given beside it. Every
front door takes either a config, keyword options, or both (options override the config's fields):

Example:
    >>> cfg = pv.LaunchConfig(schedule="GPipe", microbatches=8, steps=3, loss_fn=pv.cross_entropy, dp=2)
    >>> run = pv.launch(plan, config=cfg, inputs=(x,), target=y)
    >>> pv.export_torchrun(plan, "train.py", config=cfg.replace(steps=100), inputs=(x,), target=y)
    >>> pv.launch(plan, "1F1B", 4, 3, inputs=(x,), target=y, loss_fn=pv.cross_entropy)   # as before
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

import torch

from pipeviz.schedule import traits as sched
from pipeviz.schedule.mesh import Mesh, check_degree
from pipeviz.schedule.traits import Action, Layout, Order

__all__ = ["DP_REDUCE_MODES", "UNSET", "LaunchConfig", "dp_reduce_mode", "launch_config"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # "not given here": take the config's value (``steps=None`` is a value: until data= ends)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to run a plan; every field keyword-only, every front door's defaults these.

    Attributes:
        schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV
            (case-insensitive).
        microbatches: microbatches per step (per replica with ``dp``); must divide the batch.
        steps: optimizer steps; ``None`` with ``data=``: until the data runs out.
        accumulate: batches per optimizer step (gradient accumulation): each step runs the schedule on
            ``accumulate`` batches one after another, summing their gradients, then clips and steps the optimizer
            once, exactly as the unsplit model trained on the ``accumulate`` batches as one batch (its loss the
            ``loss_reduction`` over all of them). Replicas average their gradients once, after the last batch.
            With ``data=`` a step takes the next ``accumulate`` batches; with ``inputs=`` the one batch
            ``accumulate`` times.
        stages_per_rank: for multi-stage schedules (default 2).
        loss_fn: mean-reduced loss ``(output, target) -> scalar``; ``None``: a forward-only run.
        optimizer: ``params -> torch.optim.Optimizer`` (default ``pv.sgd(lr=0.1)``), built on every rank.
        lr_scheduler: ``optimizer -> torch.optim.lr_scheduler.LRScheduler`` (e.g. ``pv.warmup_cosine(10, 100)``
            or ``lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2)``), built on every rank around its optimizer
            and stepped after each optimizer step; ``run.learning_rates`` holds each step's rate. None: a
            constant rate.
        devices: ``"auto"``, ``"cpu"``, ``"cuda"`` or one device per process (``pv.launch``; an exported script
            takes each process's ``LOCAL_RANK`` GPU).
        timeout: seconds without progress before the run is declared hung and stopped.
        pin_cpus: on the CPU, give each process its own cores (``pv.launch``).
        on_nonfinite: a NaN or inf loss or gradient: ``"stop"`` the run or ``"continue"`` and record it.
        clip_grad_norm: clip the gradients by their global norm over every stage, replica and shard (as
            ``torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)`` on the unsplit model) before
            each optimizer step; ``run.grad_norms`` holds each step's norm. None: no clipping.
        loss_reduction: with ``pv.cross_entropy``, how a step's loss is reduced over its tokens: ``"mean"`` (each
            microbatch's mean, averaged over the microbatches: torch's schedules' way), ``"sum"``, or
            ``"token_mean"`` (the sum over valid tokens, target not -100, divided by their count in the whole step
            over every microbatch and replica, as torchtitan and Megatron-LM compute it: microbatches with
            different counts of valid tokens then weigh as the whole batch does).
        eval_every: with ``eval_data=`` (held-out batches given to ``pv.launch``), evaluate every that many
            steps and after the last: a forward-only pass of every held-out batch through the pipeline (torch's
            ``schedule.eval``, no gradients; running statistics left as training had them), its loss the
            ``loss_reduction`` over all of them in ``run.eval_losses``. None: after the last step only.
        mixed_precision: ``"bf16"``: every stage computes under ``torch.autocast`` in bfloat16 (matmuls and
            convolutions in bf16, what autocast keeps in fp32 in fp32), with fp32 master weights: the parameters,
            their gradients, the replicas' reduction and the optimizer's state stay float32, hand-offs go in the
            dtype the activation has at the split (bf16 after a matmul), and the loss is computed in float32.
            ``pv.check_numerics`` trains the unsplit model under the same autocast. ``"fp16"``: the same in
            float16, with a dynamic loss scale across every process (``pipeviz.runtime.loss_scale``:
            ``torch.amp.GradScaler``'s rules; a step whose gradients overflow anywhere is skipped everywhere and
            said as a phase). None: the traced dtype.
        compile: run each stage through ``torch.compile`` (``True``: its default backend, inductor; or a backend
            name, e.g. ``"aot_eager"``); compiled on each rank at its stages' first forward and backward, the time
            reported as a phase of its own. Refused before launch for the schedules torch cannot run compiled
            stages under (the split-backward ones), with torch's reason. False: eager.
        recompute: activation recomputation at run time (``pipeviz.schedule.recompute``): ``"none"``,
            ``"selective"`` (attention's score ops run again in the backward, Korthikanti et al. 2022) or
            ``"full"`` (each layer keeps only its inputs and runs its forward again in the backward), for every
            stage, or one mode per stage (a sequence as long as the plan's stages). Exact: the same losses and
            parameters as without. Needs a traced plan (``pv.trace``).
        init_seed: a meta model without weights: the seed of each rank's own initialisation.
        dp: data-parallel replicas of the pipeline (``pv.Mesh(pp, dp, tp)``).
        dp_shard: with ``dp`` > 1, shard each stage's parameters, gradients and optimizer state across the
            replicas with torch's FSDP2 ``fully_shard`` (ZeRO-3) instead of replicating them under DDP.
        dp_reduce: with ``dp`` > 1, how the replicas average their gradients (``dp_reduce_mode`` says what None
            picks): ``"overlap"`` (pipeviz.runtime.overlap: each stage's gradients all-reduced asynchronously as soon
            as its last backward of the step has run, while the rank goes on with its other stages, waited for once
            before the optimizer step, as Megatron-Core's ``--overlap-grad-reduce``), ``"zero1"``
            (pipeviz.runtime.zero: the same moment, but reduce-scatters; each replica keeps the optimizer's state for
            its 1/dp of every parameter and the updated parameters are all-gathered after the step: ZeRO-1,
            Megatron-Core's distributed optimizer), ``"ddp"`` (torch's DDP: in
            the stage's last backward, waited for there; not under a split backward) or ``"after_flush"`` (one
            all-reduce of the rank's gradients after the step's last action). None: ``"overlap"``; with tensor
            parallelism ``"after_flush"``; with ``dp_shard`` FSDP2's own reduce-scatter.
        tp: tensor-parallel shards of every stage.
        tp_plan: ``{module name: "colwise" | "rowwise"}`` for tensor parallelism; default: Megatron's layout
            (``default_tp_plan``: the model's HF plan, attention and MLP by name, or ``nn.Linear`` pairs; the
            vocabulary's embedding and LM head where ``tp`` divides it).
        sequence_parallel: with ``tp`` > 1, the activations between the tensor-parallel regions (norms, dropout,
            the residual stream) sharded by token over the shards (Korthikanti et al. 2022): a row-wise
            projection's all-reduce becomes a reduce-scatter and a column-wise group's input an all-gather.
        cp: context-parallel shares of every sequence: each process of a stage holds 1/cp of every sequence (the
            2·cp-chunk zig-zag order), keys and values all-gathered per attention (``pipeviz.adapter.context_graph``);
            priced by ``pv.simulate`` and ``pv.plan_cluster``.
        ep: expert parallelism: each MoE block's routed experts sharded over ``ep`` of a stage's ``dp × cp``
            processes (no processes added; ``ep`` divides ``dp * cp``), tokens sent to their experts' processes by
            all-to-all; each process holds only its own experts' weights, gradients and optimizer state.
        ep_overlap: with ``ep`` > 1, run one microbatch's forward beside another's backward so that one half's
            all-to-alls wait while the other half computes: DualPipeV's overlapped pairs (torch's ``OVERLAP_F_B``
            actions), or under 1F1B a combined 1F1B (``pipeviz.schedule.ep_overlap.combined_1f1b``: each forward
            paired with an earlier microbatch's backward; more warm-up forwards, so more activations held). The
            backward runs in a second thread with its own expert-parallel process group (torchtitan's DualPipeV +
            EP overlap, its PR #1721; ``pipeviz.adapter.overlap_fb``). Exact: the same ops on the same values.
            ``pv.simulate`` prices each pair as ``max(F, B, F's compute + B's compute)``.
        ep_delay: seconds every expert all-to-all waits after its exchange: a slowed link, to see (and test on a
            CPU) what ``ep_overlap`` hides; ``pv.simulate`` adds it to each priced ``A2A``. 0 in real runs.
        order: a custom schedule: one list of actions per pipeline rank, each a ``pv.schedule.Action`` or its text
            in torch's notation (``"1F0"``: stage 1's forward of microbatch 0; kinds ``F``, ``B``, or ``I`` and
            ``W`` for a split backward); held as ``Action``s (``actions()`` gives them typed). The stages stay
            where ``schedule`` and ``stages_per_rank`` place them; the order replaces the schedule's own.
            ``pv.simulate`` plays it and ``pv.launch`` runs it through torch's own runtime
            (``_PipelineScheduleRuntime``, which adds the sends and receives); every stage's forward and
            backward of every microbatch must appear once, in an order that can run.

    Raises:
        MeshError: ``dp``, ``cp``, ``tp`` or ``ep`` not a positive int (a ``LaunchError``).
    """

    schedule: str = "1F1B"
    microbatches: int = 4
    steps: int | None = 1
    accumulate: int = 1
    stages_per_rank: int | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    lr_scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None
    devices: str | Sequence[str] = "auto"
    timeout: float = 120.0
    pin_cpus: bool = True
    on_nonfinite: str = "stop"
    clip_grad_norm: float | None = None
    loss_reduction: str = "mean"
    eval_every: int | None = None
    mixed_precision: str | None = None
    compile: bool | str = False
    recompute: str | Sequence[str] = "none"
    init_seed: int = 0
    dp: int = 1
    dp_shard: bool = False
    dp_reduce: str | None = None
    tp: int = 1
    tp_plan: Mapping[str, str] | None = None
    sequence_parallel: bool = False
    cp: int = 1
    order: Sequence[Sequence[Action | str]] | None = None
    ep: int = 1
    ep_overlap: bool = False
    ep_delay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "ep"):  # one check for every front door (pipeviz.schedule.mesh)
            check_degree(name, getattr(self, name))
        if not isinstance(self.ep_overlap, bool):
            raise TypeError(f"ep_overlap must be True or False, got {self.ep_overlap!r}.")
        if isinstance(self.ep_delay, bool) or not isinstance(self.ep_delay, (int, float)) or not self.ep_delay >= 0:
            raise ValueError(f"ep_delay must be seconds >= 0 (a slowed expert link), got {self.ep_delay!r}. Fix: "
                             "ep_delay=0.0, or e.g. 0.005.")
        if self.order is not None:  # read once here, text or Actions (an unknown kind raises), held as Actions
            object.__setattr__(self, "order", tuple(tuple(r) for r in sched.order_of(self.order)))

    def actions(self) -> Order | None:
        """The custom ``order`` as ``Action``s (``None``: the schedule's own)."""
        # __post_init__ made every entry an Action; the field's type also says what a caller may give
        return None if self.order is None else [list(cast("Sequence[Action]", r)) for r in self.order]

    def layout(self, num_stages: int) -> Layout:
        """Where ``num_stages`` stages run under this schedule and stages per rank
        (``pipeviz.schedule.traits.layout``)."""
        return sched.layout(self.schedule, num_stages, self.stages_per_rank)

    def mesh(self, num_stages: int) -> Mesh:
        """The run's layout for a plan of ``num_stages`` stages: its pipeline ranks × ``dp`` × ``cp`` × ``tp``."""
        return Mesh(self.layout(num_stages).num_ranks, self.dp, self.tp, self.cp, self.ep)

    def replace(self, **changes: object) -> LaunchConfig:
        """A copy with ``changes``; an unknown option is named with the valid ones."""
        _check_names(changes)
        # the names are checked above, the values by __post_init__ and the launch's validation
        return dataclasses.replace(self, **cast("dict[str, Any]", changes))


DP_REDUCE_MODES = ("overlap", "zero1", "ddp", "after_flush")


def dp_reduce_mode(config: LaunchConfig) -> str:
    """How ``config``'s replicas average their gradients: ``config.dp_reduce``, or for None ``"fsdp2"`` (with
    ``dp_shard``: FSDP2's reduce-scatter), ``"after_flush"`` (tensor parallelism: one all-reduce after the step)
    or ``"overlap"`` (``pipeviz.runtime.overlap``)."""
    if config.dp_shard:
        return "fsdp2"
    if config.dp_reduce is not None:
        return config.dp_reduce
    return "after_flush" if config.tp > 1 else "overlap"


def _check_names(changes: Mapping[str, object]) -> None:
    valid = [f.name for f in fields(LaunchConfig)]
    unknown = sorted(set(changes) - set(valid))
    if unknown:
        raise TypeError(f"Unknown launch option {unknown[0]!r}; valid: {', '.join(valid)}. Fix: spell it as one of "
                        "those, or pass data as inputs=, input_kwargs=, target=, data= or weights=.")


def launch_config(config: LaunchConfig | str | None, **given: object) -> LaunchConfig:
    """``config`` (default ``LaunchConfig()``; a schedule's name stands for ``LaunchConfig(schedule=name)``) with the
    options given at the call (``UNSET`` ones left out)."""
    if isinstance(config, str):
        if given.get("schedule", UNSET) is not UNSET:
            raise TypeError(f"The schedule came twice: {config!r} by position and schedule={given['schedule']!r}. "
                            "Fix: give it once.")
        config, given = None, {**given, "schedule": config}
    if config is not None and not isinstance(config, LaunchConfig):
        raise TypeError(f"config must be a pv.LaunchConfig or a schedule's name, got {type(config).__name__}. Fix: "
                        "pv.LaunchConfig(schedule='1F1B', microbatches=4, ...), or the options as keywords.")
    return (config or LaunchConfig()).replace(**{k: v for k, v in given.items() if v is not UNSET})
