"""The schedules a training test runs: three in ``make test`` that take the runtime's three paths (one stage per
rank; several per rank with the backward split into input and weight passes; the V shape), the other four in
``make compat`` (the ``compat`` marker), so CI covers all seven."""

from __future__ import annotations

from typing import Any

import pytest

FAST = ("1F1B", "InterleavedZeroBubble", "DualPipeV")
REST = ("GPipe", "Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble")
SCHEDULES = pytest.mark.parametrize("schedules", [FAST, pytest.param(REST, marks=pytest.mark.compat)],
                                    ids=["3-schedules", "other-4"])


def train_exactly(schedule: str, plans: tuple[Any, Any], **launch: Any) -> Any:
    """Launch ``schedule`` (2 steps, 4 microbatches) on ``plans[0]`` (GPipe, 1F1B: one stage per rank) or
    ``plans[1]`` (the multi-stage schedules), wait, and assert it trained like the unsplit model; returns the
    run for further checks."""
    import pipeviz as pv

    plan = plans[0] if schedule in ("GPipe", "1F1B") else plans[1]
    run = pv.launch(plan, schedule, 4, steps=2, optimizer=pv.sgd(lr=0.1), **launch)
    assert run.wait(240) == "done", f"{schedule}: {run.error}"
    check = pv.check_numerics(run)  # with replicas, also that they hold the same parameters
    assert check.ok, f"{schedule}: {check}"
    return run
