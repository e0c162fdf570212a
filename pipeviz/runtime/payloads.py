"""What each rank of a launch receives, and how: its payload (its stages, its share of the batch, the layout), the
model's values mapped from one file (``pipeviz.runtime.ship``), and torch's Pipe traced once per plan and input shape.
Shared by ``pv.launch`` (``rank_payloads``) and ``pv.export_torchrun`` (``spec_stages``, ``rank_payload``).

Example:
    >>> blobs, shipment, draws = rank_payloads(plan, spec, ["cpu"] * 2, [None] * 2, "gloo", port, t0, 120.0, 1, None)
    >>> payload = ship.load_payload(blobs[0])      # in rank 0: its stages, their tensors mapped from the file
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from pipeviz.capture.export import TRACE_LOCK, batch_size_of
from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.batches import share
from pipeviz.runtime.ship import Shipment
from pipeviz.runtime.spec import LaunchSpec
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import dp_reduce_mode
from pipeviz.schedule.mesh import Coords
from pipeviz.schedule.recompute import recompute_modes

if TYPE_CHECKING:
    from pipeviz.capture.weights import StageSource
    from pipeviz.runtime.ship import Shipped
    from pipeviz.runtime.stages import StageSet

__all__ = ["PAYLOAD_WAIT", "SHIP_VALUES", "Boot", "RankPayload", "launch_stages", "rank_boots", "rank_payload",
           "rank_payloads", "shape_stages", "spec_stages", "stage_sources"]


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
    # pipeviz.schedule.mesh.Mesh with replicas or shards (dp or tp > 1); None: one pipeline, rank = pp rank
    mesh: Any = None
    tp_placements: dict[str, str] = field(default_factory=dict)  # tp > 1: canonical name -> "shard0"/"shard1"
    dp_shard: bool = False  # replicas shard each stage with FSDP2 (fully_shard over the dp mesh dim)
    sequence_parallel: bool = False  # tp > 1: activations between the sharded regions split by token
    clip_grad_norm: float | None = None  # clip by the global norm of every stage's, replica's, shard's gradients
    loss_reduction: str = "mean"  # pipeviz.schedule.training.LOSS_REDUCTIONS
    accumulate: int = 1  # batches per optimizer step (gradient accumulation)
    lr_scheduler: Any = None  # optimizer -> LRScheduler, stepped after each optimizer step
    eval_batches: list[Any] = field(default_factory=list)  # eval_data=: this process's share of each held-out batch
    eval_every: int | None = None  # steps between evaluations (None: after the last step only)
    resume: Any = None  # runtime.checkpoint.Resume: the checkpoint this run continues (its optimizer's state)
    compile: str | None = None  # torch.compile's backend for every stage (None: eager)
    recompute: tuple[str, ...] = ()  # per stage: "none", "selective" or "full" (pipeviz.schedule.recompute)
    dp_reduce: str = "overlap"  # how replicas average gradients (runtime.config.dp_reduce_mode)
    loss_scaling: bool = False  # fp16: a dynamic loss scale across every process (pipeviz.runtime.loss_scale)
    order: tuple[tuple[sched.Action, ...], ...] | None = None  # a custom order: every pipeline rank's actions
    seed: int = 0  # random draws (dropout): each stage forward seeds from it (pipeviz.runtime.rng.stage_seed)
    seq: int = 0  # context parallelism: the whole sequence's length (each share holds seq / cp tokens of it)
    ep_overlap: bool = False  # DualPipeV's F/B pairs run at once (pipeviz.adapter.overlap_fb)
    ep_delay: float = 0.0  # seconds each expert all-to-all waits after its exchange (a slowed link)

    @property
    def split_backward(self) -> bool:
        """Whether backwards run as separate input-grad and weight-grad passes (``I`` and ``W`` actions)."""
        if self.order is not None:
            return any(a.kind in (sched.Kind.I, sched.Kind.W) for acts in self.order for a in acts)
        return sched.info(self.schedule).split_backward

    @property
    def replicas(self) -> int:
        """The processes a stage's gradients are averaged over: its ``dp`` replicas × ``cp`` shares of every
        sequence (each share's loss is the mean over its tokens; their average is the whole sequence's)."""
        return self.mesh.dp * self.mesh.cp if self.mesh is not None else 1

    @property
    def coords(self) -> Coords:
        """This process's place in the mesh (pipeline rank, replica, shard)."""
        return self.mesh.coords(self.rank) if self.mesh is not None else Coords(self.rank)


def rank_payloads(plan: SplitPlan, spec: LaunchSpec, devices: list[str], compute: list[str | None], backend: str,
                  port: int, t0: float, timeout: float, threads: int,
                  cpus: list[tuple[int, ...]] | None, state_dir: str | None = None,
                  values_prefix: str = "pipeviz-values-") -> tuple[list[bytes], Shipment, list[int]]:
    """Each rank's share of the run, pickled, the ``Shipment`` of the model's tensor values, and each stage's random
    ops per forward (``pipeviz.runtime.rng``: what the run's reference must seed alike).

    The stages' structure is built once per plan and input shapes (``launch_stages``, cached); the values are the
    model's tensors at this moment, written once into a file the ranks map (``pipeviz.runtime.ship``). With
    ``spec.sources`` (weights= or a meta model) the tensors the ranks load or initialise themselves are not shipped.
    Each rank writes its trained tensors to ``state_dir``. The caller removes ``shipment.path`` when the run ends."""
    from pipeviz.runtime import ship

    if not SHIP_VALUES:  # as before 2026-12-02: traced at every launch, every value pickled into its rank's payload
        stages, tied = spec_stages(plan, spec)
        shipped: dict[int, tuple[torch.Tensor, Shipped]] = {}
        values: dict[str, torch.Tensor] = {}
    else:
        stages, tied = launch_stages(plan, spec)
    sources = stage_sources(plan, stages, spec) if spec.sources is not None else None
    if SHIP_VALUES:
        shipped, values = _shipped(plan, stages, sources)
    try:
        shipment = ship.write_values(values, values_prefix)
    except ship.ValuesSpaceError as exc:
        raise LaunchError(str(exc)) from exc
    try:
        blobs = []
        for rank in range(spec.mesh.world):
            payload = rank_payload(
                spec, stages, tied, rank, sources=sources, port=port, backend=backend, device=devices[rank],
                compute=compute[rank], t0=t0, parent_pid=os.getpid(), timeout=max(timeout, 30.0), threads=threads,
                cpus=cpus[rank] if cpus else None,
                state_path=os.path.join(state_dir, f"rank{rank}.pt") if state_dir else None)
            # the small values inline, each rank its own stages' only
            mine = {canon for st in payload.stages for canon, _, t in _stage_tensors(stages, st.index)
                    if id(t) in shipped}
            blobs.append(ship.dump_payload(payload, shipped, ship.Shipment(
                shipment.path, shipment.slots, {k: v for k, v in shipment.inline.items() if k in mine})))
    except BaseException:
        if shipment.path:
            os.unlink(shipment.path)
        raise
    return blobs, shipment, list(stages.draws)


def rank_boots(spec: LaunchSpec, devices: list[str], compute: list[str | None], backend: str, port: int, t0: float,
               timeout: float, threads: int, cpus: list[tuple[int, ...]] | None) -> list[Boot]:
    """Each rank's ``worker.Boot``: what it needs to join the process group before its payload is written."""
    mesh = spec.mesh
    return [Boot(rank=rank, world=mesh.world, port=port, backend=backend, device=devices[rank],
                 compute_device=compute[rank], t0=t0, parent_pid=os.getpid(), timeout_s=max(timeout, 30.0),
                 threads=threads, cpus=cpus[rank] if cpus else None, mesh=mesh if mesh.world > mesh.pp else None)
            for rank in range(mesh.world)]


def spec_stages(plan: SplitPlan, spec: LaunchSpec) -> tuple[StageSet, dict[str, list[int]]]:
    """The launch's stages (``pipeviz.runtime.stages.build_stages``), traced with one replica's microbatch, and
    the pipeline ranks holding each shared parameter. Built anew, holding the model's values (what an exported run
    pickles); ``launch_stages`` is the cached structure ``pv.launch`` ships values into."""
    from pipeviz.runtime.stages import build_stages, tied_ranks

    args0, kwargs0 = _replica_inputs(spec)
    with TRACE_LOCK:  # torch.export keeps global tracing state: two runs starting at once trace in turn
        stages = build_stages(_with_inputs(plan, args0, kwargs0), spec.microbatches,
                              whole_output=spec.loss_fn is None, autocast=autocast_dtype(spec), cp=spec.cp)
    return stages, tied_ranks(stages, spec.layout.stage_ranks)


def autocast_dtype(spec: LaunchSpec) -> torch.dtype | None:
    """The dtype the stages compute in under ``mixed_precision`` (None: as traced)."""
    from pipeviz.runtime.spec import MIXED_PRECISION

    mp = spec.config.mixed_precision
    return MIXED_PRECISION[mp] if mp is not None else None


def _replica_inputs(spec: LaunchSpec) -> tuple[tuple[object, ...], dict[str, object]]:
    # Traced with one replica's share of the batch: its microbatches have the shape every stage will see.
    batch = batch_size_of(spec.args, spec.kwargs) or 1
    return share((spec.args, spec.kwargs), 0, spec.dp, batch)


# False: the stages are traced at every launch and pickled with their values into each rank's payload, as pv.launch
# did before 2026-12-02 (benchmarks/speed/launch_latency.py sets it to measure both side by side).
SHIP_VALUES = True
_STAGE_CACHE: collections.OrderedDict[tuple[Any, ...], tuple[Any, Any]] = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 8  # structures only (the model's tensors are meta in them): small


def launch_stages(plan: SplitPlan, spec: LaunchSpec) -> tuple[StageSet, dict[str, list[int]]]:
    """``spec_stages`` with the model's parameters and buffers on the meta device (their values are shipped from
    the model at each launch), cached per traced plan, microbatch shapes and output mode: torch's ``pipeline()``
    traces the model (2-3 s for GPT-2 small), and a second launch of the same plan needs none of it."""
    import weakref

    from pipeviz.runtime.stages import tied_ranks

    cap = plan.graph.capture
    key: tuple[Any, ...] | None = None
    if cap.traced:
        args0, kwargs0 = _replica_inputs(spec)
        key = (id(cap), plan.splits, tuple(plan.graph.layer_names), spec.microbatches, spec.loss_fn is None,
               shape_signature((args0, kwargs0)), autocast_dtype(spec), spec.cp)
        with _CACHE_LOCK:
            hit = _STAGE_CACHE.get(key)
            if hit is not None and hit[0]() is cap:
                _STAGE_CACHE.move_to_end(key)
                return hit[1], tied_ranks(hit[1], spec.layout.stage_ranks)
    stages, tied = spec_stages(plan, spec)
    _to_meta(stages)
    if key is not None:
        with _CACHE_LOCK:
            _STAGE_CACHE[key] = (weakref.ref(cap), stages)
            while len(_STAGE_CACHE) > _CACHE_SIZE:
                _STAGE_CACHE.popitem(last=False)
    return stages, tied


def shape_stages(plan: SplitPlan, spec: LaunchSpec, args: tuple[object, ...], kwargs: dict[str, object],
                 ) -> list[bytes]:
    """Every process's stages traced for a ``data=`` batch of another shape (``launch_stages`` with that batch, so
    cached per shape), pickled: the structure only, their tensors on the meta device; each process binds them to
    the parameters and buffers it already trains (``pipeviz.runtime.shapes.rebind``).

    Raises:
        LaunchError: a layout whose stages are wrapped per process (tensor parallelism, FSDP2, DDP), which a batch
            of another shape cannot join.
    """
    import dataclasses
    import pickle

    from pipeviz.runtime.stages import rank_stages

    mode = dp_reduce_mode(spec.config)
    why = ("tp > 1 (each stage's shards are placed once)" if spec.tp > 1 else
           "dp_shard=True (FSDP2 shards each stage once)" if spec.dp_shard else
           "dp_reduce='ddp' (DDP wraps each stage once)" if spec.dp > 1 and mode == "ddp" and spec.training
           else None)
    if why is not None:
        raise LaunchError(f"data= gave a batch of another shape ({payload_shapes(args, kwargs)}; the run started with "
                          f"{payload_shapes(spec.args, spec.kwargs)}), which a run with {why} cannot take. "
                          "Fix: pad every "
                          "batch to one shape, or a layout without it (batches of several shapes run with pp and dp).")
    other = dataclasses.replace(spec, args=tuple(args), kwargs=dict(kwargs), sources=None)
    stages, _ = launch_stages(plan, other)
    lay = spec.layout
    return [pickle.dumps(rank_stages(stages, lay.stage_ranks, spec.mesh.coords(rank).pp, None))
            for rank in range(spec.mesh.world)]


def payload_shapes(args: object, kwargs: object) -> str:
    return ", ".join(str(tuple(t.shape)) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))


def shape_signature(tree: object) -> tuple[str, tuple[object, ...]]:
    """What a traced Pipe depends on in its example inputs: their structure, and each tensor's shape, dtype and
    device (other values as they are)."""
    leaves, treespec = pytree.tree_flatten(tree)
    return (str(treespec), tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else repr(t)
                                 for t in leaves))


def _stage_tensors(stages: StageSet, s: int) -> list[tuple[str, bool, torch.Tensor]]:
    """Stage ``s``'s model tensors: (canonical name, is a parameter, the tensor), each object once."""
    mod = stages.runners[s].stage
    named = {**dict(mod.named_parameters(remove_duplicate=False)), **dict(mod.named_buffers(remove_duplicate=False))}
    out = [(c, True, named[i]) for c, i in stages.params[s].items()]
    return out + [(c, False, named[i]) for c, i in stages.buffers[s].items()]


def _to_meta(stages: StageSet) -> None:
    """Replace the stages' model tensors by meta tensors of the same shape, dtype and kind, keeping which names
    share one object (a tensor used twice in a stage stays one)."""
    ids = {id(t) for s in range(len(stages.runners)) for _, _, t in _stage_tensors(stages, s)}
    memo: dict[int, torch.Tensor] = {}
    for runner in stages.runners:
        for m in runner.stage.modules():
            for table in (m._parameters, m._buffers):
                for k, t in table.items():
                    if t is None or id(t) not in ids:
                        continue
                    if id(t) not in memo:
                        empty = torch.empty_like(t, device="meta")
                        memo[id(t)] = (torch.nn.Parameter(empty, requires_grad=t.requires_grad)
                                       if isinstance(t, torch.nn.Parameter) else empty)
                    table[k] = memo[id(t)]  # type: ignore[assignment]


def _shipped(plan: SplitPlan, stages: StageSet, sources: Sequence[StageSource] | None,
             ) -> tuple[dict[int, tuple[torch.Tensor, Shipped]], dict[str, torch.Tensor]]:
    """The stage tensors to ship (``id -> (tensor, Shipped)``) and their values, the model's tensors now by
    canonical name; the ones a rank loads or initialises itself (``sources``) stay as they are.

    Raises:
        LaunchError: the model no longer has a tensor of the traced shape and dtype (it changed after ``pv.trace``).
    """
    from pipeviz.capture.weights import lookup_tensor
    from pipeviz.runtime.ship import Shipped

    model = plan.graph.capture.model
    shipped: dict[int, tuple[torch.Tensor, Shipped]] = {}
    values: dict[str, torch.Tensor] = {}
    for s in range(len(stages.runners)):
        own = {*sources[s].load, *(c for u in sources[s].init for c in u.names.values())} if sources else set()
        for canon, is_param, t in _stage_tensors(stages, s):
            if canon in own or id(t) in shipped:
                continue
            try:
                value = lookup_tensor(model, canon).detach()
            except (KeyError, AttributeError):
                value = None
            if value is None or value.is_meta or value.shape != t.shape or value.dtype != t.dtype:
                now = "gone" if value is None else f"{tuple(value.shape)} {value.dtype}" + (
                    " on the meta device" if value.is_meta else "")
                raise LaunchError(
                    f"the model's {canon!r} is {now}, but the traced plan has {tuple(t.shape)} {t.dtype}: the model "
                    "changed after pv.trace. Fix: trace it again (pv.trace) and split the new graph.")
            values[canon] = value
            shipped[id(t)] = (t, Shipped(canon, len(shipped), is_param, t.requires_grad))
    return shipped, values


def rank_payload(spec: LaunchSpec, stages: StageSet, tied: dict[str, list[int]], rank: int, *,
                 sources: Sequence[StageSource] | None = None,
                 port: int = 0, backend: str = "gloo", device: str = "cpu", compute: str | None = None,
                 t0: float = -1.0, parent_pid: int = 0, timeout: float = 120.0, threads: int = 1,
                 cpus: tuple[int, ...] | None = None, init_method: str | None = None,
                 state_path: str | None = None) -> RankPayload:
    """Process ``rank``'s share of a launch (a ``worker.RankPayload``), the one builder ``pv.launch`` and an
    exported script's ranks use: its coordinates' stages, its replica's share of the batch (the inputs on the
    first pipeline rank, the target on the last), and the layout."""
    from pipeviz.runtime.batches import sequence_length
    from pipeviz.runtime.stages import rank_stages
    lay, mesh = spec.layout, spec.mesh
    c = mesh.coords(rank)
    pp, replica = c.pp, c.dp
    batch = batch_size_of(spec.args, spec.kwargs) or 1
    args, kwargs, target = _tokens(share((spec.args, spec.kwargs, spec.target), replica, mesh.dp, batch), c.cp, mesh.cp)
    first, last = lay.stage_ranks[0], lay.stage_ranks[-1]
    held_out = []  # each held-out batch: this replica's share, the inputs on the first stage, the target on the last
    for b in spec.eval_batches:
        a, k, t = _tokens(share(b, replica, mesh.dp, batch_size_of(b[0], b[1]) or 1), c.cp, mesh.cp)
        held_out.append((a if pp == first else (), k if pp == first else {}, t if pp == last else None))
    return RankPayload(
        rank=rank, world=mesh.world, port=port, backend=backend, device=device, compute_device=compute,
        schedule=spec.schedule, stage_ranks=lay.stage_ranks, microbatches=spec.microbatches, steps=spec.steps,
        stages=rank_stages(stages, lay.stage_ranks, pp, sources),
        tied=tied, loss_fn=spec.loss_fn, optimizer=spec.optimizer,
        args=args if pp == first else (), kwargs=kwargs if pp == first else {},
        target=target if pp == last else None, t0=t0, parent_pid=parent_pid, timeout_s=timeout, threads=threads,
        cpus=cpus, init_method=init_method, on_nonfinite=spec.config.on_nonfinite, state_path=state_path,
        mesh=mesh if mesh.world > mesh.pp else None, tp_placements=spec.tp_placements, dp_shard=spec.dp_shard,
        sequence_parallel=spec.config.sequence_parallel and mesh.tp > 1,
        clip_grad_norm=None if spec.config.clip_grad_norm is None else float(spec.config.clip_grad_norm),
        loss_reduction=spec.config.loss_reduction, accumulate=spec.config.accumulate,
        lr_scheduler=spec.config.lr_scheduler, eval_batches=held_out, eval_every=spec.config.eval_every,
        resume=spec.resume,
        compile=None if spec.config.compile is False else "inductor" if spec.config.compile is True
        else str(spec.config.compile),
        recompute=recompute_modes(spec.config.recompute, len(lay.stage_ranks)),
        dp_reduce=dp_reduce_mode(spec.config),
        loss_scaling=autocast_dtype(spec) is torch.float16 and spec.loss_fn is not None,
        order=None if (acts := spec.config.actions()) is None else tuple(tuple(r) for r in acts),
        seed=spec.init_seed, seq=(sequence_length(spec.args, spec.kwargs) or 0) if mesh.cp > 1 else 0,
        ep_overlap=spec.config.ep_overlap and mesh.ep > 1, ep_delay=float(spec.config.ep_delay),
    )


def _tokens(batch: tuple[Any, Any, Any], share: int, shares: int) -> tuple[Any, Any, Any]:
    """Context parallelism: a batch's tokens this share holds (``batches.seq_share``), the target's too."""
    if shares == 1:
        return batch
    from pipeviz.runtime.batches import seq_share, sequence_length

    seq = sequence_length(batch[0], batch[1])
    assert seq is not None  # (launch checks: a sequence dim 2·cp divides)
    a, k, t = seq_share(batch, share, shares, seq)
    return a, k, t


def stage_sources(plan: SplitPlan, stages: StageSet, spec: LaunchSpec) -> list[StageSource]:
    """Per stage, a ``StageSource`` (what its rank loads or initialises), with those tensors stripped to meta
    in the stage that is shipped."""
    from pipeviz.capture.weights import StageSource, init_units, strip

    assert spec.sources is not None
    cap = plan.graph.capture
    out = []
    for s, runner in enumerate(stages.runners):
        inner = {**stages.params[s], **stages.buffers[s]}
        src = {c: spec.sources.get(c, "keep") for c in inner}
        load = {c: v for c, v in src.items() if isinstance(v, tuple)}
        init = [c for c, v in src.items() if v == "init"]
        strip(runner.stage, [inner[c] for c in [*load, *init]])
        out.append(StageSource(load, init_units(cap.model, init, cap.aliases), spec.init_seed))
    return out


def _with_inputs(plan: SplitPlan, args: tuple[object, ...], kwargs: dict[str, object]) -> SplitPlan:
    """The same plan over a capture whose example inputs are the launch's batch (shapes are baked into the
    traced Pipe, so it is traced with a microbatch of what will really run)."""
    import copy

    cap = copy.copy(plan.graph.capture)
    cap.example_args, cap.example_kwargs = args, kwargs
    cap.batch_size = batch_size_of(args, kwargs)
    from pipeviz.graph.model import ModelGraph

    graph = ModelGraph(cap, plan.graph.layer_names, tree=getattr(plan.graph, "_tree", None))
    return SplitPlan(graph, plan.splits)
