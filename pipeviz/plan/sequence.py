"""``SequenceStage``: a stage of a manual plan (``pv.manual_plan``), its modules run one after another.

Example:
    >>> stage = SequenceStage(model, ["blocks.0", "blocks.1"])      # deep copies, original names kept
    >>> y = stage(x)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

__all__ = ["SequenceStage"]


class SequenceStage(nn.Module):
    """A stage of a manual plan: its modules, under their original names, run one after another."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.order = list(names)
        # One deepcopy for all modules keeps weights tied inside the stage tied.
        copies = copy.deepcopy([model.get_submodule(n) for n in names])
        for name, mod in zip(names, copies, strict=True):
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for atom in path:
                if atom not in parent._modules:
                    parent.add_module(atom, nn.Module())
                parent = parent._modules[atom]  # type: ignore[assignment]
            parent.add_module(leaf, mod)

    def forward(self, *args: object, **kwargs: object) -> object:
        x: object = None
        for i, name in enumerate(self.order):
            mod = self.get_submodule(name)
            if i == 0:
                x = mod(*args, **kwargs)
            else:
                x = mod(*x) if isinstance(x, tuple) else mod(x)
        return x
