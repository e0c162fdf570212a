"""Links and collectives: a link's bandwidth and latency, a ring all-reduce's time, DDP's buckets, the all-reduces
of tensor parallelism and the key/value exchange of context parallelism (a process's share of a stage's costs
under a mesh: ``pipeviz.cost.model.parallel_costs``).

Composed with data (``dp`` replicas), context (``cp`` shares of every sequence) and tensor (``tp`` shards)
parallelism: each replica trains on 1/dp of every microbatch and each share on 1/cp of every sequence, so a
microbatch's compute, activations and hand-off bytes scale by 1/(dp x cp); each shard computes 1/tp of a stage and
holds 1/tp of its parameters (gradients, optimizer state) and, roughly, of its activations (norms and buffers are
replicated in truth: an approximation). Tensor parallelism pays all-reduces of layer outputs on the critical path
(``tp_all_reduces``), context parallelism an all-gather of each attention op's keys and values
(``cp_exchange_seconds``), and the replicas and shares average their gradients once per step (``all_reduce_time`` of
the rank's parameter bytes; ``pv.simulate`` places it).

Example:
    >>> all_reduce_time(2**20, 4, backend_link("cpu"))          # seconds: a ring all-reduce of 1 MiB over 4 processes
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeviz.cost.machine import LINKS
from pipeviz.schedule.mesh import Mesh

if TYPE_CHECKING:
    from pipeviz.capture.view import Layer
    from pipeviz.plan.split import SplitPlan

__all__ = [
    "DDP_BUCKET_BYTES",
    "all_reduce_time",
    "attention_kv_bytes",
    "backend_link",
    "cp_collectives",
    "cp_exchange_bytes",
    "cp_exchange_seconds",
    "ddp_buckets",
    "tp_all_reduces",
    "tp_collectives",
]


DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb=25


def backend_link(device: str | None = "cpu", backend: str | None = None, bandwidth: float | None = None,
         latency: float | None = None) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` of a link: ``LINKS[backend]`` (default gloo on CPU, NCCL on GPUs),
    either figure overridden."""
    name = backend or ("nccl" if str(device).startswith("cuda") else "gloo")
    bw, lat = LINKS.get(name, LINKS["gloo"])
    return bandwidth or bw, lat if latency is None else latency


def all_reduce_time(nbytes: float, ranks: int, via: tuple[float, float]) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` processes on link ``via``:
    ``2(N-1)/N x bytes / bandwidth + 2(N-1) x latency`` (a reduce-scatter then an all-gather, N-1 steps each,
    every step moving bytes/N; Patarasuk & Yuan 2009, NCCL's ring). Zero for one process or no bytes."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = via
    steps = 2 * (ranks - 1)
    return steps / ranks * nbytes / bw + steps * lat


def ddp_buckets(nbytes: int, bucket: int = DDP_BUCKET_BYTES) -> list[int]:
    """Gradient bytes per DDP bucket in the order DDP reduces them (reverse parameter order): full
    ``bucket``-sized ones first, the rest (the stage's first layers, ready only at the end of the backward)
    last. Parameter boundaries and DDP's smaller first bucket are ignored."""
    if nbytes <= 0:
        return []
    full, rest = divmod(nbytes, bucket)
    return [bucket] * full + ([rest] if rest else [])


def tp_all_reduces(layer: Layer) -> int:
    """All-reduces of a layer's output per forward (and as many of its input grad per backward) under tensor
    parallelism, from what the graph knows of the layer (Megatron-LM, Shoeybi et al. 2019):

    - 0 for a layer without parameters, or a normalisation layer (``"Norm"`` in its kind): replicated;
    - 1 for a single module (not expandable: ``Linear``, ``Embedding``, a convolution): one row-parallel
      (or vocabulary-parallel) op whose output is summed across shards;
    - 2 for a composite layer (a block): attention and MLP each end in a row-parallel all-reduce. A block
      holding one Linear (``zoo.MyNetworkBlock``) is counted as a block too: an overestimate.
    """
    if not (layer.params or layer.shared) or "Norm" in layer.kind:
        return 0
    return 2 if layer.expandable else 1


def tp_collectives(plan: SplitPlan, microbatches: float, dp: int = 1, tp: int = 1,
                   via: tuple[float, float] | None = None, scale: float = 1.0) -> tuple[float, ...]:
    """Per stage, seconds of tensor-parallel all-reduces in one forward of one microbatch (as many again in
    its backward): ``sum over layers of all-reduces x all_reduce_time(out_bytes / (m x dp), tp)`` (``scale``:
    the bytes' dtype and batch relative to the traced ones, ``CostOptions``): Megatron-LM's count per layer, the
    layout a cluster's run uses (``pv.launch``'s own is ``pipeviz.cost.sharding.launch_collectives``)."""
    via = via or backend_link()
    layers = {layer.name: layer for layer in plan.graph.layers}
    return tuple(
        sum(tp_all_reduces(layers[n]) * all_reduce_time(layers[n].out_bytes * scale / (microbatches * dp), tp, via)
            for n in s.layers)
        for s in plan.stages
    )


def cp_exchange_bytes(plan: SplitPlan) -> list[list[float]]:
    """Per stage, in op order, the bytes of each key/value exchange its attention ops issue in one forward of the
    traced batch, as ``pipeviz.adapter.context_graph`` issues them: one per ``scaled_dot_product_attention`` (its
    keys and values stacked) where they have one shape, one each otherwise; the whole sequence's bytes (what a share
    holds once gathered). Its backward issues as many, of their gradients."""
    ops = plan.graph.capture.ops
    out: list[list[float]] = [[] for _ in range(plan.num_stages)]
    for op in ops:
        if "scaled_dot_product" not in op.target:
            continue
        stage = out[plan._stage_of_op(op.index)]
        if len(op.inputs) < 3:  # (the trace does not tell keys from values: twice the output, one exchange)
            stage.append(2.0 * op.out_bytes)
            continue
        k, v = (ops[i] for i in op.inputs[1:3])
        same = k.out_bytes == v.out_bytes and _shape(k) == _shape(v)
        stage.extend([float(k.out_bytes + v.out_bytes)] if same else [float(k.out_bytes), float(v.out_bytes)])
    return out


def _shape(op: object) -> object:
    spec = getattr(op, "spec", None)
    return getattr(spec, "shape", None)


def attention_kv_bytes(plan: SplitPlan) -> list[float]:
    """Per stage, the bytes of keys and values its attention ops read in one forward of the traced batch
    (``scaled_dot_product_attention``'s second and third inputs; twice its output where the trace does not tell
    them apart): what context parallelism gathers from the other shares of the sequence."""
    return [sum(xs) for xs in cp_exchange_bytes(plan)]


def cp_exchange_seconds(plan: SplitPlan, microbatches: float, mesh: Mesh, via: tuple[float, float],
                        scale: float = 1.0, gloo: bool = True) -> tuple[list[list[float]], list[list[float]]]:
    """Per stage, the seconds of each exchange of context parallelism in one forward and in one backward of one
    microbatch (``cp_exchange_bytes`` of a microbatch on one replica, ``scale``: the bytes' dtype and batch relative
    to the traced ones): the forward all-gathers the keys and values, ``(cp-1)/cp x bytes / bandwidth + (cp-1) x
    latency`` (half a ring all-reduce); the backward reduce-scatters their gradients, as long on NCCL, while on
    ``gloo`` (no reduce-scatter) the run all-reduces them and each share keeps its part: a whole all-reduce.

    Example:
        >>> fwd, bwd = cp_exchange_seconds(plan, 4, pv.Mesh(pp=2, cp=2), backend_link("cpu"))
    """
    fwd, bwd = [], []
    for xs in cp_exchange_bytes(plan):
        whole = [all_reduce_time(b * scale / (microbatches * mesh.dp), mesh.cp, via) for b in xs]
        fwd.append([t / 2 for t in whole])
        bwd.append(whole if gloo else [t / 2 for t in whole])
    return fwd, bwd


def cp_collectives(plan: SplitPlan, microbatches: float, mesh: Mesh, via: tuple[float, float],
                   scale: float = 1.0) -> tuple[float, ...]:
    """Per stage, seconds of context parallelism's exchanges in one forward of one microbatch (the sum of
    ``cp_exchange_seconds``' forward ones: every attention op's keys and values all-gathered across the ``cp``
    shares of the sequence, as torchtitan's all-gather rotation does), not overlapped."""
    return tuple(sum(xs) for xs in cp_exchange_seconds(plan, microbatches, mesh, via, scale)[0])
