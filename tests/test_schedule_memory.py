"""Regression: the simulator's activation memory per schedule, as the zero-bubble paper (Qi et al., arXiv
2401.10241, ZB-V) and the 1F1B analysis state it: ZB-V keeps 1F1B's first-rank level on every rank (p microbatches),
flat in the microbatch count; 1F1B's falls from the first rank to the last; GPipe keeps every microbatch. Each stage
saves its own copy of the input it receives, so ZB-V's twice as many stages keep those copies twice as often."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.costs import stage_costs
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
    assert one[0] > one[1] > one[2] > one[3]  # 1F1B: p - r microbatches in flight on rank r
    # In microbatches (the batch is fixed, so one microbatch is 64/m rows): ZB-V and 1F1B's first rank keep p = 4,
    # whatever m; GPipe keeps all m. A ZB-V rank's microbatch is one pass through its two V stages.
    v = stage_costs(eight, m).activation_bytes
    pair = [v[r] + v[7 - r] for r in range(4)]
    assert [z / p for z, p in zip(zbv, pair, strict=True)] == pytest.approx([4] * 4, rel=0.05)
    per_mb = stage_costs(four, m).activation_bytes
    assert one[0] / per_mb[0] == pytest.approx(4)
    assert gpipe[0] / per_mb[0] == pytest.approx(m)
    # 1F1B's first rank's level, once the copies are counted: each of ZB-V's 8 stages saves its own copy of the
    # input it receives, 4 stages of 1F1B half as many (here a V pair keeps 4 tensors a microbatch, a 1F1B stage 3).
    assert max(zbv) == pytest.approx(one[0] * max(pair) / per_mb[0], rel=0.05)
    assert max(zbv) == pytest.approx(one[0] * 4 / 3, rel=0.05)
