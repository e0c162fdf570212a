"""The compatibility matrix over HF architectures (tests/compat.py): every row trains like the unsplit model
under GPipe, 1F1B and a multi-stage schedule. The README's table is this test's output
(``python -m tests.compat``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.compat import ROWS, TOL, check, multi_for

pytestmark = [pytest.mark.slow, pytest.mark.compat]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_architecture_trains_like_the_unsplit_model(row: object) -> None:
    result = check(row, multi_for(row))  # type: ignore[arg-type]
    assert not result.errors, result.errors
    assert set(result.diffs) == {"GPipe", "1F1B", multi_for(row)}  # type: ignore[arg-type]
    for schedule, (d_loss, d_state) in result.diffs.items():
        assert d_loss <= TOL and d_state <= TOL, f"{schedule}: loss {d_loss:.1e}, parameters/buffers {d_state:.1e}"

