"""The process that runs one rank: its stages, torch's schedule, the fixes torch lacks, and events.

Started by ``pipeviz.runtime.run`` through ``torch.multiprocessing`` (spawn). Everything it needs
arrives as one cloudpickled ``RankPayload`` (so models, losses and optimizer factories defined in a
notebook's ``__main__`` work), and everything it reports goes to the parent over one queue:

    ("events", [(rank, stage, kind, mb, start, end, step), ...])   ("loss", step, value)
    ("step", rank, step, time)   ("state", rank, bytes)   ("done", rank)   ("error", rank, traceback)

Events, losses and step ends are sent together at most every ``SEND_INTERVAL`` seconds: each message wakes
the parent (a notebook kernel), which then takes a core from the ranks. Measured on 2 cores, 60 steps of
47 ms: sending at every step end kept the parent busy 2-3 % of a core with about 350 wake-ups; batching
brought that to 1.3-1.8 % and 150-220.

This module must stay importable without any view library.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from pipeviz.schedules import ZERO_BUBBLE

SEND_INTERVAL = 0.1  # seconds: live enough to watch, rare enough not to disturb the ranks


@dataclass
class RankPayload:
    rank: int
    world: int
    port: int
    backend: str
    device: str  # where torch's PipelineStage lives (and communicates)
    compute_device: str | None  # set when the stage computes elsewhere (a shared GPU, over host memory)
    schedule: str
    stage_ranks: tuple[int, ...]  # rank of every stage
    microbatches: int
    steps: int
    plan: Any  # SplitPlan whose example inputs are the launch's batch
    loss_fn: Any
    optimizer: Any
    target: Any  # only for the rank holding the last stage
    t0: float
    parent_pid: int
    timeout_s: float
    threads: int = 1
    cpus: tuple[int, ...] | None = None  # cores of this rank's threads (pv.launch on CPU; see run._cpu_sets)
    init_method: str | None = None  # default: tcp://127.0.0.1:port; "env://" under torchrun


def _watch_parent(parent_pid: int) -> None:
    # No orphans: a killed kernel cannot reap us, so leave as soon as the parent is gone.
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def main(payload_path: str, queue: Any) -> None:
    """Process entry point (spawned by ``launch``); reads its payload from ``payload_path`` and deletes it."""
    import warnings

    import cloudpickle

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own pytree deprecation noise
    rank = -1
    try:
        with open(payload_path, "rb") as f:
            payload: RankPayload = cloudpickle.loads(f.read())
        os.unlink(payload_path)
        rank = payload.rank
        threading.Thread(target=_watch_parent, args=(payload.parent_pid,), daemon=True).start()
        _run(payload, queue)
        queue.put(("done", rank))
    except BaseException:  # report everything, including SystemExit from user code
        queue.put(("error", rank, traceback.format_exc()))
        queue.close()
        queue.join_thread()
        sys.exit(1)
    queue.close()
    queue.join_thread()


def _run(p: RankPayload, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from pipeviz._malloc import keep_heap

    keep_heap()
    torch.set_num_threads(max(1, p.threads))
    dist.init_process_group(
        p.backend, init_method=p.init_method or f"tcp://127.0.0.1:{p.port}", rank=p.rank, world_size=p.world,
        timeout=timedelta(seconds=p.timeout_s),
    )
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
    clock.queue = queue
    step_box = [0]

    class Stage(PipelineStage):
        """torch's PipelineStage, timing every forward, backward, input-grad and weight-grad action."""

        def forward_one_chunk(self, fwd_chunk_id: int, *a: Any, **k: Any) -> Any:
            with clock.span(p.rank, self.stage_index, "F", fwd_chunk_id, step_box[0]):
                return super().forward_one_chunk(fwd_chunk_id, *a, **k)

        def backward_one_chunk(self, bwd_chunk_id: int, *a: Any, full_backward: bool = True, **k: Any) -> Any:
            with clock.span(p.rank, self.stage_index, "B" if full_backward else "I", bwd_chunk_id, step_box[0]):
                return super().backward_one_chunk(bwd_chunk_id, *a, full_backward=full_backward, **k)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *a: Any, **k: Any) -> Any:
            with clock.span(p.rank, self.stage_index, "W", bwd_chunk_id, step_box[0]):
                return super().backward_weight_one_chunk(bwd_chunk_id, *a, **k)

    # Time spent blocked on communication, as torch's schedules wait for batched sends/receives.
    original_wait = torch_schedules._wait_batch_p2p

    def timed_wait(work: Any) -> Any:
        if not work:  # torch waits on empty lists too: nothing to time
            return original_wait(work)
        start = time.time()
        out = original_wait(work)
        end = time.time()
        if end - start > 1e-4:  # only waits that block: keeps the event stream (and its cost) small
            clock.record((p.rank, -1, "COMM", -1, start - clock.t0, end - clock.t0, step_box[0]))
        return out

    torch_schedules._wait_batch_p2p = timed_wait

    # Every rank builds the stages from the same plan: torch's stage graphs cannot be pickled (their
    # unflattened submodules hold fx graphs), and building here gives each rank its own parameters.
    from pipeviz.runtime.stages import build_stages

    built = build_stages(p.plan, p.microbatches)
    num_stages = len(built.runners)
    mine = [s for s, r in enumerate(p.stage_ranks) if r == p.rank]
    tied = {name: sorted({p.stage_ranks[s] for s in ss}) for name, ss in built.tied.items()}
    stages = []
    params: list[torch.nn.Parameter] = []
    local: dict[str, list[torch.Tensor]] = {}  # canonical tied name -> local copies
    for s in mine:
        runner = built.runners[s].to(compute)
        runner.compute_device = compute if compute != device else None
        runner.fresh_outputs = p.schedule in ZERO_BUBBLE
        # Static shapes, so torch never runs its shape inference (an extra forward/backward in step 1).
        # Activations from another stage need grads; model inputs and integer tensors (masks) do not.
        ins = tuple(_like(t, device, grad=s > 0 and t.is_floating_point()) for t in built.inputs[s])
        outs = tuple(_like(t, device, grad=t.is_floating_point()) for t in built.outputs[s])
        stages.append(Stage(runner, s, num_stages, device, input_args=ins, output_args=outs))
        named = dict(runner.stage.named_parameters(remove_duplicate=False))
        for canon, inner in built.params[s].items():
            t = named[inner]
            if all(t is not q for q in params):
                params.append(t)
            if canon in tied:
                local.setdefault(canon, []).append(t)
    groups = {}
    for canon in sorted(tied):  # every rank creates the same groups in the same order
        ranks = tied[canon]
        groups[canon] = dist.new_group(ranks) if len(ranks) > 1 else None

    cls = torch_schedules.get_schedule_class(p.schedule)
    if p.schedule in ("GPipe", "1F1B"):
        schedule = cls(stages[0], n_microbatches=p.microbatches, loss_fn=p.loss_fn)  # one stage per rank
    else:
        schedule = cls(stages, n_microbatches=p.microbatches, loss_fn=p.loss_fn)
    optimizer = p.optimizer(params)
    first, last = 0 in mine, num_stages - 1 in mine
    graph = p.plan.graph
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in graph.example_args)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in graph.example_kwargs.items()}
    target = p.target.to(device) if isinstance(p.target, torch.Tensor) else p.target

    for step in range(p.steps):
        step_box[0] = step
        losses: list[torch.Tensor] = []
        call_kwargs: dict[str, Any] = dict(kwargs) if first else {}
        if last:
            call_kwargs.update(target=target, losses=losses)
        schedule.step(*(args if first else ()), **call_kwargs)
        _sync_tied(local, tied, groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if last:
            clock.post(("loss", step, float(torch.stack([x.detach().float() for x in losses]).mean())))
        clock.post(("step", p.rank, step, time.time() - p.t0))
        clock.flush(force=step == p.steps - 1)

    state: dict[str, torch.Tensor] = {}
    for s in mine:
        stage_mod = built.runners[s].stage
        named = {**dict(stage_mod.named_parameters(remove_duplicate=False)),
                 **dict(stage_mod.named_buffers(remove_duplicate=False))}
        for canon, inner in {**built.params[s], **built.buffers[s]}.items():
            if built.owner.get(canon) == s and canon not in state:
                state[canon] = named[inner].detach().cpu().clone()
    buf = io.BytesIO()
    torch.save(state, buf)
    queue.put(("state", p.rank, buf.getvalue()))
    dist.barrier()
    dist.destroy_process_group()


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


def _sync_tied(local: dict[str, list[torch.Tensor]], tied: dict[str, list[int]], groups: dict[str, Any]) -> None:
    """Sum the gradients of every copy of a tied parameter, then give each copy the sum (as DeepSpeed
    does), so tied copies stay identical and match the unsplit model."""
    import torch.distributed as dist

    for canon in sorted(tied):
        copies = local.get(canon, [])
        if not copies:
            continue
        grads = [c.grad if c.grad is not None else torch.zeros_like(c) for c in copies]
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if groups.get(canon) is not None:
            dist.all_reduce(total, group=groups[canon])
        for c in copies:
            c.grad = total.clone()


class _Clock:
    """Timestamps on one clock across ranks (wall time minus the run's start), and the rank's outbox.

    On a GPU, spans are timed with CUDA events, so they mark when the work ran, not when it was queued;
    they are read at step end. Events and posted messages leave together, at most every ``SEND_INTERVAL``.
    """

    def __init__(self, t0: float, cuda: torch.device | None) -> None:
        self.t0, self.cuda = t0, cuda
        self.pending: list[tuple[Any, ...]] = []
        self.buffer: list[tuple[Any, ...]] = []
        self.outbox: list[tuple[Any, ...]] = []
        self.sent_at = 0.0
        self.queue: Any = None
        self.anchor: tuple[float, Any] | None = None

    def span(self, rank: int, stage: int, kind: str, mb: int, step: int) -> _Span:
        return _Span(self, (rank, stage, kind, mb, step))

    def record(self, event: tuple[Any, ...]) -> None:
        """A host-timed event (communication waits), sent with the others."""
        self.buffer.append(event)
        if event[5] - self.sent_at > SEND_INTERVAL:
            self.send()

    def post(self, msg: tuple[Any, ...]) -> None:
        """A message (loss, step end) to send with the next batch of events."""
        self.outbox.append(msg)

    def send(self) -> None:
        if self.buffer:
            self.queue.put(("events", self.buffer))
            self.buffer = []
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
        else:
            rank, stage, kind, mb, step = self.key
            now = time.time() - c.t0
            c.buffer.append((rank, stage, kind, mb, self.start, now, step))
            if now - c.sent_at > SEND_INTERVAL:  # batched: live, without a queue put per action
                c.send()
