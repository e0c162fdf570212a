"""Every combination of ``Collectives`` fields prices a tp > 1, cp > 1 plan, or is refused naming the field; overlap
never makes a step slower (issue 49: Megatron-Core's ``tp_overlap`` with Megatron's layout used to crash)."""

from __future__ import annotations

import itertools
from dataclasses import fields

import pytest
import torch

import pipeviz as pv
from pipeviz.cost.machine import DTYPE_BYTES
from pipeviz.sim.collectives import DP_REDUCE, TP_LAYOUTS, Collectives
from pipeviz.zoo import TinyTransformer

# Each field's valid values (a dtype also by alias): the whole product is walked
VALUES: dict[str, tuple[object, ...]] = {
    "dp_reduce": DP_REDUCE,
    "grad_dtype": (None, *DTYPE_BYTES, "bf16"),
    "tp_overlap": (False, True),
    "scatter_gather": (False, True),
    "tp_layout": TP_LAYOUTS,
}
# What each field refuses, and the error naming it
BAD: dict[str, tuple[object, type[Exception]]] = {
    "dp_reduce": ("zero3", ValueError),
    "grad_dtype": ("int8", ValueError),
    "tp_overlap": ("yes", TypeError),
    "scatter_gather": (1, TypeError),
    "tp_layout": ("deepspeed", ValueError),
}


@pytest.fixture(scope="module")
def plan() -> pv.SplitPlan:
    torch.manual_seed(0)
    graph = pv.trace(TinyTransformer(vocab=64, dim=32, heads=2, depth=4, seq=16),
                     example_args=(torch.randint(0, 64, (8, 16)),))
    return pv.balance(graph, 4)


def test_the_grid_covers_every_field() -> None:
    assert set(VALUES) == set(BAD) == {f.name for f in fields(Collectives)}


@pytest.mark.parametrize("field", sorted(BAD))
def test_a_bad_value_is_refused_naming_its_field(field: str) -> None:
    value, error = BAD[field]
    with pytest.raises(error, match=rf"{field}.*{value!r}|{value!r}.*{field}|{field}={value!r}") as info:
        Collectives(**{field: value})  # type: ignore[arg-type]
    assert "valid" in str(info.value)


@pytest.mark.parametrize(("schedule", "spr", "recompute"), [("1F1B", None, "none"), ("ZBVZeroBubble", 2, "full")])
def test_every_combination_prices_and_overlap_never_slows(plan: pv.SplitPlan, schedule: str, spr: int | None,
                                                          recompute: str) -> None:
    """tp 4 x cp 2 x dp 2 on H100s (a batch large enough that compute and collectives are of one size): every
    combination simulates; the layout priced is named; tp_overlap=True is never slower than the same combination
    without it, and faster somewhere."""
    opts = pv.CostOptions(hardware="H100", dtype="bfloat16", recompute=recompute, batch_scale=4096)
    steps: dict[tuple[object, ...], float] = {}
    names = list(VALUES)
    for combo in itertools.product(*VALUES.values()):
        coll = Collectives(**dict(zip(names, combo, strict=True)))  # type: ignore[arg-type]
        tl = pv.simulate(plan, schedule, 8, stages_per_rank=spr, dp=2, cp=2, tp=4, options=opts, collectives=coll)
        assert tl.step_time > 0 and tl.tp_layout == coll.tp_layout
        assert all(e.end >= e.start for e in tl.events)
        steps[combo] = tl.step_time
    overlap = names.index("tp_overlap")
    faster = 0
    for combo, step in steps.items():
        if combo[overlap]:
            plain = steps[(*combo[:overlap], False, *combo[overlap + 1:])]
            assert step <= plain * (1 + 1e-12), combo
            faster += step < plain * (1 - 1e-6)
    assert faster > 0


def test_megatron_core_row_prices_as_reported_in_issue_49(plan: pv.SplitPlan) -> None:
    """The call that raised ``zip() argument 2 is longer than argument 1``: tp_overlap with Megatron's layout."""
    kw = {"hardware": "H100", "dtype": "bfloat16", "dp": 2, "tp": 4}
    tl = pv.simulate(plan, "1F1B", 8, **kw, collectives=Collectives(tp_overlap=True, tp_layout="megatron"))
    plain = pv.simulate(plan, "1F1B", 8, **kw, collectives=Collectives(tp_layout="megatron"))
    assert 0 < tl.step_time <= plain.step_time and tl.tp_layout == "megatron"
    assert "tp 4 (megatron layout)" in repr(tl)
    # the default prices what pv.launch shards, and says so; no tensor parallelism: no layout
    assert pv.simulate(plan, "1F1B", 8, **kw).tp_layout == "launch"
    assert pv.simulate(plan, "1F1B", 8, hardware="H100", dp=2).tp_layout is None
