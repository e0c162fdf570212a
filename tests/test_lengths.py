"""Sequence lengths that vary: the buckets that pad least (against brute force), padding waste by hand, and the
number of buckets simulated (``compare_buckets``) and searched on a cluster (``plan_cluster_lengths``)."""

from __future__ import annotations

import itertools

import pytest
import torch

import pipeviz as pv
from pipeviz.planner.lengths import (
    buckets,
    compare_buckets,
    padding_waste,
    plan_cluster_lengths,
)
from pipeviz.zoo import TinyTransformer


def _padded(lengths: list[int], lens: tuple[int, ...]) -> int:
    return sum(min(b for b in lens if b >= s) for s in lengths)


def test_buckets_pad_least_and_waste_is_counted_by_hand() -> None:
    lengths = [3, 5, 5, 6, 9, 12, 12, 16, 31, 32]
    assert buckets(lengths, 1) == (32,)
    assert padding_waste(lengths, (32,)) == pytest.approx(1 - 131 / 320)  # 131 real tokens of 10 x 32
    distinct = sorted(set(lengths))
    for n in (2, 3, 4):
        best = min(_padded(lengths, (*cut, 32)) for cut in itertools.combinations(distinct[:-1], n - 1))
        got = buckets(lengths, n)
        assert len(got) == n and got[-1] == 32 and _padded(lengths, got) == best
    assert buckets(lengths, 3) == (6, 16, 32)  # 6x4 + 16x4 + 32x2: 152 tokens computed for 131
    assert padding_waste(lengths, (6, 16, 32)) == pytest.approx(1 - 131 / 152)
    assert buckets(lengths, 20) == tuple(distinct)  # no more buckets than distinct lengths: no padding
    assert buckets(lengths, 2, multiple=8) == (16, 32)  # every bucket a multiple of 8
    with pytest.raises(ValueError, match="longer than every bucket"):
        padding_waste(lengths, (16,))
    with pytest.raises(ValueError, match="positive sequence lengths"):
        buckets([4, 0], 2)


def test_more_buckets_pad_less_and_each_bucket_is_simulated_at_its_length() -> None:
    torch.manual_seed(0)
    graph = pv.trace(TinyTransformer(vocab=64, dim=32, heads=2, depth=4, seq=64),
                     example_args=(torch.randint(0, 64, (8, 64)),))
    plan = pv.balance(graph, 2, by="params")
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(4, 65, (400,), generator=g)]
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, loss_fn=pv.cross_entropy)
    cmp = compare_buckets(plan, lengths, cfg, max_buckets=3, hardware="h100")
    assert [r.buckets for r in cmp.rows] == [1, 2, 3] and cmp.rows_per_batch == 8
    assert [r.padding for r in cmp.rows] == sorted((r.padding for r in cmp.rows), reverse=True)
    assert cmp.rows[0].padding > 0.4 > 0.25 > cmp.rows[2].padding  # uniform lengths: 46 % -> 21 %
    for r in cmp.rows:
        assert sum(r.share) == pytest.approx(1) and list(r.step_times) == sorted(r.step_times)
        assert r.step_time == pytest.approx(sum(s * t for s, t in zip(r.share, r.step_times, strict=True)))
        assert r.tokens_per_s == pytest.approx(8 * sum(lengths) / len(lengths) / r.step_time)
    assert cmp.best.buckets == 3 and cmp.rows[2].tokens_per_s > cmp.rows[0].tokens_per_s
    # a bucket's step: the model traced at that length, split alike, simulated alike
    short = cmp.rows[2].lengths[0]
    again = pv.trace(graph.capture.model, example_args=(torch.randint(0, 64, (8, short)),))
    want = pv.simulate(again.split(dict(plan.splits)), cfg, hardware="h100").step_time
    assert cmp.rows[2].step_times[0] == pytest.approx(want, rel=1e-9)


def test_a_cluster_plan_over_lengths_weighs_each_bucket() -> None:
    torch.manual_seed(0)
    graph = pv.trace(TinyTransformer(vocab=64, dim=32, heads=2, depth=4, seq=16),
                     example_args=(torch.randint(0, 64, (8, 16)),))
    hw = pv.hardware("h100")
    options = {"schedules": ("GPipe", "1F1B"), "recompute": "none"}
    mixed = plan_cluster_lengths(graph, 4, hw, global_batch=16, lengths={8: 0.75, 32: 0.25}, **options)
    short = pv.plan_cluster(graph, 4, hw, global_batch=16, seq_len=8, top=10_000, **options)
    long = pv.plan_cluster(graph, 4, hw, global_batch=16, seq_len=32, top=10_000, **options)
    row = mixed.best
    same = [(a, b) for a in short.rows for b in long.rows
            if (a.pp, a.dp, a.schedule, a.microbatch_size, a.dp_reduce) ==
            (b.pp, b.dp, b.schedule, b.microbatch_size, b.dp_reduce) ==
            (row.pp, row.dp, row.schedule, row.microbatch_size, row.dp_reduce)]
    assert len(same) == 1
    a, b = same[0]
    assert row.step_time == pytest.approx(0.75 * a.step_time + 0.25 * b.step_time)
    assert row.peak_memory == max(a.peak_memory, b.peak_memory)
    assert row.tokens_per_s == pytest.approx(16 * (0.75 * 8 + 0.25 * 32) / row.step_time)
    assert [r.step_time for r in mixed.rows] == sorted(r.step_time for r in mixed.rows)
    assert "bucketed to 8 (75%), 32 (25%)" in mixed.notes[-1]
