"""The timeline figures (pipeviz.widgets.figures): a simulated overlay drawn over a measured run with replicas or
shards lands on the rows of the processes it stands for. A measured run has one row per process; a simulation plays
one pipeline (replica 0, shard 0), so its pipeline rank r belongs on process pp r dp 0 tp 0's row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.widgets.figures import memory_traces, timeline_traces
from pipeviz.zoo import MyNetwork

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("degrees", "rows"), [({"dp": 2}, {0: 0, 1: 2}), ({"tp": 2}, {0: 0, 1: 2})])
def test_a_simulated_overlay_is_drawn_on_its_processes_rows(degrees: dict, rows: dict) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randint(0, 10, (8,))
    plan = pv.trace(MyNetwork(8, [8, 8]), example_args=(x,)).split(["layer0"])
    run = pv.launch(plan, "GPipe", 2, steps=1, inputs=(x,), target=y, loss_fn=F.cross_entropy, **degrees)
    assert run.wait(120) == "done", run.error
    measured = run.timeline()
    sim = pv.simulate(plan, "GPipe", 2, **degrees)
    assert measured.num_ranks == 4 and sim.num_ranks == 2 and sim.pipeline_ranks == measured.pipeline_ranks == 2
    labels = {r: measured.process_label(r) for r in range(4)}
    traces = timeline_traces(measured, overlay=sim, labels=True)
    overlay = [t for t in traces if t.get("meta", [""])[0].endswith("(overlay)") and len(t["x"])]
    assert overlay
    for t in overlay:
        for stage, row in zip(t["customdata"][:, 0], t["y"], strict=True):
            if int(stage) < 0:  # a rank's gradient average after its last action (the replicas' DP tail)
                continue
            want = rows[int(stage)]  # stage s runs on pipeline rank s here
            assert round(float(row) + 0.27) == want, (t["meta"], stage, row)
            assert labels[want] == f"pp{int(stage)} {'dp' if 'dp' in degrees else 'tp'}0"
    # the simulated peak under each process's memory track: its pipeline rank's
    mem = [t for t in memory_traces(measured, sim) if t["meta"][1] == "MEMSIM"]
    peaks = sim.meta["peak_activation_bytes"]
    assert len(mem) == 4
    for t in mem:
        rank = int(t["hovertemplate"].split(":")[0].split()[-1])
        assert f"{peaks[measured.pipeline_of(rank)] / 2**20:.2f} MiB" in t["hovertemplate"]
