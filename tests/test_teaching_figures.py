"""Schedules side by side on one time axis and one memory axis, and a step played action by action with each rank's
saved activations at that instant (``pv.side_by_side_figure``, ``pv.player_figure``)."""

from __future__ import annotations

import pytest

import pipeviz as pv
from pipeviz.cost.model import Costs

pytest.importorskip("plotly")

MIB = 2**20


def _sims() -> list[pv.Timeline]:
    return [pv.simulate(None, s, 8, costs=Costs.uniform(n, 1.0, 2.0), num_stages=n)
            for s, n in (("GPipe", 4), ("1F1B", 4), ("ZBVZeroBubble", 8))]


def test_side_by_side_shares_one_time_axis_and_one_memory_axis() -> None:
    sims = _sims()
    fig = pv.side_by_side_figure(sims)
    lay = fig.layout
    # one row per schedule, titled with its step and bubble
    titles = [a.text for a in lay.annotations if a.text]
    assert [t.split(":")[0] for t in titles] == ["GPipe", "1F1B", "ZBVZeroBubble"]
    assert "bubble 27%" in titles[1]
    # every Gantt chart follows the first one's time axis; every memory axis has the same range
    gantt_axes = {tr.xaxis for tr in fig.data if tr.type == "bar" and tr.orientation == "h" and tr.base is not None}
    assert len(gantt_axes) == 3
    # shared: plotly ties each column's axes to its bottom row's
    assert {getattr(lay, "xaxis" + ax[1:]).matches or ax for ax in gantt_axes} == {"x5"}
    memory = [tr for tr in fig.data if tr.name and tr.name.endswith(": memory")]
    assert len(memory) == 3
    ranges = {tuple(getattr(lay, "xaxis" + tr.xaxis[1:]).range) for tr in memory}
    assert len(ranges) == 1
    # the bars are the timelines' memory per rank
    assert [round(x * MIB) for x in memory[1].x] == sims[1].memory_bytes
    # the legend names each kind once
    assert sorted(tr.name for tr in fig.data if tr.showlegend) == ["B", "F", "I", "W"]


def test_side_by_side_takes_a_comparison_in_its_order(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer0", "layer1"])
    cmp = pv.compare(plan, microbatches=4)
    fig = pv.side_by_side_figure(cmp, why=True)
    titles = [a.text.split(":")[0] for a in fig.layout.annotations if a.text]
    assert titles == [r.schedule for r in cmp.rows]
    assert any(tr.name == "critical path" for tr in fig.data)


def test_side_by_side_refuses_nothing_to_draw() -> None:
    with pytest.raises(ValueError, match="needs at least one timeline"):
        pv.side_by_side_figure([])
    with pytest.raises(TypeError, match=r"draws pv\.Timeline objects, got str"):
        pv.side_by_side_figure(["1F1B"])  # type: ignore[list-item]


def test_the_player_steps_action_by_action_with_memory_at_each_instant() -> None:
    """1F1B, 4 ranks, 8 microbatches at unit costs: a frame per instant an action finishes; the finished bars only
    grow; the memory bars at each instant rise to the simulated peak of each rank and end at zero."""
    tl = pv.simulate(None, "1F1B", 8, costs=Costs.uniform(4, 1.0, 2.0), num_stages=4)
    fig = pv.player_figure(tl)
    ends = sorted({e.end for e in tl.events if e.kind in ("F", "B")})
    assert len(fig.frames) == len(ends) + 1  # the start, then each instant an action finishes
    names = [tr.name for tr in fig.data]
    assert names == ["to come", "F", "B", "now", "saved activations"]
    finished = [sum(len(d.x) for d in f.data[:2]) for f in fig.frames]
    assert finished == sorted(finished) and finished[0] == 0 and finished[-1] == len(tl.events)
    memory = [list(f.data[3].x) for f in fig.frames]
    assert [max(m[r] for m in memory) for r in range(4)] == [b / MIB for b in tl.peak_activation_bytes]
    assert memory[0] == memory[-1] == [0.0] * 4
    # the line is at each frame's instant, the title says which action finished then
    assert [f.data[2].x[0] for f in fig.frames[1:]] == [t * 1e3 for t in ends]
    assert fig.frames[1].layout.title.text.startswith("<b>0F0 done</b> · 1000.00 ms")
    # play, pause and a slider with one step per frame (stepping one action forward or back)
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["▶ play", "❚❚ pause"]
    assert len(fig.layout.sliders[0].steps) == len(fig.frames)


def test_the_player_plays_a_measured_run_and_refuses_a_step_it_lacks() -> None:
    tl = pv.Timeline(events=[pv.Event(0, 0, "F", 0, 10.0, 10.5, 0), pv.Event(1, 1, "F", 0, 10.6,
                                                                                               11.0, 0)],
                     num_ranks=2, num_stages=2, microbatches=1, schedule="GPipe")
    fig = pv.player_figure(tl)
    assert fig.frames[-1].data[-2].x[0] == pytest.approx(1000.0)  # the line: from the first event, in ms
    with pytest.raises(ValueError, match=r"step=3 is not in this timeline; its steps are \[0\]"):
        pv.player_figure(tl, step=3)
    with pytest.raises(TypeError, match=r"needs a pv\.Timeline, got str"):
        pv.player_figure("1F1B")  # type: ignore[arg-type]


def test_the_step_player_widget_steps_one_action_forward_and_back(classic_graph: pv.ModelGraph) -> None:
    """The Explorer's "Step through" shows the simulated step in a StepPlayer, which follows the plan."""
    pytest.importorskip("ipywidgets")
    ex = pv.Explorer(classic_graph)
    ex.plan = ["layer0", "layer1"]
    assert ex.player is None and ex.player_section.layout.display == "flex"
    ex.player_button.value = True
    player = ex.player
    assert player is not None and ex.player_box.children == (player,)
    assert player.frame == 0 and player.back_button.disabled and "start" in player.label.value
    player.forward()
    assert player.frame == 1 and not player.back_button.disabled
    first = min(e.end for e in ex.sim.events if e.kind in ("F", "B"))
    assert player.figure.data[-2].x[0] == pytest.approx(first * 1e3)  # the line at the first action's end
    assert "0F0 done" in player.label.value
    player.slider.value = player.slider.max  # the end: every action drawn, no activations left
    assert player.forward_button.disabled
    assert sum(len(tr.x) for tr in player.figure.data[1:-2]) == len(ex.sim.events)
    assert list(player.figure.data[-1].x) == [0.0] * ex.sim.num_ranks
    player.back()
    assert player.frame == player.slider.max - 1
    frames = len(player.frames)
    ex.microbatches.value = 8  # the plan's simulation changes: the player follows it from its start
    assert player.frame == 0 and len(player.frames) > frames
    ex.player_button.value = False
    assert ex.player_box.children == ()


def test_the_explorer_sets_schedules_side_by_side(classic_graph: pv.ModelGraph) -> None:
    pytest.importorskip("ipywidgets")
    ex = pv.Explorer(classic_graph)
    ex.plan = ["layer0", "layer1"]
    ex.side_button.value = True
    assert ex.comparison is not None and ex.side_box.children == (ex.side_figure,)
    titles = [a.text.split(":")[0] for a in ex.side_figure.layout.annotations if a.text]
    assert titles == [r.schedule for r in ex.comparison.rows] == ["GPipe", "1F1B"]  # 3 stages: the single ones
    assert ex.comparison.row("1F1B").step_time == pytest.approx(ex.sim.step_time)  # the controls' run
    ex.microbatches.value = 8
    assert ex.comparison is not None and ex.comparison.timelines["1F1B"].microbatches == 8  # follows the controls
    ex.side_button.value = False
    assert ex.side_box.children == () and ex.comparison is None


def test_a_timeline_view_says_why_on_a_toggle(classic_graph: pv.ModelGraph) -> None:
    """The Explorer's simulated timeline (any TimelineView): "why" draws the critical path and the idle gaps, each
    gap's hover saying what it waits for; off again, the chart is as before."""
    pytest.importorskip("ipywidgets")
    ex = pv.Explorer(classic_graph)
    ex.plan = ["layer0", "layer1"]
    view = ex.sim_view
    before = [tr.name for tr in view.figure.data]
    view.why.value = True
    names = [tr.name for tr in view.figure.data]
    assert names[:len(before)] == before
    assert names[len(before):] == ["hand-offs", "idle: what it waits for", "critical path"]
    path = pv.critical_path(ex.sim)
    assert len(view.figure.data[-1].x) == len(path)
    hovers = list(view.figure.data[-2].hovertext)
    assert hovers == [g.reason for g in pv.idle_gaps(ex.sim)] and any("waits for rank" in h for h in hovers)
    ex.microbatches.value = 8  # follows the plan's simulation
    assert len(view.figure.data[-1].x) == len(pv.critical_path(ex.sim))
    view.why.value = False
    assert [tr.name for tr in view.figure.data] == before
