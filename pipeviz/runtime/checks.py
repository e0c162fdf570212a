"""Everything a launch needs, checked before any process starts: ``validate_launch`` asks a list of small checks
over one value (a ``_Draft``: the call's arguments and what the checks before found), in a fixed order, and
returns the ``LaunchSpec`` that ``pv.launch`` and ``pv.export_torchrun`` run. Each refusal names the bad value, the
choices and the fix, and the ``LaunchConfig`` field at fault (``err.setting``) where there is one.

The checks, in order: the plan and its schedule (``_PLAN_CHECKS``), each option (``settings.SETTING_CHECKS``), the
steps, timeout and inputs (``_INPUT_CHECKS``; the inputs themselves: ``pipeviz.runtime.batches``), then a
forward-only run's (``_FORWARD_CHECKS``) or a training run's (``_TRAINING_CHECKS``: ``loss_fn`` called once on an
output like the last stage's, ``optimizer`` built once on a dummy parameter, both sendable to the processes).

Example:
    >>> cfg = LaunchConfig(schedule="1F1B", microbatches=4, steps=3, loss_fn=F.cross_entropy)
    >>> spec = validate_launch(plan, cfg, inputs=(x,), target=y)
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from pipeviz.capture.export import batch_size_of
from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.batches import data_batch, eval_batches, launch_inputs, sequence_length
from pipeviz.runtime.context_checks import context_stages
from pipeviz.runtime.expert_checks import expert_overlap, expert_stages, experts_layout
from pipeviz.runtime.settings import SETTING_CHECKS, tensor_parallel_placements
from pipeviz.runtime.spec import LaunchSpec, default_optimizer
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig, dp_reduce_mode

if TYPE_CHECKING:
    from pipeviz.capture.export import Capture
    from pipeviz.capture.view import GraphView
    from pipeviz.capture.weights import Source

__all__ = ["check_weights", "validate_launch"]


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
    d = _Draft(plan, config or LaunchConfig(), inputs, input_kwargs, target, data, eval_data)
    training = d.config.loss_fn is not None
    for setting, check in _PLAN_CHECKS:
        with _setting(setting):
            check(d)
    for setting, option in SETTING_CHECKS:
        with _setting(setting):
            option(d.plan, d.config)
    for setting, check in (*_INPUT_CHECKS, *(_TRAINING_CHECKS if training else _FORWARD_CHECKS)):
        with _setting(setting):
            check(d)
    cfg = d.config
    assert d.layout is not None  # (set by _layout)
    spec = LaunchSpec(d.schedule, d.layout, d.args, d.kwargs, d.target if isinstance(d.target, torch.Tensor) else None,
                      cfg.loss_fn, d.optimizer, cfg.microbatches, cfg.steps, d.stream, dp=cfg.dp, tp=cfg.tp, cp=cfg.cp,
                      ep=cfg.ep, tp_placements=d.placements, config=cfg, dp_shard=cfg.dp_shard)
    if training:
        with _setting("eval_every"):
            spec.eval_batches = eval_batches(spec, eval_data)
    if cfg.cp > 1:
        context_stages(d.plan, spec)
    if cfg.ep > 1:
        with _setting("ep"):
            expert_stages(d.plan, spec)
    return spec


@dataclass
class _Draft:
    """A launch being checked: ``validate_launch``'s arguments, and what the checks so far found (each check reads
    it and fills in its part)."""

    plan: SplitPlan
    config: LaunchConfig
    inputs: object = None  # (a data= run: its first batch's, once _first_batch took it)
    input_kwargs: Mapping[str, object] | None = None
    target: object = None
    data: Iterable[object] | None = None
    eval_data: Iterable[object] | None = None
    schedule: str = ""  # the schedule's canonical name
    layout: sched.Layout | None = None
    placements: dict[str, str] = field(default_factory=dict)  # tensor parallelism's, by canonical parameter name
    stream: Iterator[object] | None = None  # data='s batches after the first
    args: tuple[object, ...] = ()  # the inputs in the traced order
    kwargs: dict[str, object] = field(default_factory=dict)
    batch: int = 0  # the batch size (dim 0)
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None  # (training: defaulted)


Check = Callable[[_Draft], None]


@contextlib.contextmanager
def _setting(name: str | None) -> Iterator[None]:
    """A refusal raised inside names the ``LaunchConfig`` field at fault (``err.setting``), for a view to show
    it beside that control (``None``: the check names it itself, or no field is at fault)."""
    try:
        yield
    except ValueError as exc:
        if name is not None and getattr(exc, "setting", None) is None:
            exc.setting = name  # type: ignore[attr-defined]
        raise


# ------------------------------------------------------------------ the plan and its schedule


def _on_nonfinite(d: _Draft) -> None:
    if d.config.on_nonfinite not in ("stop", "continue"):
        raise LaunchError(f"on_nonfinite={d.config.on_nonfinite!r}; valid: 'stop', 'continue'.")


def _is_plan(d: _Draft) -> None:
    if not isinstance(d.plan, SplitPlan):
        raise LaunchError(f"launch() needs a SplitPlan (graph.split(...)), got {type(d.plan).__name__}.")


def _schedule_known(d: _Draft) -> None:
    d.schedule = sched.canonical(d.config.schedule)


def _plan_runnable(d: _Draft) -> None:
    """What the trace could not capture, and a model changed since, are refused; so is a plan of one stage."""
    plan = d.plan
    if plan.graph.capture.unsupported:
        raise LaunchError(plan.graph.capture.unsupported[0])
    _check_model_unchanged(plan)
    if plan.num_stages < 2:
        raise LaunchError("The plan has 1 stage; a pipeline needs at least 2. Fix: plan.toggle(<layer>) to split.")


def _forward_only_schedule(d: _Draft) -> None:
    """Before the stage count: the schedule is the cause."""
    if d.config.loss_fn is None and not sched.info(d.schedule).forward_only:
        raise LaunchError(f"{d.schedule} cannot run forward only: torch 2.13's V-shaped schedules split every "
                          "backward and fail without one. Fix: schedule='GPipe', '1F1B' or 'Interleaved1F1B' for a "
                          "forward-only run, or pass loss_fn=... to train.", setting="schedule")


def _layout(d: _Draft) -> None:
    d.layout = sched.layout(d.schedule, d.plan.num_stages, d.config.stages_per_rank)


def _order(d: _Draft) -> None:
    """A custom order (``LaunchConfig.order``) is a training step's, and complete for this layout."""
    cfg = d.config
    order = cfg.actions()
    if order is None:
        return
    if cfg.loss_fn is None:
        raise LaunchError("order= is a training step's actions (forwards and backwards); a run without loss_fn "
                          "only runs forwards. Fix: pass loss_fn=... to train with this order, or drop order "
                          "for a forward-only run.")
    from pipeviz.sim.engine import check_order

    assert d.layout is not None
    with _setting("order"):
        check_order(order, d.layout, cfg.microbatches)


def _placements(d: _Draft) -> None:
    d.placements = tensor_parallel_placements(d.plan, d.config.tp, d.config.tp_plan)


_PLAN_CHECKS: tuple[tuple[str | None, Check], ...] = (
    (None, _on_nonfinite), (None, _is_plan), (None, _schedule_known), ("ep", experts_layout), (None, expert_overlap),
    (None, _plan_runnable),
    (None, _forward_only_schedule), ("schedule", _layout), (None, _order), ("tp", _placements),
)


# ------------------------------------------------------------------ steps, timeout and the inputs


def _steps(d: _Draft) -> None:
    steps = d.config.steps
    if steps is None and d.data is not None:  # until data= runs out
        return
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise LaunchError(f"steps must be a positive int, got {steps!r} (steps=None runs until data= runs out).",
                          setting="steps")


def _timeout(d: _Draft) -> None:
    timeout = d.config.timeout
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise LaunchError(f"timeout must be a positive number of seconds, got {timeout!r}. Fix: timeout=120 "
                          "(seconds without progress before the run is declared hung).")


def _first_batch(d: _Draft) -> None:
    """A ``data=`` run's inputs and target are its first batch's; the rest stream from ``d.stream``."""
    if d.data is None:
        return
    if d.inputs is not None or d.input_kwargs is not None or d.target is not None:
        raise LaunchError("data= gives the inputs and targets of every step: drop inputs=, input_kwargs= and "
                          "target= (or drop data= to train on one batch).")
    d.stream = iter(d.data) if not isinstance(d.data, Iterator) else d.data
    try:
        first = next(d.stream)
    except StopIteration:
        raise LaunchError("data= gave no batch at all. Fix: pass an iterable with at least one batch.") from None
    d.inputs, d.input_kwargs, d.target = data_batch(first, 0, d.config.loss_fn is not None)


def _inputs(d: _Draft) -> None:
    # a data= run traces its stages for each batch's shapes (runtime.shapes): its first batch may differ too
    d.args, d.kwargs = launch_inputs(d.plan.graph, d.inputs, d.input_kwargs, any_length=d.stream is not None)


def _batch(d: _Draft) -> None:
    """One batch size over every input, which the replicas share equally."""
    batch = batch_size_of(d.args, d.kwargs)
    if batch is None:
        raise LaunchError("inputs hold no tensor with a batch dimension.")
    for leaf in pytree.tree_leaves((d.args, d.kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] != batch:
            raise LaunchError(f"Every input needs the same batch size (dim 0); found {batch} and {leaf.shape[0]}.")
    dp, microbatches = d.config.dp, d.config.microbatches
    if batch % dp:
        fits = [n for n in range(1, batch + 1) if batch % n == 0 and batch // n % microbatches == 0]
        raise LaunchError(f"dp={dp} replicas cannot share a batch of {batch} equally. Valid dp for {microbatches} "
                          f"microbatches: {', '.join(map(str, fits)) or 'none'}; or change the batch size.",
                          setting="dp")
    d.batch = batch


def _microbatches(d: _Draft) -> None:
    """The schedule's microbatch rules, on each replica's share of the batch."""
    cfg, dp = d.config, d.config.dp
    try:
        sched.check_microbatches(d.schedule, d.plan.num_stages, cfg.microbatches, cfg.stages_per_rank,
                                 batch_size=d.batch // dp)
    except ValueError as exc:
        if dp > 1:
            exc = type(exc)(f"{exc} (each of the dp={dp} replicas takes {d.batch // dp} of the batch of {d.batch})")
        exc.setting = "microbatches"  # type: ignore[attr-defined]
        raise exc from None
    if cfg.loss_fn is not None:
        _batch_statistics(d, d.batch // dp // cfg.microbatches)


def _batch_statistics(d: _Draft, rows: int) -> None:
    """A batch norm that trains needs more than one value per channel in each microbatch: torch raises in the forward
    otherwise (the unsplit model trained on such microbatches would too). Found by pipeviz fuzz: the run failed
    after launch, in the parent's stage build, instead of being refused."""
    capture = d.plan.graph.capture
    for op in capture.ops:
        args: tuple[object, ...] = tuple(op.spec[0]) if op.spec else ()
        if op.target != "aten.batch_norm.default" or len(args) < 6 or args[5] is not True:
            continue
        shape: tuple[int, ...] | None = getattr(args[0], "shape", None)
        if not shape or len(shape) < 2 or not capture.batch_size:
            continue
        per_row = math.prod(shape) // shape[1] // capture.batch_size
        if rows * per_row <= 1:
            raise LaunchError(
                f"microbatches={d.config.microbatches} leaves {rows} row per microbatch, and {op.stack[-1]!r} "
                f"(batch norm, training) then sees 1 value per channel, which torch refuses. Valid: microbatches at "
                f"most {d.batch // d.config.dp // 2}. Fix: fewer microbatches, a larger batch, or model.eval() for "
                "that module.", setting="microbatches")


def _comm_order(d: _Draft) -> None:
    """torch's own sends and receives played for deadlock (a custom order: ``check_order``'s)."""
    if d.config.order is None:
        from pipeviz.schedule.comm_order import check_schedule_comms

        check_schedule_comms(d.schedule, d.plan.num_stages, d.config.microbatches, d.config.stages_per_rank)


def _context(d: _Draft) -> None:
    """Context parallelism: every sequence cut into 2·cp equal chunks, an attention each share can run exactly,
    and the options it runs with."""
    cfg, cp = d.config, d.config.cp
    if cp == 1:
        return
    if not any("scaled_dot_product" in op.target for op in d.plan.graph.capture.ops):
        # found by pipeviz fuzz: an MLP's dim 1 (its features) was cut as if it were a sequence, and the first
        # Linear failed inside the processes
        raise LaunchError(f"cp={cp}: the model's trace has no scaled_dot_product_attention (no attention, or "
                          "attention written as matmuls), and context parallelism cuts dim 1 of the inputs into "
                          "shares of every sequence and gathers keys and values per fused attention. Fix: cp=1, or "
                          "a model whose attention is fused (HF: attn_implementation='sdpa').", setting="cp")
    seq = sequence_length(d.args, d.kwargs)
    if seq is None or seq % (2 * cp):
        fits = [c for c in range(1, (seq or 0) // 2 + 1) if seq and seq % (2 * c) == 0]
        raise LaunchError(
            f"cp={cp}: a sequence of {seq} tokens (dim 1 of the inputs) cannot be cut into 2·cp = {2 * cp} equal "
            "chunks (each share holds two, chunks r and 2·cp−1−r, so causal attention's work balances). Valid cp "
            f"for {seq} tokens: {', '.join(map(str, fits)) or 'none'}; or pad the sequence to a multiple of "
            f"{2 * cp}.", setting="cp")
    unsupported = [(cfg.loss_fn is None, "a forward-only run (no loss_fn)", "pass loss_fn=... to train"),
                   (d.stream is not None, "data= (batches after the first)", "one batch per launch"),
                   (cfg.compile is not False, f"compile={cfg.compile!r}", "compile=False"),
                   (any(m != "none" for m in ([cfg.recompute] if isinstance(cfg.recompute, str) else cfg.recompute)),
                    f"recompute={cfg.recompute!r}", "recompute='none'"),
                   (cfg.dp_shard, "dp_shard=True (FSDP2)", "dp_shard=False"),
                   (dp_reduce_mode(cfg) == "zero1", "dp_reduce='zero1'", "dp_reduce=None"),
                   (cfg.sequence_parallel and cfg.tp > 1, "sequence_parallel=True", "sequence_parallel=False")]
    for bad, what, fix in unsupported:
        if bad:
            raise LaunchError(f"cp={cp} with {what}: not built for context parallelism. Fix: {fix}, or cp=1.",
                              setting="cp")
    config = getattr(getattr(d.plan.graph.capture, "model", None), "config", None)
    for attr, what in (("attn_logit_softcapping", "logit soft-capping"), ("is_encoder_decoder", "cross-attention "
                       "(an encoder-decoder)"), ("add_cross_attention", "cross-attention")):
        if getattr(config, attr, None):
            raise LaunchError(f"cp={cp}: the model's attention uses {what} ({attr}={getattr(config, attr)!r}), which "
                              "a share of the sequence cannot compute exactly from gathered keys and values. Fix: "
                              "cp=1.", setting="cp")


_INPUT_CHECKS: tuple[tuple[str | None, Check], ...] = (
    (None, _steps), (None, _timeout), (None, _first_batch), (None, _inputs), (None, _batch), (None, _microbatches),
    (None, _comm_order), (None, _context),
)


# ------------------------------------------------------------------ a forward-only run, a training run


def _nothing_to_train(d: _Draft) -> None:
    """A forward-only run (``run.outputs``) takes no target, optimizer or evaluation."""
    if d.target is not None:
        raise LaunchError("target= was given without a loss_fn. Fix: pass loss_fn=... to train, or drop target "
                          "for a forward-only run (run.outputs holds the model's outputs).")
    if d.config.optimizer is not None:
        raise LaunchError("optimizer= was given without a loss_fn: a forward-only run trains nothing. Fix: pass "
                          "loss_fn=... to train, or drop optimizer.")
    if d.eval_data is not None or d.config.eval_every is not None:
        raise LaunchError("eval_data= / eval_every= were given without a loss_fn: a forward-only run has no loss "
                          "to evaluate. Fix: pass loss_fn=... to train, or drop them.", setting="eval_every")


def _loss_fn(d: _Draft) -> None:
    """``loss_fn`` is callable, the target a batch of targets, and the loss runs on an output like the last
    stage's."""
    loss_fn, target, batch, graph = d.config.loss_fn, d.target, d.batch, d.plan.graph
    if not callable(loss_fn):
        raise LaunchError(f"loss_fn must be a callable loss(output, target), got {loss_fn!r}. "
                          "Fix: loss_fn=pv.cross_entropy (or torch.nn.functional.cross_entropy, or your own); "
                          "no loss_fn runs forward only.")
    if target is None or not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] != batch:
        shape = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise LaunchError(f"target must be a tensor whose dim 0 is the batch ({batch}); got {shape}.")
    example = pytree.tree_leaves((tuple(graph.example_args), dict(graph.example_kwargs)))
    if all(not isinstance(a, torch.Tensor) or not isinstance(e, torch.Tensor) or a.shape[1:] == e.shape[1:]
           for a, e in zip(pytree.tree_leaves((d.args, d.kwargs)), example, strict=False)):
        _try_loss(graph, loss_fn, target, batch, d.config.microbatches)  # (on the traced output's shapes: a data=
        # run's first batch of another length is checked by its first step)


def _optimizer(d: _Draft) -> None:
    model = d.plan.graph.model
    if not any(p.requires_grad for p in model.parameters()) and any(True for _ in model.parameters()):
        # found by pipeviz fuzz: the run trained nothing, then check_numerics failed in the unsplit model's backward
        raise LaunchError("Every parameter of the model is frozen (requires_grad=False): a training run has nothing "
                          "to train. Fix: unfreeze the parameters to train, or drop loss_fn for a forward-only run.",
                          setting="loss_fn")
    d.optimizer = d.config.optimizer if d.config.optimizer is not None else default_optimizer
    _try_optimizer(d.optimizer)


def _sendable(d: _Draft) -> None:
    import cloudpickle

    for label, obj in (("loss_fn", d.config.loss_fn), ("optimizer", d.optimizer)):
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:
            raise LaunchError(f"{label} cannot be sent to the stage processes ({exc}). Fix: define it as a plain "
                              "function or lambda, without open files, locks or CUDA state.") from exc


_FORWARD_CHECKS: tuple[tuple[str | None, Check], ...] = ((None, _nothing_to_train),)
_TRAINING_CHECKS: tuple[tuple[str | None, Check], ...] = ((None, _loss_fn), (None, _optimizer), (None, _sendable))


# ------------------------------------------------------------------ what the checks above call


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
