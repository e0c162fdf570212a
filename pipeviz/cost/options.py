"""``CostOptions``: the settings every cost takes, one object (the machine, the dtype, recomputation, links, the
batch's scale).

Example:
    >>> opts = CostOptions(hardware="h100", dtype="bfloat16", recompute="selective")
    >>> pv.simulate(plan, cfg, options=opts); pv.balance(graph, 8, options=opts)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from pipeviz.cost.comm import backend_link
from pipeviz.cost.machine import DTYPE_BYTES, Hardware, dtype_name, hardware
from pipeviz.cost.rule import OPTIMIZER_STATES

if TYPE_CHECKING:
    from pipeviz.capture.view import GraphView

__all__ = ["OPTIMIZER_STATES", "RECOMPUTE", "CostChanges", "CostOptions", "LinkOptions"]


class LinkOptions(TypedDict, total=False):
    """The FLOP-rate and link keywords of ``stage_costs`` (``CostOptions``' fields of the same names)."""

    device: str | None
    flops_per_s: float | None
    bandwidth: float | None
    latency: float | None
    backend: str | None


class CostChanges(LinkOptions, total=False):
    """``CostOptions``' fields as keywords (``CostOptions.of``): None keeps the value of the options given."""

    hardware: Hardware | str | None
    dtype: str | None
    recompute: str | None
    optimizer_states: int | None
    batch_scale: float | None
    expert_imbalance: float | None




RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class CostOptions:
    """Everything the cost model needs besides the plan: one typed object that ``stage_costs``,
    ``memory_per_rank``, ``pv.simulate``, ``pv.balance``, ``pv.compare`` and ``pv.plan_cluster`` all take.

    Example:
        >>> opts = CostOptions(hardware="h100", dtype="bfloat16", recompute="selective")
        >>> pv.simulate(plan, "1F1B", 8, options=opts)         # the same as the keywords below
        >>> pv.simulate(plan, "1F1B", 8, hardware="h100", dtype="bfloat16", recompute="selective")

    Attributes:
        hardware: a ``pv.Hardware`` or preset name; layer times then come from a roofline per op
            (``pipeviz.hardware.op_time``) and links from the hardware (intra- or inter-node by where the ranks
            sit). ``None``: FLOPs at ``flops_per_s`` (default by ``device``) and the ``backend``'s link.
        dtype: the training dtype (``"bfloat16"``, ``"float32"``, ...): the peak used and the size of activations,
            hand-offs and weight reads relative to the dtype the model was traced in (parameters, gradients and
            optimizer state keep the traced size: mixed precision keeps float32 masters). Default: the hardware's
            fast dtype; without hardware, the traced sizes.
        recompute: ``"none"``, ``"selective"`` (attention's score/softmax activations recomputed in the backward,
            Korthikanti et al. 2022) or ``"full"`` (each layer keeps only its input and runs its forward again in
            the backward).
        device, flops_per_s, bandwidth, latency, backend: the FLOP-rate and link settings without hardware
            (``bandwidth`` / ``latency`` override the hardware's links too).
        optimizer_states: tensors of optimizer state per parameter (Adam: 2).
        batch_scale: the step's batch as a multiple of the traced example batch, in tokens (``pv.plan_cluster``
            plans a global batch and sequence length the graph was not traced with): compute, activations and
            hand-offs scale with it, parameters do not.
        expert_imbalance: under expert parallelism (``ep`` > 1), the busiest expert owner's routed tokens over
            the mean (``pipeviz.sim.experts.measured_imbalance(run.expert_tokens, ep)`` reads it from a run): every
            rank of a group waits for it, so the routed experts' compute is charged that many times. Default 1.0,
            a balanced router (what load-balancing losses aim at; a small random MoE measured higher, see
            docs/experts.md).

    Raises:
        ValueError: an unknown recompute mode, hardware or dtype (the message lists the valid ones), or an
            ``expert_imbalance`` below 1.
    """

    hardware: Hardware | str | None = None
    dtype: str | None = None
    recompute: str = "none"
    device: str = "cpu"
    flops_per_s: float | None = None
    bandwidth: float | None = None
    latency: float | None = None
    backend: str | None = None
    optimizer_states: int = OPTIMIZER_STATES
    batch_scale: float = 1.0
    expert_imbalance: float = 1.0

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Unknown recompute={self.recompute!r}; valid: {', '.join(RECOMPUTE)}. Fix: "
                             "recompute='selective' keeps all but attention's scores, 'full' only each layer's input.")
        if self.hardware is not None:
            hw = hardware(self.hardware)
            object.__setattr__(self, "hardware", hw)
            object.__setattr__(self, "dtype", hw.dtype(self.dtype))
        elif self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if not self.batch_scale > 0:
            raise ValueError(f"batch_scale must be positive, got {self.batch_scale!r}.")
        if not self.expert_imbalance >= 1.0:
            raise ValueError(f"expert_imbalance={self.expert_imbalance!r}: the busiest expert owner's tokens over the "
                             "mean, at least 1.0. Fix: 1.0 (balanced) or a measured factor "
                             "(pipeviz.sim.experts.measured_imbalance).")

    @classmethod
    def of(cls, options: CostOptions | None = None, **changes: Unpack[CostChanges]) -> CostOptions:
        """``options`` (default: all defaults) with every keyword that is not ``None`` replaced: how the
        functions that take both ``options=`` and today's keywords merge them."""
        given: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
        base = options if options is not None else cls()
        return replace(base, **given) if given else base

    @property
    def hw(self) -> Hardware | None:
        """The ``Hardware`` (resolved from a name on construction), or None."""
        return self.hardware if isinstance(self.hardware, Hardware) else None

    def link(self, span: int = 2, allreduce: bool = False) -> tuple[float, float]:
        """``(bandwidth, latency)`` between ranks ``span`` apart (a group over ``span`` consecutive ranks): the
        hardware's intra- or inter-node link (an all-reduce's share of it with ``allreduce=True``), else the
        backend's; ``bandwidth`` / ``latency`` override."""
        hw = self.hw
        if hw is None:
            return backend_link(self.device, self.backend, self.bandwidth, self.latency)
        bw, lat = hw.link(span, allreduce=allreduce)
        return self.bandwidth or bw, lat if self.latency is None else self.latency

    def byte_scale(self, graph: GraphView) -> float:
        """Activation and hand-off bytes in ``dtype`` relative to the traced ones (1 without a dtype)."""
        if self.dtype is None:
            return 1.0
        cap = graph.capture
        numel = sum(cap.param_numel.values())
        traced = sum(cap.param_bytes.values()) / numel if numel else 4.0
        return DTYPE_BYTES[self.dtype] / (traced or 4.0)
