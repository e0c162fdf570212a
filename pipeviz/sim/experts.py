"""Expert parallelism priced (``LaunchConfig.ep``): what ``pv.simulate`` charges a stage holding mixture-of-experts
blocks when each block's routed experts are shared out over ``ep`` of a stage's replicas, as ``pv.launch`` runs it
(``pipeviz.adapter.expert_graph``) and torchtitan and Megatron-LM carve it out of the data-parallel ranks:

- per block and microbatch the forward exchanges counts (a small all-to-all, latency only, not an ``A2A`` event:
  the run does not time it either), sends each row to its expert's owner (an ``A2A``) and gets the outputs back
  (another ``A2A``); the backward (or input-grad pass ``I``; never ``W``) the two reversed. A rank sends
  ``(ep-1)/ep`` of its routed rows (tokens x top-k x hidden x dtype) each time: ``sent / bandwidth + (ep-1) x
  latency`` on the link the expert-parallel group spans (``ep_bandwidth`` overrides it);
- load imbalance: every rank of a group waits for the busiest owner, so the routed experts' share of a stage's
  compute is charged ``expert_imbalance`` times (``CostOptions.expert_imbalance``: the busiest owner's tokens over
  the mean; 1.0, balanced, by default; ``measured_imbalance(run.expert_tokens, ep)`` reads it from a run);
- on a CPU (no hardware and a CPU device, or ``"cpu"``), as for context parallelism's shares
  (``pipeviz.sim.collectives.cp_exchanges``, the same measured constants): each forward runs the stage graph op by
  op (``cpu_cp_op_overhead`` per op), and where the processes outnumber the cores each ``A2A`` waits
  ``cpu_cp_exchange_wait`` more for the other processes to get a core;
- memory: each rank holds 1/ep of the routed experts' weights (their gradients and optimizer state with them).
  That is the layout torchtitan and Megatron run, and ``pv.launch``'s (``pipeviz.runtime.expert_shards``: measured
  equal, ``benchmarks/accuracy/ep_memory.py``). The gradient reduction is priced on the smaller bytes likewise.

Example:
    >>> ex = ep_exchanges(plan, 4, pv.Mesh(pp=2, dp=2, ep=2), (1e9, 2e-4))
    >>> len(ex.each(0, "F")), ex.seconds("B")         # A2A actions in one forward of stage 0; per stage, backward
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pipeviz.cost.calibration import constant
from pipeviz.cost.model import Costs
from pipeviz.sim.exchanges import StageExchanges

if TYPE_CHECKING:
    from pipeviz.capture.ops import Op
    from pipeviz.cost.options import CostOptions
    from pipeviz.plan.split import SplitPlan
    from pipeviz.schedule.mesh import Mesh

__all__ = ["EpExchanges", "MoeStage", "a2a_seconds", "ep_exchanges", "measured_imbalance", "moe_stages",
           "simulated_ep", "with_experts"]

_LISTED = re.compile(r"^(?P<block>.+\.experts)\.(?P<e>\d+)$")  # an nn.ModuleList's expert e (MoENet, HF 4.x)
_FUSED = re.compile(r"^(?P<block>.+\.experts)$")  # transformers 5.x's fused experts (gate_up_proj, down_proj)


@dataclass(frozen=True)
class MoeStage:
    """One stage's routed experts, from the trace: ``blocks`` (the experts' modules, in graph order), per block
    ``row_bytes`` (the rows routed to its experts in one forward of the traced batch: tokens x top-k x hidden x
    dtype), ``expert_flops`` (the routed experts' forward FLOPs: their rows only, top-k of E per token)
    and ``expert_param_bytes`` (their weights)."""

    blocks: tuple[str, ...] = ()
    row_bytes: tuple[float, ...] = ()
    expert_flops: int = 0
    expert_param_bytes: int = 0


def _unit(op: Op) -> tuple[str, str] | None:
    """(block, expert unit) of an op inside routed experts: ``("b.experts", "b.experts.3")`` for a list's expert,
    ``("b.experts", "b.experts")`` for fused experts; None elsewhere (the router, shared experts)."""
    for name in op.stack:
        if m := _LISTED.match(name):
            return m["block"], name
    for name in op.stack:
        if m := _FUSED.match(name):
            return m["block"], name
    return None


def moe_stages(plan: SplitPlan) -> list[MoeStage]:
    """Per stage, its routed experts (``MoeStage``; empty where a stage has none). An expert unit's rows are the
    input of its first op reading a weight (directly, or through an op of the weight alone: the transpose before
    transformers' grouped matmul): the largest such input not made of weights. Dropless routing computes every
    routed row, so the units' rows sum to tokens x top-k whatever the traced routing."""
    return list(_moe_stages(plan))


@functools.lru_cache(maxsize=64)  # (pv.plan_cluster prices one plan at many degrees: one walk of the ops each)
def _moe_stages(plan: SplitPlan) -> tuple[MoeStage, ...]:
    ops = plan.graph.capture.ops
    param_bytes = plan.graph.capture.param_bytes
    weightish = {op.index for op in ops if op.params and not op.inputs}  # ops of parameters alone
    seen_unit: set[str] = set()
    rows: list[dict[str, float]] = [{} for _ in range(plan.num_stages)]
    flops = [0] * plan.num_stages
    params: list[set[str]] = [set() for _ in range(plan.num_stages)]
    for op in ops:
        where = _unit(op)
        if where is None:
            continue
        block, unit = where
        s = plan._stage_of_op(op.index)
        flops[s] += op.flops
        params[s].update(op.params)
        rows[s].setdefault(block, 0.0)
        reads_weight = bool(op.params) or any(i in weightish for i in op.inputs)
        if unit in seen_unit or not reads_weight or op.index in weightish:
            continue
        seen_unit.add(unit)
        rows[s][block] += max((ops[i].out_bytes for i in op.inputs if i not in weightish), default=0)
    return tuple(MoeStage(tuple(r), tuple(r.values()), f, sum(param_bytes.get(p, 0) for p in ps))
                 for r, f, ps in zip(rows, flops, params, strict=True))


@functools.lru_cache(maxsize=64)
def _per_stage(plan: SplitPlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage, its ops and their forward FLOPs."""
    ops, flops = [0] * plan.num_stages, [0] * plan.num_stages
    for op in plan.graph.capture.ops:
        s = plan._stage_of_op(op.index)
        ops[s] += 1
        flops[s] += op.flops
    return tuple(ops), tuple(flops)


@dataclass(frozen=True)
class EpExchanges(StageExchanges):
    """Expert parallelism's exchanges as a run issues them, per stage: the seconds of each ``A2A`` in one forward
    (dispatch, combine per block) and in one backward (the same reversed: ``B`` or ``I``, never ``W``),
    ``count_seconds`` (the forward's count exchanges, untimed by the run: charged in the forward, no event),
    ``op_seconds`` (per stage, what a forward pays for running the graph op by op: on a CPU only) and
    ``imbalance_seconds`` (per stage, the busiest owner's extra expert compute in one forward; the backward pays
    twice it) and ``core_wait`` (of each ``A2A``, the seconds spent waiting for a core, not for the link: no other
    work of the process can run in them, so ``ep_overlap`` cannot hide them)."""

    count_seconds: tuple[float, ...]
    op_seconds: tuple[float, ...] = ()
    imbalance_seconds: tuple[float, ...] = ()
    core_wait: float = 0.0


def a2a_seconds(nbytes: float, ep: int, via: tuple[float, float]) -> float:
    """One all-to-all over ``ep`` ranks in which each sends ``nbytes`` in all: ``(ep-1)/ep`` of them leave it
    (the rest are its own experts' rows), one message to each of the ``ep-1`` others (gloo and NCCL send them
    pairwise): ``(ep-1)/ep x nbytes / bandwidth + (ep-1) x latency``. Zero for one rank."""
    if ep <= 1:
        return 0.0
    bw, lat = via
    return (ep - 1) / ep * nbytes / bw + (ep - 1) * lat


def ep_exchanges(plan: SplitPlan, microbatches: float, mesh: Mesh, via: tuple[float, float], scale: float = 1.0,
                 cpu: bool = False, oversubscribed: bool = False, delay: float = 0.0) -> EpExchanges:
    """The all-to-alls of a ``mesh.ep`` > 1 run of ``plan`` on link ``via``: per block of a stage, one microbatch of
    one replica routes ``row_bytes x scale / (microbatches x dp x cp)`` (``scale``: the dtype's and batch's, as
    ``CostOptions.byte_scale`` x ``batch_scale``); the dispatch and the combine move as many bytes each way. On a
    ``cpu`` a forward pays ``cpu_cp_op_overhead`` per op of its stage, and ``oversubscribed`` (more processes than
    cores) each ``A2A`` ``cpu_cp_exchange_wait`` more (the measured constants of context parallelism's shares, which
    run a stage the same way: op by op, waiting at each exchange for the other processes). ``delay``: seconds more
    per ``A2A`` (``LaunchConfig.ep_delay``: a slowed link)."""
    core_wait = constant("cpu_cp_exchange_wait") if cpu and oversubscribed else 0.0
    wait = core_wait + delay
    per_op = constant("cpu_cp_op_overhead") if cpu else 0.0
    ops, _ = _per_stage(plan)
    fwd, bwd, count = [], [], []
    for st in moe_stages(plan):
        each = [a2a_seconds(b * scale / (microbatches * mesh.dp * mesh.cp), mesh.ep, via) + wait
                for b in st.row_bytes]
        pair = tuple(t for t in each for _ in range(2))  # dispatch, combine per block
        fwd.append(pair)
        bwd.append(pair)
        count.append(len(each) * a2a_seconds(0.0, mesh.ep, via))
    return EpExchanges(tuple(fwd), tuple(bwd), tuple(count), tuple(n * per_op for n in ops), core_wait=core_wait)


def simulated_ep(plan: SplitPlan, microbatches: int, mesh: Mesh, via: tuple[float, float], scale: float,
                 opts: CostOptions, cores: int | None, delay: float = 0.0) -> EpExchanges | None:
    """What ``pv.simulate`` charges for expert parallelism's exchanges (None without it): ``ep_exchanges``, on a CPU
    (no hardware and a CPU device, or ``"cpu"``) with the op-by-op forward, and a wait per ``A2A`` where the
    processes outnumber the ``cores``; ``delay`` more per ``A2A`` (``LaunchConfig.ep_delay``).

    Raises:
        ValueError: ``ep`` > 1 on a model without routed experts (as ``pv.launch`` refuses it, naming ep).
    """
    if mesh.ep == 1:
        return None
    if not any(st.blocks for st in moe_stages(plan)):
        raise ValueError(f"ep={mesh.ep}: the model has no routed experts (no module named '<block>.experts.<e>' in an "
                         "nn.ModuleList, nor transformers' fused experts) for expert parallelism to shard. Fix: ep=1, "
                         "or a mixture-of-experts model.")
    hw = opts.hw
    cpu = hw.name == "cpu" if hw is not None else not str(opts.device).startswith("cuda")
    return ep_exchanges(plan, microbatches, mesh, via, scale, cpu, cores is not None and mesh.world > cores, delay)


def with_experts(costs: Costs, plan: SplitPlan, ex: EpExchanges, ep: int,
                 imbalance: float) -> tuple[Costs, EpExchanges]:
    """``costs`` (one process's, ``parallel_costs``) with expert parallelism: each forward pays its ``A2A``s and
    count exchanges (and its op-by-op run, ``op_seconds``), each backward (``B``, ``I``) its ``A2A``s (as
    collectives: ``Costs.collective``); forward and backward the busiest owner's extra expert compute
    (``imbalance`` - 1 of the experts' share of the stage's FLOPs); parameters (with gradients and optimizer state)
    hold 1/ep of the routed experts' weights."""
    moe = moe_stages(plan)
    n = len(costs.forward)
    _, stage_flops = _per_stage(plan)
    share = [m.expert_flops / f if f else 0.0 for m, f in zip(moe, stage_flops, strict=True)]
    extra = tuple(max(0.0, imbalance - 1.0) * x * f for x, f in zip(share, costs.forward, strict=True))
    fwd_c, bwd_c = ex.seconds("F"), ex.seconds("B")
    coll = costs.collective or (0.0,) * n
    back = costs.collective_backward or coll
    # (the experts' bytes as this process holds them: tensor parallelism has already cut its stage's parameters,
    # which would otherwise lose more than the experts' whole bytes and price a 671B model in GBs)
    held = [p / st.param_bytes if st.param_bytes else 1.0 for p, st in zip(costs.param_bytes, plan.stages,
                                                                             strict=True)]
    kept = tuple(max(0, p - round(m.expert_param_bytes * h * (1 - 1 / ep)))
                 for p, m, h in zip(costs.param_bytes, moe, held, strict=True))
    ops = ex.op_seconds or (0.0,) * n
    priced = replace(
        costs,
        forward=tuple(f + x + o for f, x, o in zip(costs.forward, extra, ops, strict=True)),
        backward=tuple(b + 2 * x for b, x in zip(costs.backward, extra, strict=True)),
        collective=tuple(c + a + k for c, a, k in zip(coll, fwd_c, ex.count_seconds, strict=True)),
        collective_backward=tuple(c + a for c, a in zip(back, bwd_c, strict=True)),
        param_bytes=kept)
    return priced, replace(ex, imbalance_seconds=extra)


def measured_imbalance(loads: Sequence[Any], ep: int) -> float:
    """The load imbalance a run measured (``run.expert_tokens``: ``ExpertLoad``s) for ``ep`` shares: per block,
    microbatch and expert-parallel group (replicas ``g·ep … (g+1)·ep − 1``), the tokens the group routed to each
    owner's experts, the busiest owner's over the mean; the mean of those over the run (1.0: balanced). What
    ``CostOptions(expert_imbalance=...)`` takes.

    Example:
        >>> pv.simulate(plan, cfg, expert_imbalance=measured_imbalance(run.expert_tokens, cfg.ep))
    """
    groups: dict[tuple[int, int, str, int, int], list[int]] = {}
    for ld in loads:
        key = (ld.step, ld.stage, ld.block, ld.mb, ld.replica // ep)
        per = groups.setdefault(key, [0] * len(ld.counts))
        for e, c in enumerate(ld.counts):
            per[e] += c
    factors = []
    for per in groups.values():
        k = len(per) // ep
        owners = [sum(per[r * k:(r + 1) * k]) for r in range(ep)]
        if sum(owners):
            factors.append(max(owners) * ep / sum(owners))
    return sum(factors) / len(factors) if factors else 1.0
