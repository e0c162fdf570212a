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

The loop has four parts: ``_connect`` (process group, cores, clock), ``_stages`` (torch's
``PipelineStage`` around each runner, with static shapes), ``_schedule`` and ``_train`` (steps, shared
gradients summed, optimizer), then ``_state`` (trained tensors under the original names).

This module must stay importable without any view library.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from pipeviz import schedules as sched
from pipeviz.mesh import Coords
from pipeviz.runtime.memory import MemoryMeter
from pipeviz.runtime.messages import (
    Done,
    End,
    Events,
    Failed,
    Loss,
    Memory,
    Message,
    NonFinite,
    Output,
    Phase,
    State,
    StepEnd,
)
from pipeviz.runtime.stages import StepError
from pipeviz.timeline import Event

__all__ = ["SEND_INTERVAL", "Boot", "RankPayload", "main", "run_payload"]


SEND_INTERVAL = 0.1  # seconds: live enough to watch, rare enough not to disturb the ranks


@dataclass
class Boot:
    """What a rank needs to join the run before its stages arrive: ``pv.launch`` starts the processes with it, so
    they join the process group while the launching process builds and writes their payloads."""

    rank: int
    world: int
    port: int
    backend: str
    device: str
    compute_device: str | None
    t0: float
    parent_pid: int
    timeout_s: float
    threads: int
    cpus: tuple[int, ...] | None = None
    init_method: str | None = None
    mesh: Any = None

    @property
    def coords(self) -> Coords:
        return self.mesh.coords(self.rank) if self.mesh is not None else Coords(self.rank)


PAYLOAD_WAIT = 3600.0  # seconds a started rank waits for its payload (the launching process may trace a big model)


@dataclass
class RankPayload:
    """Everything one rank needs (pickled by the parent, read once by the worker)."""

    rank: int
    world: int
    port: int
    backend: str
    device: str  # where torch's PipelineStage lives (and communicates)
    compute_device: str | None  # set when the stage computes elsewhere (a shared GPU, over host memory)
    schedule: str
    stage_ranks: tuple[int, ...]  # rank of every stage
    microbatches: int
    steps: int | None  # None: a data= run, fed until "end"
    stages: list[Any]  # this rank's pipeviz.runtime.stages.RankStage list
    tied: dict[str, list[int]]  # shared parameter -> ranks holding a copy
    loss_fn: Any
    optimizer: Any
    args: tuple[Any, ...] = ()  # the first stage's inputs (full batch)
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: Any = None  # only for the rank holding the last stage
    t0: float = 0.0
    parent_pid: int = 0
    timeout_s: float = 120.0
    threads: int = 1
    cpus: tuple[int, ...] | None = None  # cores of this rank's threads (pv.launch on CPU; see spec.cpu_sets)
    init_method: str | None = None  # default: the launching process's TCPStore on port; "env://" under torchrun
    on_nonfinite: str = "stop"  # a NaN or inf loss or gradient: "stop" the run, or "continue" and report it
    data: Any = None  # set by main(): the queue the launching process streams data= batches on
    state_path: str | None = None  # where this rank writes its trained tensors (else: sent on the queue)
    mesh: Any = None  # pipeviz.mesh.Mesh with replicas or shards (dp or tp > 1); None: one pipeline, rank = pp rank
    tp_placements: dict[str, str] = field(default_factory=dict)  # tp > 1: canonical name -> "shard0"/"shard1"
    dp_shard: bool = False  # replicas shard each stage with FSDP2 (fully_shard over the dp mesh dim)

    @property
    def coords(self) -> Coords:
        """This process's place in the mesh (pipeline rank, replica, shard)."""
        return self.mesh.coords(self.rank) if self.mesh is not None else Coords(self.rank)


def main(payload_path: str, queue: Any, log_path: str | None = None, data: Any = None, boot: Boot | None = None,
         payload_ready: Any = None) -> None:
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


def run_payload(p: RankPayload, queue: Any, connected: tuple[_Clock, torch.device, torch.device] | None = None) -> None:
    import torch.distributed as dist

    from pipeviz.adapter import exact_split_backward, timed_collectives, timed_waits

    clock, device, compute = connected or _connect(p, queue)
    step_box = [0]
    pp_group, dp_group, dp_mesh, tp_mesh = _mesh_groups(p)
    stages, params, local = _stages(p, clock, step_box, device, compute, pp_group, dp_group, tp_mesh,
                                    dp_mesh if p.dp_shard else None)
    groups = _tied_groups(p)
    schedule = _schedule(p, stages)
    optimizer = p.optimizer(params) if p.loss_fn is not None else None
    held = ""
    if p.dp_shard:  # FSDP2: this process holds its shard of every parameter (DTensor numel is the whole's)
        held = (f" ({sum(_local(t).numel() for t in params):,} of {sum(t.numel() for t in params):,} parameter "
                f"elements held: sharded over {p.mesh.dp} replicas)")
    queue.put(Phase(p.rank, p.coords, f"stage{'s' * (len(p.stages) > 1)} "
                                      f"{', '.join(str(s.index) for s in p.stages)} ready{held}"))

    def comm(start: float, end: float) -> None:
        clock.record((p.rank, -1, "COMM", -1, start - clock.t0, end - clock.t0, step_box[0]))

    def collective(name: str, start: float, end: float) -> None:  # a tensor-parallel shard's all-reduce, ...
        clock.record_async((p.rank, clock.stage, "TP", -1, start - clock.t0, end - clock.t0, step_box[0]))

    clock.meter.watch(params)
    clock.meter.count_static(params)
    timed_tp = timed_collectives(collective) if tp_mesh is not None else contextlib.nullcontext()
    with timed_waits(comm), exact_split_backward(), clock.meter.counting(), timed_tp:
        if optimizer is None:
            finished = _infer(p, schedule, clock, step_box, device)
        else:
            finished = _train(p, schedule, optimizer, params, local, groups, clock, step_box, device, dp_group)
    if finished:
        if p.state_path is not None:  # a file: a big stage's tensors do not pass through the queue
            torch.save(_state(p, copy=False), p.state_path)
            queue.put(State(p.rank, p.coords, p.state_path))
        else:
            buf = io.BytesIO()
            torch.save(_state(p), buf)
            queue.put(State(p.rank, p.coords, buf.getvalue()))
    dist.barrier()
    dist.destroy_process_group()


def _connect(p: Boot | RankPayload, queue: Any) -> tuple[_Clock, torch.device, torch.device]:
    """Join the process group, take this rank's cores, agree on one clock."""
    import torch.distributed as dist

    from pipeviz._malloc import keep_heap

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
    clock = _Clock(p.t0, compute if compute.type == "cuda" else None)
    clock.queue, clock.rank, clock.coords = queue, p.rank, p.coords
    return clock, device, compute


def _mesh_groups(p: RankPayload) -> tuple[Any, Any, Any, Any]:
    """This process's pipeline group, data-parallel group, data-parallel (1-D) mesh and tensor-parallel (1-D)
    mesh from torch's ``DeviceMesh`` (named dims); Nones for a pure pipeline, whose pipeline is the world."""
    if p.mesh is None or p.mesh.world == p.mesh.pp:
        return None, None, None, None
    dm = p.mesh.device_mesh("cuda" if p.backend == "nccl" else "cpu")
    dp = p.mesh.dp > 1
    return (dm.get_group("pp"), dm.get_group("dp") if dp else None, dm["dp"] if dp else None,
            dm["tp"] if p.mesh.tp > 1 else None)


def _tied_groups(p: RankPayload) -> dict[str, Any]:
    """Per shared parameter, the process group of this replica's ranks holding a copy (None: one rank holds
    every copy). Every process creates every replica's groups, in one order (torch's ``new_group`` rule)."""
    import torch.distributed as dist

    me = p.mesh.coords(p.rank) if p.mesh is not None else None
    pipelines = [(d, t) for d in range(p.mesh.dp) for t in range(p.mesh.tp)] if p.mesh is not None else [(0, 0)]
    out: dict[str, Any] = {}
    for name, holders in sorted(p.tied.items()):
        for d, t in pipelines:
            ranks = [p.mesh.rank(h, d, t) for h in holders] if p.mesh is not None else list(holders)
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if me is None or (me.dp, me.tp) == (d, t):
                out[name] = group
    return out


def _stages(p: RankPayload, clock: _Clock, step_box: list[int], device: torch.device,
            compute: torch.device, pp_group: Any = None, dp_group: Any = None, tp_mesh: Any = None,
            shard_mesh: Any = None) -> tuple[list[Any], list[torch.nn.Parameter], dict[str, list[torch.Tensor]]]:
    """torch's ``PipelineStage`` around each of this rank's runners (timed; in this replica's pipeline group),
    the parameters to optimize and, per shared parameter, this rank's copies. With replicas, each runner is
    wrapped in torch's ``DistributedDataParallel`` over its data-parallel group: torch's stage then
    accumulates gradients under ``no_sync`` and averages them across replicas in the last backward. Not under
    the schedules that split backwards (zero bubble, DualPipeV): with torch 2.13–2.15, DDP's reducer there
    averages the gradients before the weight-gradient passes have run (replicas silently diverge: 7e-3 after
    two steps) or fails ("Encountered gradient which is undefined, but still allreduced by DDP reducer"), so
    ``_average_replicas`` averages them after the step instead. With ``shard_mesh`` (``dp_shard=True``) each
    runner is sharded across the replicas by FSDP2's ``fully_shard`` instead (torch's stage unshards, reshards and
    reduce-scatters it)."""
    from pipeviz.adapter import timed_stage_class

    Stage = timed_stage_class(lambda stage, kind, mb: clock.span(p.rank, stage, kind, mb, step_box[0]))

    num_stages = len(p.stage_ranks)
    stages = []
    params: list[torch.nn.Parameter] = []
    local: dict[str, list[torch.Tensor]] = {}
    for st in p.stages:
        if st.source is not None:  # weights= or a meta model: this rank's tensors, read or initialised here
            from pipeviz.weights import materialize_stage

            materialize_stage(st.runner.stage, {**st.params, **st.buffers}, st.source, compute)
        retarget = getattr(st.runner.stage, "retarget", None)
        if callable(retarget):  # devices baked in by the trace (the meta device, or the CPU on a GPU run)
            retarget(compute)
        runner = st.runner.to(compute)
        runner.compute_device = compute if compute != device else None
        runner.fresh_outputs = sched.info(p.schedule).split_backward
        # Static shapes, so torch never runs its shape inference (an extra forward/backward in step 1).
        # Activations from another stage need grads; model inputs and integer tensors (masks) do not.
        ins = tuple(_like(t, device, grad=st.index > 0 and t.is_floating_point()) for t in st.inputs)
        outs = tuple(_like(t, device, grad=t.is_floating_point()) for t in st.outputs)
        if tp_mesh is not None:
            from pipeviz.runtime.tensor_parallel import shard_stage

            shard_stage(runner.stage, st.params, p.tp_placements, tp_mesh)
            runner.tp_mesh = tp_mesh
        submod = runner
        if shard_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            submod = fully_shard(runner, mesh=shard_mesh)
        elif dp_group is not None and p.loss_fn is not None and not _averaged_after_step(p):
            from torch.nn.parallel import DistributedDataParallel

            # broadcast_buffers=False: running statistics stay each replica's own (replica 0's are reported);
            # find_unused_parameters: a parameter used only under no_grad gets no gradient in any replica.
            submod = DistributedDataParallel(runner, process_group=dp_group, broadcast_buffers=False,
                                             find_unused_parameters=True)
            submod.register_comm_hook(dp_group, _timed_allreduce(clock, p.rank, st.index, step_box))
        stages.append(Stage(submod, st.index, num_stages, device, input_args=ins, output_args=outs,
                            group=pp_group))
        named = dict(runner.stage.named_parameters(remove_duplicate=False))
        for canon, inner in st.params.items():
            t = named[inner]
            if all(t is not q for q in params):
                params.append(t)
            if canon in p.tied:
                local.setdefault(canon, []).append(t)
    return stages, params, local


def _timed_allreduce(clock: _Clock, rank: int, stage: int, step_box: list[int]) -> Any:
    """DDP's own averaging of one gradient bucket (torch's ``allreduce_hook``: divide by the replicas, then an
    asynchronous all-reduce), timed from its launch inside the backward to its completion: a ``DP`` event per
    bucket, overlapping the backward that produced it on the timeline."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(group: Any, bucket: Any) -> Any:
        start, step = time.time() - clock.t0, step_box[0]

        def done(fut: Any) -> Any:
            clock.record_async((rank, stage, "DP", -1, start, time.time() - clock.t0, step))
            return fut.value()

        return allreduce_hook(group, bucket).then(done)

    # DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation).
    hook.__annotations__ = {"group": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


def _schedule(p: RankPayload, stages: list[Any]) -> Any:
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = torch_schedules.get_schedule_class(p.schedule)
    loss_fn = _named_loss(p.loss_fn, p) if p.loss_fn is not None else None
    if not sched.info(p.schedule).multi:
        return cls(stages[0], n_microbatches=p.microbatches, loss_fn=loss_fn)  # one stage per rank
    return cls(stages, n_microbatches=p.microbatches, loss_fn=loss_fn)


def _named_loss(loss_fn: Any, p: RankPayload) -> Any:
    """``loss_fn``, whose failures say where they happened and on what (the last stage, shapes)."""
    from pipeviz.adapter import describe

    def loss(output: Any, target: Any) -> Any:
        try:
            return loss_fn(output, target)
        except Exception as exc:
            raise StepError(
                f"loss_fn failed on rank {p.rank} (the last stage, {len(p.stage_ranks) - 1}) on its output "
                f"{describe(output)} and target {describe(target)}: {type(exc).__name__}: {exc}. Fix: loss_fn was "
                "checked on an output like this before the launch, so look at what differs in this batch."
            ) from exc

    return loss


def _train(p: RankPayload, schedule: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
           local: dict[str, list[torch.Tensor]], groups: dict[str, Any], clock: _Clock, step_box: list[int],
           device: torch.device, dp_group: Any = None) -> bool:
    """Run the steps; False when a NaN or inf stopped the run (every rank stops at the same step)."""
    import torch.distributed as dist

    first = any(st.index == 0 for st in p.stages)
    last = any(st.index == len(p.stage_ranks) - 1 for st in p.stages)
    # One process reports the loss: replica 0's shard 0 (the other replicas averaged into it, the shards agree).
    reports = p.coords.dp == p.coords.tp == p.coords.cp == 0  # replica 0, shard 0, share 0 speaks for all
    names = {id(t): canon for st in p.stages for canon, inner in st.params.items()
             for n, t in st.runner.stage.named_parameters(remove_duplicate=False) if n == inner}
    for step, (args, kwargs, target) in enumerate(_batches(p, device)):
        step_box[0] = step
        losses: list[torch.Tensor] = []
        call_kwargs: dict[str, Any] = dict(kwargs) if first else {}
        if last:
            call_kwargs.update(target=target, losses=losses)
        schedule.step(*(args if first else ()), **call_kwargs)
        if dp_group is not None and _averaged_after_step(p):
            _average_replicas(params, dp_group, p.mesh.dp, clock, p.rank, step)
        _sync_tied(local, p.tied, groups)
        loss = float(torch.stack([x.detach().float() for x in losses]).mean()) if last else 0.0
        if last and dp_group is not None:  # the global batch's loss: the replicas' mean (shards agree)
            total = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(total, group=dp_group)
            loss = float(total.item()) / p.mesh.dp
        bad = _nonfinite(loss, params, names, p, step)
        flag = torch.tensor([1.0 if bad else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank learns of it and stops at the same step
        if bad:
            clock.post(NonFinite(p.rank, p.coords, step, bad))
        if flag.item() and p.on_nonfinite == "stop":
            clock.flush(force=True)
            return False
        optimizer.step()
        clock.meter.count_static(params, optimizer)  # gradients and optimizer state as they stand at step end
        optimizer.zero_grad(set_to_none=True)
        if last and reports:
            clock.post(Loss(p.rank, p.coords, step, loss))
        clock.post(StepEnd(p.rank, p.coords, step, time.time() - p.t0))
        clock.flush()
    clock.flush(force=True)
    return True


def _batches(p: RankPayload, device: torch.device) -> Any:
    """Each step's (args, kwargs, target) on ``device``: the one batch of the payload ``steps`` times, or the
    batches the launching process streams from ``data=`` (``messages.Batch``) until it sends ``messages.End``
    (ranks that need no data get an empty ``Batch`` each step, so every rank runs the same number of steps)."""
    def moved(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) else x

    if p.data is None:
        args, kwargs, target = tuple(moved(a) for a in p.args), {k: moved(v) for k, v in p.kwargs.items()}, \
            moved(p.target)
        for _ in range(p.steps or 0):
            yield args, kwargs, target
        return
    while True:
        msg = p.data.get(timeout=p.timeout_s)
        if isinstance(msg, End):
            return
        yield tuple(moved(a) for a in msg.args), {k: moved(v) for k, v in msg.kwargs.items()}, moved(msg.target)


def _infer(p: RankPayload, schedule: Any, clock: _Clock, step_box: list[int], device: torch.device) -> bool:
    """Forward-only steps (no loss_fn): the last stage's rank sends the whole batch's output each step."""
    first = any(st.index == 0 for st in p.stages)
    last = any(st.index == len(p.stage_ranks) - 1 for st in p.stages)
    for step, (args, kwargs, _) in enumerate(_batches(p, device)):
        step_box[0] = step
        with torch.no_grad():
            out = schedule.step(*(args if first else ()), **(kwargs if first else {}))
        if last:
            leaves = out if isinstance(out, tuple | list) else (out,)
            buf = io.BytesIO()
            torch.save([t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in leaves], buf)
            if p.coords.tp == 0:  # the shards' outputs are the same full tensors
                clock.post(Output(p.rank, p.coords, step, buf.getvalue()))
        clock.post(StepEnd(p.rank, p.coords, step, time.time() - p.t0))
        clock.flush()
    clock.flush(force=True)
    return True


def _nonfinite(loss: float, params: list[torch.nn.Parameter], names: dict[int, str], p: RankPayload,
               step: int) -> list[str]:
    """What is NaN or inf on this rank after a step's backward: the loss, and each gradient (by name)."""
    import math

    stages = ", ".join(str(s.index) for s in p.stages)
    found = []
    if not math.isfinite(loss):
        found.append(f"the loss is {loss} (step {step}, rank {p.rank}, stage {stages})")
    grads = [_local(t.grad) for t in params if t.grad is not None]
    if grads and not bool(torch.isfinite(torch.stack([g.detach().float().sum() for g in grads])).all()):
        for t in params:
            if t.grad is not None and not bool(torch.isfinite(_local(t.grad)).all()):
                kind = "nan" if bool(torch.isnan(_local(t.grad)).any()) else "inf"
                found.append(f"the gradient of {names.get(id(t), '?')!r} holds {kind} (step {step}, rank {p.rank}, "
                             f"stage {stages})")
    return found


def _state(p: RankPayload, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors this rank's stages own, on the CPU, under the original model's canonical names (copies
    unless ``copy=False``: written to a file at once, they need none)."""
    state: dict[str, torch.Tensor] = {}
    for st in p.stages:
        mod = st.runner.stage
        named = {**dict(mod.named_parameters(remove_duplicate=False)),
                 **dict(mod.named_buffers(remove_duplicate=False))}
        inner = {**st.params, **st.buffers}
        for canon in st.reports:
            value = named[inner[canon]].detach()
            full = getattr(value, "full_tensor", None)
            t = (full() if callable(full) else value).cpu()  # a shard gathers its stage's whole tensor
            state[canon] = t.clone() if copy else t
    return state


def _pin(cpus: tuple[int, ...]) -> None:
    """Keep every thread of this process (compute, gloo's, started after init) on ``cpus``; threads
    started later inherit it from the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


def _like(t: torch.Tensor, device: torch.device, grad: bool) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=device).requires_grad_(grad)


def _averaged_after_step(p: RankPayload) -> bool:
    """Whether replicas average their gradients after the step (``_average_replicas``) rather than by DDP: the
    split-backward schedules, and tensor-parallel stages (DDP does not take DTensor parameters)."""
    return not p.dp_shard and (sched.info(p.schedule).split_backward or (p.mesh is not None and p.mesh.tp > 1))


def _average_replicas(params: list[torch.nn.Parameter], group: Any, replicas: int, clock: _Clock, rank: int,
                      step: int) -> None:
    """Average this rank's gradients across its replicas in one all-reduce (timed as a ``DP`` action): for
    the schedules whose split backward DDP's reducer cannot follow (see ``_stages``)."""
    import torch.distributed as dist

    grads = [_local(t.grad) for t in params if t.grad is not None]
    if not grads:
        return
    with clock.span(rank, -1, "DP", -1, step), torch.no_grad():
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat /= replicas
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(reduced)


def _local(t: Any) -> Any:
    """A DTensor's local shard (a tensor-parallel gradient), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _sync_tied(local: dict[str, list[torch.Tensor]], tied: dict[str, list[int]], groups: dict[str, Any]) -> None:
    """Sum the gradients of every copy of a shared parameter (on this rank, then across the ranks holding
    one), then give each copy the sum (as DeepSpeed does for tied weights): copies stay identical and take
    one update, like the unsplit model's one tensor."""
    import torch.distributed as dist

    for canon in sorted(tied):
        copies = local.get(canon, [])
        if not copies:
            continue
        for c in copies:
            if c.grad is None:
                c.grad = torch.zeros_like(c)
        grads = [_local(c.grad) for c in copies]  # a tensor-parallel copy's local part (tied: replicated)
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if groups.get(canon) is not None:
            dist.all_reduce(total, group=groups[canon])
        with torch.no_grad():
            for g in grads:
                g.copy_(total)


class _Clock:
    """Timestamps on one clock across ranks (wall time minus the run's start), and the rank's outbox.

    On a GPU, spans are timed with CUDA events, so they mark when the work ran, not when it was queued;
    they are read at step end. Events and posted messages leave together, at most every ``SEND_INTERVAL``.
    """

    def __init__(self, t0: float, cuda: torch.device | None) -> None:
        self.t0, self.cuda = t0, cuda
        self.pending: list[tuple[Any, ...]] = []
        self.buffer: list[tuple[Any, ...]] = []
        self.outbox: list[Message] = []
        self.finished: collections.deque[tuple[Any, ...]] = collections.deque()  # from other threads
        self.meter = MemoryMeter(cuda)
        self.stage = -1  # the stage of the action running now (what a tensor-parallel collective belongs to)
        self.memory: list[tuple[float, int, int]] = []  # (time, total bytes, saved-activation bytes)
        self.sent_at = 0.0
        self.queue: Any = None
        self.rank, self.coords = -1, Coords(-1)  # the sender named in every message
        self.anchor: tuple[float, Any] | None = None

    def span(self, rank: int, stage: int, kind: str, mb: int, step: int) -> _Span:
        return _Span(self, (rank, stage, kind, mb, step))

    def record(self, event: tuple[Any, ...]) -> None:
        """A host-timed event (communication waits), sent with the others."""
        self.buffer.append(event)
        if event[5] - self.sent_at > SEND_INTERVAL:
            self.send()

    def sample(self) -> None:
        """A memory sample now (``pipeviz.runtime.memory``): taken as each action starts and ends."""
        activations, total = self.meter.sample()
        self.memory.append((time.time() - self.t0, total, activations))

    def record_async(self, event: tuple[Any, ...]) -> None:
        """An event timed on another thread (a communication future's callback): queued, and moved into the
        next batch by the rank's own thread, which alone touches ``buffer``."""
        self.finished.append(event)

    def post(self, msg: Message) -> None:
        """A message (loss, step end) to send with the next batch of events."""
        self.outbox.append(msg)

    def send(self) -> None:
        while self.finished:
            self.buffer.append(self.finished.popleft())
        if self.buffer:
            self.queue.put(Events(self.rank, self.coords, [Event(*e) for e in self.buffer]))
            self.buffer = []
        if self.memory:
            self.queue.put(Memory(self.rank, self.coords, self.memory))
            self.memory = []
        for msg in self.outbox:
            self.queue.put(msg)
        self.outbox.clear()
        self.sent_at = time.time() - self.t0

    def flush(self, force: bool = False) -> None:
        """At step end: read GPU timings, and send if the last send is ``SEND_INTERVAL`` old (or ``force``)."""
        if self.cuda is not None and self.pending:
            self._read_gpu_events()
        if force or time.time() - self.t0 - self.sent_at > SEND_INTERVAL:
            self.send()

    def _read_gpu_events(self) -> None:
        torch.cuda.synchronize(self.cuda)
        host, ev0 = self.anchor  # type: ignore[misc]
        for (rank, stage, kind, mb, step), a, b in self.pending:
            start = host + ev0.elapsed_time(a) / 1e3
            self.buffer.append((rank, stage, kind, mb, start, host + ev0.elapsed_time(b) / 1e3, step))
        self.pending.clear()
        self.anchor = None


class _Span:
    def __init__(self, clock: _Clock, key: tuple[Any, ...]) -> None:
        self.clock, self.key = clock, key

    def __enter__(self) -> None:
        c = self.clock
        c.stage = self.key[1]
        c.sample()
        if c.cuda is not None:
            if c.anchor is None:
                torch.cuda.synchronize(c.cuda)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                c.anchor = (time.time() - c.t0, ev)
            self.a = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.start = time.time() - c.t0

    def __exit__(self, *exc: Any) -> None:
        c = self.clock
        if c.cuda is not None:
            b = torch.cuda.Event(enable_timing=True)
            b.record()
            c.pending.append((self.key, self.a, b))
            c.sample()
        else:
            rank, stage, kind, mb, step = self.key
            now = time.time() - c.t0
            c.buffer.append((rank, stage, kind, mb, self.start, now, step))
            c.sample()
            if now - c.sent_at > SEND_INTERVAL:  # batched: live, without a queue put per action
                c.send()
