"""Where the collectives of a simulated step go: ``Collectives`` (how a framework reduces the replicas' gradients,
overlaps tensor-parallel collectives, scatters hand-offs), ``Reduction`` (the replicas' gradient reduction placed
on a simulated rank's timeline, as torch DDP, Megatron-LM or Megatron-Core's distributed optimizer do it) and
``CpExchanges`` (context parallelism's key/value exchanges, each a ``CP`` action inside the compute action that
issues it: ``cp_actions``).

Example:
    >>> megatron_2021 = Collectives(dp_reduce="after_flush", grad_dtype="float16", scatter_gather=True)
    >>> pv.simulate(plan, "1F1B", 64, dp=8, tp=8, hardware="a100", collectives=megatron_2021)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeviz.cost.calibration import constant
from pipeviz.cost.comm import DDP_BUCKET_BYTES, all_reduce_time, cp_exchange_bytes, cp_exchange_seconds, ddp_buckets
from pipeviz.cost.machine import DTYPE_BYTES, dtype_name
from pipeviz.cost.memory import stages_and_kinds
from pipeviz.cost.model import Costs
from pipeviz.schedule import traits as sched
from pipeviz.schedule.mesh import Mesh
from pipeviz.schedule.timeline import Event
from pipeviz.sim.exchanges import StageExchanges

if TYPE_CHECKING:
    from pipeviz.cost.options import CostOptions
    from pipeviz.plan.split import SplitPlan

__all__ = ["DP_REDUCE", "MEGATRON_BUCKET_PARAMS", "Collectives", "CpExchanges", "Reduction", "cp_actions",
           "cp_exchanges", "gradient_bytes", "reduction_floor", "replica_reduction",
           "simulated_cp", "traced_element_bytes"]

DP_REDUCE = ("ddp", "after_flush", "distributed", "overlap")
TP_LAYOUTS = ("launch", "megatron")
MEGATRON_BUCKET_PARAMS = 40_000_000  # Megatron-Core's DDP bucket: max(40M, 1M x dp) parameters


@dataclass(frozen=True)
class Collectives:
    """How a run does its collectives, where frameworks differ (``pv.simulate(..., collectives=...)``).

    Example:
        >>> megatron_2021 = Collectives(dp_reduce="after_flush", grad_dtype="float16", scatter_gather=True)
        >>> pv.simulate(plan, "1F1B", 64, dp=8, tp=8, hardware="a100", collectives=megatron_2021)

    Attributes:
        dp_reduce: where the replicas' gradient average goes.

            - ``"ddp"`` (default): torch DDP's 25 MiB buckets overlapping each stage's last backward (the
              split-backward schedules: one all-reduce per rank after its last action, as torch's runtime does).
            - ``"after_flush"``: every rank's gradients in one all-reduce after its last action, not overlapped
              (Megatron-LM's ``--DDP-impl local`` of 2021: ``allreduce_gradients()`` after the pipeline flush).
            - ``"distributed"``: Megatron-Core's distributed optimizer with ``--overlap-grad-reduce
              --overlap-param-gather``: gradients reduce-scattered (half an all-reduce's bytes) in buckets of
              ``max(40M, 1M x dp)`` parameters from each stage's last backward on, as DDP's but on their own
              stream (the backward does not wait for them; the optimizer step does): what outlasts the rank's
              compute is charged as a ``"DP"`` event after its last action. The updated parameters are
              all-gathered (in ``dtype``) stage by stage from the step's start, in the order of the stages'
              first forwards, and a stage's first forward ends no earlier than its gather: with several stages
              per rank (interleaved) each stage's reduction starts at its own last backward and each stage's
              gather hides behind the earlier stages' forwards, as Megatron-Core r0.8.0 does per model chunk.
            - ``"overlap"``: ``pv.launch``'s default (``LaunchConfig.dp_reduce="overlap"``,
              ``pipeviz.runtime.overlap``): each stage's gradients all-reduced in DDP's 25 MiB buckets from the end of
              its last backward (or weight-grad pass), one after another on the rank's link, while the rank goes
              on with its other stages; what outlasts its last action is a ``"DP"`` event after it.
        grad_dtype: the dtype gradients are reduced in (``"float16"``: Megatron 2021's fp16 runs; ``"float32"``:
            Megatron's bf16 runs, ``--accumulate-allreduce-grads-in-fp32``). Default: the traced parameters'.
        tp_overlap: tensor-parallel collectives overlap the matmuls they feed (Megatron-Core ``--tp-comm-overlap``,
            torchtitan's async TP): a stage pays only what its collectives outlast its compute by.
        tp_layout: what tensor parallelism shards, for its collectives and each shard's memory.

            - ``"launch"`` (default): what ``pv.launch`` shards (``default_tp_plan`` or the config's ``tp_plan``):
              the collectives it issues (``pipeviz.cost.sharding.launch_collectives``) and each shard's share of
              the parameters and activations (``tp_shares``: norms whole; the residual stream whole unless the
              config's ``sequence_parallel``).
            - ``"megatron"``: every block's attention and MLP and the vocabulary sharded, as Megatron-LM and
              torchtitan run a large model: 2 all-reduces per block each way and a uniform 1/tp of the
              parameters and activations (``pv.plan_cluster``'s rows). It is the layout ``pv.launch`` runs by
              default (``default_tp_plan``: GPT-2's fused q/k/v by heads, the vocabulary with a parallel loss),
              so a row launches as priced; checked against a run's own events in
              ``tests/test_tensor_parallel_hf.py`` (a block's all-reduces as counted, each shard's memory
              within 12 %: norms and position tables stay whole, which ``"launch"`` counts).
        scatter_gather: pipeline hand-offs under tensor parallelism send 1/tp of the activation per shard, each
            over its own NIC, gathered over NVLink on arrival (Narayanan et al. 2021, sec. 4.1, the
            "scatter/gather optimization"; sequence parallelism's sharded activations hand on the same 1/tp).

    Raises:
        ValueError: an unknown ``dp_reduce``, ``grad_dtype`` or ``tp_layout`` (the message names the field and lists
            the valid values).
        TypeError: ``tp_overlap`` or ``scatter_gather`` not a bool.
    """

    dp_reduce: str = "ddp"
    grad_dtype: str | None = None
    tp_overlap: bool = False
    scatter_gather: bool = False
    tp_layout: str = "launch"

    def __post_init__(self) -> None:
        if self.tp_layout not in TP_LAYOUTS:
            raise ValueError(f"Unknown tp_layout={self.tp_layout!r}; valid: {', '.join(TP_LAYOUTS)}. Fix: "
                             "tp_layout='launch' (what pv.launch shards) or 'megatron' (Megatron-LM's full layout).")
        if self.dp_reduce not in DP_REDUCE:
            raise ValueError(f"Unknown dp_reduce={self.dp_reduce!r}; valid: {', '.join(DP_REDUCE)}. Fix: "
                             "dp_reduce='ddp' (torch DDP), 'after_flush' (Megatron-LM local DDP), "
                             "'distributed' (Megatron-Core's distributed optimizer) or 'overlap' (pv.launch's "
                             "overlapped all-reduces).")
        if self.grad_dtype is not None:
            object.__setattr__(self, "grad_dtype", dtype_name(self.grad_dtype, "grad_dtype"))
        for name in ("tp_overlap", "scatter_gather"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Collectives({name}={getattr(self, name)!r}): valid: True, False. Fix: "
                                f"{name}=True (overlapped / scattered, as Megatron-Core runs it) or False.")



def _bucket_bytes(mode: str, dp: int, grad_element: float) -> int:
    """A bucket: DDP's 25 MiB (``"ddp"``, ``"overlap"``), or Megatron-Core's ``max(40M, 1M x dp)`` parameters."""
    if mode in ("ddp", "overlap"):
        return DDP_BUCKET_BYTES
    return int(max(MEGATRON_BUCKET_PARAMS, 1_000_000 * dp) * grad_element)


def reduction_floor(grads: Sequence[float], mode: str, dp: int, via: tuple[float, float], split_backward: bool,
                    grad_element: float = 4.0) -> float:
    """The least time a rank's step goes on after its last action's compute for the reduction of its stages'
    gradients (``grads``: bytes per stage, as ``Reduction`` reduces them over ``dp`` holders on ``via``): what
    ``pv.plan_cluster``'s step bound adds, so that a layout with a slow reduction is ruled out unsimulated.

    A rank's last action is some stage's last backward, and ``Reduction`` then waits at least for that stage's last
    bucket (``"ddp"``, inside the backward; ``"distributed"``: a reduce-scatter, after the step) or all its buckets
    one after another (``"overlap"``); ``"after_flush"`` (and DDP under a split backward) all-reduces the rank's
    gradients after its last action. The stage is not known without playing the order: the least of its stages.

    Example:
        >>> reduction_floor([2e9, 2e9], "after_flush", 8, (100e9, 5e-6), False)      # all-reduce of 4 GB
    """
    if dp <= 1 or not grads:
        return 0.0
    mode = "after_flush" if mode == "ddp" and split_backward else mode
    if mode == "after_flush":
        return all_reduce_time(sum(grads), dp, via)
    bucket = _bucket_bytes(mode, dp, grad_element)
    half = 0.5 if mode == "distributed" else 1.0
    whole = all_reduce_time(bucket, dp, via) * half
    chains = []
    for g in grads:
        # ddp_buckets' buckets, counted rather than listed (10^5 of them over a large search): full ones, the rest
        full, rest = divmod(round(g), bucket)
        if rest:
            last, before = all_reduce_time(rest, dp, via) * half, full
        else:
            last, before = (whole, full - 1) if full else (0.0, 0)
        chains.append(last + before * whole if mode == "overlap" else last)
    return min(chains)


class Reduction:
    """Where the replicas' gradient reduction goes (``Collectives.dp_reduce``): buckets overlapping each stage's
    last backward (``"ddp"``: all-reduces; ``"distributed"``: reduce-scatters, and each stage's parameters
    all-gathered before its first forward ends), or one ``DP`` event per rank after its last action
    (``"after_flush"``, and ``"ddp"`` under the split-backward schedules, as torch's runtime does)."""

    def __init__(self, acts: sched.Order, lay: sched.Layout, costs: Costs, dp: int, via: tuple[float, float],
                 mode: str = "ddp", grad_scale: float = 1.0, param_scale: float = 1.0,
                 grad_element: float = 4.0) -> None:
        self.dp, self.via, self.costs = dp, via, costs
        self.mode = "after_flush" if mode == "ddp" and lay.info.split_backward else mode
        self.grads = [p * grad_scale for p in costs.param_bytes]  # per stage, the bytes reduced
        self.nbytes = [sum(self.grads[s] for s in lay.stages_of(r)) for r in lay.ranks]
        self.bucket = _bucket_bytes(mode, dp, grad_element)
        self.seconds = [0.0] * lay.num_ranks
        # per rank, the reduction's seconds the rank waits for (its compute does not hide them): a DDP backward's
        # wait for its buckets, a first forward's wait for its gathered parameters, the tail after the last action
        self.exposed = [0.0] * lay.num_ranks
        last_of: dict[tuple[int, int], int] = {}  # (rank, stage) -> index of the stage's last backward action
        for rank, rank_acts in enumerate(acts if self.mode != "after_flush" else []):
            stages, kinds = stages_and_kinds(tuple(rank_acts))
            for i, (s, kind) in enumerate(zip(stages, kinds, strict=True)):
                if kind != "F":
                    last_of[(rank, s)] = i
        self.last = {(rank, i): s for (rank, s), i in last_of.items()}  # (rank, action index) -> stage
        self.link_free = [0.0] * lay.num_ranks  # a rank's reductions run one after another on its link
        # The distributed optimizer's parameter all-gather, stage by stage (Megatron-Core r0.8.0 dispatches each
        # model chunk's all-gather ahead of that chunk's first forward: param_sync_func per chunk in the
        # interleaved schedule, bucket by bucket in forward pre-hooks): the rank's stages are gathered one after
        # another from the step's start, in the order of their first forwards, and a stage's first forward ends
        # no earlier than its parameters have arrived. With one stage per rank this is the whole gather against
        # the first forward; interleaved, the later stages' gathers hide behind the earlier stages' forwards.
        self.gathered: dict[tuple[int, int], float] = {}  # (rank, index of a stage's first forward) -> arrival
        for rank, rank_acts in enumerate(acts if self.mode == "distributed" else []):
            t, seen = 0.0, set()
            stages, kinds = stages_and_kinds(tuple(rank_acts))
            for i, (s, kind) in enumerate(zip(stages, kinds, strict=True)):
                if kind == "F" and s not in seen:
                    seen.add(s)
                    t += all_reduce_time(costs.param_bytes[s] * param_scale, dp, via) / 2
                    self.gathered[(rank, i)] = t
            self.seconds[rank] += t
            self.link_free[rank] = t  # the same link: the step's reductions queue behind its gathers

    def _time(self, nbytes: float) -> float:
        """One bucket: an all-reduce, or (distributed optimizer) a reduce-scatter, half its steps and bytes."""
        t = all_reduce_time(nbytes, self.dp, self.via)
        return t / 2 if self.mode == "distributed" else t

    def finish(self, rank: int, index: int, start: float, end: float) -> float:
        """When action ``index`` of ``rank``, computing from ``start`` to ``end``, returns (DDP, and Megatron's
        overlapped reduce-scatter, wait for the buckets' reductions in the stage's last backward)."""
        arrived = self.gathered.get((rank, index))
        if arrived is not None:  # a stage's first forward waits for the last of its parameters
            self.exposed[rank] += max(0.0, arrived - end)
            return max(end, arrived)
        s = self.last.get((rank, index))
        if s is None:
            return end
        buckets = ddp_buckets(round(self.grads[s]), self.bucket)
        if not buckets:
            return end
        if self.mode == "overlap":  # launched when the stage's last backward has returned, one after another
            t = max(self.link_free[rank], end) + sum(self._time(b) for b in buckets)
        else:
            t = max(self.link_free[rank], start)
            for b in buckets[:-1]:  # ready while the backward runs: overlapped from its start
                t += self._time(b)
            t = max(t, end) + self._time(buckets[-1])  # the first layers: ready at the end
        self.seconds[rank] += sum(self._time(b) for b in buckets)
        self.link_free[rank] = t
        # torch DDP's reducer waits for its buckets inside the backward; Megatron-Core's overlapped
        # reduce-scatter, and pipeviz's overlapped all-reduce, run beside the rank's other actions and are waited for
        # once, before the optimizer step (after_step).
        if self.mode in ("distributed", "overlap"):
            return end
        self.exposed[rank] += max(0.0, t - end)
        return t

    def after_step(self, events: list[Event]) -> list[Event]:
        """``DP`` events after each rank's last action: the whole all-reduce (``"after_flush"``), or the
        distributed optimizer's reduce-scatters still running."""
        out = []
        last: dict[int, float] = {}  # each rank's last end (one pass over the events: a deep pipeline has 10^5)
        for e in events:
            last[e.rank] = max(last.get(e.rank, e.end), e.end)
        for rank, nbytes in enumerate(self.nbytes):
            if rank not in last:
                continue
            if self.mode == "after_flush":
                t = all_reduce_time(nbytes, self.dp, self.via)
                self.seconds[rank] = t
            elif self.mode in ("distributed", "overlap"):
                # The reduce-scatters still running after the rank's last action (the all-gathers are in the
                # stages' first forwards, ``finish``).
                t = max(0.0, self.link_free[rank] - last[rank])
            else:
                continue
            if t > 0:
                self.exposed[rank] += t
                end = last[rank]
                out.append(Event(rank, -1, "DP", -1, end, end + t))
        return out


@dataclass(frozen=True)
class CpExchanges(StageExchanges):
    """Context parallelism's exchanges as a run issues them (``pipeviz.adapter.context_graph``), per stage: the
    seconds of each in one forward (keys and values all-gathered, one per attention op) and in one backward (their
    gradients reduce-scattered; ``I`` under a split backward, never ``W``), and ``op_seconds``, what the share's
    forward pays beside its compute for running the stage graph op by op (on a CPU: ``cpu_cp_op_overhead`` per op;
    0 elsewhere, where the host runs ahead of the device), and ``saved_bytes``, what a share saves beyond 1/cp of
    a microbatch's activations: attention keeps the keys and values it gathered, the whole sequence's, for its
    backward (``(cp-1)/cp`` of their bytes).

    Example:
        >>> ex = cp_exchanges(plan, 4, pv.Mesh(pp=2, cp=2), (1e9, 5e-5))
        >>> ex.seconds("F"), len(ex.each(0, "B"))      # per stage; the exchanges of stage 0's backward
    """

    op_seconds: tuple[float, ...]
    saved_bytes: tuple[int, ...]


def cp_exchanges(plan: SplitPlan, microbatches: float, mesh: Mesh, via: tuple[float, float], scale: float = 1.0,
                 cpu: bool = True, oversubscribed: bool = False) -> CpExchanges:
    """The exchanges of a ``mesh.cp`` > 1 run of ``plan`` (``cp_exchange_seconds`` on link ``via``; gloo's
    all-reduce for the backward's reduce-scatter on a ``cpu``). On a ``cpu`` each forward also pays
    ``cpu_cp_op_overhead`` per op of the stage (the share runs the graph op by op, each op's shapes checked), and
    with more processes than cores (``oversubscribed``) each exchange waits ``cpu_cp_exchange_wait`` more for the
    other shares' processes to get a core (both measured: ``pipeviz/cost/calibration.json``)."""
    fwd, bwd = cp_exchange_seconds(plan, microbatches, mesh, via, scale, gloo=cpu)
    whole = cp_exchange_bytes(plan)  # the traced batch's: a microbatch of one replica holds 1 / (m x dp) of them
    saved = tuple(round(sum(xs) * scale / (microbatches * mesh.dp) * (mesh.cp - 1) / mesh.cp) for xs in whole)
    wait = constant("cpu_cp_exchange_wait") if cpu and oversubscribed else 0.0
    per_op = constant("cpu_cp_op_overhead") if cpu else 0.0
    ops = [0] * plan.num_stages
    for op in plan.graph.capture.ops:
        ops[plan._stage_of_op(op.index)] += 1
    return CpExchanges(tuple(tuple(t + wait for t in xs) for xs in fwd),
                       tuple(tuple(t + wait for t in xs) for xs in bwd), tuple(n * per_op for n in ops), saved)


def simulated_cp(plan: SplitPlan, microbatches: int, mesh: Mesh, via: tuple[float, float], scale: float,
                 opts: CostOptions, cores: int | None) -> CpExchanges | None:
    """What ``pv.simulate`` charges for context parallelism (None without it): ``cp_exchanges`` on a CPU (no
    hardware and a CPU device, or ``"cpu"``) with the share's op-by-op forward, and a wait per exchange where the
    processes outnumber the ``cores``; NCCL's reduce-scatter elsewhere."""
    if mesh.cp == 1:
        return None
    hw = opts.hw
    cpu = hw.name == "cpu" if hw is not None else not str(opts.device).startswith("cuda")
    return cp_exchanges(plan, microbatches, mesh, via, scale, cpu, cores is not None and mesh.world > cores)


def cp_actions(events: Sequence[Event], ex: StageExchanges, kind: str = "CP") -> list[Event]:
    """A ``CP`` event (``kind``: ``"A2A"`` for expert parallelism's ``EpExchanges``, ``"TP"`` for tensor
    parallelism's ``TpExchanges``) for each exchange of every
    simulated compute action, inside it, as the run times them: the action's exchanges spread over its span with
    its compute between them (where in the action an attention or a MoE block falls is not modelled; their count
    and seconds are what the run issues)."""
    out = []
    for e in events:
        if e.kind not in ("F", "B", "I") or e.stage < 0:
            continue
        xs = ex.each(e.stage, e.kind)
        if not xs:
            continue
        gap = max(0.0, e.duration - sum(xs)) / (len(xs) + 1)
        t = e.start
        for x in xs:
            t += gap
            end = min(e.end, t + x)
            out.append(Event(e.rank, e.stage, kind, e.mb, t, end, e.step))
            t = end
    return out


def gradient_bytes(plan: SplitPlan | None, coll: Collectives) -> tuple[float, float]:
    """How the replicas' gradients are reduced, in bytes: their size relative to the traced parameters' (the
    ``grad_dtype``'s, 1 without one) and the bytes of one element (what Megatron's buckets count in)."""
    traced = traced_element_bytes(plan)
    if not coll.grad_dtype:
        return 1.0, traced
    return DTYPE_BYTES[coll.grad_dtype] / traced, float(DTYPE_BYTES[coll.grad_dtype])


def traced_element_bytes(plan: SplitPlan | None) -> float:
    """Bytes of one parameter element as traced (the parameters' average; 4 without a plan)."""
    if plan is None:
        return 4.0
    cap = plan.graph.capture
    numel = sum(cap.param_numel.values())
    return (sum(cap.param_bytes.values()) / numel if numel else 4.0) or 4.0


def replica_reduction(plan: SplitPlan | None, acts: sched.Order, lay: sched.Layout, costs: Costs, holders: int,
                      via: tuple[float, float], coll: Collectives, dtype: str | None) -> Reduction:
    """The ``Reduction`` of ``pv.simulate``: the gradients of ``holders`` processes holding the same parameters
    averaged on link ``via`` as ``coll`` says, in its ``grad_dtype`` (else the traced one), the distributed
    optimizer's parameters gathered in the training ``dtype``."""
    grad, element = gradient_bytes(plan, coll)
    param = DTYPE_BYTES[dtype] / traced_element_bytes(plan) if dtype else 1.0
    return Reduction(acts, lay, costs, holders, via, coll.dp_reduce, grad, param, element)
