"""``launch()`` a plan as real processes running torch's schedule; returns the ``Run`` that watches them.

Example:
    >>> cfg = pv.LaunchConfig(schedule="1F1B", microbatches=8, steps=5, loss_fn=pv.cross_entropy,
    ...                       optimizer=pv.sgd(lr=0.1))
    >>> run = pv.launch(plan, cfg, inputs=(x,), target=y)      # checked, then returns at once
    >>> run.wait(timeout=60); run.losses; run.timeline(); run.state_dict()
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence

import torch

from pipeviz._compat import positional_legacy
from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.checks import check_weights, validate_launch
from pipeviz.runtime.devices import cpu_sets, resolve_devices
from pipeviz.runtime.payloads import rank_boots, rank_payloads
from pipeviz.runtime.procs import rendezvous, temp_prefix
from pipeviz.runtime.run import LIVE_RUNS, Run
from pipeviz.runtime.spec import default_optimizer
from pipeviz.schedule.config import UNSET, LaunchConfig, launch_config

__all__ = ["launch"]


@positional_legacy("steps")
def launch(
    plan: SplitPlan,
    config: LaunchConfig | str | None = None,
    microbatches: int = UNSET,
    *,
    steps: int | None = UNSET,
    inputs: torch.Tensor | Sequence[object] | None = None,
    input_kwargs: Mapping[str, object] | None = None,
    target: torch.Tensor | None = None,
    data: Iterable[object] | None = None,
    eval_data: Iterable[object] | None = None,
    resume: str | os.PathLike[str] | None = None,
    weights: str | os.PathLike[str] | None = None,
    **options: object,
) -> Run:
    """Start the plan's stages as processes running torch's ``schedule``; returns a ``Run`` at once.

    One process per rank, joining a rendezvous the calling process holds open (no port race). The stages
    are built here once; each rank receives only its own. Every forward, backward, input-grad and
    weight-grad action streams back as an ``Event``. Skip connections are relayed stage by stage and shared
    weights' gradients are summed across the stages holding them, so the run trains like the unsplit model
    (same microbatching, mean loss per microbatch).

    How to run is one ``pv.LaunchConfig`` (second, or ``config=``), the same object ``pv.simulate``,
    ``pv.export_torchrun``, the CLI and the Explorer take, or its fields as keywords (they override ``config``'s);
    in its place a schedule's name, then ``microbatches``, may come by position. Defaults: ``LaunchConfig()``'s.

    Example:
        >>> cfg = pv.LaunchConfig(schedule="GPipe", microbatches=4, steps=3, dp=2, loss_fn=pv.cross_entropy)
        >>> run = pv.launch(plan, cfg, inputs=(x,), target=y)
        >>> run = pv.launch(plan, "1F1B", 4, steps=3, inputs=(x,), target=y, loss_fn=pv.cross_entropy)

    Args:
        plan: the ``SplitPlan``.
        config: the ``pv.LaunchConfig``, or a schedule's name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
            InterleavedZeroBubble, ZBVZeroBubble, DualPipeV.
        microbatches: microbatches per step; must divide the batch.
        steps: optimizer steps (``None`` with ``data``: until it runs out).
        inputs / input_kwargs: the full batch (defaults: the graph's example inputs): a tensor or a tuple or
            list of them, each like the traced example (same dtype, same shape after the batch dim).
        target: the full batch of targets, passed to ``loss_fn(output, target)`` per microbatch.
            ``output`` is the model's output (its only tensor; for HF models the logits).
        loss_fn: mean-reduced loss returning a scalar tensor (tried once on a sample before launching).
            Without one the run is forward only: ``run.outputs[step]`` is the model's output for the batch.
        data: instead of ``inputs``/``target``: any iterable (a ``DataLoader`` too) whose next batch each step
            takes, streamed to the ranks that need it while the run goes: ``(inputs, target)`` pairs or
            ``{"inputs": ..., "target": ..., <keyword input>: ...}`` mappings (forward only: the inputs
            alone). Every batch has the first one's shapes. The run ends after ``steps`` or when it runs out.
        weights: a safetensors checkpoint (a ``.safetensors`` file, or a folder of shards with
            ``model.safetensors.index.json``, as HF ``save_pretrained`` and ``run.save`` write): each rank reads
            only its own stage's tensors, and no process is sent the model's values. The model may be on the
            meta device. Missing tensors and shapes that differ are named before any process starts.
        resume: a folder ``run.save(folder)`` wrote after a training run: the run goes on from it (its weights,
            every parameter's optimizer state, the scheduler's, the step count for dropout's draws; a ``data=``
            stream skips the batches it consumed), under any layout (``pipeviz.runtime.checkpoint``). ``steps``
            counts the steps of this run. Another model's checkpoint, another optimizer or a scheduler given on
            one side only are refused before any process starts.
        eval_data: held-out batches (like ``data=``'s, shaped as a training batch), evaluated every
            ``eval_every`` steps and after the last: ``run.eval_losses``.
        init_seed: a meta model without ``weights``: each rank initialises its own tensors with their
            modules' initialisers (HF ``_init_weights``, else ``reset_parameters``), seeded per module by this
            and the module's name (``pv.materialize(model, seed=init_seed)`` builds the same whole model).
        optimizer: ``params -> torch.optim.Optimizer`` (default ``pv.sgd(lr=0.1)``), built on every rank.
        devices: ``"auto"``, ``"cpu"``, ``"cuda"`` or one device per rank.
        stages_per_rank: for multi-stage schedules (default 2).
        timeout: seconds without progress before the run is declared hung and stopped.
        pin_cpus: on the CPU, give each rank its own cores (``run.cpus``) when there are enough and no
            other run of this process is going: its compute and gloo's threads then never wait behind
            another rank's (docs/torch-fixes.md has the measured gain).
        on_nonfinite: a NaN or inf loss or gradient: ``"stop"`` (the run fails before that step's update,
            naming the step, rank, stage and tensor) or ``"continue"`` (recorded in ``run.nonfinite``).
        dp: data-parallel replicas of the pipeline (``pv.Mesh(pp, dp)``: pp × dp processes). Each replica trains
            on its contiguous 1/dp of every batch (cut into ``microbatches``); torch's
            ``DistributedDataParallel`` on each stage averages the gradients across replicas in the last
            backward of a step, so the run trains like the unsplit model on the whole batch. ``run.losses`` is
            the whole batch's loss; ``run.state_dict()`` is replica 0's, checked equal to the others'.
        dp_shard: with ``dp`` > 1, each stage sharded across the replicas by torch's FSDP2 ``fully_shard``
            (parameters, gradients and optimizer state: 1/dp per process) instead of replicated under DDP.
        tp: tensor-parallel shards of every stage (pp × dp × tp processes): each stage's projections sharded with
            DTensor (``pipeviz.schedule.tensor_parallel``), column-wise then row-wise, as Megatron-LM shards a
            transformer: the attention by heads, the MLP by hidden units, the vocabulary's embedding and LM head
            by tokens (``pv.cross_entropy`` then takes each shard's logits: no process holds them whole).
        tp_plan: ``{module name: "colwise" | "rowwise"}`` for ``nn.Linear`` (and ``"rowwise"`` for
            ``nn.Embedding``) modules; default ``default_tp_plan``: the model's HF plan, attention and MLP by name,
            else Linear pairs (a Linear feeding the next Linear's input column-wise, that one row-wise).
        cp: context-parallel shares of every sequence (pp × dp × cp × tp processes): each process of a stage runs it
            on 1/cp of every sequence (zig-zag: chunks r and 2·cp−1−r of 2·cp), keys and values all-gathered per
            attention (``pipeviz.adapter.context_graph``; docs/composing.md); the sequence length must divide by
            2·cp.
        sequence_parallel: with ``tp`` > 1, norms, dropout and the residual stream sharded by token between the
            tensor-parallel regions (their activations 1/tp per shard; reduce-scatters and all-gathers in place of
            the all-reduces).

    Raises:
        LaunchError, ScheduleError, PlanError: before any process starts, naming the bad value and the fix.
    """
    cfg = launch_config(config, microbatches=microbatches, steps=steps, **options)
    checkpoint = None
    if resume is not None:  # the weights from the checkpoint; data= goes on after the batches it consumed
        from pipeviz.runtime.checkpoint import read_resume

        if weights is not None:
            raise LaunchError("resume= reads the weights from its checkpoint; weights= was given too. Fix: drop "
                              "weights= (or resume=, to start a new optimizer from those weights).", setting="resume")
        if isinstance(plan, SplitPlan):
            checkpoint = read_resume(plan, resume, cfg, cfg.optimizer or default_optimizer)
            weights = resume
            if data is not None:
                data = itertools.islice(iter(data), checkpoint.batches, None)
    spec = validate_launch(plan, cfg, inputs=inputs, input_kwargs=None if input_kwargs is None else dict(input_kwargs),
                           target=target, data=data, eval_data=eval_data)
    spec.sources, spec.init_seed = check_weights(plan, weights, cfg.init_seed), cfg.init_seed
    spec.resume = checkpoint
    world = spec.mesh.world
    stage_devices, backend, compute = resolve_devices(cfg.devices, world)
    on_cpu = all(d == "cpu" for d in stage_devices) and not any(compute)
    # Two runs at once would be pinned to the same cores: the second one is left to the scheduler.
    alone = not any(r.status in ("starting", "running") for r in list(LIVE_RUNS))
    threads, cpus = cpu_sets(world, cfg.pin_cpus and on_cpu and alone)

    run = Run(plan, spec, timeout=cfg.timeout, on_nonfinite=cfg.on_nonfinite)
    run.weights = weights
    run.devices = [c or d for c, d in zip(compute, stage_devices, strict=True)]
    run.cpus = cpus
    t0 = run.started_at
    run._store = rendezvous(world, cfg.timeout)
    port = run._store.port

    def build() -> list[bytes]:
        blobs, shipment, draws = rank_payloads(plan, spec, stage_devices, compute, backend, port, t0, cfg.timeout,
                                               threads, cpus, run._state_dir, values_prefix=temp_prefix("values"))
        run.random_draws = tuple(draws)
        if shipment.path:  # the ranks map it; removed when the run ends (the mappings outlive the name)
            run._files.append(shipment.path)
        run._shipped_bytes = shipment.nbytes
        return blobs

    run._start(build, rank_boots(spec, stage_devices, compute, backend, port, t0, cfg.timeout, threads, cpus))
    return run
