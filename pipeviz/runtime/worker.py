"""The process that runs one rank: its stages, torch's schedule, the fixes torch lacks, and events.

Started by ``pipeviz.runtime.run`` through ``torch.multiprocessing`` (spawn), or by an exported torchrun
script. Everything it needs arrives as one cloudpickled ``RankPayload`` holding only this rank's stages
(flat ``fx.GraphModule``s built by the launching process), and everything it reports goes to the parent
over one queue as typed messages (``pipeviz.runtime.messages``), each carrying the sender's rank and mesh
coordinates: ``Phase``, ``Events``, ``Loss``, ``Output``, ``StepEnd``, ``NonFinite``, ``State``, ``Done``, ``Failed``.

torch's own log lines and anything else the rank prints to stderr go to a file of the rank's; the tail of it
comes with an error (in ``run.error``), never to the user's terminal or notebook.

Events, losses and step ends leave together at most every ``SEND_INTERVAL`` seconds: each message wakes
the parent (a notebook kernel), which shares the ranks' cores.

The loop has four parts: ``_connect`` (process group, cores, clock), ``rank_stages`` (torch's
``PipelineStage`` around each runner, with static shapes), ``build_schedule`` and ``train`` (steps, shared
gradients summed, optimizer), then ``rank_state`` (trained tensors under the original names).

This module must stay importable without any view library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from pipeviz.runtime.clock import SEND_INTERVAL, Clock, Sink
from pipeviz.runtime.expert_shards import held_text, whole_experts
from pipeviz.runtime.grads import local_tensor
from pipeviz.runtime.messages import (
    Done,
    Failed,
    Feed,
    Message,
    OptimState,
    Phase,
    State,
)
from pipeviz.runtime.payloads import PAYLOAD_WAIT, Boot, RankPayload
from pipeviz.runtime.rank_schedule import build_schedule
from pipeviz.runtime.rank_stages import rank_stages
from pipeviz.runtime.shapes import Shapes, rebind
from pipeviz.runtime.stages import StepError
from pipeviz.runtime.steps import StepContext, infer, param_names, rank_state, train
from pipeviz.schedule.mesh import Coords

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event as MpEvent

    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage

    from pipeviz.runtime.overlap import OverlappedReduction
    from pipeviz.runtime.rank_schedule import Schedule
    from pipeviz.runtime.stages import RankStage
    from pipeviz.runtime.zero import ZeroOne

# Boot and RankPayload are built by pipeviz.runtime.payloads (their names here are the ones 0.2 code imports).
__all__ = ["SEND_INTERVAL", "Boot", "RankPayload", "main", "run_payload"]


def main(payload_path: str, queue: Queue[Message], log_path: str | None = None, data: Queue[Feed] | None = None,
         boot: Boot | None = None, payload_ready: MpEvent | None = None) -> None:
    """Process entry point (started by ``launch``): reads its payload from ``payload_path`` and deletes it;
    stderr goes to ``log_path`` (the launching process removes it when the run ends); ``data``: the queue
    of a ``data=`` run's batches. With ``boot`` the rank joins the process group first, then waits for
    ``payload_ready`` (an event the launching process sets once every payload is written)."""
    import warnings

    from pipeviz.runtime.ship import load_payload

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own pytree deprecation noise
    rank, coords = (boot.rank, boot.coords) if boot is not None else (-1, Coords(-1))
    _quiet_stderr(log_path)
    try:
        connected = None
        if boot is not None:
            threading.Thread(target=_watch_parent, args=(boot.parent_pid,), daemon=True).start()
            connected = _connect(boot, queue)
            if payload_ready is not None and not payload_ready.wait(PAYLOAD_WAIT):
                raise TimeoutError(f"rank {rank} waited {PAYLOAD_WAIT:g} s for its stages from the launching process")
        with open(payload_path, "rb") as f:
            payload: RankPayload = load_payload(f.read())
        os.unlink(payload_path)
        rank, coords = payload.rank, payload.coords
        payload.data = data
        if boot is None:
            threading.Thread(target=_watch_parent, args=(payload.parent_pid,), daemon=True).start()
        run_payload(payload, queue, connected)
        queue.put(Done(rank, coords))
    except BaseException as exc:  # report everything, including SystemExit from user code
        summary = _summary(exc)
        queue.put(Failed(rank, coords, summary, traceback.format_exc(), _tail(log_path)))
        queue.close()
        queue.join_thread()
        sys.exit(1)
    queue.close()
    queue.join_thread()


def _summary(exc: BaseException) -> str:
    """One line naming what failed: pipeviz's located error when one is in the chain (torch wraps it in
    "[Stage 1] failed to run forward"), else the exception itself."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, StepError):
            return str(seen).split("\n")[0]
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _quiet_stderr(path: str | None) -> None:
    """Send this process's stderr (torch's log lines, C++ warnings) to its log file."""
    if path is None:
        return
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def _tail(path: str | None, lines: int = 40) -> str:
    if path is None:
        return ""
    try:
        sys.stderr.flush()
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _watch_parent(parent_pid: int) -> None:
    # No orphans: a killed kernel cannot reap us, so leave as soon as the launching process is gone. (Ranks
    # are forked by a fork server, so the launching process is not our parent: check that it is alive.)
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:  # alive, under another user (pid reuse): keep going
            pass
        time.sleep(0.5)


def run_payload(p: RankPayload, queue: Sink, connected: tuple[Clock, torch.device, torch.device] | None = None) -> None:
    import torch.distributed as dist

    from pipeviz.adapter import exact_split_backward, plant_fault, timed_collectives, timed_waits

    clock, device, compute = connected or _connect(p, queue)
    plant_fault()  # a testing hook: nothing unless $PIPEVIZ_PLANT_FAULT names a collective (docs/fuzz.md)
    step_box = [0, 0, 0]  # the step, its accumulated (or held-out) batch, and whether it evaluates
    pp_group, dp_group, dp_mesh, tp_mesh, cp_group = _mesh_groups(p)
    ep_group, ep_replicas = _ep_groups(p)
    ep_back = _ep_groups(p)[0] if p.ep_overlap else None  # ep_overlap: a second group, the backward's all-to-alls'
    stages, params, local, overlapped = rank_stages(p, clock, step_box, device, compute, pp_group, dp_group, tp_mesh,
                                                dp_mesh if p.dp_shard else None, cp_group=cp_group,
                                                ep_group=ep_group, ep_replicas=ep_replicas, ep_back_group=ep_back)
    reduction: OverlappedReduction | ZeroOne | None = overlapped
    stepped, names = params, param_names(p)  # what the optimizer steps (ZeRO-1: its shards)
    if p.dp_reduce == "zero1" and dp_mesh is not None and p.loss_fn is not None:
        from pipeviz.runtime.zero import ZeroOne

        def reduced(stage: int, start: float, end: float) -> None:
            clock.record_async((p.rank, stage, "DP", -1, start - clock.t0, end - clock.t0, step_box[0]))

        zero = ZeroOne(params, names, dp_mesh, reduced)
        for st in stages:
            zero.add_stage(st.stage_index, list(st.submod.parameters()))
            st.grads_final = zero.launch  # type: ignore[attr-defined]
        reduction, stepped, names = zero, zero.shards, zero.names
    groups = _tied_groups(p)
    schedule = build_schedule(p, stages)

    def build(new: list[RankStage]) -> tuple[Schedule, list[PipelineStage]]:
        # A data= batch of a new shape: its stages over this process's parameters and buffers (runtime.shapes),
        # not wrapped again per replica: the reduction built for the first shape's stages takes theirs too.
        rebind(new, p.stages)
        q = dataclasses.replace(p, stages=new)
        built = rank_stages(q, clock, step_box, device, compute, pp_group, ep_group=ep_group,
                            ep_back_group=ep_back)[0]
        for st in built:
            if reduction is not None:
                st.grads_final = reduction.launch  # type: ignore[attr-defined]
        return build_schedule(q, built), built

    shapes = Shapes(schedule, stages, build)
    # A rank whose stages hold no parameter (a split around a ReLU) still steps: torch's optimizers refuse an empty
    # list, so it gets one empty placeholder (no gradient, nothing updated; its learning rate schedules as the rest).
    optimizer = (p.optimizer(stepped or [torch.nn.Parameter(torch.zeros(0))]) if p.loss_fn is not None else None)
    scheduler = p.lr_scheduler(optimizer) if optimizer is not None and p.lr_scheduler is not None else None
    if p.resume is not None and optimizer is not None:  # resume=: the checkpoint's state for this rank's parameters
        from pipeviz.runtime.checkpoint import load_optimizer

        load_optimizer(p.resume, optimizer, scheduler, stepped, names)
    held = ""
    if p.dp_shard:  # FSDP2: this process holds its shard of every parameter (DTensor numel is the whole's)
        held = (f" ({sum(local_tensor(t).numel() for t in params):,} of {sum(t.numel() for t in params):,} parameter "
                f"elements held: sharded over {p.mesh.dp} replicas)")
    held += held_text(params)  # expert parallelism: this process's experts alone
    queue.put(Phase(p.rank, p.coords, f"stage{'s' * (len(p.stages) > 1)} "
                                      f"{', '.join(str(s.index) for s in p.stages)} ready{held}"))

    def comm(start: float, end: float) -> None:
        clock.record((p.rank, -1, "COMM", -1, start - clock.t0, end - clock.t0, step_box[0]))

    def collective(name: str, start: float, end: float) -> None:  # a tensor-parallel shard's all-reduce, ...
        clock.record_async((p.rank, clock.stage, "TP", -1, start - clock.t0, end - clock.t0, step_box[0]))

    clock.meter.watch(params)
    clock.meter.count_static(params)
    timed_tp = timed_collectives(collective) if tp_mesh is not None else contextlib.nullcontext()
    ctx = StepContext(p, schedule, clock, device, step_box, stages=stages, shapes=shapes, dp_group=dp_group,
                      optimizer=optimizer, params=params, local=local, groups=groups, scheduler=scheduler,
                      reduction=reduction)
    with timed_waits(comm), exact_split_backward(), clock.meter.counting(), timed_tp:
        finished = infer(ctx) if optimizer is None else train(ctx)
    with clock.lock:  # the steps are over (their last events sent): nothing after the rank's final messages
        clock.stopped = True
    if finished:
        # every routed expert whole (expert parallelism: gathered from the processes that hold them)
        state = whole_experts(rank_state(p, copy=p.state_path is None), params)
        if p.state_path is not None:  # a file: a big stage's tensors do not pass through the queue
            torch.save(state, p.state_path)
            queue.put(State(p.rank, p.coords, p.state_path))
        else:
            buf = io.BytesIO()
            torch.save(state, buf)
            queue.put(State(p.rank, p.coords, buf.getvalue()))
        if optimizer is not None:
            _send_optimizer(p, queue, optimizer, scheduler, stepped, names)
    dist.barrier()
    dist.destroy_process_group()


def _send_optimizer(p: RankPayload, queue: Sink, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None, params: list[torch.nn.Parameter],
                    names: dict[int, str]) -> None:
    """The optimizer's state after the last step, whole tensors by name, for ``run.save``'s checkpoint: gathered on
    every process (a shard's or FSDP2 replica's part), sent by replica 0's shard 0; process 0 adds the optimizer's
    class, groups and the scheduler's state."""
    from pipeviz.runtime.checkpoint import gathered_optimizer_state

    tensors = whole_experts(gathered_optimizer_state(optimizer, params, names), params)
    if p.coords.dp or p.coords.tp or p.coords.cp:
        return
    out: dict[str, object] = {"tensors": tensors}
    if p.rank == 0:
        out.update(optimizer=type(optimizer).__name__, scheduler=scheduler.state_dict() if scheduler else None,
                   groups=[{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    if p.state_path is not None:
        torch.save(out, p.state_path + ".optim")
        queue.put(OptimState(p.rank, p.coords, p.state_path + ".optim"))
    else:
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put(OptimState(p.rank, p.coords, buf.getvalue()))


def _connect(p: Boot | RankPayload, queue: Sink) -> tuple[Clock, torch.device, torch.device]:
    """Join the process group, take this rank's cores, agree on one clock."""
    import torch.distributed as dist

    from pipeviz.adapter.malloc import keep_heap

    keep_heap()
    torch.set_num_threads(max(1, p.threads))
    timeout = timedelta(seconds=p.timeout_s)
    if p.init_method:  # torchrun
        dist.init_process_group(p.backend, init_method=p.init_method, rank=p.rank, world_size=p.world,
                                timeout=timeout)
    else:  # join the store the launching process holds open: no port can be taken in between
        store = dist.TCPStore("127.0.0.1", p.port, is_master=False, timeout=timeout)
        dist.init_process_group(p.backend, store=store, rank=p.rank, world_size=p.world, timeout=timeout)
    if p.cpus:
        _pin(p.cpus)
    if p.t0 < 0:  # under torchrun: one clock for every rank, rank 0's start (hosts' clocks assumed synced)
        t0 = torch.tensor([time.time()], dtype=torch.float64)
        dist.broadcast(t0, src=0)
        p.t0 = float(t0.item())
    device = torch.device(p.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    compute = torch.device(p.compute_device) if p.compute_device else device
    clock = Clock(p.t0, compute if compute.type == "cuda" else None)
    clock.queue, clock.rank, clock.coords = queue, p.rank, p.coords
    clock.watch_stale()  # a rank stuck in an action still reports the ones it finished (the hang report reads them)
    return clock, device, compute


def _mesh_groups(p: RankPayload) -> tuple[ProcessGroup | None, ProcessGroup | None, DeviceMesh | None,
                                          DeviceMesh | None, ProcessGroup | None]:
    """This process's pipeline group, the group its stages' gradients are averaged over (its data-parallel
    replicas and, with context parallelism, every share of the sequence: dp × cp processes), the data-parallel
    (1-D) mesh, the tensor-parallel (1-D) mesh from torch's ``DeviceMesh`` (named dims), and its context-parallel
    group; Nones for a pure pipeline, whose pipeline is the world."""
    import torch.distributed as dist

    if p.mesh is None or p.mesh.world == p.mesh.pp:
        return None, None, None, None, None
    mesh = p.mesh
    dm = mesh.device_mesh("cuda" if p.backend == "nccl" else "cpu")
    dp = mesh.dp > 1
    reduce_group, cp_group = dm.get_group("dp") if dp else None, None
    if mesh.cp > 1:
        cp_group = dm.get_group("cp")
        me = mesh.coords(p.rank)
        for pp in range(mesh.pp):  # every process makes every group, in one order (torch's new_group rule)
            for t in range(mesh.tp):
                ranks = [mesh.rank(pp, dp=d, tp=t, cp=c) for d in range(mesh.dp) for c in range(mesh.cp)]
                group = dist.new_group(ranks) if dp else cp_group
                if (me.pp, me.tp) == (pp, t):
                    reduce_group = group
    return (dm.get_group("pp"), reduce_group, dm["dp"] if dp else None,
            dm["tp"] if mesh.tp > 1 else None, cp_group)


def _ep_groups(p: RankPayload) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """This process's expert-parallel group (``LaunchConfig.ep``): the ``ep`` replicas of its stages that share out
    every MoE block's experts (replicas ``g·ep .. (g+1)·ep − 1``), and the replicas that hold the same experts as
    it (the same share ``dp mod ep`` of every group: their expert gradients are reduced together); Nones without
    expert parallelism. Every process makes every group, in one order (torch's ``new_group`` rule)."""
    import torch.distributed as dist

    mesh = p.mesh
    if mesh is None or mesh.ep == 1:
        return None, None
    me, mine, same = mesh.coords(p.rank), None, None
    for pp in range(mesh.pp):
        for g in range(mesh.dp // mesh.ep):
            group = dist.new_group([mesh.rank(pp, dp=d) for d in range(g * mesh.ep, (g + 1) * mesh.ep)])
            if me.pp == pp and me.dp // mesh.ep == g:
                mine = group
        for r in range(mesh.ep):
            group = dist.new_group([mesh.rank(pp, dp=d) for d in range(r, mesh.dp, mesh.ep)])
            if me.pp == pp and me.dp % mesh.ep == r:
                same = group
    return mine, same


def _tied_groups(p: RankPayload) -> dict[str, ProcessGroup | None]:
    """Per shared parameter, the process group of this replica's ranks holding a copy (None: one rank holds
    every copy). Every process creates every replica's groups, in one order (torch's ``new_group`` rule)."""
    import torch.distributed as dist

    me = p.mesh.coords(p.rank) if p.mesh is not None else None
    pipelines = p.mesh.pipelines() if p.mesh is not None else [(0, 0, 0)]
    out: dict[str, ProcessGroup | None] = {}
    for name, holders in sorted(p.tied.items()):
        for d, t, c in pipelines:
            ranks = [p.mesh.rank(h, dp=d, tp=t, cp=c) for h in holders] if p.mesh is not None else list(holders)
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if me is None or (me.dp, me.tp, me.cp) == (d, t, c):
                out[name] = group
    return out












def _pin(cpus: tuple[int, ...]) -> None:
    """Keep every thread of this process (compute, gloo's, started after init) on ``cpus``; threads
    started later inherit it from the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass




