"""A rank's torch ``PipelineStage``s, built in its process: each runner on its compute device (its tensors read or
initialised here, tensor-parallel sharded, compiled, its layers recomputed), replicated (DDP, FSDP2 or the overlapped
reduction), given static shapes, and timed (every action an ``Event``, a forward's random draws seeded as the
reference seeds them).

Example:
    >>> stages, params, local, reduction = rank_stages(payload, clock, step_box, device, compute, pp_group)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch

from pipeviz.runtime.clock import Clock
from pipeviz.runtime.expert_shards import Share, expert_params, shard_experts
from pipeviz.runtime.payloads import RankPayload

if TYPE_CHECKING:
    from torch.distributed import GradBucket, ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage

    from pipeviz.runtime.overlap import OverlappedReduction
    from pipeviz.runtime.stages import RankStage, StageRunner

__all__ = ["rank_stages"]


def rank_stages(p: RankPayload, clock: Clock, step_box: list[int], device: torch.device,
            compute: torch.device, pp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None,
            tp_mesh: DeviceMesh | None = None, shard_mesh: DeviceMesh | None = None, *,
            cp_group: ProcessGroup | None = None, ep_group: ProcessGroup | None = None,
            ep_replicas: ProcessGroup | None = None, ep_back_group: ProcessGroup | None = None,
            ) -> tuple[list[PipelineStage], list[torch.nn.Parameter], dict[str, list[torch.Tensor]],
                       OverlappedReduction | None]:
    """torch's ``PipelineStage`` around each of this rank's runners (timed; in this replica's pipeline group),
    the parameters to optimize, per shared parameter this rank's copies, and the overlapped reduction of their
    gradients across replicas (``p.dp_reduce == "overlap"``, the default: ``pipeviz.runtime.overlap``, launched by
    each stage when its gradients are final, waited for in ``steps.train``). With ``"ddp"`` each runner is
    wrapped in torch's ``DistributedDataParallel`` over its data-parallel group: torch's stage then
    accumulates gradients under ``no_sync`` and averages them across replicas in the last backward. Not under
    the schedules that split backwards (zero bubble, DualPipeV): with torch 2.13–2.15, DDP's reducer there
    averages the gradients before the weight-gradient passes have run (replicas silently diverge: 7e-3 after
    two steps) or fails ("Encountered gradient which is undefined, but still allreduced by DDP reducer"); there
    (refused before launch) and with ``"after_flush"`` ``average_replicas`` averages them after the step. With
    ``shard_mesh`` (``dp_shard=True``) each
    runner is sharded across the replicas by FSDP2's ``fully_shard`` instead (torch's stage unshards, reshards and
    reduce-scatters it). With ``cp_group`` (context parallelism) each runner runs its graph on this process's share of
    every sequence (``adapter.context_graph``), its exchanges timed as ``CP`` events. With ``ep_group`` (expert
    parallelism) each runner computes this process's share of every MoE block's experts, the tokens routed to the
    others' sent there and back (``adapter.expert_graph``), each all-to-all an ``A2A`` event; the process holds only
    its own experts (``runtime.expert_shards``), their gradients reduced over ``ep_replicas`` (the processes holding
    the same experts) and divided by all the replicas, the rest's over ``dp_group``; ``ep_back_group``
    (``ep_overlap``) carries the backward's all-to-alls."""
    from pipeviz.adapter import timed_stage_class

    Stage = timed_stage_class(_timed_span(p, clock, step_box, compute))
    reduction = None
    if dp_group is not None and p.loss_fn is not None and p.dp_reduce == "overlap" and p.mesh is not None:
        from pipeviz.runtime.overlap import OverlappedReduction

        def reduced(stage: int, start: float, end: float) -> None:
            clock.record_async((p.rank, stage, "DP", -1, start - clock.t0, end - clock.t0, step_box[0]))

        reduction = OverlappedReduction(dp_group, p.replicas, reduced)

    num_stages = len(p.stage_ranks)
    stages = []
    params: list[torch.nn.Parameter] = []
    local: dict[str, list[torch.Tensor]] = {}
    for st in p.stages:
        runner = _runner(p, st, device, compute, tp_mesh)
        if cp_group is not None:
            _context(p, runner, cp_group, clock, step_box)
        if ep_group is not None and p.mesh is not None:
            share = Share(p.mesh.ep, p.coords.dp % p.mesh.ep, ep_group, ep_replicas)
            _experts(p, st, runner, share, clock, step_box, ep_back_group)
        # Static shapes, so torch never runs its shape inference (an extra forward/backward in step 1).
        # Activations from another stage need grads; model inputs and integer tensors (masks) do not.
        ins = tuple(_like(t, device, grad=st.index > 0 and t.is_floating_point()) for t in st.inputs)
        outs = tuple(_like(t, device, grad=t.is_floating_point()) for t in st.outputs)
        submod = _replicated(p, runner, st.index, clock, step_box, dp_group, shard_mesh)
        stages.append(Stage(submod, st.index, num_stages, device, input_args=ins, output_args=outs,
                            group=pp_group))
        stages[-1].recomputes = runner.recomputed is not None  # type: ignore[attr-defined]
        if reduction is not None:  # dp_reduce="overlap": the stage's average starts when its gradients are final
            rest, experts = expert_params(runner.parameters())
            reduction.add_stage(st.index, rest)
            if experts:  # held by dp / ep processes: summed over those, divided by every replica
                reduction.add_stage(st.index, experts, group=ep_replicas, divisor=p.replicas)
            stages[-1].grads_final = reduction.launch  # type: ignore[attr-defined]
        named = dict(runner.stage.named_parameters(remove_duplicate=False))
        for canon, inner in st.params.items():
            t = named[inner]
            if all(t is not q for q in params):
                params.append(t)
            if canon in p.tied:
                local.setdefault(canon, []).append(t)
    return stages, params, local, reduction


def _timed_span(p: RankPayload, clock: Clock, step_box: list[int], compute: torch.device,
                ) -> Callable[[int, str, int], AbstractContextManager[object]]:
    """The span each stage action is timed in (an ``Event``), seeding a forward's random draws first as the
    reference does (``pipeviz.runtime.rng``)."""
    from pipeviz.runtime.rng import EVAL_SEED, seed_device, stage_seed

    drawing = {st.index for st in p.stages if st.draws}  # stages whose forward draws random numbers (dropout)
    first_mb = p.coords.dp * p.microbatches  # this replica's microbatches, counted across replicas
    per_batch = p.microbatches * (p.mesh.dp if p.mesh is not None else 1)  # every replica's, in one batch

    def span(stage: int, kind: str, mb: int) -> AbstractContextManager[object]:
        # An accumulated step's b-th batch: its microbatches numbered after the earlier batches' (the timeline
        # shows accumulate x microbatches per step; the reference seeds batch b's the same way). A held-out
        # batch's forward (evaluation) is an EVAL event, its draws seeded apart from training's (EVAL_SEED).
        evaluating = step_box[2]
        if kind == "F" and stage in drawing:  # the reference seeds the same before this stage's draws
            at = step_box[1] * per_batch + first_mb + mb
            step = step_box[0] + (p.resume.step if p.resume is not None else 0)  # a resumed run's steps go on
            seed_device(compute, stage_seed(p.seed + EVAL_SEED * evaluating, step, at, stage))
        return clock.span(p.rank, stage, "EVAL" if evaluating else kind, step_box[1] * p.microbatches + mb,
                          step_box[0])

    return span


def _runner(p: RankPayload, st: RankStage, device: torch.device, compute: torch.device,
            tp_mesh: DeviceMesh | None) -> StageRunner:
    """The stage's runner on its compute device: its tensors read or initialised here (weights=, a meta model),
    sharded over ``tp_mesh``, compiled, its layers recomputed, as the payload asks."""
    if st.source is not None:  # weights= or a meta model: this rank's tensors, read or initialised here
        from pipeviz.capture.weights import materialize_stage

        materialize_stage(st.runner.stage, {**st.params, **st.buffers}, st.source, compute)
    retarget = getattr(st.runner.stage, "retarget", None)
    if callable(retarget):  # devices baked in by the trace (the meta device, or the CPU on a GPU run)
        retarget(compute)
    runner = st.runner.to(compute)
    runner.compute_device = compute if compute != device else None
    runner.autocast_device = compute.type  # (mixed precision: autocast where the stage computes)
    runner.fresh_outputs = p.split_backward
    if tp_mesh is not None:
        from pipeviz.schedule.tensor_parallel import shard_stage

        shard_stage(runner.stage, st.params, p.tp_placements, tp_mesh, p.sequence_parallel)
        runner.tp_mesh = tp_mesh
        # dropout on a sharded tensor keeps its part of the unsplit model's mask (every shard seeded alike)
        from pipeviz.runtime.rng import register_sharded_draws

        register_sharded_draws()
        # pv.cross_entropy takes logits sharded by vocabulary as they are (torch's loss_parallel): no shard
        # gathers the whole logits. Another loss gets them whole.
        from pipeviz.schedule.training import cross_entropy

        runner.vocab_parallel_loss = st.index == len(p.stage_ranks) - 1 and p.loss_fn is cross_entropy
    if p.compile is not None:
        if p.split_backward:
            # A split backward runs the stage's backward twice (input grads, then weight grads), keeping its
            # graph in between; torch 2.13-2.15 compile the backward with donated buffers, which it refuses to
            # keep: "This backward function was compiled with non-empty donated buffers which requires
            # create_graph=False and retain_graph=False ... or set torch._functorch.config.donated_buffer=False"
            # (DualPipeV's I passes). Its own fix, for this process.
            import torch._functorch.config as functorch_config

            functorch_config.donated_buffer = False
        runner.compile_stage(p.compile)
    if p.recompute and p.recompute[st.index] != "none":
        runner.recompute(p.recompute[st.index])
    return runner


def _context(p: RankPayload, runner: StageRunner, group: ProcessGroup, clock: Clock, step_box: list[int]) -> None:
    """The runner's graph run on this process's share of every sequence, each exchange of keys and values (or of
    their gradients) a ``CP`` event of the stage acting."""
    from pipeviz.adapter.context_graph import ContextGraph, Share

    def record(start: float, end: float) -> None:
        clock.record_async((p.rank, clock.stage, "CP", -1, start - clock.t0, end - clock.t0, step_box[0]))

    assert p.mesh is not None
    share = Share(p.seq, p.mesh.cp, p.coords.cp, group, record=record)
    runner.context = ContextGraph(runner.stage, share, runner.traced_shapes)  # type: ignore[arg-type]


def _experts(p: RankPayload, st: RankStage, runner: StageRunner, share: Share, clock: Clock,
             step_box: list[int], back_group: ProcessGroup | None = None) -> None:
    """The runner's graph with this process's share of every MoE block's experts, each all-to-all an ``A2A`` event
    and the tokens routed to each expert per forward an ``ExpertTokens`` message; the other shares' expert weights
    dropped from the stage (``shard_experts``)."""
    from pipeviz.adapter.expert_graph import ExpertGraph, Team, find_blocks
    from pipeviz.runtime.messages import ExpertTokens

    def record(start: float, end: float) -> None:
        clock.record_async((p.rank, clock.stage, "A2A", clock.mb, start - clock.t0, end - clock.t0, step_box[0]))

    def count(block: str, counts: list[int]) -> None:
        if not step_box[2]:  # training forwards (a held-out batch's are evaluation); mb as the F event's
            clock.post(ExpertTokens(p.rank, p.coords, step_box[0], clock.stage, clock.mb, block, counts))

    assert p.mesh is not None
    team = Team(share.ep, share.rank, share.group, record=record, count=count, back_group=back_group,
                delay=p.ep_delay)
    blocks = find_blocks(runner.stage)  # type: ignore[arg-type]
    if blocks:
        shard_experts(runner.stage, st.params, blocks, share)  # type: ignore[arg-type]
        runner.context = ExpertGraph(runner.stage, blocks, team)  # type: ignore[arg-type]


def _replicated(p: RankPayload, runner: StageRunner, stage: int, clock: Clock, step_box: list[int],
                dp_group: ProcessGroup | None, shard_mesh: DeviceMesh | None) -> torch.nn.Module:
    """The runner as its replicas run it: sharded by FSDP2 (``shard_mesh``), wrapped in DDP (``dp_reduce="ddp"``),
    or as it is."""
    if shard_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        # (the same module, its class swapped for one deriving from both FSDPModule and the runner's)
        return cast("torch.nn.Module", fully_shard(runner, mesh=shard_mesh))
    if dp_group is not None and p.loss_fn is not None and p.dp_reduce == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # broadcast_buffers=False: running statistics stay each replica's own (replica 0's are reported);
        # find_unused_parameters: a parameter used only under no_grad gets no gradient in any replica.
        submod = DistributedDataParallel(runner, process_group=dp_group, broadcast_buffers=False,
                                         find_unused_parameters=True)
        submod.register_comm_hook(dp_group, _timed_allreduce(clock, p.rank, stage, step_box))
        return submod
    return runner


def _timed_allreduce(clock: Clock, rank: int, stage: int, step_box: list[int],
                     ) -> Callable[[ProcessGroup, GradBucket], torch.futures.Future[torch.Tensor]]:
    """DDP's own averaging of one gradient bucket (torch's ``allreduce_hook``: divide by the replicas, then an
    asynchronous all-reduce), timed from its launch inside the backward to its completion: a ``DP`` event per
    bucket, overlapping the backward that produced it on the timeline."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(group: ProcessGroup, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        start, step = time.time() - clock.t0, step_box[0]

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            clock.record_async((rank, stage, "DP", -1, start, time.time() - clock.t0, step))
            return fut.value()

        return allreduce_hook(group, bucket).then(done)

    # DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation).
    hook.__annotations__ = {"group": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


def _like(t: torch.Tensor, device: torch.device, grad: bool) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=device).requires_grad_(grad)
