"""Small models for runtime tests: importable, so spawned workers can load them by reference too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Skip4(nn.Module):
    """Two skip connections: ``a`` jumps from l0 to after l2, ``b`` from l1 to the output."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(d, d) for _ in range(4))
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.l0(x))
        b = torch.relu(self.l1(a))
        c = torch.relu(self.l2(b)) + a
        d = torch.relu(self.l3(c))
        return self.out(d + b)


class Tied4(nn.Module):
    """Embedding and output head share one weight (as GPT-2's wte and lm_head)."""

    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.l1, self.l2, self.l3 = (nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in (self.l1, self.l2, self.l3):
            x = torch.tanh(layer(x))
        return self.head(x)


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())
