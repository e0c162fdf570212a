"""``Costs``: what a layer and a stage cost in time, from one time source chosen once (``time_source``).

The stage preview, ``pv.simulate``, ``pv.balance``, the report and the Explorer all read these numbers, so
one plan has one memory figure everywhere.

Every function takes the same settings: a ``CostOptions`` (hardware, dtype, recompute, links, batch scale) or its
fields as keywords.

Time: a layer's forward and backward per microbatch come from a ``pv.profile`` measurement attached to the
graph (``graph.with_profile(prof)``), scaled to the microbatch size; else, on a ``pv.Hardware``, from a roofline
per op (``pipeviz.hardware``); else from its FLOPs at a device's rate (backward = 2 x forward). Recomputation
adds forward work to each backward (``"full"``: the whole forward; ``"selective"``: attention's score ops). A
hand-off between stages costs bytes / bandwidth + latency.

Example:
    >>> costs = stage_costs(plan, microbatches=4)
    >>> stage_costs(plan, 4, options=CostOptions(hardware="h100", dtype="bfloat16", recompute="selective"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipeviz.capture.export import op_saved_bytes
from pipeviz.cost.machine import Hardware, device_rate
from pipeviz.cost.options import CostOptions
from pipeviz.cost.roofline import layer_roofline, loss_kernel_times, op_table
from pipeviz.schedule import traits as sched
from pipeviz.schedule.mesh import Mesh

if TYPE_CHECKING:
    from pipeviz.capture.view import GraphView
    from pipeviz.cost.sharding import TpShares
    from pipeviz.plan.split import SplitPlan

__all__ = ["BACKWARD_PER_FORWARD", "Costs", "layer_activation_bytes", "layer_times", "measured_here", "overlapped",
           "parallel_costs", "selective_saves_nothing", "stage_costs", "time_source"]


BACKWARD_PER_FORWARD = 2.0  # a backward computes two matmuls per forward matmul (input and weight grads)


@dataclass(frozen=True)
class Costs:
    """Per-stage durations for one microbatch, in seconds, and bytes.

    Attributes:
        forward, backward: per stage; ``backward`` is the full backward (input + weight grads).
        comm: per boundary ``s -> s+1``: seconds to move one microbatch's activations (and, back, grads).
        activation_bytes: per stage, activations one in-flight microbatch keeps alive.
        param_bytes: per stage, parameters held (shared copies included).
        buffer_bytes: per stage, buffers held.
        weight_fraction: share of a backward that is weight grads (``W`` in zero-bubble schedules).
        overhead: fixed seconds per action (launch and bookkeeping).
        source: ``"flops"`` or ``"measured"``.
        collective: per stage, seconds of tensor-parallel all-reduces in one forward (and as many in one
            backward or input-grad pass), on the critical path; empty without tensor parallelism.
        collective_backward: per stage, the backward's (and input-grad pass's) own seconds where they differ from
            the forward's (the launch's layout: an embedding's sum has no backward collective, a column-wise
            group's input gradient no forward one); empty: ``collective``.
        latency: the part of each ``comm`` a smaller microbatch does not shrink (``parallel_costs``).
        recompute_bytes: per stage, activations a backward rebuilds for a moment under recomputation (one
            layer's, the largest); empty without recomputation.
        send_bytes: per boundary, bytes one microbatch hands on (``pv.simulate`` prices them on the link the
            two ranks share); empty when unknown.
        runtime: per stage, fixed seconds an ``F``, ``B`` or ``I`` pays for the send and receive actions that go
            with it under torch's multi-stage runtime (``pv.simulate`` sets it: ``overhead`` per cross-rank
            hand-off); empty for single-stage schedules, whose hand-offs ride inside the compute action.
        input_freed: per stage, the share of ``activation_bytes`` a zero-bubble input-grad pass (``I``) frees, the
            rest going at its ``W`` (``SplitPlan.input_grad_freed_bytes``); empty: ``weight_fraction`` at ``I``.
        frozen_bytes: per stage, the part of ``param_bytes`` that does not train (no gradient, no optimizer
            state); empty: every parameter trains.
        recompute_seconds: per stage, the part of ``backward`` that is recomputation (the forward run again);
            a split backward pays it in its ``I`` and again in its ``W``, as torch's schedules run them (each pass
            is a backward call of its own, and torch's non-reentrant checkpoint recomputes once per call); empty
            without recomputation.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    comm: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    weight_fraction: float = 0.5
    overhead: float = 0.0
    source: str = "flops"
    buffer_bytes: tuple[int, ...] = ()
    collective: tuple[float, ...] = ()
    collective_backward: tuple[float, ...] = ()
    latency: float = 0.0
    recompute_bytes: tuple[int, ...] = ()
    send_bytes: tuple[float, ...] = ()
    runtime: tuple[float, ...] = ()
    input_freed: tuple[float, ...] = ()
    frozen_bytes: tuple[int, ...] = ()
    recompute_seconds: tuple[float, ...] = ()

    def duration(self, stage: int, kind: str) -> float:
        """Seconds of one action: ``F``, ``B``, or a zero-bubble ``I`` / ``W`` half of a backward (tensor-parallel
        all-reduces go with ``F``, ``B`` and ``I``: the weight-grad pass sends nothing)."""
        back = self.collective_backward if self.collective_backward and kind in ("B", "I") else self.collective
        coll = back[stage] if back and kind != "W" else 0.0
        if self.runtime and kind != "W":
            coll += self.runtime[stage]
        if kind == "F":
            return self.forward[stage] + coll + self.overhead
        if kind == "B":
            return self.backward[stage] + coll + self.overhead
        if kind not in ("I", "W"):
            raise sched.ScheduleError(f"Cannot price an action of kind {kind!r}; valid: F, B, I, W (forward, backward, "
                                "input-grad, weight-grad).")
        part = self.weight_fraction if kind == "W" else 1 - self.weight_fraction
        again = self.recompute_seconds[stage] if self.recompute_seconds else 0.0
        return (self.backward[stage] - again) * part + again + coll + self.overhead

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0,
                activation_bytes: int = 1) -> Costs:
        """Equal costs on every stage: the textbook setting."""
        return cls((forward,) * num_stages, (backward,) * num_stages, (comm,) * max(0, num_stages - 1),
                   (activation_bytes,) * num_stages, (0,) * num_stages)


def layer_times(graph: GraphView, microbatches: float = 1, device: str | None = None,
                flops_per_s: float | None = None, options: CostOptions | None = None,
                ) -> tuple[list[float], list[float], str]:
    """Per-layer forward and backward seconds for one microbatch, and where they come from.

    Measured when the graph carries a ``pv.profile`` of its layers (``graph.with_profile``), scaled from the
    microbatch size it was measured at (a measurement wins over any estimate made for that kind of device:
    ``measured_here``); else, on a ``Hardware``
    (``options.hardware``), a roofline per op summed over the layer's ops (``pipeviz.cost.roofline.op_time``: matmuls by
    their FLOPs, elementwise ops by the bytes they read and write, views free; backward = 2 x forward), or on
    ``"cpu"`` each op replayed at its shapes (``pipeviz.cost.replay``: its own forward and backward); else FLOPs at
    ``flops_per_s`` (default by device). Recomputation adds to the
    backward: the whole forward (``"full"``) or attention's score ops (``"selective"``).

    Example:
        >>> fwd, bwd, source = layer_times(graph, 4, options=CostOptions(hardware="h100"))

    Returns:
        ``(forward, backward, source)`` with ``source`` ``"measured"``, ``"roofline"`` or ``"flops"``.
    """
    opts = CostOptions.of(options, device=device, flops_per_s=flops_per_s)
    k = opts.batch_scale / microbatches  # the microbatch as a fraction of the traced example batch
    prof = graph.profile
    table = op_table(graph.capture)
    spans = list(zip(graph.index.layer_first, graph.index.layer_last, strict=True))
    sel_flops = [sum(table.flops[i] for i in table.selective if a <= i <= b) for a, b in spans]
    hw = opts.hw
    source = time_source(graph, opts)
    if source == "measured":
        assert prof is not None
        scale = prof.microbatches * k  # a microbatch of 1/m of the batch takes m_prof/m as long
        fwd = [prof.forward[n] * scale for n in graph.layer_names]
        bwd = [prof.backward[n] * scale for n in graph.layer_names]
        # Selective recomputation's share of a measured forward: its ops' share of the layer's FLOPs.
        sel = [f * sf / layer.flops if layer.flops else 0.0
               for f, sf, layer in zip(fwd, sel_flops, graph.layers, strict=True)]
        source = "measured"
    elif hw is not None:
        fwd, sel, bwd = layer_roofline(graph, hw, opts.dtype, k, opts.byte_scale(graph))
    else:
        rate = opts.flops_per_s or device_rate(opts.device)
        fwd = [layer.flops * k / rate for layer in graph.layers]
        bwd = [f * BACKWARD_PER_FORWARD for f in fwd]
        sel = [f * k / rate for f in sel_flops]
    if opts.recompute == "full":
        bwd = [b + f for b, f in zip(bwd, fwd, strict=True)]
    elif opts.recompute == "selective":
        bwd = [b + x for b, x in zip(bwd, sel, strict=True)]
    return fwd, bwd, source


def time_source(graph: GraphView, options: CostOptions) -> str:
    """Where a layer's time comes from, chosen once for every consumer (the preview, ``pv.simulate``,
    ``pv.balance``, the planner): ``"measured"`` (the graph's ``pv.profile``, when it was measured on that kind of
    device: ``measured_here``), else ``"roofline"`` on a ``Hardware`` (each op replayed on the ``"cpu"`` preset,
    its roofline on a GPU preset), else ``"flops"`` at the nominal device's rate (``machine.device_rate``)."""
    hw = options.hw
    if measured_here(graph, hw):
        return "measured"
    return "roofline" if hw is not None else "flops"


def measured_here(graph: GraphView, hw: Hardware | None) -> bool:
    """Whether the graph's ``pv.profile`` applies: it covers every layer and (on a ``Hardware``) was measured on
    that kind of device, a CPU profile for ``"cpu"``, a GPU one for a GPU preset. A CPU measurement says nothing
    of an H100, so there the roofline is used."""
    prof = graph.profile
    if prof is None or not all(name in prof.forward for name in graph.layer_names):
        return False
    return hw is None or (hw.name == "cpu") == str(prof.device).startswith("cpu")


def _matmul(target: str) -> bool:
    return any(k in target for k in ("bmm", "matmul", "baddbmm", "einsum"))


def layer_activation_bytes(graph: GraphView, options: CostOptions | None = None) -> list[float]:
    """Per layer, the activation bytes one example batch keeps alive until its backward, in ``options.dtype``:

    - ``"none"``: what autograd saves for the layer's backward (``Layer.saved_bytes``: each tensor once, in the
      first layer that saves it; parameters never; a view shares its base's memory; a no_grad region saves
      nothing);
    - ``"selective"``: all but what attention's scores, their scaling/masking and softmax (and its dropout)
      save: the ``5as/h`` term of Korthikanti et al. 2022; a fused attention (SDPA, flash) saves none of them
      anyway;
    - ``"full"``: only the layer's input (``Layer.in_bytes``; the output layer keeps the loss's too).

    Example:
        >>> sum(layer_activation_bytes(graph, CostOptions(recompute="full")))
    """
    opts = options or CostOptions()
    s = opts.byte_scale(graph)
    ops = graph.capture.ops
    spans = list(zip(graph.index.layer_first, graph.index.layer_last, strict=True))
    if opts.recompute == "full":  # the loss's saved tensors (in the output layer's saved_bytes) stay
        loss = [layer.saved_bytes - sum(op_saved_bytes(ops[i]) for i in range(a, b + 1))
                for layer, (a, b) in zip(graph.layers, spans, strict=True)]
        return [((layer.in_bytes or min(layer.out_bytes, layer.activation_bytes)) + x) * s
                for layer, x in zip(graph.layers, loss, strict=True)]
    dropped = [0.0] * len(graph.layers)
    if opts.recompute == "selective":
        table = op_table(graph.capture)
        # The score matmul's saved queries and keys stay (the recomputation starts from them): only what the score
        # ops themselves save goes (pipeviz.schedule.recompute checkpoints from that matmul to the one with values).
        marked = set(table.selective)
        dropped = [sum(op_saved_bytes(ops[i]) for i in table.selective if a <= i <= b and not _matmul(ops[i].target))
                   for a, b in spans]
        # The matmul with the values is inside the checkpoint too: the probabilities it saves (a dropout's output,
        # not the softmax's own, which is counted above) go; the values stay.
        for k, (a, b) in enumerate(spans):
            for op in ops[a:b + 1]:
                if op.index not in marked and _matmul(op.target) and any(j in marked for j in op.inputs):
                    rest = sum(ops[j].out_bytes for j in op.inputs if j not in marked)
                    dropped[k] += max(0, op_saved_bytes(op) - rest)
    return [(layer.saved_bytes - d) * s for layer, d in zip(graph.layers, dropped, strict=True)]


def stage_costs(
    plan: SplitPlan, microbatches: float, device: str | None = None, flops_per_s: float | None = None,
    bandwidth: float | None = None, latency: float | None = None, backend: str | None = None, *,
    hardware: Hardware | str | None = None, dtype: str | None = None, recompute: str | None = None,
    options: CostOptions | None = None,
) -> Costs:
    """Costs of ``plan``'s stages for one microbatch (see the module docstring for the rules).

    Example:
        >>> stage_costs(plan, 8, hardware="h100", dtype="bfloat16", recompute="full").backward

    Args:
        plan: the split.
        microbatches: microbatches the (traced example, times ``options.batch_scale``) batch is cut into.
        device, flops_per_s, bandwidth, latency, backend, hardware, dtype, recompute: ``CostOptions`` fields,
            given as keywords (they override ``options``).
        options: a ``CostOptions``.

    Communication: bytes / bandwidth + latency: the hardware's intra-node link, or the backend's (gloo on CPU,
    NCCL on GPUs); ``pv.simulate`` re-prices each boundary on the link its two ranks share.
    """
    opts = CostOptions.of(options, device=device, flops_per_s=flops_per_s, bandwidth=bandwidth, latency=latency,
                          backend=backend, hardware=hardware, dtype=dtype, recompute=recompute)
    g = plan.graph
    stages = plan.stages
    fwd_l, bwd_l, source = layer_times(g, microbatches, options=opts)
    pos = {n: i for i, n in enumerate(g.layer_names)}
    fwd = [sum(fwd_l[pos[n]] for n in s.layers) for s in stages]
    bwd = [sum(bwd_l[pos[n]] for n in s.layers) for s in stages]
    again: tuple[float, ...] = ()
    if opts.recompute != "none":
        plain = layer_times(g, microbatches, options=replace(opts, recompute="none"))[1]
        again = tuple(sum(bwd_l[pos[n]] - plain[pos[n]] for n in s.layers) for s in stages)
    overhead = 0.0
    prof = g.profile
    if source == "measured" and prof is not None:
        scale = prof.microbatches * opts.batch_scale / microbatches
        # Ops between layers (embedding sums, masks) are timed as a whole; share them by FLOPs.
        total = sum(s.flops for s in stages) or 1
        fwd = [f + prof.glue_forward * scale * s.flops / total for f, s in zip(fwd, stages, strict=True)]
        bwd = [b + prof.glue_backward * scale * s.flops / total for b, s in zip(bwd, stages, strict=True)]
        # The last stage computes the loss after its forward and starts its backward from the loss.
        fwd[-1] += prof.loss_forward * scale
        bwd[-1] += prof.loss_backward * scale
        overhead = prof.overhead
    elif source == "roofline" and opts.hw is not None:
        overhead = opts.hw.action_overhead
        if opts.hw.roofline == "kernels":  # this machine's kernels: the last stage's loss, replayed like its ops
            lf, lb = loss_kernel_times(g.capture, opts.batch_scale / microbatches, opts.dtype)
            fwd[-1], bwd[-1] = fwd[-1] + lf, bwd[-1] + lb
    bs = opts.byte_scale(g) * opts.batch_scale
    stored = layer_activation_bytes(g, opts)
    dropped = [layer.saved_bytes * opts.byte_scale(g) - kept for layer, kept in zip(g.layers, stored, strict=True)]
    # Under full recomputation a stage's first layer keeps its input, which is the copy the stage received: that
    # copy is not kept a second time.
    received = plan.received_saved_bytes if opts.recompute == "full" else [0] * len(stages)
    acts = tuple(max(0, int((s.activation_bytes - r) * bs - sum(dropped[pos[n]] for n in s.layers) * opts.batch_scale))
                 // microbatches for s, r in zip(stages, received, strict=True))
    rebuilt: tuple[int, ...] = ()
    if opts.recompute != "none":  # a backward rebuilds what recomputation dropped, one layer at a time
        kept_all = layer_activation_bytes(g, replace(opts, recompute="none"))
        # full: the layer's forward runs again and saves all it saves without recomputation (its kept input among
        # it, no second time); selective: the dropped score ops' tensors come back.
        extra = kept_all if opts.recompute == "full" else [max(0.0, k - r) for k, r in zip(kept_all, stored,
                                                                                             strict=True)]
        rebuilt = tuple(round(max(extra[pos[n]] for n in s.layers) * opts.batch_scale / microbatches) for s in stages)
    sends = tuple(s.send_bytes * bs / microbatches for s in stages[:-1])
    bw, lat = opts.link(2)
    comm = tuple(b / bw + lat for b in sends)
    # What a zero-bubble I pass frees, as a share of what the stage keeps: what the ops after the stage's last weight
    # op saved, and the loss's. Selective recomputation drops only attention's scores, which come before the output
    # projection: the same bytes go, of fewer kept. Under full recomputation those ops are inside the last layer's
    # checkpoint, whose inputs the weight-grad pass still needs: only the loss's go (pipeviz.schedule.recompute).
    freed_bytes = list(plan.input_grad_freed_bytes)
    if opts.recompute == "full":
        op, loss = g.index.loss_saved
        freed_bytes = [0] * len(stages)
        if loss:
            freed_bytes[plan._stage_of_op(op)] = loss  # (the plan's own rule for an op's stage)
    stored = [(s.activation_bytes - r) * bs - sum(dropped[pos[n]] for n in s.layers) * opts.batch_scale
              for s, r in zip(stages, received, strict=True)]
    freed = tuple(min(1.0, f * bs / kept) if kept > 0 else 1.0 for f, kept in zip(freed_bytes, stored, strict=True))
    return Costs(tuple(fwd), tuple(bwd), comm, tuple(int(a) for a in acts), tuple(s.param_bytes for s in stages),
                 overhead=overhead, source=source, buffer_bytes=tuple(s.buffer_bytes for s in stages), latency=lat,
                 recompute_bytes=rebuilt, send_bytes=sends, input_freed=freed,
                 frozen_bytes=tuple(s.frozen_bytes for s in stages) if any(s.frozen_bytes for s in stages) else (),
                 recompute_seconds=again)


def parallel_costs(costs: Costs, mesh: Mesh | int = 1, tp: int | None = None,
                   collective: Sequence[float] | None = None, shares: TpShares | None = None,
                   collective_backward: Sequence[float] | None = None) -> Costs:
    """``costs`` of one microbatch of a pipeline alone, for one process of that pipeline in ``mesh`` (its ``dp``
    replicas, ``cp`` shares of every sequence and ``tp`` shards per stage): forward and backward / (dp x cp x tp),
    activations likewise (roughly, for tp), hand-offs' bytes / (dp x cp) (``comm - latency``), parameters / tp;
    ``collective`` (``tp_collectives`` plus ``cp_collectives``) replaces ``costs.collective`` when given (and
    ``collective_backward`` ``costs.collective_backward``: the launch layout's backward, ``launch_tp_seconds``).
    A trivial mesh returns ``costs`` itself. (``parallel_costs(costs, dp, tp)``, the form before the mesh, still works.)
    ``shares`` (``pipeviz.cost.sharding.tp_shares``): the fractions of each stage's parameters and saved
    activations one shard keeps under the launch's layout, in place of a uniform 1 / tp."""
    if not isinstance(mesh, Mesh):
        mesh = Mesh(pp=1, dp=mesh, tp=tp or 1)
    dp, cp, tp = mesh.dp, mesh.cp, mesh.tp
    if dp == cp == tp == 1 and collective is None:
        return costs
    k, rows = dp * cp * tp, dp * cp

    def kept(values: Sequence[int], share: Sequence[float] | None, per: int) -> tuple[int, ...]:
        # (a uniform 1/tp in the same arithmetic as ever: the planner compares these bytes with a limit)
        if share is None:
            return tuple(round(v / per) for v in values)
        return tuple(round(v / (per // tp) * f) for v, f in zip(values, share, strict=False))

    return replace(
        costs,
        forward=tuple(f / k for f in costs.forward),
        backward=tuple(b / k for b in costs.backward),
        recompute_seconds=tuple(r / k for r in costs.recompute_seconds),
        comm=tuple((c - costs.latency) / rows + costs.latency for c in costs.comm),
        activation_bytes=kept(costs.activation_bytes, shares.activations if shares else None, k),
        param_bytes=kept(costs.param_bytes, shares.params if shares else None, tp),
        frozen_bytes=kept(costs.frozen_bytes, shares.params if shares else None, tp),
        collective=tuple(collective) if collective is not None else costs.collective,
        collective_backward=(tuple(collective_backward) if collective_backward is not None
                             else costs.collective_backward),
        recompute_bytes=kept(costs.recompute_bytes, shares.activations if shares else None, k),
        send_bytes=tuple(b / rows for b in costs.send_bytes),
    )


def overlapped(costs: Costs) -> Costs:
    """``costs`` with its collectives overlapping the matmuls they feed (``Collectives.tp_overlap``: Megatron-Core's
    ``--tp-comm-overlap``, torchtitan's async TP): a forward pays only what its collectives outlast the stage's
    forward compute by, a backward (and input-grad pass) what they outlast its backward compute by. The backward's
    own collectives where the layout has them (``collective_backward``: the launch's), else the forward's (Megatron's
    layout: as many in the backward). Never slower: each action's seconds become ``max(compute, collectives)``.

    Example:
        >>> overlapped(parallel_costs(costs, Mesh(1, 1, 8), collective=tp_s)).duration(0, "F")   # max(F, tp_s[0])
    """
    if not costs.collective:
        return costs
    back = costs.collective_backward or costs.collective
    return replace(costs,
                   collective=tuple(max(0.0, c - f) for c, f in zip(costs.collective, costs.forward, strict=True)),
                   collective_backward=tuple(max(0.0, c - b) for c, b in zip(back, costs.backward, strict=True)))


def selective_saves_nothing(graph: GraphView, options: CostOptions | None = None) -> bool:
    """Whether selective recomputation stores exactly what no recomputation stores on this graph: its attention is
    fused (SDPA, flash), which keeps no scores to drop (what ``pv.plan_cluster`` and the Explorer say)."""
    opts = options or CostOptions()
    return (layer_activation_bytes(graph, replace(opts, recompute="selective"))
            == layer_activation_bytes(graph, replace(opts, recompute="none")))
