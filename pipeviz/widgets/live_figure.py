"""``LiveFigure``: plotly's ``FigureWidget`` for figures pipeviz redraws from Python while the browser shows them.

After every restyle the browser sends each trace's computed defaults back (``_js2py_traceDeltas``), and plotly's
handler reconciles them with the trace's properties, asserting their shapes agree. When Python has redrawn the
trace in between (a live timeline updates several times a second), the two can disagree and the handler raises
``AssertionError`` in ``_remove_overlapping_props`` on the kernel (seen once in a clean CI run of the browser test,
plotly 7.1). pipeviz never reads those defaults back, so a delta that no longer fits is dropped, not raised.

Its browser state also survives a page reload (``persist``): plotly keeps the figure a reloaded page draws in
``_widget_data`` / ``_widget_layout``, which it sets only when the widget is first shown; every later restyle goes to
the open page alone, so a reload drew the first figure again (the Explorer's graph read "1 stage" beside a preview
of 8).
"""

from __future__ import annotations

from copy import deepcopy

import plotly.graph_objects as go
from plotly.basewidget import BaseFigureWidget
from traitlets import observe

__all__ = ["LiveFigure"]

_RECONCILE = BaseFigureWidget.__dict__["_handler_js2py_traceDeltas"].func  # plotly's own handler


class LiveFigure(go.FigureWidget):
    """A ``go.FigureWidget`` whose browser-to-Python trace defaults may be stale without an error."""

    def persist(self) -> None:
        """Make the figure as it is now the one a reloaded page draws (plotly.js ignores the change on an open
        page: it already shows it). A full copy: call it after an edit, not on every live redraw."""
        self._widget_layout = deepcopy(self._layout_obj._props)
        self._widget_data = deepcopy(self._data)

    @observe("_js2py_traceDeltas")
    def _handler_js2py_traceDeltas(self, change: dict[str, object]) -> None:
        try:
            _RECONCILE(self, change)
        except (AssertionError, KeyError, ValueError, IndexError):
            # Deltas for a trace Python has since redrawn or replaced: nothing to reconcile. End the edit as
            # plotly's handler does, so that callbacks waiting for it run.
            self._trace_edit_in_process = False
            if not self._layout_edit_in_process:
                while self._waiting_edit_callbacks:
                    self._waiting_edit_callbacks.pop()()
