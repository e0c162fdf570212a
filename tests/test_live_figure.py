"""A live figure's browser-sent trace defaults may no longer fit the trace Python has since redrawn: plotly's
FigureWidget raises on the kernel (seen in a CI run of the browser test), pipeviz's LiveFigure drops them."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import pytest

from pipeviz.widgets import live_figure
from pipeviz.widgets.live_figure import LiveFigure


def _stale_delta(fig: Any) -> None:
    """The browser's defaults for the current edit with ``marker`` as a list where Python's trace holds a dict:
    plotly's reconciler asserts the shapes agree (the AssertionError of the CI run, line for line)."""
    delta = {"uid": fig.data[0].uid, "marker": [{"color": "stale"}]}
    fig._js2py_traceDeltas = {"trace_deltas": [delta], "trace_edit_id": fig._last_trace_edit_id}


def test_plotlys_figure_widget_raises_on_a_stale_delta() -> None:
    fig = go.FigureWidget(go.Figure(go.Bar(x=[1, 2], y=[3, 4], marker={"color": "red"})))
    with pytest.raises(AssertionError):
        _stale_delta(fig)


def test_a_live_figure_drops_a_stale_delta_and_keeps_working() -> None:
    fig = LiveFigure(go.Figure(go.Bar(x=[1, 2], y=[3, 4], marker={"color": "red"})))
    ran = []
    fig._trace_edit_in_process = True
    fig._waiting_edit_callbacks.append(lambda: ran.append(1))
    _stale_delta(fig)
    assert not fig._trace_edit_in_process and ran == [1]  # the edit ended as plotly's handler ends it
    fig.data[0].marker.color = "blue"  # Python keeps drawing
    assert fig.data[0].marker.color == "blue"


def _state_bytes(widget: Any) -> int:
    """What the kernel sends the page for one widget: its state as JSON, and its binary buffers."""
    import json

    from ipywidgets.widgets.widget import _remove_buffers

    state, _, buffers = _remove_buffers(widget.get_state())
    return len(json.dumps(state, default=str)) + sum(len(b) for b in buffers)


@pytest.mark.skipif(live_figure._BUNDLE is None, reason="plotly < 6: its figures' module comes from an extension")
def test_plotly_js_reaches_the_page_once_for_every_figure(classic_graph: Any) -> None:
    """plotly's FigureWidget carries plotly.js (5 MB) in each figure's state; an Explorer shows five figures, whose
    restore after a page reload overran the front end's fixed waits on a loaded machine. pipeviz's carry it once."""
    from ipywidgets.widgets.widget import _instances

    import pipeviz as pv

    explorer = pv.Explorer(classic_graph)
    bundle = len(str(live_figure._BUNDLE))
    assert bundle > 1_000_000  # plotly.js is in it
    plain = go.FigureWidget()
    assert _state_bytes(plain) > bundle  # what plotly does
    tree, todo = set(), [explorer]
    while todo:
        w = todo.pop()
        tree.add(id(w))
        todo += [c for c in getattr(w, "children", ()) if id(c) not in tree]
    # (the explorer's own: an earlier test's figures, a step player's say, may be larger)
    figures = [w for w in _instances.values() if isinstance(w, LiveFigure) and id(w) in tree]
    assert len(figures) >= 5  # the graph, and the simulated and the run's timelines with their loss charts
    assert all(_state_bytes(f) < 100_000 for f in figures), [_state_bytes(f) for f in figures]
    carriers = {id(w) for w in _instances.values() if (isinstance(w, LiveFigure) or not isinstance(w, go.FigureWidget))
                and _state_bytes(w) > bundle}
    assert carriers == {id(live_figure.plotly_bundle())}
    # The carrier is inside the Explorer (hidden), for front ends that keep outputs apart.
    assert id(live_figure.plotly_bundle()) in tree
    plain.close()


def test_a_live_figure_keeps_its_traces_for_a_view_made_later() -> None:
    """Added, deleted and moved traces reach ``_widget_data``, which a model or view made later draws from: each
    later restyle's trace indices exist there."""
    fig = LiveFigure()
    fig.add_traces([go.Bar(x=[1], y=[1], name="a"), go.Bar(x=[2], y=[2], name="b")])
    assert [t["name"] for t in fig._widget_data] == ["a", "b"]
    fig.data = [fig.data[1]]
    assert [t["name"] for t in fig._widget_data] == ["b"]
    fig.data[0].update(y=[5])  # a restyle: not copied (the page's model applies it)
    assert list(fig._widget_data[0]["y"]) == [2]


def _page_click(fig: Any, trace: int, point: int, shift: bool = False) -> None:
    """What the page module sends for a click on ``point`` of ``trace``: a comm message of its own, handled by the
    widget as ipywidgets hands it a custom message from the page."""
    points = {"trace_indexes": [trace], "point_indexes": [point], "xs": [0], "ys": [point]}
    content = {"event": "click", "points": points,
               "device_state": {"alt": False, "ctrl": False, "meta": False, "shift": shift, "button": 0, "buttons": 1}}
    fig._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})


def _points(kind: str, trace: int, point: int) -> dict[str, Any]:
    points = {"trace_indexes": [trace], "point_indexes": [point], "xs": [0], "ys": [point]}
    return {"event_type": kind, "points": points, "device_state": {"shift": False}}


@pytest.mark.skipif(live_figure._BUNDLE is None, reason="plotly < 6: its figures' module comes from an extension")
def test_every_click_the_page_sends_reaches_the_traces_once() -> None:
    """Clicks travel as messages of their own (ipywidgets merged the trait's copy with the unhover that followed it
    while the kernel was busy: the first click after render was lost); the trait's copy is ignored, so a click is
    dispatched once; hovers still come through the trait."""
    fig = LiveFigure(go.Figure([go.Scatter(x=[0, 0], y=[0, 1]), go.Scatter(x=[0, 0, 0], y=[0, 1, 2])]))
    clicks: list[tuple[int, list[int], bool]] = []
    hovers: list[list[int]] = []
    for i, trace in enumerate(fig.data):
        trace.on_click(lambda _t, points, state, i=i: points.point_inds and clicks.append(
            (i, points.point_inds, state.shift)))
        trace.on_hover(lambda _t, points, _s: points.point_inds and hovers.append(points.point_inds))
    _page_click(fig, 1, 2)
    _page_click(fig, 1, 2, shift=True)  # the same point again: a message each, nothing merged
    _page_click(fig, 0, 1)
    assert clicks == [(1, [2], False), (1, [2], True), (0, [1], False)]
    fig._js2py_pointsCallback = _points("plotly_click", 1, 2)  # plotly's own copy of a click the page sent
    assert len(clicks) == 3 and fig._js2py_pointsCallback is None
    fig._js2py_pointsCallback = _points("plotly_hover", 1, 0)
    assert hovers == [[0]] and fig._js2py_pointsCallback is None
    assert 'el.dataset.pipevizClicks = "live"' in str(fig._esm)  # the readiness the page shows
