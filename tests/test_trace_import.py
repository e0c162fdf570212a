"""Another framework's pipelined run, recorded by ``torch.profiler``, on pipeviz's timeline (``pv.import_trace``):
the seed's plain-torch program profiled under torchrun here, and trace files in the shape torchtitan writes
(``profile_trace/iteration_<n>/rank<r>_trace.json``), with the critical path and idle analysis of any timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipeviz as pv
from pipeviz.runtime.procs import free_port
from pipeviz.schedule.timeline import Event
from pipeviz.sim.trace_import import trace_costs
from tests.test_seed_walkthrough import SCRIPT, _kill_tree, _model

PROFILED = SCRIPT.replace(
    "if rank == 0:\n    schedule.step(x)\nelse:\n    output = schedule.step()\n",
    "from torch.profiler import ProfilerActivity, profile\n"
    "with profile(activities=[ProfilerActivity.CPU]) as prof:\n"
    "    if rank == 0:\n        schedule.step(x)\n    else:\n        output = schedule.step()\n"
    "prof.export_chrome_trace(os.path.join(here, 'traces', f'rank{rank}_trace.json'))\n")


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): torchrun with the profiler, 7 s; keeps make test within 10 minutes
def test_the_seeds_program_profiled_under_torchrun_is_imported_and_analysed(tmp_path: Path) -> None:
    """3 gloo ranks, torch's ScheduleGPipe forward only, 4 microbatches: torch names each forward 'Forward <i>'."""
    assert PROFILED != SCRIPT  # the profiler went in
    model, x, y = _model()  # the script trains after the profiled forward-only step: the target too
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    torch.save(x, tmp_path / "x.pt")
    torch.save(y, tmp_path / "y.pt")
    (tmp_path / "traces").mkdir()
    script = tmp_path / "pippy_walkthrough.py"
    script.write_text(PROFILED)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert proc.returncode == 0, out

    tl = pv.import_trace(tmp_path / "traces")
    assert (tl.num_ranks, tl.num_stages, tl.microbatches, tl.schedule) == (3, 3, 4, "GPipe")
    compute = [e for e in tl.events if e.kind != "COMM"]
    assert sorted(e.label for e in compute) == sorted(f"{s}F{m}" for s in range(3) for m in range(4))
    # torch's range holds the wait for the input and the send after the forward: those are communication
    assert any(e.kind == "COMM" and e.rank == 1 for e in tl.events)
    assert {e.rank for e in tl.events if e.stage == 1} == {1}
    # one clock: each stage's forward of a microbatch starts after the previous stage's ended (it waited for it)
    at = {(e.stage, e.mb): e for e in compute}
    assert all(at[(s, m)].start >= at[(s - 1, m)].end - 1e-4 for s in (1, 2) for m in range(4))
    # the analysis of any timeline: the critical path spans the step, each idle gap says what it waits for
    path = pv.critical_path(tl)
    assert path[0].label == "0F0" and path[-1].label == "2F3"
    assert path[-1].end - path[0].start <= tl.step_time + 1e-9
    gaps = pv.idle_gaps(tl)
    assert gaps and any("waits for rank 0's F of microbatch 0" in g.reason for g in gaps if g.rank == 1), gaps
    # beside a simulation of the same layout, priced from the trace itself
    sim = pv.simulate(None, tl.schedule, tl.microbatches, costs=trace_costs(tl), num_stages=3, forward_only=True)
    fig = pv.timeline_figure(tl, overlay=sim, why=True)
    assert any(tr.name == "critical path" for tr in fig.data)


def _torchtitan_shaped(folder: Path, tl: pv.Timeline, iteration: int = 10) -> Path:
    """``tl`` written as torchtitan's profiler writes a run: one Kineto trace per rank under
    ``profile_trace/iteration_<n>``, ``PP:<action>`` ranges on the CPU thread and, 20 µs later, on the GPU
    (``gpu_user_annotation``), the rank in ``distributedInfo``, µs since ``baseTimeNanoseconds``."""
    out = folder / "profile_trace" / f"iteration_{iteration}"
    out.mkdir(parents=True)
    base_ns = 1_733_000_000_000_000_000
    for rank in range(tl.num_ranks):
        evs: list[dict[str, object]] = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{iteration}",
                                         "pid": 100 + rank, "tid": 1, "ts": 0.0, "dur": tl.step_time * 1e6 + 50}]
        for e in tl.events:
            if e.rank != rank:
                continue
            for cat, shift in (("user_annotation", 0.0), ("gpu_user_annotation", 20.0)):
                evs.append({"ph": "X", "cat": cat, "name": f"PP:{e.label}", "pid": 100 + rank, "tid": 7 if shift
                            else 1, "ts": e.start * 1e6 + shift, "dur": e.duration * 1e6, "args": {}})
        evs.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 100 + rank, "tid": 1, "ts": 1.0,
                    "dur": 2.0})
        doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
               "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": tl.num_ranks},
               "traceEvents": evs, "traceName": f"rank{rank}_trace.json", "baseTimeNanoseconds": base_ns}
        (out / f"rank{rank}_trace.json").write_text(json.dumps(doc))
    return out


def test_a_trace_in_torchtitans_shape_reads_back_as_the_run_it_records(tmp_path: Path) -> None:
    """A ZB-V step (4 ranks, 8 stages, input- and weight-grad passes) written as torchtitan writes it reads back
    as the same actions at the same times (the GPU's ranges where Kineto has them), and the same critical path."""
    from pipeviz.cost.model import Costs

    sim = pv.simulate(None, "ZBVZeroBubble", 8, costs=Costs.uniform(8, 1e-3, 2e-3), num_stages=8)
    folder = _torchtitan_shaped(tmp_path, sim)
    tl = pv.import_trace(folder, schedule="zbvzerobubble")
    assert (tl.num_ranks, tl.num_stages, tl.microbatches, tl.schedule) == (4, 8, 8, "ZBVZeroBubble")

    def actions(t: pv.Timeline) -> list[tuple[int, str, float, float]]:
        t0 = min(e.start for e in t.events)
        return sorted((e.rank, e.label, round(e.start - t0, 9), round(e.end - t0, 9)) for e in t.events)

    assert actions(tl) == actions(sim)
    assert [e.label for e in pv.critical_path(tl)] == [e.label for e in pv.critical_path(sim)]
    assert tl.bubble_fraction == pytest.approx(sim.bubble_fraction)
    costs = trace_costs(tl)
    assert costs.forward == pytest.approx((1e-3,) * 8) and costs.weight_fraction == pytest.approx(0.5)


def test_a_second_profiled_step_is_step_one_and_rank_comes_from_the_name(tmp_path: Path) -> None:
    evs = [{"ph": "X", "name": "Forward 0", "ts": t, "dur": 5.0} for t in (0.0, 100.0)]
    (tmp_path / "rank1_trace.json").write_text(json.dumps({"traceEvents": evs}))
    (tmp_path / "rank0_trace.json").write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "Forward 0", "ts": t, "dur": 4.0} for t in (-10.0, 90.0)]}))
    tl = pv.import_trace(tmp_path)
    assert [(e.rank, e.stage, e.step) for e in tl.events] == [(0, 0, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1)]
    assert tl.events[0] == Event(0, 0, "F", 0, 0.0, pytest.approx(4e-6), 0)


def test_a_trace_without_pipeline_actions_is_refused_naming_what_torch_writes(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0,
                                                                       "dur": 1}]}))
    with pytest.raises(ValueError, match=r"no pipeline action in rank0\.json.*'PP:<stage><F\|B\|I\|W><microbatch>'"):
        pv.import_trace(tmp_path / "rank0.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pv.import_trace(tmp_path / "missing.json")
    (tmp_path / "rank0_copy.json").write_text((tmp_path / "rank0.json").read_text())
    with pytest.raises(ValueError, match="are both rank 0"):
        pv.import_trace(tmp_path)
