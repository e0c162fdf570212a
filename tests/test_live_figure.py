"""A live figure's browser-sent trace defaults may no longer fit the trace Python has since redrawn: plotly's
FigureWidget raises on the kernel (seen in a CI run of the browser test), pipeviz's LiveFigure drops them."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import pytest

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
