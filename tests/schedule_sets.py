"""The schedules a training test runs: three in ``make test`` that take the runtime's three paths (one stage per
rank; several per rank with the backward split into input and weight passes; the V shape), the other four in
``make compat`` (the ``compat`` marker), so CI covers all seven."""

from __future__ import annotations

import pytest

FAST = ("1F1B", "InterleavedZeroBubble", "DualPipeV")
REST = ("GPipe", "Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble")
SCHEDULES = pytest.mark.parametrize("schedules", [FAST, pytest.param(REST, marks=pytest.mark.compat)],
                                    ids=["3-schedules", "other-4"])
