"""Tensor parallelism priced as a launched run does it on a CPU (issue 50, point 6: ``pipeviz.sim.tensor_parallel``):
each collective a ``TP`` action inside the forward or backward that issues it, as many per process and step as the
run's own timed ``TP`` events; gloo's wait for a core where the processes outnumber the cores; DTensor's dispatch
per op; and the Explorer's notes beside the overlay saying what is priced and by how much a run is off."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pipeviz as pv
from pipeviz.cost.calibration import constant
from pipeviz.sim.tensor_parallel import stage_ops
from pipeviz.widgets.tp_notes import TP_BOUND
from pipeviz.zoo import gpt2

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def plan() -> pv.SplitPlan:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 16))
    return pv.trace(gpt2(2, 32, 2, 128), example_args=(ids,)).split(["transformer.h.0"])


@pytest.fixture(scope="module")
def run(plan: pv.SplitPlan) -> pv.Run:
    """A real pp 2 x tp 2 run (4 processes), 1F1B, 4 microbatches, 2 steps."""
    ids = torch.randint(0, 128, (8, 16))
    r = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, tp=2)
    assert r.wait(300) == "done", r.error
    return r


def _config(tp: int = 2) -> pv.LaunchConfig:
    return pv.LaunchConfig(schedule="1F1B", microbatches=4, loss_fn=pv.cross_entropy, tp=tp)


@pytest.mark.slow
@pytest.mark.compat  # make test checks the count on its own tp runs (tests/test_tensor_parallel_hf.py)
def test_priced_tp_actions_match_the_runs_count_per_process_and_step(run: pv.Run) -> None:
    here = pv.simulate(run.plan, run.spec.config, cores=2)
    priced = Counter(e.rank for e in here.events if e.kind == "TP")
    for step in range(2):
        seen = Counter(e.rank for e in run.events if e.kind == "TP" and e.step == step)
        for process in range(4):
            assert seen[process] == priced[run.mesh.coords(process).pp] > 0, (step, process, seen, priced)
    # each inside the forward or backward of its stage that issues it
    for tp in (e for e in here.events if e.kind == "TP"):
        assert any(a.rank == tp.rank and a.kind in ("F", "B") and a.start <= tp.start and tp.end <= a.end + 1e-12
                   for a in here.events), tp


def test_a_collective_waits_for_a_core_only_where_processes_outnumber_the_cores(plan: pv.SplitPlan) -> None:
    wait = constant("cpu_tp_collective_wait")
    alone, shared = pv.simulate(plan, _config()), pv.simulate(plan, _config(), cores=2)
    assert alone.meta["tp_wait"] == 0.0 and shared.meta["tp_wait"] == wait > 0
    link = sorted(e.duration for e in alone.events if e.kind == "TP")
    waited = sorted(e.duration for e in shared.events if e.kind == "TP")
    assert len(link) == len(waited) and all(w == pytest.approx(x + wait) for x, w in zip(link, waited, strict=True))
    assert pv.simulate(plan, _config(), cores=4).meta["tp_wait"] == 0.0  # a core each: no wait
    # the pipeline's 2 ranks share 1 core (4 processes, 2 cores), but a process waiting for the other shard sleeps
    # off it: the other rank computes meanwhile, so the step is shorter than the two ranks' actions in a row
    assert shared.step_time < sum(e.duration for e in shared.events if e.kind in ("F", "B"))


def test_dtensor_dispatch_is_priced_per_op_on_a_cpu_only(plan: pv.SplitPlan) -> None:
    ops = stage_ops(plan)
    assert sum(ops) == len(plan.graph.capture.ops) and all(ops)
    one, two = pv.simulate(plan, _config(1)).meta["stage_costs"], pv.simulate(plan, _config()).meta["stage_costs"]
    for s, n in enumerate(ops):  # a shard: half the compute, its collectives, and n ops dispatched through DTensor
        assert two.forward[s] == pytest.approx(one.forward[s] / 2 + n * constant("cpu_tp_op_overhead"))
        assert two.backward[s] == pytest.approx(one.backward[s] / 2 + n * constant("cpu_tp_backward_op_overhead"))
    gpu = pv.simulate(plan, _config(), hardware="h100-sxm", dtype="bfloat16")
    assert gpu.meta["tp_wait"] == 0.0 and any(e.kind == "TP" for e in gpu.events)
    gpu1 = pv.simulate(plan, _config(1), hardware="h100-sxm", dtype="bfloat16").meta["stage_costs"]
    assert gpu.meta["stage_costs"].forward[0] < gpu1.forward[0]  # no dispatch charged: the shard is faster


def _text(html_: str) -> str:
    return re.sub(r"<[^>]+>", "", html_)


def test_the_overlay_notes_say_what_tp_prices_and_name_a_factor_beyond_the_bound(plan: pv.SplitPlan) -> None:
    from pipeviz.widgets import panels

    cfg = _config()
    sim, here = pv.simulate(plan, cfg), pv.simulate(plan, cfg, cores=2)
    per = Counter(e.rank for e in here.events if e.kind == "TP").most_common(1)[0][1]
    # a run measured as the simulation as run here: its notes (run_notes_html reads these of a pv.Run)
    run: Any = SimpleNamespace(timeline=lambda: here, schedule="1F1B", layout=SimpleNamespace(num_stages=2),
                               mesh=pv.Mesh(pp=2, tp=2), spec=SimpleNamespace(tp=2))
    notes = _text(panels.run_notes_html(run, sim, here, 2, 0.0))
    wait = constant("cpu_tp_collective_wait")
    assert f"simulated as run here (2 cores) {here.step_time * 1e3:.2f} ms" in notes
    assert (f"with tp 2 each process runs its stage on DTensors ({constant('cpu_tp_op_overhead') * 1e6:.0f} µs "
            f"forward, {constant('cpu_tp_backward_op_overhead') * 1e6:.0f} µs backward per op, measured) and issues "
            f"{per} TP all-reduces a step through gloo") in notes, notes
    assert f"{wait * 1e3:.1f} ms of it waiting for the other shard's process to get a core" in notes
    assert "measured is" not in notes  # the same as the simulation as run here: no factor to name
    slow = replace(here, events=[replace(e, start=3 * e.start, end=3 * e.end) for e in here.events])
    run.timeline = lambda: slow  # three times it: named, beyond the bound pp x dp runs keep
    factor = slow.step_time / here.step_time
    assert factor == pytest.approx(3.0) and factor > TP_BOUND
    assert (f"measured is {factor:.1f}× the simulation as run here, beyond the 1.25× pp × dp runs keep: not priced, "
            "time-slicing 4 processes on 2 cores (pp × dp runs measured the cores idle 8-18 % of the time and 2-4× "
            "the context switches)" in _text(panels.run_notes_html(run, sim, here, 2, 0.0)))
    # without the simulation as run here: the factor against a core per rank, and what would price it
    notes = _text(panels.run_notes_html(run, sim, None, 2, 0.0))
    factor = slow.step_time / sim.step_time
    assert f"measured is {factor:.1f}× the simulated step, which gives each process a core" in notes
    assert "waiting for the other shard's process" not in notes  # a core per rank: no wait priced
