"""What ``pv.plan_cluster`` answers: ``LayoutOption`` (one layout with its predicted step, throughput and memory, and
the ``LaunchConfig`` that runs it) and ``ClusterPlan`` (the ranked options and how the search went); and how one
option of its search is priced before it is simulated (``SearchOption``, ``SearchPricing``: its split, costs and
lower bounds, remembered across the options that share them).

Example:
    >>> best = pv.plan_cluster(graph, 64, "h100", global_batch=512).best
    >>> pv.simulate(best.plan, best.config, options=best.options, collectives=best.collectives)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple, TypedDict

from pipeviz._compat import deprecated
from pipeviz.cost.comm import attention_kv_bytes, cp_collectives, tp_collectives
from pipeviz.cost.machine import Hardware
from pipeviz.cost.memory import static_memory
from pipeviz.cost.model import Costs, overlapped, parallel_costs, stage_costs
from pipeviz.cost.options import CostOptions
from pipeviz.plan.errors import PlanError
from pipeviz.plan.preview import human_bytes
from pipeviz.plan.split import SplitPlan
from pipeviz.planner.balance import balance
from pipeviz.planner.experts import expert_costs
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig
from pipeviz.schedule.mesh import DIMS, Mesh
from pipeviz.schedule.training import cross_entropy
from pipeviz.sim.collectives import Collectives, gradient_bytes, reduction_floor
from pipeviz.sim.simulate import replica_link

if TYPE_CHECKING:
    from pipeviz.capture.view import GraphView

__all__ = ["TP_LAYOUT_WORDS", "ClusterPlan", "LayoutOption", "row_summary"]


class _RowOptions(TypedDict):
    """``LayoutOption.simulate_options``: the ``pv.simulate`` keywords that reproduced a row before 0.3."""

    dp: int
    tp: int
    cp: int
    options: CostOptions
    collectives: Collectives | None

@dataclass(frozen=True)
class LayoutOption:
    """One way to train on the cluster, with what the simulator predicts for it.

    Attributes:
        pp, dp, tp, cp: pipeline ranks, data-parallel replicas, tensor-parallel shards, context-parallel shares of
            every sequence (``pp x dp x cp x tp`` GPUs; ``mesh``).
        ep: expert parallelism: each MoE block's routed experts sharded over ``ep`` of a stage's ``dp x cp`` ranks
            (no GPUs of its own, as torchtitan and Megatron-LM carve it; 1 for a dense model), its all-to-alls
            priced and 1/ep of the experts' weights, gradients and optimizer state held per rank.
        schedule, stages_per_rank: the pipeline schedule (torch's name) and stages each pipeline rank holds.
        microbatch_size, microbatches: sequences per microbatch (per replica) and microbatches per step.
        recompute: ``"none"``, ``"selective"`` or ``"full"``.
        plan: the balanced ``SplitPlan`` (``pp x stages_per_rank`` stages).
        step_time: seconds per training step; tokens_per_s: the cluster's throughput.
        tflops_per_gpu, mfu: model FLOPs (6 x params x tokens style: 3 x the forward, recomputation not counted)
            per second per GPU, and as a fraction of the hardware's dense peak in the dtype.
        bubble: idle fraction of the pipeline ranks.
        peak_memory: the most bytes any device holds.
        extrapolated: the step and memory come from two shorter simulations (see ``plan_cluster``).
        options, collectives: how it was costed (``CostOptions``: hardware, dtype, recomputation, batch scale;
            ``Collectives``: ``dp_reduce``, how the replicas' gradients are reduced, is searched per row).
        exposed_reduction: seconds of the replicas' gradient reduction the slowest-waiting rank waits for in a step
            (not hidden by its compute: ``pv.simulate``'s ``meta["dp_exposed"]``); 0 without replicas.

    A row launches as it is: ``config`` is the ``LaunchConfig`` it simulated (a training run with
    ``pv.cross_entropy``), so ``pv.simulate(row.plan, row.config, options=row.options,
    collectives=row.collectives)`` reproduces it and ``pv.launch(row.plan, config=row.config, ...)`` runs it.
    """

    pp: int
    dp: int
    tp: int
    schedule: str
    stages_per_rank: int
    microbatch_size: int
    microbatches: int
    recompute: str
    plan: SplitPlan = field(repr=False, compare=False)
    step_time: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    bubble: float
    peak_memory: int
    extrapolated: bool = False
    options: CostOptions = field(default_factory=CostOptions, repr=False, compare=False)
    collectives: Collectives | None = field(default=None, repr=False, compare=False)
    cp: int = 1
    exposed_reduction: float = 0.0
    ep: int = 1

    @property
    def dp_reduce(self) -> str:
        """How the row reduces its replicas' gradients (``Collectives.dp_reduce``)."""
        return self.collectives.dp_reduce if self.collectives is not None else "ddp"

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.pp, self.dp, self.tp, self.cp, self.ep)

    @property
    def gpus(self) -> int:
        return self.mesh.world

    @property
    def config(self) -> LaunchConfig:
        """The ``LaunchConfig`` of this row (schedule, microbatches, stages per rank, layout, recomputation, the
        replicas' reduction, the dtype as mixed precision, a training loss). Megatron-Core's distributed optimizer
        (``"distributed"``) launches as ZeRO-1 (``dp_reduce="zero1"``: reduce-scattered gradients, sharded optimizer
        state); with tensor parallelism the launch averages after the step (the default there: ``dp_reduce_mode``).
        ``ep`` as the row's (``pv.simulate`` prices it; ``pv.launch`` runs ep beside pp and dp only, eager, fp32).
        ``scaled_down`` gives it at a size that runs here."""
        from pipeviz.schedule import traits as sched

        red = self.dp_reduce
        if red == "ddp" and sched.info(self.schedule).split_backward:
            red = "after_flush"  # (as the simulator prices DDP there: torch's runtime reduces after the last action)
        launchable = self.dp > 1 and self.tp == 1 and red in ("ddp", "overlap", "after_flush", "distributed")
        dtype = self.options.dtype
        return LaunchConfig(schedule=self.schedule, microbatches=self.microbatches, loss_fn=cross_entropy,
                            stages_per_rank=self.stages_per_rank if self.stages_per_rank > 1 else None,
                            dp=self.dp, tp=self.tp, cp=self.cp, ep=self.ep, recompute=self.recompute,
                            dp_reduce=("zero1" if red == "distributed" else red) if launchable else None,
                            mixed_precision={"bfloat16": "bf16", "float16": "fp16"}.get(dtype or ""))

    def scaled_down(self, batch: int, processes: int = 4, keep_dtype: bool = False) -> LaunchConfig:
        """This row's ``config`` at a size that runs here, on ``batch`` samples (the notebook's example batch) and at
        most ``processes`` processes: the same split (its ``pp`` pipeline ranks and stages per rank), schedule,
        recomputation and reduction; the replicas cut to the largest divisor of ``dp`` that fits (the batch
        shared equally), no tensor, context or expert parallelism (ep 1: every expert on every process), and the most
        microbatches up to the row's that the
        replica's batch divides into and the schedule accepts. The dtype stays the traced one unless
        ``keep_dtype`` (the row's as ``mixed_precision``): on a CPU autocast is slower than float32, and
        ``pv.simulate`` does not price autocast's memory yet, so the planned memory would not be the run's.

        Example:
            >>> cfg = row.scaled_down(batch=8)       # pp as planned, dp <= 4 // pp, microbatches that fit
            >>> pv.launch(row.plan, config=cfg, inputs=(x,), target=y)

        Raises:
            PlanError: the row's pipeline alone needs more than ``processes`` processes, or no microbatch count
                fits the batch (the message says which and the fix)."""
        from pipeviz.plan.errors import PlanError
        from pipeviz.schedule import traits as sched

        if self.pp > processes:
            raise PlanError(f"This row's pipeline has {self.pp} ranks, more than the {processes} processes a scaled-"
                            f"down run may start here. Fix: processes={self.pp}, or a row with fewer pipeline ranks.")
        dp = max(d for d in range(1, self.dp + 1) if self.dp % d == 0 and self.pp * d <= processes and batch % d == 0)
        spr = self.stages_per_rank if self.stages_per_rank > 1 else None
        fits = []
        for m in range(min(self.microbatches, batch // dp), 0, -1):
            if (batch // dp) % m:
                continue
            try:
                sched.check_microbatches(self.schedule, self.plan.num_stages, m, spr)
            except sched.ScheduleError:
                continue
            fits.append(m)
        if not fits:
            raise PlanError(f"No microbatch count up to {self.microbatches} divides a replica's {batch // dp} samples "
                            f"and suits {self.schedule} on {self.plan.num_stages} stages. Fix: a larger example batch "
                            "(a multiple of the row's pipeline ranks), or another row.")
        cfg = self.config
        return cfg.replace(dp=dp, tp=1, cp=1, ep=1, microbatches=fits[0], dp_reduce=cfg.dp_reduce if dp > 1 else None,
                           dp_shard=cfg.dp_shard and dp > 1,
                           mixed_precision=cfg.mixed_precision if keep_dtype else None)

    @property
    def simulate_options(self) -> _RowOptions:
        """Deprecated since 0.3: ``pv.simulate(row.plan, row.config, options=row.options,
        collectives=row.collectives)`` reproduces the row."""
        deprecated("LayoutOption.simulate_options is deprecated since pipeviz 0.3: pv.simulate(row.plan, row.config, "
                   "options=row.options, collectives=row.collectives) reproduces the row.")
        return {"dp": self.dp, "tp": self.tp, "cp": self.cp, "options": self.options,
                "collectives": self.collectives}

    def label(self) -> str:
        """``"pp4 dp8 tp2 1F1B mb=2x64 selective"`` (``cp4`` after ``dp`` when the sequence is split, ``ep8`` last
        among the degrees with expert parallelism)."""
        v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        dims = " ".join(f"{d}{getattr(self, d)}" for d in DIMS if d != "cp" or self.cp > 1)
        dims += f" ep{self.ep}" if self.ep > 1 else ""
        return f"{dims} {self.schedule}{v} mb={self.microbatch_size}x{self.microbatches} {self.recompute}"


@dataclass(frozen=True)
class ClusterPlan:
    """``plan_cluster``'s answer: ``rows`` best first (only options that fit), and how the search went.

    Attributes:
        rows: ``LayoutOption``s, fastest step first.
        hardware, gpus, global_batch, seq_len, dtype, memory_limit: the question asked.
        considered: layouts enumerated; simulated: those simulated; pruned: those dropped by a bound (memory or
            step time) without simulating; too_big: those found over the memory limit; too_long: those left out
            because simulating them would take more than ``max_actions`` actions.
        notes: what the search assumed (sequence-length scaling, selective recomputation with fused attention).
        tp_layout: the tensor-parallel layout every row was priced in (``Collectives.tp_layout``): ``"megatron"``,
            Megatron-LM's (every block's attention and MLP and the vocabulary sharded, 2 all-reduces per block), as a
            cluster's run shards a large model; ``table`` says so under the rows.
    """

    rows: tuple[LayoutOption, ...]
    hardware: Hardware
    gpus: int
    global_batch: int
    seq_len: int
    dtype: str
    memory_limit: int
    considered: int = 0
    simulated: int = 0
    pruned: int = 0
    too_big: int = 0
    too_long: int = 0
    notes: tuple[str, ...] = ()
    tp_layout: str = "megatron"

    @property
    def best(self) -> LayoutOption:
        """The fastest option that fits.

        Raises:
            PlanError: no option fits (the message says what to change).
        """
        if not self.rows:
            raise PlanError(self._none_fit())
        return self.rows[0]

    def _none_fit(self) -> str:
        return (f"No layout of {self.gpus} x {self.hardware.name} fits {human_bytes(self.memory_limit)} per device "
                f"for a global batch of {self.global_batch} x {self.seq_len} tokens. Fix: more GPUs, recompute="
                "'full', a smaller global batch or sequence, or a larger memory_limit.")

    def cells(self, top: int = 10) -> list[tuple[str, ...]]:
        """The ``top`` rows as strings, a header row first: what ``table`` prints and the report's table shows
        (one set of figures in one set of units)."""
        cps = any(r.cp > 1 for r in self.rows[:top])  # a cp column only where the sequence is split
        eps = any(r.ep > 1 for r in self.rows[:top])  # an ep column only where experts are sharded
        rows: list[tuple[str, ...]] = [
            ("#", "pp", "dp", *(("cp",) if cps else ()), "tp", *(("ep",) if eps else ()), "schedule", "v", "mb size",
             "m", "recompute", "reduce", "exposed", "step", "tokens/s", "TFLOP/s/GPU", "MFU", "bubble", "peak memory")]
        for i, r in enumerate(self.rows[:top], 1):
            rows.append((str(i), str(r.pp), str(r.dp), *((str(r.cp),) if cps else ()), str(r.tp),
                         *((str(r.ep),) if eps else ()), r.schedule,
                         str(r.stages_per_rank), str(r.microbatch_size), str(r.microbatches), r.recompute,
                         r.dp_reduce if r.dp > 1 else "-", _seconds(r.exposed_reduction) if r.dp > 1 else "-",
                         _seconds(r.step_time) + ("*" if r.extrapolated else ""), f"{r.tokens_per_s:,.0f}",
                         f"{r.tflops_per_gpu:.0f}", _share(r.mfu), f"{r.bubble:.0%}", human_bytes(r.peak_memory)))
        return rows

    def table(self, top: int = 10) -> str:
        """The ``top`` rows as text: layout, step, tokens/s, TFLOP/s per GPU, MFU, bubble, peak memory."""
        head = (f"{self.gpus} x {self.hardware.name} ({self.dtype}, efficiency {self.hardware.efficiency:g}), global "
                f"batch {self.global_batch} x {self.seq_len} tokens, memory limit {human_bytes(self.memory_limit)}")
        if not self.rows:
            return head + "\n" + self._none_fit()
        rows = self.cells(top)
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        left = {rows[0].index("schedule"), rows[0].index("recompute"), rows[0].index("reduce")}
        lines = ["  ".join(c.rjust(w) if j not in left else c.ljust(w) for j, (c, w) in
                           enumerate(zip(r, widths, strict=True))).rstrip() for r in rows]
        tail = [f"{len(self.rows)} options fit; {self.considered} considered, {self.simulated} simulated, "
                f"{self.pruned} pruned by a bound, {self.too_big} over the memory limit"
                + (f", {self.too_long} left out as too long to simulate (max_actions)." if self.too_long else ".")]
        if any(r.extrapolated for r in self.rows[:top]):
            tail.append("* extrapolated from two shorter simulations (the step grows linearly in microbatches).")
        return "\n".join([head, *lines, *self.legend(), *tail, *self.notes])

    def legend(self) -> list[str]:
        """What the table's columns mean, and the tensor-parallel layout the rows were priced in (lines under the
        table; the Explorer's cluster panel shows the same)."""
        cp = ", cp: context-parallel shares of each sequence" if any(r.cp > 1 for r in self.rows) else ""
        ep = [("ep: the dp x cp ranks each MoE block's routed experts are sharded over (their all-to-alls priced, 1/ep "
               "of their weights, grads and optimizer state per rank);")] if any(r.ep > 1 for r in self.rows) else []
        return [
            f"pp, dp, tp: pipeline ranks, data-parallel replicas, tensor-parallel shards{cp}; v: stages per pipeline "
            "rank;", *ep,
            f"mb size: sequences per microbatch; m: microbatches per step (global batch {self.global_batch} = dp x m x "
            "mb size);",
            "reduce: how the replicas reduce their gradients (dp_reduce); exposed: the seconds of it the step waits "
            "for;",
            f"tp priced in {TP_LAYOUT_WORDS.get(self.tp_layout, self.tp_layout)}: tp_layout={self.tp_layout!r}.",
        ]

    def __str__(self) -> str:
        return self.table()


class SearchOption(NamedTuple):
    """One option of the search: a layout (degrees, schedule, stages per rank, microbatch size and count,
    recomputation) and how its replicas reduce their gradients."""

    tp: int
    cp: int
    pp: int
    dp: int
    schedule: str
    v: int
    b: int
    m: int
    mode: str
    reduce: str
    ep: int = 1

    @property
    def key(self) -> tuple[object, ...]:
        """The layout without its reduction (what its memory and compute bound share)."""
        return (*self[:9], self.ep)

    @property
    def stages(self) -> int:
        return self.pp * self.v

    @property
    def layout(self) -> sched.Layout:
        return sched.layout(self.schedule, self.stages, self.v if self.v > 1 else None)


@dataclass
class SearchPricing:
    """What every option of ``pv.plan_cluster``'s search is priced with (the hardware, dtype, memory limit,
    collectives, the batch's scale per sequence) and what the options share, remembered: balanced plans per stage
    count, stage costs, one device's costs, the bounds, and each layout's peak memory (the same for every
    reduction)."""

    graph: GraphView
    hw: Hardware
    dtype: str
    base: CostOptions
    per_token: float
    limit: int
    optimizer_states: int
    collectives: Collectives
    plans: dict[int, SplitPlan | None] = field(default_factory=dict)
    _stage: dict[tuple[int, int, str], Costs] = field(default_factory=dict)
    _device: dict[tuple[int, int, str, int, int, int], Costs] = field(default_factory=dict)
    memory: dict[tuple[object, ...], float] = field(default_factory=dict)  # peak bytes per layout (the planner's)
    _bounds: dict[tuple[object, ...], int] = field(default_factory=dict)
    _floors: dict[tuple[object, ...], tuple[float, ...]] = field(default_factory=dict)

    def plan(self, n: int) -> SplitPlan | None:
        """``pv.balance``'s optimum into ``n`` stages, or None when the graph has too few split points."""
        if n not in self.plans:
            try:
                self.plans[n] = balance(self.graph, n, options=self.base)
            except PlanError:
                self.plans[n] = None
        return self.plans[n]

    def stage_costs(self, n: int, b: int, mode: str) -> Costs:
        key = (n, b, mode)
        if key not in self._stage:
            plan = self.plan(n)
            assert plan is not None
            self._stage[key] = stage_costs(plan, 1, options=replace(self.base, recompute=mode,
                                                                    batch_scale=b * self.per_token))
        return self._stage[key]

    def device_costs(self, n: int, b: int, mode: str, t: int, c: int = 1, e: int = 1) -> Costs:
        """One device's costs per microbatch of ``b`` sequences: its shard of each stage and its share of each
        sequence, with the shards' all-reduces and the shares' key/value gathers (``pv.simulate``'s), overlapped
        with the compute where the collectives say so (``tp_overlap``); with ``e`` > 1 the experts' all-to-alls and
        1/e of their weights (``pipeviz.planner.experts.expert_costs``)."""
        key = (n, b, mode, t, c, e)
        if key not in self._device:
            plan = self.plan(n)
            assert plan is not None
            mesh = Mesh(1, 1, t, c)
            coll = None
            scale = self.base.byte_scale(plan.graph) * b * self.per_token
            if t > 1 or c > 1:
                tp_s = (tp_collectives(plan, 1, c, t, self.base.link(t, allreduce=True), scale) if t > 1
                        else (0.0,) * n)
                cp_s = (cp_collectives(plan, 1, mesh, self.base.link(mesh.rank(0, cp=c - 1) + 1, allreduce=True),
                                       scale) if c > 1 else (0.0,) * n)
                coll = tuple(x + y for x, y in zip(tp_s, cp_s, strict=True))
            costs = parallel_costs(self.stage_costs(n, b, mode), mesh, collective=coll)
            if c > 1:  # attention keeps the keys and values it gathered whole (pv.simulate's cp_exchanges)
                costs = replace(costs, activation_bytes=tuple(
                    a + round(k * scale * (c - 1) / c)
                    for a, k in zip(costs.activation_bytes, attention_kv_bytes(plan), strict=True)))
            # (pv.simulate overlaps them the same way: the bound below must not exceed its step)
            costs = overlapped(costs) if self.collectives.tp_overlap else costs
            self._device[key] = expert_costs(costs, plan, self.base, e, t, c, scale)
        return self._device[key]

    def memory_bound(self, tp: int, cp: int, pp: int, schedule: str, v: int, b: int, mode: str, ep: int = 1) -> int:
        """A lower bound on the peak bytes of the options of this layout (any microbatch count and reduction): each
        rank's weights, gradients, optimizer state and one microbatch's activations."""
        key = (tp, cp, pp, schedule, v, b, mode, ep)
        if key not in self._bounds:
            self._bounds[key] = self._memory_bound(tp, cp, pp, schedule, v, b, mode, ep)
        return self._bounds[key]

    def _memory_bound(self, tp: int, cp: int, pp: int, schedule: str, v: int, b: int, mode: str, ep: int) -> int:
        rc, lay = self.device_costs(pp * v, b, mode, tp, cp, ep), sched.layout(schedule, pp * v, v if v > 1 else None)
        return max(static_memory(rc, lay.stages_of(r), self.optimizer_states)
                   + max(rc.activation_bytes[s] for s in lay.stages_of(r)) for r in lay.ranks)

    def reduction_floors(self, tp: int, cp: int, pp: int, dp: int, schedule: str, v: int, b: int, mode: str,
                         reduce: str, ep: int = 1) -> tuple[float, ...]:
        """Per pipeline rank, the least the replicas' gradient reduction adds after its last action
        (``pipeviz.sim.collectives.reduction_floor``, on ``pv.simulate``'s link and gradient bytes)."""
        key = (tp, cp, pp, dp, schedule, v, b, mode, reduce, ep)
        if key not in self._floors:
            self._floors[key] = self._reduction_floors(*key)
        return self._floors[key]

    def _reduction_floors(self, tp: int, cp: int, pp: int, dp: int, schedule: str, v: int, b: int, mode: str,
                          reduce: str, ep: int) -> tuple[float, ...]:
        lay = sched.layout(schedule, pp * v, v if v > 1 else None)
        if dp * cp <= 1:
            return (0.0,) * lay.num_ranks
        plan = self.plan(pp * v)
        rc = self.device_costs(pp * v, b, mode, tp, cp, ep)
        scale, element = gradient_bytes(plan, replace(self.collectives, dp_reduce=reduce))
        via = replica_link(Mesh(pp, dp, tp, cp), self.base)
        return tuple(reduction_floor([rc.param_bytes[s] * scale for s in lay.stages_of(r)], reduce, dp * cp, via,
                                     lay.info.split_backward, element) for r in lay.ranks)


# How each tensor-parallel layout is named under a table (Collectives.tp_layout)
TP_LAYOUT_WORDS = {
    "megatron": "Megatron-LM's layout (attention, MLP and vocabulary sharded; 2 all-reduces per block)",
    "launch": "pv.launch's layout (what default_tp_plan, or the config's tp_plan, shards)",
}


def _seconds(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def _share(x: float) -> str:
    """A share as a percentage that never reads 0.0 % when it is not zero (a small model's MFU)."""
    return f"{x:.1%}" if x >= 1e-3 or x == 0 else f"{x * 100:.2g}%"


def row_summary(i: int, r: LayoutOption) -> str:
    """One planner row on a line, in ``table``'s units, order and names (``mb size``, then ``m`` microbatches): what
    the cluster panel lists."""
    v = f" v{r.stages_per_rank}" if r.stages_per_rank > 1 else ""
    cp = f" cp{r.cp}" if r.cp > 1 else ""
    cp += f" ep{r.ep}" if r.ep > 1 else ""
    reduce = f" · {r.dp_reduce}" if r.dp > 1 else ""
    return (f"{i + 1}. pp{r.pp} dp{r.dp}{cp} tp{r.tp} {r.schedule}{v} · mb size {r.microbatch_size} · m "
            f"{r.microbatches} · {r.recompute}{reduce} · {_seconds(r.step_time)} · MFU {_share(r.mfu)} · "
            f"{human_bytes(r.peak_memory)}")
