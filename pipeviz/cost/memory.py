"""The one memory rule: what a stage and a rank hold, read off a schedule's action order.

Memory per rank, for a (plan, schedule, microbatches, optimizer state):

    sum over the rank's stages of  param_bytes x (1 weights + 1 gradients + optimizer_states)  +  buffer_bytes
    + the most activation bytes the rank's schedule keeps alive at once

where a stage keeps ``activation_bytes / microbatches`` alive per microbatch between its forward and its
backward (zero-bubble: the input-grad pass frees what the ops after the stage's last weight op saved,
``Costs.input_freed``, the weight-grad pass the rest), less
what recomputation drops (``layer_activation_bytes``), plus, under recomputation, one layer's rebuilt activations.
The peak is read off the schedule's action order, so it is exact for that order whatever the timings.

A stage's activations are what autograd saves for its backward (``StageInfo.activation_bytes``), counted at trace
time as a run counts them (``pipeviz.runtime.memory``): each tensor once, parameters never, a view as its base,
nothing in a no_grad region (``Op.saved_bytes``); a copy of its own of every saved tensor it received from an
earlier stage (``SplitPlan.received_saved_bytes``); on the last stage what the loss saves (an output-sized
log-softmax). Not counted, as the run's meter does not count them: a stage's outputs and received inputs that no
op saves (torch's stage holds them until the backward; on a GPU they are in ``memory_allocated``, not here).
Measured on CPU runs (``benchmarks/accuracy/memory_accuracy.py``): within 0.1 % of the simulator's peak per rank under
GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble.

Example:
    >>> memory_per_rank(plan, "1F1B", microbatches=4)          # bytes per rank
    >>> plan_stage_memory(plan, CostOptions(hardware="h100", dtype="bfloat16"))
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Unpack

from pipeviz.cost.model import Costs, stage_costs
from pipeviz.cost.options import CostChanges, CostOptions, LinkOptions
from pipeviz.cost.rule import OPTIMIZER_STATES, stage_bytes
from pipeviz.plan.split import register_pricer
from pipeviz.schedule import traits as sched

if TYPE_CHECKING:
    from pipeviz.cost.machine import Hardware
    from pipeviz.plan.preview import StageInfo
    from pipeviz.plan.split import SplitPlan
    from pipeviz.schedule.timeline import Event

__all__ = [
    "activation_curve",
    "in_flight",
    "memory_per_rank",
    "peak_activations",
    "plan_stage_memory",
    "plan_table",
    "stage_bytes",
    "stage_info_memory",
    "stages_and_kinds",
    "static_memory",
]


@functools.lru_cache(maxsize=4096)
def stages_and_kinds(acts: tuple[sched.Action, ...]) -> tuple[tuple[int, ...], str]:
    """One rank's actions as numpy reads them: their stages, and their kinds as one string (``"FFBFB..."``).
    Remembered: the planner and ``pv.simulate`` read the same schedule orders again and again (this was most of the
    planner's time at 1,024 GPUs)."""
    return tuple(a.stage for a in acts), "".join(a.kind for a in acts)


def peak_activations(order: Sequence[Sequence[sched.Action]], activation_bytes: Sequence[int],
                     weight_fraction: float = 0.5, input_freed: Sequence[float] = ()) -> list[int]:
    """Per rank, the most activation bytes alive at once when each rank runs its ``order``: a forward
    adds its stage's per-microbatch bytes, a backward frees them (an input-grad pass the stage's share
    ``input_freed[s]``, else ``weight_fraction`` of them, a weight-grad pass the rest)."""
    import numpy as np

    sizes = np.asarray(activation_bytes, dtype=np.float64)
    at_input = np.asarray(input_freed if input_freed else [weight_fraction] * len(sizes), dtype=np.float64)
    # what an action of each kind adds, per stage: the live bytes after each action are a running sum (numpy adds
    # in order, as a loop would: the same floats)
    delta = {"F": sizes, "B": -sizes, "I": -sizes * at_input, "W": -sizes * (1 - at_input)}
    peaks = []
    for acts in order:
        if not acts:
            peaks.append(0)
            continue
        stages, kinds = stages_and_kinds(tuple(acts))
        index = np.asarray(stages)
        per = np.empty(len(index))
        codes = np.frombuffer(kinds.encode(), dtype=np.uint8)
        for kind, values in delta.items():
            mask = codes == ord(kind)
            per[mask] = values[index[mask]]
        peaks.append(round(max(0.0, float(np.cumsum(per).max()))))
    return peaks


def activation_curve(events: Sequence[Event], activation_bytes: Sequence[int], weight_fraction: float = 0.5,
                     input_freed: Sequence[float] = ()) -> dict[int, list[tuple[float, int]]]:
    """Per rank, the activation bytes alive after each of its compute actions ends, as ``(seconds, bytes)``: the
    rule of ``peak_activations`` played on a timeline's events, so its maximum is the rank's peak. The shape of a
    measured run's ``meta["activation_memory"]``."""
    live: dict[int, float] = {}
    curve: dict[int, list[tuple[float, int]]] = {}
    first = min((e.start for e in events), default=0.0)
    for e in sorted((e for e in events if e.kind in ("F", "B", "I", "W")), key=lambda e: (e.end, e.rank)):
        size = activation_bytes[e.stage]
        delta: float
        if e.kind == "F":
            delta = size
        elif e.kind == "B":
            delta = -size
        else:
            at_input = input_freed[e.stage] if input_freed else weight_fraction
            delta = -size * (at_input if e.kind == "I" else 1 - at_input)
        live[e.rank] = live.get(e.rank, 0.0) + delta
        curve.setdefault(e.rank, [(first, 0)]).append((e.end, max(0, round(live[e.rank]))))
    return curve


def in_flight(schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None,
              weight_fraction: float = 0.5) -> list[float]:
    """Per stage, the most microbatches whose activations it keeps alive at once under ``schedule`` (GPipe:
    all of them; 1F1B: ``min(m, p - stage)``), read off the schedule's order."""
    counts = [0.0] * num_stages
    peaks = [0.0] * num_stages
    for acts in sched.orders(schedule, num_stages, microbatches, stages_per_rank):
        for s, kind, _ in acts:
            counts[s] += {"F": 1.0, "B": -1.0, "I": -weight_fraction, "W": -(1 - weight_fraction)}[kind]
            peaks[s] = max(peaks[s], counts[s])
    return peaks


def memory_per_rank(plan: SplitPlan | None, schedule: str, microbatches: int, stages_per_rank: int | None = None,
                    optimizer_states: int | None = None, costs: Costs | None = None,
                    order: Sequence[Sequence[sched.Action]] | None = None, forward_only: bool = False, *,
                    hardware: Hardware | str | None = None, dtype: str | None = None, recompute: str | None = None,
                    options: CostOptions | None = None, **link_options: Unpack[LinkOptions]) -> list[int]:
    """Bytes each rank holds at its peak when ``plan`` trains under ``schedule`` (the module's formula).

    ``forward_only``: an inference run keeps weights and buffers, no gradients or optimizer state, and one
    microbatch's activations of a stage at a time. Under recomputation a backward rebuilds one layer's
    activations for a moment: the largest such layer of the rank's stages adds to its peak.
    ``optimizer_states`` defaults to ``options.optimizer_states`` (Adam's 2); ``link_options`` are the other
    ``stage_costs`` keywords (``device``, ``bandwidth``, ...).

    Example:
        >>> memory_per_rank(plan, "GPipe", 8) == [s.memory_bytes for s in plan.stages]    # one stage per rank
        True
    """
    if costs is None:
        if plan is None:
            raise ValueError("memory_per_rank() needs a plan, or costs=Costs(...).")
        costs = stage_costs(plan, microbatches, hardware=hardware, dtype=dtype, recompute=recompute, options=options,
                            **link_options)
    if optimizer_states is None:
        optimizer_states = options.optimizer_states if options is not None else OPTIMIZER_STATES
    n = len(costs.forward)
    lay = sched.layout(schedule, n, stages_per_rank)
    acts = [list(a) for a in order] if order is not None else sched.orders(schedule, n, microbatches, stages_per_rank)
    buffers = costs.buffer_bytes or (0,) * n
    if forward_only:
        return [max(costs.activation_bytes[s] for s in lay.stages_of(r))
                + sum(costs.param_bytes[s] + buffers[s] for s in lay.stages_of(r)) for r in lay.ranks]
    peaks = peak_activations(acts, costs.activation_bytes, costs.weight_fraction, costs.input_freed)
    rebuilt = costs.recompute_bytes or (0,) * n
    return [peaks[r] + max(rebuilt[s] for s in lay.stages_of(r)) + static_memory(costs, lay.stages_of(r),
                                                                                 optimizer_states)
            for r in lay.ranks]


def stage_info_memory(stage: StageInfo, optimizer_states: int = OPTIMIZER_STATES) -> int:
    """``StageInfo.memory_bytes``: the stage on a rank of its own with every microbatch in flight (GPipe, the
    most any schedule keeps), whatever the microbatch count: its whole batch's activations."""
    return stage_bytes(stage.param_bytes, stage.buffer_bytes, stage.activation_bytes, optimizer_states,
                       stage.frozen_bytes)


def static_memory(costs: Costs, stages: Sequence[int], optimizer_states: int = OPTIMIZER_STATES) -> int:
    """A rank's bytes before any activation: its stages' weights, gradients, optimizer state and buffers."""
    buffers = costs.buffer_bytes or (0,) * len(costs.param_bytes)
    frozen = costs.frozen_bytes or (0,) * len(costs.param_bytes)
    return sum(stage_bytes(costs.param_bytes[s], buffers[s], 0, optimizer_states, frozen[s]) for s in stages)


def plan_stage_memory(plan: SplitPlan, options: CostOptions | None = None,
                      **cost_options: Unpack[CostChanges]) -> list[int]:
    """Each stage's training footprint on a rank of its own with the whole batch in flight (the preview's
    ``StageInfo.memory_bytes``), in the cost model's settings: the training dtype's activations, what
    recomputation keeps, ``optimizer_states`` (``CostOptions`` or its fields as keywords).

    Example:
        >>> plan_stage_memory(plan, CostOptions(hardware="h100", dtype="bfloat16", recompute="full"))
    """
    opts = CostOptions.of(options, **cost_options)
    costs = stage_costs(plan, 1, options=opts)
    rebuilt = costs.recompute_bytes or (0,) * plan.num_stages
    return [stage_bytes(s.param_bytes, s.buffer_bytes, a + r, opts.optimizer_states, s.frozen_bytes)
            for s, a, r in zip(plan.stages, costs.activation_bytes, rebuilt, strict=True)]


def plan_table(plan: SplitPlan, options: CostOptions | None = None, **cost_options: Unpack[CostChanges]) -> str:
    """The stage preview as a plain-text table, memory in the cost options' settings (``plan_stage_memory``)."""
    return plan.table(memory=plan_stage_memory(plan, options, **cost_options))


register_pricer(plan_stage_memory)  # SplitPlan.stage_memory answers with this: a plan never prices itself
