"""Regression: the simulator's activation memory per schedule, as the zero-bubble paper (Qi et al., arXiv
2401.10241, ZB-V) and the 1F1B analysis state it: ZB-V keeps 1F1B's first-rank level on every rank, flat in the
microbatch count; 1F1B's falls from the first rank to the last; GPipe keeps every microbatch."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.zoo import MyNetwork


@pytest.fixture(scope="module")
def plans() -> tuple[pv.SplitPlan, pv.SplitPlan]:
    torch.manual_seed(0)
    graph = pv.trace(MyNetwork(256, [256] * 8), example_args=(torch.randn(64, 256),))
    return pv.balance(graph, 4, by="params"), pv.balance(graph, 8, by="params")


@pytest.mark.parametrize("m", [8, 16, 32])
def test_zbv_memory_is_balanced_flat_in_m_and_at_1f1b_first_rank_level(plans: tuple[pv.SplitPlan, pv.SplitPlan],
                                                                       m: int) -> None:
    four, eight = plans
    zbv = pv.simulate(eight, "ZBVZeroBubble", m).peak_activation_bytes  # 8 stages, 2 per rank: 4 ranks
    one = pv.simulate(four, "1F1B", m).peak_activation_bytes
    gpipe = pv.simulate(four, "GPipe", m).peak_activation_bytes
    assert len(zbv) == len(one) == 4
    assert max(zbv) == pytest.approx(min(zbv), rel=0.05)  # balanced across ranks
    assert max(zbv) == pytest.approx(one[0], rel=0.05)  # 1F1B's first rank's level
    assert one[0] > one[1] > one[2] > one[3]  # 1F1B: p - r microbatches in flight on rank r
    # In microbatches (the batch is fixed, so one microbatch is 64/m rows): ZB-V and 1F1B's first rank keep p = 4,
    # whatever m; GPipe keeps all m.
    per_mb = gpipe[0] / m
    assert max(zbv) / per_mb == pytest.approx(4, rel=0.05)
    assert gpipe[0] / per_mb == pytest.approx(m)
