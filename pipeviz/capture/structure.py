"""What a model says of itself, without tracing: its module tree, the alias groups of its tensors (tied weights:
one canonical name per tensor), its buffers, frozen parameters, parameter-free elementwise modules and tensor
sizes. Both routes to a ``Capture`` read the model through these: the traced one (``pipeviz.capture.export``)
and the manual one (``pv.manual_plan``).

Example:
    >>> canonical, groups = alias_groups(gpt2)
    >>> groups["transformer.wte.weight"]
    ('transformer.wte.weight', 'lm_head.weight')
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["alias_groups", "buffer_names", "elementwise_modules", "frozen_names", "module_table", "tensor_at",
           "tensor_sizes"]


def module_table(model: nn.Module) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every module's FQN (shared modules under each of their names) -> (class name, child FQNs)."""
    table: dict[str, tuple[str, tuple[str, ...]]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        children = tuple(f"{fqn}.{n}" if fqn else n for n, _ in mod.named_children())
        table.setdefault(fqn, (type(mod).__name__, children))
    return table


def alias_groups(model: nn.Module) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Map every parameter/buffer FQN to a canonical name (its first FQN) and list each group."""
    by_id: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), []).append(name)
    canonical: dict[str, str] = {}
    groups: dict[str, tuple[str, ...]] = {}
    for names in by_id.values():
        for n in names:
            canonical[n] = names[0]
        groups[names[0]] = tuple(names)
    return canonical, groups


def buffer_names(model: nn.Module) -> frozenset[str]:
    """Canonical names of the model's buffers (every alias group whose tensor is a buffer)."""
    canonical, _ = alias_groups(model)
    return frozenset(canonical[name] for name, _ in model.named_buffers(remove_duplicate=False))


def frozen_names(model: nn.Module, groups: dict[str, tuple[str, ...]]) -> frozenset[str]:
    """Canonical names of the parameters that do not train (``requires_grad=False``: a frozen base under a LoRA-style
    adapter): they get no gradient and no optimizer state."""
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    return frozenset(g for g in groups if id(tensor_at(model, g)) in frozen)


_ELEMENTWISE_HOMES = ("torch.nn.modules.activation", "torch.nn.modules.dropout")


def elementwise_modules(model: nn.Module) -> frozenset[str]:
    """FQNs of parameter-free elementwise modules (activations, dropout, identity): glue between layers,
    never a layer of their own in the default view (they stay valid split points)."""
    out = set()
    for fqn, mod in model.named_modules(remove_duplicate=False):
        if not fqn or next(mod.children(), None) is not None:
            continue
        if next(mod.parameters(), None) is not None or next(mod.buffers(), None) is not None:
            continue
        home = type(mod).__module__
        if (isinstance(mod, nn.Identity) or home in _ELEMENTWISE_HOMES
                or home.rsplit(".", 1)[-1] in ("activations", "activation")) and "attention" not in home.lower():
            out.add(fqn)
    return frozenset(out)


def tensor_at(model: nn.Module, fqn: str) -> torch.Tensor:
    """The parameter or buffer ``fqn`` names (``"blocks.0.weight"``)."""
    mod_name, _, attr = fqn.rpartition(".")
    return getattr(model.get_submodule(mod_name), attr)


def tensor_sizes(model: nn.Module, groups: dict[str, tuple[str, ...]]) -> tuple[dict[str, int], dict[str, int]]:
    """Elements and bytes of each alias group's tensor, by canonical name (``Capture.param_numel``, ``param_bytes``)."""
    tensors = {g: tensor_at(model, g) for g in groups}
    return ({g: t.numel() for g, t in tensors.items()}, {g: t.numel() * t.element_size() for g, t in tensors.items()})
