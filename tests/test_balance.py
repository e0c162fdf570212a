"""pv.balance: optimal contiguous splits, memory limits, virtual stages."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import pipeviz as pv
from pipeviz.planner.balance import partition
from pipeviz.runtime import profiler
from pipeviz.sim.simulate import estimate_costs
from pipeviz.zoo import MyNetwork


def _max_group(costs: list[float], ends: list[int]) -> float:
    bounds = [0, *[e + 1 for e in ends], len(costs)]
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


def test_partition_is_optimal_against_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 10)
        k = rng.randint(1, n)
        costs = [rng.choice([rng.random(), float(rng.randint(1, 9))]) for _ in range(n)]
        ends = partition(costs, k)
        assert ends is not None and len(ends) == k - 1 and ends == sorted(set(ends))
        brute = min(_max_group(costs, list(c)) for c in itertools.combinations(range(n - 1), k - 1))
        assert _max_group(costs, ends) == pytest.approx(brute)


def test_partition_with_memory_limit_against_brute_force() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n, k = rng.randint(2, 8), rng.randint(1, 4)
        k = min(k, n)
        costs = [rng.random() for _ in range(n)]
        mem = [[rng.randint(1, 5) for _ in range(n)] for _ in range(k)]
        limit = rng.randint(3, 12)

        def fits(ends: tuple[int, ...], n: int = n, k: int = k, mem: list = mem, limit: int = limit) -> bool:
            bounds = [0, *[e + 1 for e in ends], n]
            return all(sum(mem[j][bounds[j]:bounds[j + 1]]) <= limit for j in range(k))

        feasible = [c for c in itertools.combinations(range(n - 1), k - 1) if fits(c)]
        ends = partition(costs, k, mem, limit)
        if not feasible:
            assert ends is None
            continue
        assert ends is not None and fits(tuple(ends))
        assert _max_group(costs, ends) == pytest.approx(min(_max_group(costs, list(c)) for c in feasible))


def test_balance_classic(classic_graph: pv.ModelGraph) -> None:
    plan = pv.balance(classic_graph, 3, by="flops")
    # layer1 has twice layer0's FLOPs: it gets a stage of its own.
    assert [s.layers for s in plan.stages] == [("layer0",), ("layer1",), ("layer2", "output_proj")]
    assert pv.balance(classic_graph, 2, by="params").stages[0].layers == ("layer0", "layer1")
    assert all(s.layers for s in pv.balance(classic_graph, 4).stages)


def test_balance_errors(classic_graph: pv.ModelGraph) -> None:
    with pytest.raises(pv.PlanError) as info:
        pv.balance(classic_graph, 5)
    assert str(info.value) == ("Cannot balance 4 layers into 5 non-empty stages. Valid: 1 to 4; or go finer first "
                               "(graph.expand(name) / pv.trace(..., depth=N)).")
    with pytest.raises(ValueError, match=r"Unknown balance criterion by='speed'; valid: time, flops, params\."):
        pv.balance(classic_graph, 2, by="speed")


def test_memory_limit_and_smallest_feasible_limit(classic_graph: pv.ModelGraph) -> None:
    free = pv.balance(classic_graph, 2, by="flops")
    roomy = pv.balance(classic_graph, 2, by="flops", memory_limit=1e12, schedule="1F1B", microbatches=4)
    assert roomy == free
    with pytest.raises(pv.PlanError) as info:
        pv.balance(classic_graph, 2, memory_limit=1e6, schedule="GPipe", microbatches=4)
    text = str(info.value)
    assert text.startswith("No split into 2 stages fits memory_limit=1,000,000 bytes per rank under GPipe. "
                           "The smallest limit that fits is about ")
    need = float(text.split("about ")[1].split(" bytes")[0].replace(",", ""))
    plan = pv.balance(classic_graph, 2, memory_limit=need * 1.001, schedule="GPipe", microbatches=4)
    assert plan.num_stages == 2


def test_virtual_stages() -> None:
    torch.manual_seed(0)
    graph = pv.trace(MyNetwork(16, [16, 64, 16, 64, 16, 64, 16]), example_args=(torch.randn(4, 16),))
    plan = pv.balance(graph, 4, by="flops", stages_per_rank=2)
    assert plan.num_stages == 4 and all(s.layers for s in plan.stages)
    tl = pv.simulate(plan, "Interleaved1F1B", 4, stages_per_rank=2)
    assert tl.num_ranks == 2


def test_balance_uses_measured_time(classic_graph: pv.ModelGraph) -> None:
    prof = pv.profile(classic_graph, microbatches=2, repeats=3)
    assert set(prof.forward) == set(classic_graph.layer_names)
    assert all(v > 0 for v in prof.forward.values()) and all(v > 0 for v in prof.backward.values())
    assert prof.forward["layer1"] > prof.forward["output_proj"]
    # A profile is a value: the graph it measured is unchanged, a view carries it.
    assert classic_graph.profile is None
    assert pv.simulate(classic_graph.split(["layer1"]), "1F1B", 2).meta["costs"] == "flops"
    measured = classic_graph.with_profile(prof)
    plan = pv.balance(measured, 2, by="time")
    assert plan.num_stages == 2 and plan.graph.profile is prof
    assert pv.simulate(plan, "1F1B", 2).meta["costs"] == "measured"
    assert pv.simulate(plan.toggle("layer0"), "GPipe", 2).meta["costs"] == "measured"  # plans made from it too


class _Clock:
    """A clock that moves only when told: the profile's attribution is tested without real time."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _TickBackward(torch.autograd.Function):
    clock = _Clock()

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        _TickBackward.clock.t += 1.0  # the loss's backward "takes" one second
        return g


def test_profile_puts_the_loss_on_the_last_stage(classic_graph: pv.ModelGraph, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _TickBackward.clock
    monkeypatch.setattr(profiler, "CLOCK", clock)

    def loss(out: torch.Tensor) -> torch.Tensor:
        clock.t += 1.0  # the loss's forward "takes" one second; the layers take none
        return _TickBackward.apply(out).sum()

    prof = pv.profile(classic_graph, microbatches=2, repeats=3, loss_fn=loss, busy_cores=False)
    assert prof.loss_forward == 1.0 and prof.loss_backward == 1.0
    assert set(prof.forward.values()) == {0.0} and set(prof.backward.values()) == {0.0}  # not blamed on a layer
    costs = estimate_costs(classic_graph.with_profile(prof).split(["layer1"]), 2)
    assert costs.forward == (0.0, 1.0) and costs.backward == (0.0, 1.0)
