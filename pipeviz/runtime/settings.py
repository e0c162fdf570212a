"""Each ``LaunchConfig`` option's own check before a launch, in the order ``validate_launch`` asks them
(``SETTING_CHECKS``): each takes the plan and its config and raises a ``LaunchError`` naming the bad value, the
choices and the fix.

Example:
    >>> for setting, check in SETTING_CHECKS:
    ...     check(plan, LaunchConfig(clip_grad_norm=-1.0))     # LaunchError: clip_grad_norm must be a positive ...
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.spec import MIXED_PRECISION, default_optimizer
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig

__all__ = ["SETTING_CHECKS", "SettingCheck", "tensor_parallel_placements"]

SettingCheck = Callable[[SplitPlan, LaunchConfig], None]


def check_loss_reduction(plan: SplitPlan, config: LaunchConfig) -> None:
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


def check_accumulate(plan: SplitPlan, config: LaunchConfig) -> None:
    value = config.accumulate
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchError(f"accumulate must be a positive int (batches per optimizer step), got {value!r}. Fix: "
                          "accumulate=4 to sum 4 batches' gradients into each step, or 1 for none.")
    if value > 1 and config.loss_fn is None:
        raise LaunchError(f"accumulate={value} was given without a loss_fn: a forward-only run has no gradients to "
                          "accumulate. Fix: pass loss_fn=... to train, or drop accumulate.")


def check_mixed_precision(plan: SplitPlan, config: LaunchConfig) -> None:
    value = config.mixed_precision
    if value is None or (isinstance(value, str) and value in MIXED_PRECISION):
        return
    raise LaunchError(f"mixed_precision must be 'bf16', 'fp16' or None, got {value!r}. Fix: mixed_precision='bf16' "
                      "(autocast in bfloat16, float32 master weights), 'fp16' (float16 with a dynamic loss scale), or "
                      "None for the traced dtype.")


def check_recompute(plan: SplitPlan, config: LaunchConfig) -> None:
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


def check_compile(plan: SplitPlan, config: LaunchConfig) -> None:
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


def check_lr_scheduler(plan: SplitPlan, config: LaunchConfig) -> None:
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


def check_clip(plan: SplitPlan, config: LaunchConfig) -> None:
    value = config.clip_grad_norm
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise LaunchError(f"clip_grad_norm must be a positive number (the largest global gradient norm a step "
                          f"keeps) or None, got {value!r}. Fix: clip_grad_norm=1.0, or None for no clipping.")
    if config.loss_fn is None:
        raise LaunchError("clip_grad_norm= was given without a loss_fn: a forward-only run has no gradients. Fix: "
                          "pass loss_fn=... to train, or drop clip_grad_norm.")


def check_sequence_parallel(plan: SplitPlan, config: LaunchConfig) -> None:
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


def check_dp_shard(plan: SplitPlan, config: LaunchConfig) -> None:
    if not isinstance(config.dp_shard, bool):
        raise LaunchError(f"dp_shard must be True or False, got {config.dp_shard!r}.", setting="dp_shard")
    if config.dp_shard and config.dp < 2:
        raise LaunchError(f"dp_shard=True shards parameters across data-parallel replicas, but dp={config.dp}: "
                          "there is nothing to shard across. Fix: dp=2 (or more) with dp_shard=True, or drop it.",
                          setting="dp_shard")
    if config.dp_shard and config.tp > 1:
        raise LaunchError("dp_shard=True with tp > 1 (FSDP2 over tensor-parallel DTensors) is not supported yet. "
                          "Fix: dp_shard=False (replicas average their gradients), or tp=1.")
    if config.dp_shard and config.loss_fn is None:
        raise LaunchError("dp_shard=True shards what training updates; a forward-only run (no loss_fn) has nothing "
                          "to shard. Fix: drop dp_shard, or pass loss_fn=... to train.")


def check_dp_reduce(plan: SplitPlan, config: LaunchConfig) -> None:
    """``dp_reduce``: one of ``DP_REDUCE_MODES`` or None, and a mode this layout can run (DDP: not under a split
    backward, a custom order's ``I``/``W`` actions or the schedule's own)."""
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
    if value == "ddp" and _split_backward(config):
        raise LaunchError(f"dp_reduce='ddp' under {config.schedule} (a split backward): DDP's "
                          "reducer follows one backward call, and input- and weight-grad passes are two. Fix: "
                          "dp_reduce='overlap' (or None), or a schedule without a split backward.",
                          setting="dp_reduce")


def tensor_parallel_placements(plan: SplitPlan, tp: int, tp_plan: Mapping[str, str] | None) -> dict[str, str]:
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


def _split_backward(config: LaunchConfig) -> bool:
    """Whether the run splits its backwards into input- and weight-grad passes (a custom order's ``I``/``W``
    actions, or the schedule's own)."""
    order = config.actions()
    if order is not None:
        return any(a.kind in (sched.Kind.I, sched.Kind.W) for acts in order for a in acts)
    return sched.info(sched.canonical(config.schedule)).split_backward


# The options' checks in the order they are asked, each with the ``LaunchConfig`` field a refusal names when the
# check's own errors name none (``err.setting``: a view shows it beside that control); None: the check names it.
SETTING_CHECKS: tuple[tuple[str | None, SettingCheck], ...] = (
    (None, check_dp_shard), (None, check_dp_reduce), ("sequence_parallel", check_sequence_parallel),
    ("clip_grad_norm", check_clip), ("loss_reduction", check_loss_reduction), ("accumulate", check_accumulate),
    ("lr_scheduler", check_lr_scheduler), ("compile", check_compile), ("mixed_precision", check_mixed_precision),
    (None, check_recompute),
)
