"""Small models for the planted hangs (``tests/test_hang*.py``): importable, so the ranks can unpickle them."""

from __future__ import annotations

import torch
from torch import nn


class TrimPadding(nn.Module):
    """Drops the trailing positions that are padding (all zeros) in every row of the microbatch: a realistic stage
    whose output length depends on the data (a "trim to the longest sequence" step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = int((x.abs().sum(-1) > 0).sum(1).max())
        return x[:, :length]


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def trimming_model(dim: int = 8, classes: int = 4) -> nn.Sequential:
    """``trim -> proj -> | mix -> pool -> head``: split after ``proj`` the hand-off's sequence length is the
    microbatch's longest sequence, not the example's."""
    return nn.Sequential(TrimPadding(), nn.Linear(dim, dim), nn.Linear(dim, dim), MeanPool(), nn.Linear(dim, classes))
