"""Frozen parameters (``requires_grad=False``), as a LoRA-style adapter written in plain torch freezes its base:
trained exactly, the frozen ones untouched (AdamW's weight decay included), and the memory figures (a stage's,
the simulator's per rank) counting gradients and optimizer state for the trainable ones only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeviz as pv
from pipeviz.schedule import traits as schedules


class LoRABlock(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (``x A^T B^T``), as LoRA adapts a layer."""

    def __init__(self, d: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d) * 0.3)
        self.b = nn.Parameter(torch.randn(d, rank) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + x @ self.a.t() @ self.b.t())


class LoRANet(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d).requires_grad_(False)
        self.blocks = nn.ModuleList(LoRABlock(d) for _ in range(4))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x) + x
        return self.head(x)


def _graph() -> tuple[pv.ModelGraph, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids, target = torch.randint(0, 16, (16, 4)), torch.randint(0, 16, (16, 4))
    return pv.trace(LoRANet(), example_args=(ids,)), ids, target


def _adamw(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "layout"), [
    ("1F1B", {}), ("Interleaved1F1B", {}), ("ZBVZeroBubble", {}), ("DualPipeV", {}), ("1F1B", {"dp": 2}),
    ("GPipe", {"dp": 2, "dp_shard": True}),
    pytest.param("LoopedBFS", {}, marks=(pytest.mark.compat, pytest.mark.coverage)),
    pytest.param("InterleavedZeroBubble", {}, marks=(pytest.mark.compat, pytest.mark.coverage))])
def test_frozen_parameters_stay_and_the_rest_trains_exactly(schedule: str, layout: dict[str, object]) -> None:
    graph, ids, target = _graph()
    before = {k: v.clone() for k, v in graph.model.state_dict().items()}
    cuts = ["blocks.0", "blocks.1", "blocks.2"] if schedules.info(schedule).multi else ["blocks.1"]
    run = pv.launch(graph.split(cuts), schedule, 4, steps=2, inputs=(ids,), target=target,
                    loss_fn=pv.cross_entropy, optimizer=_adamw, **layout)
    assert run.wait(300) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok, check
    after = run.state_dict()
    frozen = {n for n, p in graph.model.named_parameters() if not p.requires_grad}
    assert frozen == {"emb.weight", *(f"blocks.{i}.base.{w}" for i in range(4) for w in ("weight", "bias"))}
    for name, value in after.items():
        moved = float((value - before[name]).abs().max())
        assert (moved == 0.0) == (name in frozen), (name, moved)


def test_memory_counts_gradients_and_optimizer_state_of_the_trainable_parameters_only() -> None:
    """Each stage's figure and the simulator's per rank drop (1 gradient + 2 Adam states) x the frozen bytes (beside
    activations, which differ too: a trainable embedding's backward keeps its ids)."""
    graph, _, _ = _graph()
    plan = graph.split(["blocks.1"])
    assert graph.capture.frozen == frozenset({"emb.weight", *(f"blocks.{i}.base.{w}" for i in range(4)
                                                              for w in ("weight", "bias"))})
    frozen = [s.frozen_bytes for s in plan.stages]
    assert frozen == [(16 * 8 + 2 * (8 * 8 + 8)) * 4, 2 * (8 * 8 + 8) * 4]
    trained = pv.trace(LoRANet().requires_grad_(True), example_args=graph.example_args).split(["blocks.1"])
    assert trained.graph.capture.frozen == frozenset()
    for s, t, f in zip(plan.stages, trained.stages, frozen, strict=True):
        assert (t.memory_bytes - t.activation_bytes) - (s.memory_bytes - s.activation_bytes) == 3 * f
    sim, whole = (pv.simulate(p, "1F1B", 4, loss_fn=pv.cross_entropy).meta for p in (plan, trained))
    static = [[m - a for m, a in zip(t["memory_bytes"], t["peak_activation_bytes"], strict=True)] for t in (sim, whole)]
    assert [w - s for w, s in zip(static[1], static[0], strict=True)] == [3 * f for f in frozen]
