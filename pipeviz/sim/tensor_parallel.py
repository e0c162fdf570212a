"""Tensor parallelism's collectives as a launched run issues them (``Collectives.tp_layout="launch"``): each one a
``TP`` action inside the forward or backward that issues it, and on a CPU what the run pays beside them.

``pv.launch(..., tp=K)`` runs each stage's graph on DTensors (``pipeviz.adapter.dtensor_graph``) and each
collective through gloo. On a CPU that costs what a link model alone leaves out, each part measured
(``benchmarks/calibration/cpu_constants.py``, ``pipeviz/cost/calibration.json``):

- every op of the stage is dispatched through DTensor (its sharding propagated, its local op called), forward and
  backward: ``cpu_tp_op_overhead`` and ``cpu_tp_backward_op_overhead`` per traced op of the stage, on top of the
  shard's 1/K of the compute (the Explorer's tiny GPT-2: about 130 ops a stage, a forward's compute below a
  millisecond, its dispatch several);
- where the processes outnumber the cores (``cores=``: 4 processes on 2), each collective waits for the other
  shard's process to get a core before it can join: ``cpu_tp_collective_wait`` more than its link time per
  collective, as context parallelism's exchanges wait (``cpu_cp_exchange_wait``). The waiting process sleeps off
  its core, which another process computes on meanwhile (``TpExchanges.idle``: ``play_on_cores`` frees the core
  for it).

On a GPU (a hardware preset other than ``"cpu"``, or a CUDA device) neither is charged: the host dispatches ahead of
the device, and each process has its own device.

Example:
    >>> ex = tp_exchanges(plan, sharded_modules(plan, None, 2), 4, pv.Mesh(pp=2, tp=2), (1e9, 2e-4))
    >>> len(ex.each(0, "F")), ex.seconds("B"), ex.op_backward      # TP actions in one forward of stage 0, ...
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipeviz.cost.calibration import constant
from pipeviz.cost.comm import all_reduce_time
from pipeviz.cost.model import Costs
from pipeviz.cost.sharding import launch_collectives
from pipeviz.sim.exchanges import StageExchanges

if TYPE_CHECKING:
    from pipeviz.cost.options import CostOptions
    from pipeviz.plan.split import SplitPlan
    from pipeviz.schedule.mesh import Mesh

__all__ = ["TpExchanges", "idle_of", "simulated_tp", "stage_ops", "tp_exchanges", "with_dispatch"]


@dataclass(frozen=True)
class TpExchanges(StageExchanges):
    """Per stage, the seconds of each tensor-parallel collective in one forward and in one backward (``B``, or ``I``
    under a split backward, as the run issues them; never ``W``), each with its wait for a core where the processes
    outnumber the cores (``wait``, included), and what running the stage on DTensors adds beside the shard's compute:
    ``op_forward`` per forward, ``op_backward`` per backward (0 off a CPU)."""

    op_forward: tuple[float, ...]
    op_backward: tuple[float, ...]
    wait: float = 0.0

    def idle(self) -> dict[tuple[int, str], float]:
        """Per ``(stage, kind)``, the seconds an action's process waits off its core for the other shard's (its
        collectives' ``wait``): with the cores shared (``cores=``) another process computes meanwhile."""
        out = {}
        for s, (fwd, bwd) in enumerate(zip(self.forward, self.backward, strict=True)):
            out[(s, "F")] = self.wait * len(fwd)
            out[(s, "B")] = out[(s, "I")] = self.wait * len(bwd)
        return out


def stage_ops(plan: SplitPlan) -> list[int]:
    """Per stage, the traced ops it holds (what the op-by-op costs are counted per)."""
    ops = [0] * plan.num_stages
    for op in plan.graph.capture.ops:
        ops[plan._stage_of_op(op.index)] += 1
    return ops


def tp_exchanges(plan: SplitPlan, sharded: Mapping[str, str], microbatches: float, mesh: Mesh,
                 via: tuple[float, float], scale: float = 1.0, sequence_parallel: bool = False, cpu: bool = True,
                 oversubscribed: bool = False) -> TpExchanges:
    """The collectives of a ``mesh.tp`` > 1 run of ``plan`` sharding ``sharded`` (``launch_collectives``: a ring
    all-reduce, or half one for an all-gather or a reduce-scatter, of ``nbytes x scale / (microbatches x dp x cp)``
    on link ``via``), each ``cpu_tp_collective_wait`` longer where the processes outnumber the cores
    (``oversubscribed``), and on a ``cpu`` the DTensor dispatch per op (``cpu_tp_op_overhead``,
    ``cpu_tp_backward_op_overhead``)."""
    rows = microbatches * mesh.dp * mesh.cp
    wait = constant("cpu_tp_collective_wait") if cpu and oversubscribed else 0.0

    def seconds(kind: str, nbytes: float) -> float:
        whole = all_reduce_time(nbytes * scale / rows, mesh.tp, via)
        return (whole if kind == "all_reduce" else whole / 2) + wait

    per_stage = launch_collectives(plan, dict(sharded), sequence_parallel)
    fwd = tuple(tuple(seconds(c.kind, c.nbytes) for c in cs if not c.backward) for cs in per_stage)
    bwd = tuple(tuple(seconds(c.kind, c.nbytes) for c in cs if c.backward) for cs in per_stage)
    ops = stage_ops(plan) if cpu else [0] * plan.num_stages
    per_f = constant("cpu_tp_op_overhead") if cpu else 0.0
    per_b = constant("cpu_tp_backward_op_overhead") if cpu else 0.0
    return TpExchanges(fwd, bwd, tuple(n * per_f for n in ops), tuple(n * per_b for n in ops), wait)


def simulated_tp(plan: SplitPlan, sharded: Mapping[str, str], microbatches: int, mesh: Mesh,
                 via: tuple[float, float], scale: float, opts: CostOptions, cores: int | None,
                 sequence_parallel: bool = False) -> TpExchanges | None:
    """What ``pv.simulate`` charges for the launch layout's tensor parallelism (None without it): ``tp_exchanges``
    on a CPU (no hardware and a CPU device, or ``"cpu"``) with DTensor's op-by-op dispatch, and a wait per
    collective where the processes outnumber the ``cores``; the link alone elsewhere."""
    if mesh.tp == 1:
        return None
    hw = opts.hw
    cpu = hw.name == "cpu" if hw is not None else not str(opts.device).startswith("cuda")
    return tp_exchanges(plan, sharded, microbatches, mesh, via, scale, sequence_parallel, cpu,
                        cores is not None and mesh.world > cores)


def with_dispatch(costs: Costs, ex: TpExchanges) -> Costs:
    """``costs`` (one shard's: ``parallel_costs``) with DTensor's dispatch added to each stage's forward and backward
    (``ex.op_forward``, ``ex.op_backward``): the process's own work, beside its share of the compute."""
    return replace(costs, forward=tuple(f + o for f, o in zip(costs.forward, ex.op_forward, strict=True)),
                   backward=tuple(b + o for b, o in zip(costs.backward, ex.op_backward, strict=True)))


def idle_of(ex: TpExchanges | None) -> dict[tuple[int, str], float] | None:
    """``ex.idle()`` (what ``play_on_cores`` frees the core for), None without tensor parallelism."""
    return None if ex is None else ex.idle()
