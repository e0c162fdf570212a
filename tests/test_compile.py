"""``compile=``: every stage run through ``torch.compile`` on its rank, under every schedule and layout, exact
against the unsplit model; the compile time is a phase of its own; a backend torch does not have is refused
before any process starts. (Split backwards run a compiled stage's backward twice and keep its graph in between:
pipeviz turns off torch's donated buffers there, as torch's own message advises; DualPipeV failed without.)"""

from __future__ import annotations

import re

import pytest
import torch

import pipeviz as pv
from pipeviz.schedule import traits as schedules
from tests.models import TiedSkipBN


def _plan(schedule: str) -> tuple[pv.SplitPlan, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids, target = torch.randint(0, 16, (16, 4)), torch.randint(0, 16, (16, 4))
    graph = pv.trace(TiedSkipBN(), example_args=(ids,))
    return graph.split(["l1", "bn", "l2"] if schedules.info(schedule).multi else ["bn"]), ids, target


def _compiled(run: pv.Run) -> dict[str, float]:
    """Per process, the seconds its compile phase names."""
    found = {}
    for _, text in run.phases:
        m = re.match(r"(rank \d+[^:]*): torch\.compile \((\w+)\): ([\d.]+) s compiling this rank's stages", text)
        if m:
            found[m.group(1)] = float(m.group(3))
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "layout"), [
    ("1F1B", {}), pytest.param("ZBVZeroBubble", {}, marks=pytest.mark.compat), ("DualPipeV", {}),
    ("Interleaved1F1B", {"tp": 2, "tp_plan": {"l2": "colwise", "l3": "rowwise"}}),
    # (make compat: keeps make test within 10 minutes)
    pytest.param("Interleaved1F1B", {}, marks=pytest.mark.compat),
    pytest.param("1F1B", {"dp": 2}, marks=pytest.mark.compat),
    pytest.param("GPipe", {"dp": 2, "dp_shard": True}, marks=pytest.mark.compat),
    pytest.param("LoopedBFS", {}, marks=(pytest.mark.compat, pytest.mark.coverage)),
    pytest.param("InterleavedZeroBubble", {}, marks=(pytest.mark.compat, pytest.mark.coverage))])
def test_compiled_stages_train_exactly(schedule: str, layout: dict[str, object]) -> None:
    """aot_eager: torch.compile's whole path (dynamo, AOTAutograd's joint graph) without generating code, so the
    matrix stays fast; inductor itself runs in test_inductor_compiled_stages_train_exactly (make compat)."""
    plan, ids, target = _plan(schedule)
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    compile="aot_eager", **layout)
    assert run.wait(300) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok, check
    compiled = _compiled(run)
    assert len(compiled) == run.mesh.world and all(s > 0 for s in compiled.values()), run.phases


@pytest.mark.compat
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_inductor_compiled_stages_train_exactly(schedule: str) -> None:
    plan, ids, target = _plan(schedule)
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    compile=True)
    assert run.wait(600) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok, check
    assert "inductor" in " ".join(text for _, text in run.phases) and len(_compiled(run)) == 2


@pytest.mark.slow
def test_a_compiled_forward_only_run_matches() -> None:
    plan, ids, _ = _plan("GPipe")
    run = pv.launch(plan, "GPipe", 4, steps=1, inputs=(ids,), compile="aot_eager")
    assert run.wait(300) == "done", run.error
    assert pv.check_numerics(run).ok and len(_compiled(run)) == 2


def test_a_backend_torch_does_not_have_is_refused_before_any_process() -> None:
    plan, ids, target = _plan("GPipe")
    for bad in ("inducto", 1, "TRUE"):
        with pytest.raises(pv.LaunchError, match=r"compile must be True, False or one of torch's backends, got .*"
                                                 r"valid backends: .*aot_eager.*inductor.*Fix: compile=True"):
            pv.launch(plan, "GPipe", 4, inputs=(ids,), target=target, loss_fn=pv.cross_entropy, compile=bad)
