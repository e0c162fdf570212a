"""What a launch runs, checked before any process starts: the ``LaunchSpec``, its validation, the devices and
cores of each rank (each rank's payload: ``pipeviz.runtime.payloads``). Shared by ``pv.launch`` and
``pv.export_torchrun``.

Example:
    >>> cfg = LaunchConfig(schedule="1F1B", microbatches=4, steps=3, loss_fn=F.cross_entropy)
    >>> spec = validate_launch(plan, cfg, inputs=(x,), target=y)
    >>> devices, backend, compute = resolve_devices("auto", spec.mesh.world)
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from pipeviz.capture.export import batch_size_of
from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig
from pipeviz.schedule.mesh import Mesh

if TYPE_CHECKING:
    from pipeviz.capture.export import Capture
    from pipeviz.capture.view import GraphView
    from pipeviz.capture.weights import Source

__all__ = ["FedBatch", "LaunchError", "LaunchSpec", "check_weights", "cpu_sets", "data_batch", "like_first",
           "resolve_devices", "share", "validate_launch"]

T = TypeVar("T")

# One batch's (args, kwargs, target), as checked against the first batch.
FedBatch = tuple[tuple[object, ...], dict[str, object], object]


@dataclass
class LaunchSpec:
    """A validated launch: what ``launch`` and ``export_torchrun`` run."""

    schedule: str
    layout: sched.Layout
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: torch.Tensor | None  # None: a forward-only run
    loss_fn: Callable[..., torch.Tensor] | None  # None: a forward-only run
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None
    microbatches: int = 1
    steps: int | None = 1  # None: until data= runs out
    data: Any = None  # an iterator over the batches after the first (whose args/kwargs/target are above)
    sources: dict[str, Any] | None = None  # weights= or a meta model: where each tensor comes from on its rank
    init_seed: int = 0
    dp: int = 1  # data-parallel replicas of the pipeline, each on 1/dp of every batch
    dp_shard: bool = False  # replicas shard their stages' parameters (FSDP2) instead of replicating them (DDP)
    tp: int = 1  # tensor-parallel shards of every stage
    tp_placements: dict[str, str] = field(default_factory=dict)  # canonical parameter name -> "shard0"/"shard1"
    config: LaunchConfig = field(default_factory=LaunchConfig)  # the options it was validated from
    eval_batches: list[FedBatch] = field(default_factory=list)  # eval_data=: held-out batches, checked
    resume: Any = None  # runtime.checkpoint.Resume (resume=): the checkpoint the run continues from

    @property
    def training(self) -> bool:
        return self.loss_fn is not None

    @property
    def mesh(self) -> Mesh:
        """The layout of the run's processes: ``layout.num_ranks`` pipeline ranks × ``dp`` replicas × ``tp``
        shards."""
        return Mesh(pp=self.layout.num_ranks, dp=self.dp, tp=self.tp)


def share(tree: T, replica: int, replicas: int, batch: int) -> T:
    """Replica ``replica``'s share of a batch: every tensor whose dim 0 is the batch, cut into ``replicas``
    contiguous parts along it (replica 0 the first part); other values as they are."""
    if replicas == 1:
        return tree
    return pytree.tree_map(lambda t: t.tensor_split(replicas)[replica]
                           if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t, tree)


@contextlib.contextmanager
def _setting(name: str) -> Iterator[None]:
    """A refusal raised inside names the ``LaunchConfig`` field at fault (``err.setting``), for a view to show
    it beside that control."""
    try:
        yield
    except ValueError as exc:
        if getattr(exc, "setting", None) is None:
            exc.setting = name  # type: ignore[attr-defined]
        raise


def validate_launch(plan: SplitPlan, config: LaunchConfig | None = None, *, inputs: object = None,
                    input_kwargs: Mapping[str, object] | None = None, target: object = None,
                    data: Iterable[object] | None = None, eval_data: Iterable[object] | None = None) -> LaunchSpec:
    """Check everything a launch needs before any process starts; raises with the value, the choices and the fix.

    Checked: the plan and the config's schedule (stage and microbatch rules), ``steps``, ``timeout`` and
    ``on_nonfinite``, the layout (``dp``, ``tp``, ``tp_plan``), the inputs (a tensor, a tuple or list of them;
    each like the traced example: same dtype, same shape after the batch dim), the target, ``loss_fn`` (called
    once on an output like the last stage's: it must return a scalar tensor), ``optimizer`` (built once on a
    dummy parameter) and that both can be sent to the stage processes.
    """
    import cloudpickle

    config = config or LaunchConfig()
    schedule, microbatches, steps, stages_per_rank = (config.schedule, config.microbatches, config.steps,
                                                      config.stages_per_rank)
    loss_fn, optimizer, timeout, dp, tp = config.loss_fn, config.optimizer, config.timeout, config.dp, config.tp
    if config.on_nonfinite not in ("stop", "continue"):
        raise LaunchError(f"on_nonfinite={config.on_nonfinite!r}; valid: 'stop', 'continue'.")

    if not isinstance(plan, SplitPlan):
        raise LaunchError(f"launch() needs a SplitPlan (graph.split(...)), got {type(plan).__name__}.")
    name = sched.canonical(schedule)
    if plan.graph.capture.unsupported:
        raise LaunchError(plan.graph.capture.unsupported[0])
    _check_model_unchanged(plan)
    if config.cp > 1:
        raise LaunchError(
            f"cp={config.cp}: pv.launch does not run context parallelism. torch's context_parallel shards attention "
            "on CUDA devices only (on the CPU, torch 2.13 refuses: 'Operator "
            "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
            "registered'), and pipeviz's GPU path for it is not built yet. pv.simulate and pv.plan_cluster price "
            "it. Fix: cp=1 to launch.")
    if plan.num_stages < 2:
        raise LaunchError("The plan has 1 stage; a pipeline needs at least 2. Fix: plan.toggle(<layer>) to split.")
    if loss_fn is None and not sched.info(name).forward_only:  # before the stage count: the schedule is the cause
        raise LaunchError(f"{name} cannot run forward only: torch 2.13's V-shaped schedules split every backward "
                          "and fail without one. Fix: schedule='GPipe', '1F1B' or 'Interleaved1F1B' for a "
                          "forward-only run, or pass loss_fn=... to train.", setting="schedule")
    with _setting("schedule"):
        lay = sched.layout(name, plan.num_stages, stages_per_rank)
    if config.order is not None:
        if loss_fn is None:
            raise LaunchError("order= is a training step's actions (forwards and backwards); a run without loss_fn "
                              "only runs forwards. Fix: pass loss_fn=... to train with this order, or drop order "
                              "for a forward-only run.")
        from pipeviz.sim.engine import check_order

        with _setting("order"):
            check_order(config.order, lay, microbatches)
    with _setting("tp"):
        placements = _tensor_parallel(plan, tp, config.tp_plan)
    _check_dp_shard(config)
    split = (any(sched.parse(a).kind in ("I", "W") for acts in config.order for a in acts) if config.order is not None
             else sched.info(name).split_backward)
    _check_dp_reduce(config, split)
    with _setting("sequence_parallel"):
        _check_sequence_parallel(plan, config)
    for setting, check in _training_checks():  # each refusal names its field (err.setting)
        with _setting(setting):
            check(config)
    _check_recompute(plan, config)
    if not (steps is None and data is not None) and (not isinstance(steps, int) or isinstance(steps, bool)
                                                     or steps < 1):
        raise LaunchError(f"steps must be a positive int, got {steps!r} (steps=None runs until data= runs out).",
                          setting="steps")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise LaunchError(f"timeout must be a positive number of seconds, got {timeout!r}. Fix: timeout=120 "
                          "(seconds without progress before the run is declared hung).")
    graph = plan.graph
    stream = None
    if data is not None:
        if inputs is not None or input_kwargs is not None or target is not None:
            raise LaunchError("data= gives the inputs and targets of every step: drop inputs=, input_kwargs= and "
                              "target= (or drop data= to train on one batch).")
        stream = iter(data) if not isinstance(data, Iterator) else data
        try:
            first = next(stream)
        except StopIteration:
            raise LaunchError("data= gave no batch at all. Fix: pass an iterable with at least one batch.") from None
        inputs, input_kwargs, target = data_batch(first, 0, loss_fn is not None)
    # a data= run traces its stages for each batch's shapes (runtime.shapes): its first batch may differ too
    args, kwargs = _inputs(graph, inputs, input_kwargs, any_length=stream is not None)
    batch = batch_size_of(args, kwargs)
    if batch is None:
        raise LaunchError("inputs hold no tensor with a batch dimension.")
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] != batch:
            raise LaunchError(f"Every input needs the same batch size (dim 0); found {batch} and {leaf.shape[0]}.")
    if batch % dp:
        fits = [d for d in range(1, batch + 1) if batch % d == 0 and batch // d % microbatches == 0]
        raise LaunchError(f"dp={dp} replicas cannot share a batch of {batch} equally. Valid dp for {microbatches} "
                          f"microbatches: {', '.join(map(str, fits)) or 'none'}; or change the batch size.",
                          setting="dp")
    try:
        sched.check_microbatches(name, plan.num_stages, microbatches, stages_per_rank, batch_size=batch // dp)
    except ValueError as exc:
        if dp > 1:
            exc = type(exc)(f"{exc} (each of the dp={dp} replicas takes {batch // dp} of the batch of {batch})")
        exc.setting = "microbatches"  # type: ignore[attr-defined]
        raise exc from None
    if config.order is None:  # torch's own sends and receives played for deadlock (a custom order: check_order's)
        from pipeviz.schedule.comm_order import check_schedule_comms

        check_schedule_comms(name, plan.num_stages, microbatches, stages_per_rank)
    if loss_fn is None:  # a forward-only run: run.outputs
        if target is not None:
            raise LaunchError("target= was given without a loss_fn. Fix: pass loss_fn=... to train, or drop target "
                              "for a forward-only run (run.outputs holds the model's outputs).")
        if optimizer is not None:
            raise LaunchError("optimizer= was given without a loss_fn: a forward-only run trains nothing. Fix: pass "
                              "loss_fn=... to train, or drop optimizer.")
        if eval_data is not None or config.eval_every is not None:
            raise LaunchError("eval_data= / eval_every= were given without a loss_fn: a forward-only run has no loss "
                              "to evaluate. Fix: pass loss_fn=... to train, or drop them.", setting="eval_every")
        return LaunchSpec(name, lay, args, kwargs, None, None, None, microbatches, steps, stream, dp=dp, tp=tp,
                          tp_placements=placements, config=config, dp_shard=config.dp_shard)
    if not callable(loss_fn):
        raise LaunchError(f"loss_fn must be a callable loss(output, target), got {loss_fn!r}. "
                          "Fix: loss_fn=pv.cross_entropy (or torch.nn.functional.cross_entropy, or your own); "
                          "no loss_fn runs forward only.")
    if target is None or not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] != batch:
        shape = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise LaunchError(f"target must be a tensor whose dim 0 is the batch ({batch}); got {shape}.")
    example = pytree.tree_leaves((tuple(graph.example_args), dict(graph.example_kwargs)))
    if all(not isinstance(a, torch.Tensor) or not isinstance(e, torch.Tensor) or a.shape[1:] == e.shape[1:]
           for a, e in zip(pytree.tree_leaves((args, kwargs)), example, strict=False)):
        _try_loss(graph, loss_fn, target, batch, microbatches)  # (on the traced output's shapes: a data= run's
        # first batch of another length is checked by its first step)
    if optimizer is None:
        optimizer = default_optimizer
    _try_optimizer(optimizer)
    for label, obj in (("loss_fn", loss_fn), ("optimizer", optimizer)):
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:
            raise LaunchError(f"{label} cannot be sent to the stage processes ({exc}). Fix: define it as a plain "
                              "function or lambda, without open files, locks or CUDA state.") from exc
    spec = LaunchSpec(name, lay, args, kwargs, target, loss_fn, optimizer, microbatches, steps, stream, dp=dp, tp=tp,
                      tp_placements=placements, config=config, dp_shard=config.dp_shard)
    with _setting("eval_every"):
        spec.eval_batches = _eval_batches(spec, eval_data)
    return spec


def _eval_batches(spec: LaunchSpec, eval_data: Iterable[object] | None) -> list[FedBatch]:
    """``eval_data=``'s held-out batches, each like the first training batch (the stages' shapes are static)."""
    every = spec.config.eval_every
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise LaunchError(f"eval_every must be a positive int (steps between evaluations) or None, got {every!r}. "
                          "Fix: eval_every=10, or None to evaluate after the last step only.")
    if eval_data is None:
        if every is not None:
            raise LaunchError(f"eval_every={every} was given without eval_data=: there is nothing to evaluate on. "
                              "Fix: pv.launch(..., eval_data=[(x_val, y_val)]), or drop eval_every.")
        return []
    if isinstance(eval_data, torch.Tensor | str) or not isinstance(eval_data, Iterable):
        raise LaunchError(f"eval_data= must be an iterable of (inputs, target) batches, got "
                          f"{type(eval_data).__name__}. Fix: eval_data=[(x_val, y_val)] (each batch shaped like a "
                          "training batch).")
    batches = [like_first(data_batch(item, i, True), spec, i, "eval_data=") for i, item in enumerate(eval_data)]
    if not batches:
        raise LaunchError("eval_data= gave no batch. Fix: at least one (inputs, target) batch, or drop eval_data.")
    return batches


def _training_checks() -> tuple[tuple[str, Callable[[LaunchConfig], None]], ...]:
    """The training options' own checks, each with the ``LaunchConfig`` field it names."""
    return (("clip_grad_norm", _check_clip), ("loss_reduction", _check_loss_reduction),
            ("accumulate", _check_accumulate), ("lr_scheduler", _check_lr_scheduler), ("compile", _check_compile),
            ("mixed_precision", _check_mixed_precision))


def _check_model_unchanged(plan: SplitPlan) -> None:
    """Every tensor the trace saw is still in the model with the same number of elements and bytes: a launch ships
    the model's values as they are now (``pipeviz.runtime.ship``) into stages traced from it then."""
    from pipeviz.capture.weights import lookup_tensor

    cap = plan.graph.capture
    for canon, numel in cap.param_numel.items():
        try:
            t = lookup_tensor(cap.model, canon)
        except (KeyError, AttributeError):
            t = None
        if t is None or t.numel() != numel or t.numel() * t.element_size() != cap.param_bytes.get(canon):
            now = "gone" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise LaunchError(f"The model's {canon!r} is {now}, not what pv.trace saw ({numel:,} elements, "
                              f"{cap.param_bytes.get(canon, 0):,} bytes): the model changed after it was traced. "
                              "Fix: trace it again (pv.trace) and split the new graph.")


def _check_loss_reduction(config: LaunchConfig) -> None:
    from pipeviz.runtime.loss import LOSS_REDUCTIONS
    from pipeviz.schedule.training import cross_entropy

    value = config.loss_reduction
    if not isinstance(value, str) or value not in LOSS_REDUCTIONS:
        raise LaunchError(f"loss_reduction must be one of {', '.join(map(repr, LOSS_REDUCTIONS))}, got {value!r}. "
                          "Fix: loss_reduction='token_mean' for the mean over the whole step's valid tokens.")
    if value != "mean" and config.loss_fn is not None and config.loss_fn is not cross_entropy:
        # (a forward-only run, no loss_fn, reduces nothing: the Explorer's infer mode keeps the setting)
        raise LaunchError(f"loss_reduction={value!r} reduces pv.cross_entropy's per-token losses, but loss_fn is "
                          f"{getattr(config.loss_fn, '__name__', config.loss_fn)!r}. Fix: loss_fn=pv.cross_entropy, "
                          "or loss_reduction='mean' (your loss_fn's own reduction per microbatch).")


def _check_accumulate(config: LaunchConfig) -> None:
    value = config.accumulate
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchError(f"accumulate must be a positive int (batches per optimizer step), got {value!r}. Fix: "
                          "accumulate=4 to sum 4 batches' gradients into each step, or 1 for none.")
    if value > 1 and config.loss_fn is None:
        raise LaunchError(f"accumulate={value} was given without a loss_fn: a forward-only run has no gradients to "
                          "accumulate. Fix: pass loss_fn=... to train, or drop accumulate.")


MIXED_PRECISION = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _check_mixed_precision(config: LaunchConfig) -> None:
    value = config.mixed_precision
    if value is None or (isinstance(value, str) and value in MIXED_PRECISION):
        return
    raise LaunchError(f"mixed_precision must be 'bf16', 'fp16' or None, got {value!r}. Fix: mixed_precision='bf16' "
                      "(autocast in bfloat16, float32 master weights), 'fp16' (float16 with a dynamic loss scale), or "
                      "None for the traced dtype.")


def _check_recompute(plan: SplitPlan, config: LaunchConfig) -> None:
    """``recompute``: a mode, or one per stage (``pipeviz.schedule.recompute``), on a traced plan, not compiled."""
    from pipeviz.schedule.recompute import recompute_modes

    try:
        modes = recompute_modes(config.recompute, plan.num_stages)
    except ValueError as exc:
        raise LaunchError(str(exc), setting="recompute") from None
    if set(modes) == {"none"}:
        return
    if not plan.graph.capture.traced:
        raise LaunchError("recompute= checkpoints the layers of traced stages, and this plan's stages are your own "
                          "modules (pv.manual_plan). Fix: wrap their layers in torch.utils.checkpoint.checkpoint "
                          "yourself, or plan from pv.trace.", setting="recompute")
    if config.compile is not False:
        raise LaunchError(f"recompute={config.recompute!r} with compile={config.compile!r}: pipeviz checkpoints the "
                          "stage's layers op by op, outside what torch.compile sees. Fix: compile=False, or "
                          "recompute='none'.", setting="recompute")


def _check_compile(config: LaunchConfig) -> None:
    """``compile``: a bool or one of torch's registered backends (``torch._dynamo.list_backends``), and a compiler
    torch can use here (inductor on the CPU builds C++: it needs a compiler on the PATH)."""
    value = config.compile
    if value is False:
        return
    import shutil

    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if not (value is True or (isinstance(value, str) and value in backends)):
        raise LaunchError(f"compile must be True, False or one of torch's backends, got {value!r}; valid backends: "
                          f"{', '.join(b for b in backends if 'TESTING' not in b)}. Fix: compile=True (inductor), or "
                          "compile='aot_eager' (traced and differentiated ahead of time, no code generated).")
    devices = config.devices if isinstance(config.devices, str) else ",".join(config.devices)
    gpu = "cuda" in devices or (devices == "auto" and torch.cuda.is_available())
    if value in (True, "inductor") and not gpu and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise LaunchError("compile=True compiles each stage with inductor, which builds C++ on the CPU, and no C++ "
                          "compiler is on the PATH (g++, c++, clang++). Fix: install one (apt-get install g++), or "
                          "compile='aot_eager'.")


def _check_lr_scheduler(config: LaunchConfig) -> None:
    """A scheduler factory is built once on a dummy optimizer (the run's own factory's) and must step."""
    import cloudpickle

    factory = config.lr_scheduler
    if factory is None:
        return
    if config.loss_fn is None:
        raise LaunchError("lr_scheduler= was given without a loss_fn: a forward-only run has no optimizer. Fix: pass "
                          "loss_fn=... to train, or drop lr_scheduler.")
    fix = ("Fix: lr_scheduler=pv.warmup_cosine(warmup=10, steps=100), or "
           "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2) (a factory taking the optimizer).")
    if not callable(factory) or isinstance(factory, torch.optim.lr_scheduler.LRScheduler):
        raise LaunchError(f"lr_scheduler must be a factory optimizer -> LRScheduler, got {factory!r}. {fix}")
    try:
        built = factory((config.optimizer or default_optimizer)([torch.nn.Parameter(torch.zeros(1))]))
    except Exception as exc:
        raise LaunchError(f"lr_scheduler(optimizer) fails on a dummy optimizer: {type(exc).__name__}: {exc}. "
                          f"{fix}") from exc
    if not callable(getattr(built, "step", None)) or not callable(getattr(built, "get_last_lr", None)):
        raise LaunchError(f"lr_scheduler(optimizer) must return a torch LRScheduler, got {type(built).__name__}. "
                          f"{fix}")
    try:
        cloudpickle.dumps(factory)
    except Exception as exc:
        raise LaunchError(f"lr_scheduler cannot be sent to the stage processes ({exc}). Fix: define it as a plain "
                          "function or lambda, without open files, locks or CUDA state.") from exc


def _check_clip(config: LaunchConfig) -> None:
    value = config.clip_grad_norm
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise LaunchError(f"clip_grad_norm must be a positive number (the largest global gradient norm a step "
                          f"keeps) or None, got {value!r}. Fix: clip_grad_norm=1.0, or None for no clipping.")
    if config.loss_fn is None:
        raise LaunchError("clip_grad_norm= was given without a loss_fn: a forward-only run has no gradients. Fix: "
                          "pass loss_fn=... to train, or drop clip_grad_norm.")


def _check_sequence_parallel(plan: SplitPlan, config: LaunchConfig) -> None:
    from pipeviz.schedule.tensor_parallel import check_sequence_parallel, sharded_modules

    if not isinstance(config.sequence_parallel, bool):
        raise LaunchError(f"sequence_parallel must be True or False, got {config.sequence_parallel!r}.")
    if not config.sequence_parallel:
        return
    if config.tp == 1:
        raise LaunchError("sequence_parallel=True with tp=1: sequence parallelism splits the activations between "
                          "tensor-parallel regions over the shards, and there is one. Fix: tp=2 (or more), or drop "
                          "sequence_parallel.")
    try:
        check_sequence_parallel(plan.graph.model, sharded_modules(plan, config.tp_plan, config.tp),
                                [tuple(s.layers) for s in plan.stages])
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc


def _check_dp_shard(config: LaunchConfig) -> None:
    if not isinstance(config.dp_shard, bool):
        raise LaunchError(f"dp_shard must be True or False, got {config.dp_shard!r}.")
    if config.dp_shard and config.dp < 2:
        raise LaunchError(f"dp_shard=True shards parameters across data-parallel replicas, but dp={config.dp}: "
                          "there is nothing to shard across. Fix: dp=2 (or more) with dp_shard=True, or drop it.")
    if config.dp_shard and config.tp > 1:
        raise LaunchError("dp_shard=True with tp > 1 (FSDP2 over tensor-parallel DTensors) is not supported yet. "
                          "Fix: dp_shard=False (replicas average their gradients), or tp=1.")
    if config.dp_shard and config.loss_fn is None:
        raise LaunchError("dp_shard=True shards what training updates; a forward-only run (no loss_fn) has nothing "
                          "to shard. Fix: drop dp_shard, or pass loss_fn=... to train.")


def _check_dp_reduce(config: LaunchConfig, split_backward: bool) -> None:
    """``dp_reduce``: one of ``DP_REDUCE_MODES`` or None, and a mode this layout can run."""
    from pipeviz.schedule.config import DP_REDUCE_MODES

    value = config.dp_reduce
    if value is None:
        return
    if value not in DP_REDUCE_MODES:
        raise LaunchError(f"dp_reduce must be one of {', '.join(map(repr, DP_REDUCE_MODES))} or None, got {value!r}. "
                          "Fix: dp_reduce='overlap' (each stage's average overlapped with the rest of the step), or "
                          "None for the default.", setting="dp_reduce")
    if config.dp_shard:
        raise LaunchError(f"dp_reduce={value!r} with dp_shard=True: FSDP2 reduce-scatters the sharded gradients "
                          "itself. Fix: dp_reduce=None, or dp_shard=False.", setting="dp_reduce")
    if config.tp > 1 and value != "after_flush":  # (zero1 too: its shards would be DTensors of DTensors)
        raise LaunchError(f"dp_reduce={value!r} with tp={config.tp}: tensor-parallel gradients are DTensors, which "
                          "pipeviz averages after the step (DDP does not take them; the overlapped form is not built "
                          "for them yet). Fix: dp_reduce='after_flush', or None.", setting="dp_reduce")
    if value == "ddp" and split_backward:
        raise LaunchError(f"dp_reduce='ddp' under {config.schedule} (a split backward): DDP's "
                          "reducer follows one backward call, and input- and weight-grad passes are two. Fix: "
                          "dp_reduce='overlap' (or None), or a schedule without a split backward.",
                          setting="dp_reduce")


def _tensor_parallel(plan: SplitPlan, tp: int, tp_plan: Mapping[str, str] | None) -> dict[str, str]:
    """The placements of a tensor-parallel launch's parameters (canonical names), checked: ``tp_plan`` (module
    name -> ``"colwise"`` / ``"rowwise"``) or Megatron's layout (``default_tp_plan``)."""
    from pipeviz.schedule.tensor_parallel import check_tp_plan, sharded_modules

    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise LaunchError(f"tp must be a positive int (tensor-parallel shards of every stage), got {tp!r}. Fix: tp=1 "
                          "for unsharded stages, tp=2 to shard each stage's projections over two processes.")
    if tp == 1:
        if tp_plan:
            raise LaunchError("tp_plan= was given with tp=1: nothing is sharded. Fix: tp=2 (or more), or drop tp_plan.")
        return {}
    model = plan.graph.model
    chosen = sharded_modules(plan, tp_plan, tp)
    try:
        placements = check_tp_plan(model, chosen, tp)
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    if not placements:
        raise LaunchError(f"tp={tp} but nothing to shard: no stage holds a projection the default layout shards (the "
                          "model's own config.base_model_tp_plan, attention and MLP projections by name, or a pair "
                          "of nn.Linear layers chaining into each other). Fix: pass tp_plan={'<module>': 'colwise', "
                          "'<module>': 'rowwise', ...}, or tp=1.")
    canonical = {a: c for c, names in plan.graph.capture.aliases.items() for a in names}
    return {canonical.get(n, n): place for n, place in placements.items()}


def data_batch(item: object, step: int, training: bool) -> tuple[object, dict[str, object] | None, object]:
    """One item of ``data=`` as (inputs, input_kwargs, target).

    An item is ``(inputs, target)`` (inputs: a tensor, or a tuple or list of the model's positional inputs),
    or a mapping ``{"inputs": ..., "target": ..., <keyword input>: tensor, ...}`` whose other keys are the
    model's keyword inputs (``attention_mask``, ...). A forward-only run (no ``loss_fn``) takes the inputs
    alone (a tensor, tuple or list) or a mapping without ``"target"``.
    """
    if isinstance(item, Mapping):
        rest = {k: v for k, v in item.items() if k not in ("inputs", "target")}
        if "inputs" not in item:
            raise LaunchError(f"data= batch {step} is a mapping without 'inputs' (keys: {sorted(item)}). Fix: "
                              "{'inputs': x, 'target': y, <keyword inputs>...}, or an (inputs, target) tuple.")
        return item["inputs"], rest or None, item.get("target")
    if training:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise LaunchError(f"data= batch {step} is a {type(item).__name__}; a training run takes (inputs, target) "
                              "pairs or {'inputs': ..., 'target': ...} mappings.")
        return item[0], None, item[1]
    return item, None, None


def like_first(batch: tuple[object, Mapping[str, object] | None, object], spec: LaunchSpec, step: int,
               what: str = "data=", same_shapes: bool = True) -> FedBatch:
    """A data= batch as (args, kwargs, target), checked against the first batch: the same inputs, dtypes and number
    of dimensions, and with ``same_shapes`` the same shapes (torch's stages have static shapes). Without it (a
    ``data=`` run: ``pipeviz.runtime.shapes`` traces the stages again for each new shape) the sizes may differ, the
    batch still splitting into the run's microbatches on every replica."""
    inputs, kwargs, target = batch
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs) if isinstance(inputs, tuple | list) \
        else None
    if args is None:
        raise LaunchError(f"{what} batch {step}: inputs is a {type(inputs).__name__}; expected a tensor or a tuple or "
                          "list of tensors, like the first batch.")
    kwargs = dict(kwargs or {})
    pairs = [(f"inputs[{i}]", a, e) for i, (a, e) in enumerate(zip(args, spec.args, strict=False))]
    pairs += [(f"input_kwargs[{k!r}]", kwargs.get(k), v) for k, v in spec.kwargs.items()]
    if spec.target is not None:
        pairs.append(("target", target, spec.target))
    if len(args) != len(spec.args) or set(kwargs) != set(spec.kwargs):
        raise LaunchError(f"{what} batch {step} has other inputs than the first batch ({len(args)} positional, "
                          f"keywords {sorted(kwargs)}; the first: {len(spec.args)}, {sorted(spec.kwargs)}).")
    for label, got, want in pairs:
        if not isinstance(want, torch.Tensor):
            continue
        if not same_shapes and isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.dim() == want.dim():
            continue
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            shown = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise LaunchError(
                f"{what} batch {step}: {label} is {shown}, but the run started with {tuple(want.shape)} {want.dtype}: "
                "a pipeline's shapes are fixed by its first batch (and the batch must split into the "
                f"{spec.microbatches} microbatches). Fix: equal batches, e.g. DataLoader(..., drop_last=True).")
    if not same_shapes:
        from pipeviz.capture.export import batch_size_of

        size, parts = batch_size_of(args, kwargs), spec.microbatches * spec.dp
        if size is not None and size % parts:
            raise LaunchError(f"{what} batch {step} holds {size} samples, which do not split into the run's "
                              f"{spec.microbatches} microbatches x {spec.dp} replicas ({parts} equal parts). Fix: "
                              f"batches of a multiple of {parts} samples, e.g. DataLoader(..., drop_last=True).")
    return args, {k: kwargs[k] for k in spec.kwargs}, target


def _inputs(graph: GraphView, inputs: object, input_kwargs: Mapping[str, object] | None, any_length: bool = False,
            ) -> tuple[tuple[object, ...], dict[str, object]]:
    """The launch's inputs as (args, kwargs) in the traced order, each checked against the traced example."""
    if inputs is None:
        args = tuple(graph.example_args)
    elif isinstance(inputs, torch.Tensor):
        args = (inputs,)
    elif isinstance(inputs, tuple | list):
        args = tuple(inputs)
    else:
        hint = " Fix: pass keyword inputs as input_kwargs={...}." if isinstance(inputs, dict) else \
            " Fix: inputs=(x,)."
        raise LaunchError(f"inputs must be a tensor, or a tuple or list of tensors (the model's positional "
                          f"inputs), got {type(inputs).__name__}.{hint}")
    kwargs = dict(graph.example_kwargs) if input_kwargs is None and inputs is None else dict(input_kwargs or {})
    if not isinstance(kwargs, dict):
        raise LaunchError(f"input_kwargs must be a dict of keyword inputs, got {type(input_kwargs).__name__}.")
    # Keep the traced keyword order: stage 0 maps inputs onto torch's placeholders in that order.
    order = list(graph.example_kwargs)
    unknown = [k for k in kwargs if k not in order]
    if unknown:
        raise LaunchError(f"input_kwargs {unknown} were not in the traced example_kwargs {order}. "
                          "Fix: trace with the same keyword inputs you launch with.")
    kwargs = {k: kwargs[k] for k in order if k in kwargs}
    example = tuple(graph.example_args)
    if len(args) != len(example):
        raise LaunchError(f"The model was traced with {len(example)} positional input(s); launch got {len(args)}. "
                          "Fix: pass inputs like the example, or re-trace with these.")
    pairs = [(f"inputs[{i}]", a, e) for i, (a, e) in enumerate(zip(args, example, strict=True))]
    pairs += [(f"input_kwargs[{k!r}]", kwargs[k], graph.example_kwargs[k]) for k in kwargs]
    for label, got, want in pairs:
        _like_example(label, got, want, any_length)
    return args, kwargs


def _like_example(label: str, got: object, want: object, any_length: bool = False) -> None:
    if not isinstance(want, torch.Tensor):
        return
    retrace = "or re-trace with it: pv.trace(model, example_args=..., example_kwargs=...)."
    if not isinstance(got, torch.Tensor):
        raise LaunchError(f"{label} is a {type(got).__name__}, but the model was traced with a tensor "
                          f"{tuple(want.shape)} {want.dtype}. Fix: pass a tensor like the example, {retrace}")
    if got.dtype != want.dtype:
        raise LaunchError(f"{label} is {got.dtype}, but the model was traced with {want.dtype}. Fix: pass a "
                          f"{want.dtype} tensor (e.g. x.to({want.dtype})), {retrace}")
    if got.dim() != want.dim() or (tuple(got.shape[1:]) != tuple(want.shape[1:]) and not any_length):
        raise LaunchError(f"{label} has shape {tuple(got.shape)}, but the model was traced with "
                          f"{tuple(want.shape)} (every dim after the batch must match). Fix: pass a batch shaped like "
                          f"the example, {retrace}")


# The last few (capture, loss_fn, target, batch, microbatches) that passed _try_loss, with the objects themselves
# held so that their ids stay theirs. The Explorer checks its settings at every control change; a 128k-vocabulary
# model's sampled logits are hundreds of MB, so an unchanged question is not asked twice.
_LOSS_CHECKED: OrderedDict[tuple[int, ...], tuple[object, ...]] = OrderedDict()


def _try_loss(graph: GraphView, loss_fn: Callable[..., object], target: torch.Tensor, batch: int,
              microbatches: int) -> None:
    """Call ``loss_fn`` once on an output like the last stage's for one microbatch and a target microbatch."""
    cap = graph.capture
    if not cap.outputs:
        return
    key = (id(cap), id(loss_fn), id(target), target._version, batch, microbatches)
    if key in _LOSS_CHECKED:
        _LOSS_CHECKED.move_to_end(key)
        return
    _check_loss(cap, loss_fn, target, batch, microbatches)
    _LOSS_CHECKED[key] = (cap, loss_fn, target)
    while len(_LOSS_CHECKED) > 8:
        _LOSS_CHECKED.popitem(last=False)


def _check_loss(cap: Capture, loss_fn: Callable[..., object], target: torch.Tensor, batch: int,
                microbatches: int) -> None:
    size = batch // microbatches
    gen = torch.Generator().manual_seed(0)

    def sample(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shape = (size, *shape[1:]) if shape and shape[0] == cap.batch_size else shape
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(dtype)
        return torch.zeros(shape, dtype=dtype)

    leaves = [sample(shape, dtype) for shape, dtype in cap.outputs]
    if cap.output_index is not None:
        out: Any = leaves[cap.output_index]
    else:
        out = leaves[0] if len(leaves) == 1 else tuple(leaves)
    tgt = target.tensor_split(microbatches)[0]
    shapes = tuple(out.shape) if isinstance(out, torch.Tensor) else [tuple(t.shape) for t in out]
    try:
        loss = loss_fn(out, tgt)
    except Exception as exc:
        raise LaunchError(f"loss_fn(output, target) fails on an output like the last stage's ({shapes}) and a "
                          f"target microbatch ({tuple(tgt.shape)} {tgt.dtype}): {type(exc).__name__}: {exc}. "
                          "Fix: make loss_fn accept the model's output and a slice of target along dim 0.") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"a tensor of shape {tuple(loss.shape)} ({loss.dtype})" if isinstance(loss, torch.Tensor) \
            else type(loss).__name__
        raise LaunchError(f"loss_fn must return a scalar float tensor (one loss per microbatch); on an output like "
                          f"the last stage's ({shapes}) it returned {got}. Fix: reduce it, e.g. .mean().")


def _try_optimizer(optimizer: object) -> None:
    if not callable(optimizer):
        raise LaunchError(f"optimizer must be a factory params -> torch.optim.Optimizer, got {optimizer!r}. "
                          "Fix: optimizer=pv.sgd(lr=0.1), or lambda ps: torch.optim.AdamW(ps, lr=1e-3).")
    try:
        built = optimizer([torch.nn.Parameter(torch.zeros(1))])
    except Exception as exc:
        raise LaunchError(f"optimizer(params) fails on a dummy parameter: {type(exc).__name__}: {exc}. Fix: pass a "
                          "factory taking the list of a rank's parameters, e.g. pv.sgd(lr=0.1).") from exc
    if not (callable(getattr(built, "step", None)) and callable(getattr(built, "zero_grad", None))):
        raise LaunchError(f"optimizer(params) must return a torch.optim.Optimizer, got {type(built).__name__}. "
                          "Fix: optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1) (a factory, not an optimizer).")


def resolve_devices(devices: str | Sequence[str], num_ranks: int) -> tuple[list[str], str, list[str | None]]:
    """Map ranks to devices; returns (stage devices, backend, compute devices).

    ``"auto"``: CPU and gloo without CUDA; one GPU per rank and NCCL with enough GPUs; with fewer GPUs
    than ranks, stages share GPUs and talk over host memory (gloo on CPU tensors; each stage moves its
    inputs to its GPU and its outputs back), because NCCL refuses two ranks on one GPU and gloo cannot
    send CUDA tensors.
    """
    # device_count() does not create a CUDA context in this process (the kernel need not initialise CUDA).
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(devices, str):
        if devices == "auto":
            devices = ["cpu"] * num_ranks if gpus == 0 else [f"cuda:{r % gpus}" for r in range(num_ranks)]
        elif devices in ("cpu", "cuda"):
            devices = [devices if devices == "cpu" else f"cuda:{r % max(gpus, 1)}" for r in range(num_ranks)]
        else:
            devices = [devices] * num_ranks
    devices = [str(d) for d in devices]
    if len(devices) != num_ranks:
        raise LaunchError(
            f"devices lists {len(devices)} entries but the run has {num_ranks} ranks. "
            f"Fix: pass {num_ranks} devices, or devices='auto'."
        )
    for d in devices:
        try:
            dev = torch.device(d)
        except RuntimeError as exc:
            raise LaunchError(f"Unknown device {d!r}; valid: 'cpu', 'cuda', 'cuda:N', or 'auto'.") from exc
        if dev.type not in ("cpu", "cuda"):
            raise LaunchError(f"Device {d!r} is not supported; valid: 'cpu', 'cuda:N', 'auto'.")
        if dev.type == "cuda" and (dev.index or 0) >= gpus:
            raise LaunchError(f"Device {d!r} is not available: this machine has {gpus} CUDA device(s). "
                              "Fix: devices='auto' or 'cpu'.")
    cuda = [d for d in devices if d.startswith("cuda")]
    if cuda and len(cuda) == len(devices) and len(set(devices)) == len(devices):
        return devices, "nccl", [None] * num_ranks
    # CPU, mixed, or a shared GPU: communicate through host memory.
    return ["cpu"] * num_ranks, "gloo", [d if d.startswith("cuda") else None for d in devices]


def check_weights(plan: SplitPlan, weights: str | os.PathLike[str] | None, init_seed: int) -> dict[str, Source] | None:
    """Where each tensor of the plan's stages comes from (``pipeviz.capture.weights.plan_sources``), checked now:
    a checkpoint's missing tensors and wrong shapes, and meta tensors nothing can initialise, are named."""
    from pipeviz.capture.weights import WeightsError, plan_sources

    if not isinstance(init_seed, int) or isinstance(init_seed, bool):
        raise LaunchError(f"init_seed must be an int, got {init_seed!r}.")
    cap = plan.graph.capture
    try:
        return plan_sources(cap.model, cap.aliases, plan.stage_tensors(), weights)
    except WeightsError as exc:
        raise LaunchError(str(exc)) from exc


def cpu_sets(ranks: int, pin: bool) -> tuple[int, list[tuple[int, ...]] | None]:
    """Threads per rank, and with ``pin`` each rank's own cores out of those this process may use.

    Why pin: with every core computing, a gloo thread that a rank needs (to post a send or a receive) can
    be queued behind another rank's compute thread until the next scheduler tick; on its own cores it runs
    as soon as its rank waits. No pinning when ranks outnumber the cores.
    """
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    count = len(allowed) or os.cpu_count() or 1
    threads = max(1, count // ranks)
    if not pin or not allowed or ranks > len(allowed):
        return threads, None
    return threads, [tuple(allowed[r * threads:(r + 1) * threads]) for r in range(ranks)]


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)
