"""What a split reads of a traced model: ``Layer``, ``GraphIndex`` and the ``GraphView`` protocol that
``pipeviz.graph.model.ModelGraph`` implements. Below both the graph and the plan modules, so that a plan can name the
graph it splits without importing the graph module, whose ``split`` makes plans: no import cycle, types included.

Example:
    >>> isinstance(pv.trace(model, example_args=(x,)), GraphView)
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import nn
from torch.distributed.pipelining import SplitPoint

if TYPE_CHECKING:
    from pipeviz.capture.export import Capture
    from pipeviz.capture.measured import Profile
    from pipeviz.capture.units import CallTree, Unit

__all__ = ["GraphIndex", "GraphView", "Layer"]


@dataclass(frozen=True)
class Layer:
    """One layer of a ``ModelGraph``: one call of a module in the model's forward.

    Attributes:
        name: the module's FQN in the original model (``"transformer.h.3"``); ``fqn@k`` for call ``k`` of
            a module that runs several times (``"shared@1"``).
        kind: the module's class name.
        index: position in execution order.
        params: parameter elements (buffers excluded); a tensor shared by several layers counts once, in
            the first.
        param_bytes: bytes of those parameters.
        flops: forward FLOPs for the example batch (``torch.utils.flop_counter``).
        out_bytes: bytes of the activations this layer hands to the rest of the model.
        shared: canonical names of parameters this layer shares with other layers (tied or reused weights).
        calls: how many times forward calls the module (more than 1: each call is a layer of its own).
        expandable: whether ``graph.expand(name)`` can show its children.
        activation_bytes: bytes of every activation the layer produces (its ops' outputs, views included): an
            upper bound of what it keeps for backward.
        saved_bytes: bytes autograd saves for the layer's backward (``Op.saved_bytes``: parameters never,
            nothing in a no_grad region, each tensor once in the model, in the first layer that saves it: a
            layer's input saved by the layer before it too counts there): what training keeps alive from the
            layer's forward to its backward, the figure the memory model uses
            (``pipeviz.costs.layer_activation_bytes``). The layer making the model's output also holds what the
            loss saves (one output-sized tensor). A stage adds the copies it receives across a split
            (``StageInfo.activation_bytes``).
        in_bytes: bytes of the values the layer reads from outside itself (other layers' outputs, model inputs):
            what it keeps under full recomputation.
        buffer_bytes: bytes of the buffers (running statistics, ``inv_freq``, ...) first used here.
    """

    name: str
    kind: str
    index: int
    params: int
    param_bytes: int
    flops: int
    out_bytes: int
    shared: tuple[str, ...]
    calls: int
    expandable: bool
    activation_bytes: int = 0
    buffer_bytes: int = 0
    saved_bytes: int = 0
    in_bytes: int = 0


@dataclass(frozen=True)
class GraphIndex:
    """The part of a ``ModelGraph`` a plan reads: ops in execution order with prefix sums, the values
    crossing each point, and where every tensor and model input is used. Positions are op indices; a split
    sits between two ops (``k + 0.5``).

    Attributes:
        num_ops: ops in the captured forward.
        layer_names, layer_first, layer_last: the view's layers and their op spans.
        flops_prefix, act_prefix: prefix sums of FLOPs and output bytes over ops (length ``num_ops + 1``).
        values: ``(producer op, last reader op, bytes)`` of every value read after it is made.
        param_uses, buffer_uses, input_uses: canonical name -> ops reading it.
        numel, nbytes: per canonical tensor name.
        mutated: buffers the forward updates in place.
        saved_prefix: prefix sums of what each op saves for backward (``Op.saved_bytes``: each tensor in the
            first op that saves it; the model's output op also holds the loss's, ``Layer.saved_bytes``).
        resaved: ``(op, first op, slot, bytes)`` of every tensor an op saves that an earlier op saved first
            (``Op.resaved``): a stage other than the first saver's holds a copy of its own (it received it).
        loss_saved: ``(op, bytes)``: the loss's saved bytes, counted in ``saved_prefix`` at the model's output op.
    """

    num_ops: int
    layer_names: tuple[str, ...]
    layer_first: tuple[int, ...]
    layer_last: tuple[int, ...]
    flops_prefix: tuple[int, ...]
    act_prefix: tuple[int, ...]
    values: tuple[tuple[int, int, int], ...]
    param_uses: Mapping[str, tuple[int, ...]]
    buffer_uses: Mapping[str, tuple[int, ...]]
    input_uses: Mapping[str, tuple[int, ...]]
    numel: Mapping[str, int]
    nbytes: Mapping[str, int]
    mutated: frozenset[str] = field(default_factory=frozenset)
    saved_prefix: tuple[int, ...] = ()
    resaved: tuple[tuple[int, int, int, int], ...] = ()
    loss_saved: tuple[int, int] = (-1, 0)


@runtime_checkable
class GraphView(Protocol):
    """A traced model's view as plans and their consumers read it (``pipeviz.graph.model.ModelGraph`` is one)."""

    profile: Profile | None
    _tree: CallTree

    @property
    def capture(self) -> Capture: ...

    @property
    def index(self) -> GraphIndex: ...

    @property
    def layers(self) -> list[Layer]: ...

    @property
    def edges(self) -> list[tuple[str, str]]: ...

    @property
    def layer_names(self) -> tuple[str, ...]: ...

    @property
    def model(self) -> nn.Module: ...

    @property
    def notes(self) -> list[str]: ...

    @property
    def example_args(self) -> tuple[object, ...]: ...

    @property
    def example_kwargs(self) -> dict[str, object]: ...

    @property
    def batch_size(self) -> int | None: ...

    @property
    def split_candidates(self) -> list[str]: ...

    @property
    def skip_edges(self) -> list[tuple[str, str]]: ...

    @property
    def total_params(self) -> int: ...

    @property
    def total_buffer_bytes(self) -> int: ...

    @property
    def total_flops(self) -> int: ...

    def layer(self, name: str) -> Layer: ...

    def can_split_after(self, name: str) -> bool: ...

    def valid_splits_text(self) -> str: ...

    def position(self, name: str, point: SplitPoint = SplitPoint.END) -> float: ...

    def unit(self, name: str) -> Unit: ...

    def region_at(self, position: float) -> str: ...

    def data_dependent_at(self, position: float) -> str: ...

    def refine(self, positions: Sequence[float]) -> GraphView: ...

    def regroup(self, depth: int | None = None) -> GraphView: ...

    def expand(self, name: str) -> GraphView: ...

    def collapse(self, name: str) -> GraphView: ...

    def with_profile(self, profile: Profile | None) -> GraphView: ...

    # a SplitPlan: pipeviz.plan.split imports this module, so the type cannot be named here without a cycle
    def split(self, spec: Iterable[str] | Mapping[str, object]) -> object: ...

    def _require_layer(self, name: object) -> None: ...
