"""transformers 4.x mixture-of-experts blocks, made exportable for tracing and splitting.

transformers 4.x's ``MixtralSparseMoeBlock`` and ``Qwen2MoeSparseMoeBlock`` loop over the experts that received a
token (``for expert_idx in expert_hit``, a tensor): a data-dependent loop ``torch.export`` cannot capture, so
neither model could be traced or split. Inside ``exportable_moe()`` their forward is the same computation with
the loop over every expert (``range(num_experts)``): each expert still runs on exactly the tokens routed to it
(``torch.where`` on its column of the routing mask; none: an empty batch) and adds into the output in the same
expert order, so outputs are bit-for-bit the original's and gradients equal to rounding (autograd may sum the
same terms in another order: ≤ 1e-7 measured on tiny Qwen2-MoE and Mixtral). transformers 5.x rewrote these blocks
(experts as 3-D tensors) and exports as is; nothing is patched there. The patch is on the class, for the block
only: ``pv.trace`` and ``plan.pipe()`` enter it around ``torch.export`` / torch's ``pipeline()``; the user's model
runs the original forward everywhere else (the numerics reference included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["exportable_moe"]

# (module, class) of the blocks whose transformers 4.x forward loops over a tensor of hit experts
_BLOCKS = (("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
           ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"))


class _SparseMoeBlock(Protocol):
    """What the patched forwards read of a transformers 4.x sparse MoE block (its attributes and submodules)."""

    num_experts: int
    top_k: int
    gate: Callable[[torch.Tensor], torch.Tensor]
    experts: nn.ModuleList


class _MixtralBlock(_SparseMoeBlock, Protocol):
    training: bool
    jitter_noise: float


class _Qwen2MoeBlock(_SparseMoeBlock, Protocol):
    norm_topk_prob: bool
    shared_expert: Callable[[torch.Tensor], torch.Tensor]
    shared_expert_gate: Callable[[torch.Tensor], torch.Tensor]


def _routed(block: _SparseMoeBlock, hidden_states: torch.Tensor, routing_weights: torch.Tensor,
            selected_experts: torch.Tensor) -> torch.Tensor:
    """The experts' weighted outputs, summed per token: transformers 4.57's loop, over every expert."""
    hidden_dim = hidden_states.shape[-1]
    final = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(selected_experts, num_classes=block.num_experts).permute(2, 1, 0)
    for e in range(block.num_experts):
        idx, top_x = torch.where(expert_mask[e])
        current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
        current = block.experts[e](current_state) * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, current.to(hidden_states.dtype))
    return final


def _route(block: _SparseMoeBlock, hidden_states: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, ...]:
    router_logits = block.gate(hidden_states)
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, block.top_k, dim=-1)
    if normalize:
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    return router_logits, routing_weights.to(hidden_states.dtype), selected_experts


def _mixtral_forward(self: _MixtralBlock, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    if self.training and self.jitter_noise > 0:
        hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
    hidden_states = hidden_states.view(-1, hidden_dim)
    router_logits, routing_weights, selected = _route(self, hidden_states, normalize=True)
    final = _routed(self, hidden_states, routing_weights, selected)
    return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


def _qwen2_moe_forward(self: _Qwen2MoeBlock, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    hidden_states = hidden_states.view(-1, hidden_dim)
    router_logits, routing_weights, selected = _route(self, hidden_states, normalize=self.norm_topk_prob)
    final = _routed(self, hidden_states, routing_weights, selected)
    shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
    return (final + shared).reshape(batch_size, sequence_length, hidden_dim), router_logits


_FORWARDS = {"MixtralSparseMoeBlock": _mixtral_forward, "Qwen2MoeSparseMoeBlock": _qwen2_moe_forward}


def _loop_blocks() -> list[type]:
    """The installed transformers' MoE block classes whose forward loops over hit experts (4.x only)."""
    import importlib
    import inspect
    import sys

    if "transformers" not in sys.modules:  # a model from transformers has imported it; else nothing to patch
        return []
    found = []
    for module_name, cls_name in _BLOCKS:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            continue
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if "for expert_idx in expert_hit" in source and "self.experts[expert_idx]" in source:
            found.append(cls)
    return found


@contextlib.contextmanager
def exportable_moe() -> Iterator[None]:
    """Inside the block, transformers 4.x's Mixtral / Qwen2-MoE sparse blocks run an exportable, identical
    forward (see the module's docstring); outside it, their own."""
    patched = [(cls, cls.__dict__["forward"]) for cls in _loop_blocks()]
    for cls, _ in patched:
        setattr(cls, "forward", _FORWARDS[cls.__name__])  # noqa: B010 (a class found at run time)
    try:
        yield
    finally:
        for cls, forward in patched:
            setattr(cls, "forward", forward)  # noqa: B010
