"""Models written the way other people write them (not shaped for pipeviz), for correctness tests.

Importable, so spawned workers load them by reference. Each ``case_*`` returns
``(model, args, kwargs, target, loss_fn, splits)``: one full batch, and split names a user would pick.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeviz.schedule.training import cross_entropy

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any], torch.Tensor, Callable[..., torch.Tensor], list[str]]


lm_loss = cross_entropy  # the one language-model loss: pv.cross_entropy over the last dim


def sum_of_ce(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0], target) + out[1].pow(2).mean()


class SeqBlocks(nn.Module):
    """The PiPPy tutorial's network with each block an ``nn.Sequential(Linear, ReLU)``."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        for i in range(n):
            setattr(self, f"layer{i}", nn.Sequential(nn.Linear(d, d), nn.ReLU()))
        self.n = n
        self.output_proj = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = getattr(self, f"layer{i}")(x)
        return self.output_proj(x)


class Reused(nn.Module):
    """One module applied before and after the split (its weights live in two stages)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(x)
        x = torch.relu(self.l1(x))
        x = torch.relu(self.l2(x))
        x = self.shared(x)
        return self.head(x)


class BNNet(nn.Module):
    """BatchNorm (running statistics, ``num_batches_tracked``) plus a registered buffer."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc0 = nn.Linear(d, d)
        self.bn0 = nn.BatchNorm1d(d)
        self.fc1 = nn.Linear(d, d)
        self.bn1 = nn.BatchNorm1d(d)
        self.fc2 = nn.Linear(d, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn0(self.fc0(x)))
        x = torch.relu(self.bn1(self.fc1(x * self.scale)))
        return self.fc2(x)


class KwInputs(nn.Module):
    """Keyword inputs: a mask used by a later block."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = torch.relu(self.a(x))
        x = torch.relu(self.b(x))
        if mask is not None:
            x = x * mask
        return self.d(torch.relu(self.c(x)))


class TwoOutputs(nn.Module):
    """Returns logits and an auxiliary tensor."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.cls, self.aux = nn.Linear(d, 4), nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.cls(h), self.aux(h)


class Aliased(nn.Module):
    """One Parameter reachable under two module names (``dec`` is ``enc`` again, transposed use)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.enc = nn.Linear(d, d, bias=False)
        self.mid = nn.Linear(d, d)
        self.dec = nn.Linear(d, d, bias=False)
        self.dec.weight = self.enc.weight
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.enc(x))
        x = torch.tanh(self.mid(x))
        x = torch.tanh(self.dec(x))
        return self.out(x)


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class TinyResNet(nn.Module):
    """A torchvision-style ResNet: stem, residual stages, pooling, classifier."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.layer2 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Expert(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class MoELayer(nn.Module):
    """Pre-norm mixture of experts: a learned router picks the top-k experts per token; every expert runs
    densely and the router's weights (zero for experts not picked) mix the results."""

    def __init__(self, d: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, 2 * d) for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        probs = self.router(h).softmax(-1)
        top, idx = probs.topk(self.k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        out = torch.stack([e(h) for e in self.experts], dim=-1)
        return x + (out * gates.unsqueeze(-2)).sum(-1)


class MoENet(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.moe0 = MoELayer(d)
        self.moe1 = MoELayer(d)
        self.moe2 = MoELayer(d)
        self.layers = layers
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = self.moe2(self.moe1(self.moe0(x)))
        return self.head(x)


def case(name: str) -> Case:
    """The named case, built with seed 0."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    y4 = torch.randint(0, 4, (8,))
    if name == "mlp_chain":
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        return model, (x,), {}, y4, F.cross_entropy, ["1"]
    if name == "seq_blocks":
        return SeqBlocks(), (x,), {}, torch.randint(0, 10, (8,)), F.cross_entropy, ["layer0", "layer1"]
    if name == "reused":
        return Reused(), (x,), {}, y4, F.cross_entropy, ["l1"]
    if name == "batchnorm":
        return BNNet(), (x,), {}, y4, F.cross_entropy, ["bn0"]
    if name == "kwargs":
        mask = (torch.rand(8, 16) > 0.3).float()
        return KwInputs(), (x,), {"mask": mask}, y4, F.cross_entropy, ["a"]
    if name == "two_outputs":
        return TwoOutputs(), (x,), {}, y4, sum_of_ce, ["a"]
    if name == "aliased":
        return Aliased(), (x,), {}, y4, F.cross_entropy, ["enc", "mid"]
    if name == "resnet":
        return (TinyResNet(), (torch.randn(8, 3, 8, 8),), {}, torch.randint(0, 5, (8,)), F.cross_entropy,
                ["layer1"])
    if name == "moe":
        ids = torch.randint(0, 32, (8, 6))
        return MoENet(), (ids,), {}, torch.randint(0, 32, (8, 6)), lm_loss, ["moe0", "moe1"]
    raise KeyError(name)


CASES = ("mlp_chain", "seq_blocks", "reused", "batchnorm", "kwargs", "two_outputs", "aliased", "resnet", "moe")


def routed_moe_net(skip_empty: bool = False) -> nn.Module:
    """The seed's mixture of experts with routed dispatch (``pipeviz.zoo.MoENet``), small: vocab 32, 16 wide,
    4 blocks; ``skip_empty``: with a branch on values torch.export cannot capture."""
    from pipeviz.zoo import MoENet

    return MoENet(vocab=32, d=16, layers=4, skip_empty=skip_empty)
