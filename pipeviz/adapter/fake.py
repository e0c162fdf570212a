"""Shapes without computing: run torch code on fake tensors (``fake_tensors``, ``fake_cpu``) and back (``defake``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

T = TypeVar("T")


class Faker(Protocol):
    """What ``fake_tensors`` yields: ``fake(tree)`` is ``tree`` with each tensor a fake one."""

    def __call__(self, tree: T) -> T: ...


@contextlib.contextmanager
def fake_tensors() -> Iterator[Faker]:
    """Inside the block, run code on fake tensors: ``fake(tree)`` turns the tensors of ``tree`` into fake
    ones; real parameters and buffers met along the way are used as fakes too, so nothing real changes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(tree: T) -> T:
        return pytree.tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, tree)

    with torch.no_grad(), mode:
        yield fake


def fake_cpu(model: nn.Module) -> FakeTensorMode:
    """Turn ``model``'s meta tensors into fake CPU tensors (no memory) and return their ``FakeTensorMode``:
    traced inside it (``with mode: torch.export.export(model, fake_inputs)``), a meta model takes the code
    paths it takes on the CPU, where it will run (HF Mixtral dispatches experts by the device type; on the
    meta device it would trace the GPU path). Tensors shared by several modules stay shared."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in memo:
                    with mode:
                        fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else fake
                table[key] = memo[id(t)]  # type: ignore[assignment]
    return mode


def defake(module: nn.Module) -> None:
    """Turn the fake tensors a ``fake_cpu`` trace left in ``module`` back into meta tensors (constants the
    trace created from Python numbers keep their value)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def plain(t: torch.Tensor) -> torch.Tensor:
        const = getattr(t, "constant", None)
        if isinstance(const, torch.Tensor) and not isinstance(const, FakeTensor):
            return const.clone()
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if isinstance(t, FakeTensor):
                    value = plain(t)
                    table[key] = nn.Parameter(value, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else value  # type: ignore[assignment]
        for key, t in list(vars(mod).items()):
            if isinstance(t, FakeTensor):
                setattr(mod, key, plain(t))
