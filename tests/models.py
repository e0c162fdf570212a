"""Small models for runtime tests: importable, so spawned workers can load them by reference too."""

from __future__ import annotations

import torch
from torch import nn

from pipeviz.schedule.training import cross_entropy


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


lm_loss = cross_entropy  # the one language-model loss: pv.cross_entropy over the last dim


class Rotary(nn.Module):
    """A table computed under ``@torch.no_grad()`` with autocast off inside, as HF's rotary embeddings before
    transformers 5.24 are: two nested regions in one layer."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.linspace(0.5, 2.0, d), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return torch.cos(x.float() * self.inv_freq)


class Regions(nn.Module):
    """Every kind of grad-mode and autocast region ``torch.export`` captures as a higher-order op: a ``no_grad``
    block between layers (frozen statistics), a decorated layer (``Rotary``), a module called inside a
    ``no_grad`` block (an EMA teacher: not a split point), ``set_grad_enabled(True)``, and a bfloat16
    ``autocast`` block around a layer."""

    def __init__(self, d: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(d, d) for _ in range(4))
        self.rotary = Rotary(d)
        self.teacher = nn.Linear(d, d)
        self.out = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l0(x))
        with torch.no_grad():
            scale = h.norm(dim=-1, keepdim=True) + 1
        h = h / scale + self.rotary(h)
        with torch.no_grad():
            frozen = self.teacher(h)
        h = torch.relu(self.l1(h)) + 0.5 * frozen
        with torch.set_grad_enabled(True):
            h = h * 1.5
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.l2(h)
        h = torch.relu(self.l3(h.float()))
        return self.out(h)


class TiedSkipBN(nn.Module):
    """A tied embedding and head, a skip connection over two blocks and a BatchNorm: what data parallelism
    must keep exact (the tied copies' gradients summed across stages, the skip relayed, each replica's running
    statistics its own)."""

    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.l1, self.l2, self.l3 = (nn.Linear(d, d) for _ in range(3))
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.l1(self.emb(ids)))
        b = self.bn(a.transpose(1, 2)).transpose(1, 2)
        c = torch.tanh(self.l2(b)) + a
        return self.head(torch.tanh(self.l3(c)))
