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

And plotly.js reaches the page once, not once per figure. plotly >= 6's ``FigureWidget`` is an anywidget whose module
(``_esm``) is the whole of plotly.js, 5 MB, in every figure's state: the Explorer's five figures sent 25 MB when
shown and again on every page reload, and the page compiled plotly.js five times. On a loaded 2-core machine the
restore after a reload then overran the front end's fixed waits (the widget manager's 4 s for the kernel's states
and 2 s per model, anywidget's 2 s per module): "Error displaying widget: model not found" or "[anywidget] Failed
to initialize model" (a clean CI run of the browser test, 2026-12-03). A ``LiveFigure``'s module is a few lines that
wait for plotly's, which one ``PlotlyBundle`` widget per kernel carries (``plotly_bundle()``; every ``LiveFigure``
makes sure it exists, and the views that hold figures show it, hidden, beside them).

And plotly.js is in no state a page restores. The ``PlotlyBundle`` sends it in the state it opens with (a page that
sees it made loads it at once, even while the kernel then runs a long cell: "Run All" over a live timeline followed
by ``run.wait()``; nbclient keeps that state in an executed notebook, so a static page with widget state has it),
and never again as state: the state ipywidgets' control comm sends a reloaded page for every widget
("request_states"), or one widget's on a frame's "request_state", leaves it out. The restore after a reload used to
carry it, 5.1 MB of the 5.4 MB a fresh Explorer's 257 widgets restore (5.2 MB in the browser test), which overran
the widget manager's fixed 4 s wait for that reply on a machine at load 5-8 ("Error displaying widget: model not
found", issue 43: the browser test's last step, 1 run of 10). A page whose bundle came without it asks the kernel
with a message (``{"event": "bundle?"}``), answered with plotly's module as one binary buffer
(``{"event": "bundle"}``, 4.96 MB): the restore is 0.28 MB (0.45-0.48 MB at the end of the browser test), and
plotly.js follows in its own message, which no fixed wait times (2026-12-06, 2 cores at load 7-16: the browser test
passed 10 runs of 10). Every bundle model on a page loads the first answer (the kernel's answer reaches each page
and frame showing its widgets; one already loaded ignores it). The figures wait for it in ``render`` as before; a
kernel busy with a cell answers when the cell ends, so a page reloaded meanwhile draws its figures then.
(ipywidgets' ``embed_minimal_html`` reads the states as a restore does: an HTML file it writes has no plotly.js for
the figures; nbconvert's pages of an executed notebook have it, from the opening state.)

And every click reaches Python. plotly's widget sends hovers, unhovers and clicks through one synced trait
(``_js2py_pointsCallback``), and ipywidgets lets one state message per widget wait on the kernel at a time: what the
page sets meanwhile is buffered and merged per trait, the latest value winning. A click made while the figure's
previous message (its hover over that very marker, or the deltas it sends once drawn) was still unanswered waited in
that buffer, and the unhover of the mouse leaving the marker replaced it: the kernel never saw the click (issue 43:
the first click after the Explorer rendered, lost in 2 runs of 4 with both cores busy; 0 of 5 when the mouse stayed
on the marker). A ``LiveFigure``'s page module sends each click as its own message instead (``model.send``: never
buffered, merged or dropped; the kernel handles it in turn, however busy), and the trait's copy of a click is
ignored. The module marks the chart ``data-pipeviz-clicks="live"`` once its click listener is attached: a click from
then on reaches Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from copy import deepcopy
from functools import cache
from pathlib import Path

import anywidget
import ipywidgets as W
import plotly
import plotly.graph_objects as go
from plotly.basewidget import BaseFigureWidget
from traitlets import observe

__all__ = ["LiveFigure", "PlotlyBundle", "plotly_bundle"]

_RECONCILE = BaseFigureWidget.__dict__["_handler_js2py_traceDeltas"].func  # plotly's own handlers
_POINTS = BaseFigureWidget.__dict__["_handler_js2py_pointsCallback"].func

# plotly >= 6's widget module (plotly.js and the widget's own code): a path, or anywidget's FileContents whose str()
# is the text; None before plotly 6, whose FigureWidget came from a JupyterLab extension instead.
_BUNDLE: object | None = getattr(BaseFigureWidget, "_esm", None)
# One slot per page for plotly's module, per plotly version (two kernels of two environments can share a page).
_SLOT = f"""
const KEY = Symbol.for("pipeviz.plotly-widget@{plotly.__version__}");
const slot = () => globalThis[KEY] ??= (() => {{
  let resolve, reject;
  const promise = new Promise((a, b) => {{ resolve = a; reject = b; }});
  return {{ promise, resolve, reject, started: false }};
}})();
"""
# A LiveFigure's module: plotly's widget, once the PlotlyBundle's module has loaded it. ``initialize`` does not wait
# for it (anywidget fails a model whose initialize takes over 2 s); ``render`` does. Each click goes to Python as a
# message of its own (see the module docstring), from a listener attached as soon as plotly has the chart's event
# hub: plotly's widget draws the chart within its ``render``, and attaches its own listeners only once drawn (its
# "plotlywidget-after-render" event); a later redraw that replaces the hub gets the listener again.
_FIGURE_ESM = _SLOT + """
const points = data => {  // what plotly's FigureView.buildPointsObject sends, for a click's points
  const out = { trace_indexes: [], point_indexes: [], xs: [], ys: [] };
  for (const p of data.points || []) {
    for (const n of p.pointNumbers || [p.pointNumber]) {
      out.trace_indexes.push(p.curveNumber); out.point_indexes.push(n); out.xs.push(p.x); out.ys.push(p.y);
    }
  }
  return out;
};
const listen = (el, model) => {
  if (!el._ev || el.__pipevizHub === el._ev || typeof el.on !== "function") return;
  el.__pipevizHub = el._ev;
  el.on("plotly_click", data => {
    const e = data.event || {};
    model.send({ event: "click", points: points(data), device_state: {
      alt: e.altKey, ctrl: e.ctrlKey, meta: e.metaKey, shift: e.shiftKey, button: e.button, buttons: e.buttons } });
  });
  el.dataset.pipevizClicks = "live";
};
export default () => {
  let inner = null, ready = null;
  return {
    initialize(ctx) {
      ready = slot().promise.then(mod => {
        inner = typeof mod.default === "function" ? mod.default() : mod.default;
        if (inner.initialize) return inner.initialize(ctx);
      });
      ready.catch(e => console.error("[pipeviz] plotly.js did not load:", e));
    },
    async render(ctx) {
      await ready;
      const { el, model } = ctx, cleanup = inner.render(ctx);
      const drawn = e => { if (e.detail && e.detail.element === el) listen(el, model); };
      document.addEventListener("plotlywidget-after-render", drawn);
      listen(el, model);
      return () => {
        document.removeEventListener("plotlywidget-after-render", drawn);
        delete el.dataset.pipevizClicks;
        if (typeof cleanup === "function") cleanup();
      };
    },
  };
};
"""
# The PlotlyBundle's module: compiles plotly's widget module once per page and hands it to the figures' slot. The
# module comes in the state the kernel opened the widget with (``bundle``: a page that saw the widget made, or a
# notebook's saved state); a page that restores the widget later (a reload, a frame of its own) gets a state without
# it and asks the kernel for it with a message, answered with the module as a binary buffer (see the module
# docstring). Every bundle on the page listens: the answer goes to each page showing the kernel's widgets.
_BUNDLE_ESM = _SLOT + """
const load = (s, source) => {
  s.started = true;
  const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
  import(/* webpackIgnore: true */ url).then(
    mod => { URL.revokeObjectURL(url); s.resolve(mod); },
    err => { URL.revokeObjectURL(url); s.reject(err); });
};
export default {
  initialize({ model }) {
    const s = slot();
    model.on("msg:custom", (msg, buffers) => {
      if (!s.started && msg && msg.event === "bundle" && buffers && buffers.length) load(s, buffers[0]);
    });
    if (s.started) return;
    const source = model.get("bundle");
    if (source) load(s, source);
    else model.send({ event: "bundle?" });
  },
  render() {},
};
"""


class PlotlyBundle(anywidget.AnyWidget):
    """An invisible widget that brings plotly's widget module to the page for its ``LiveFigure``s: in the state it
    is opened with (``bundle``), and to a page that restores it later as the answer to the page's message; never in
    the state a page restores (see the module docstring)."""

    _esm = _BUNDLE_ESM

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.on_msg(self._on_page_msg)

    def open(self) -> None:
        """Open the comm, with plotly's module in the opening state (a page showing the widget as it is made
        loads it at once, even while the kernel then runs a long cell; nbclient keeps it in a notebook's state)."""
        self._opening = self.comm is None
        try:
            super().open()
        finally:
            self._opening = False

    def get_state(self, key: object = None, drop_defaults: bool = False) -> dict[str, object]:
        """The synced state: plotly's module only in the opening state, never in what a page restores."""
        state: dict[str, object] = super().get_state(key=key, drop_defaults=drop_defaults)
        if key is None and getattr(self, "_opening", False):
            state["bundle"] = _bundle_bytes().decode("utf-8")
        return state

    def _on_page_msg(self, _widget: object, content: object, _buffers: Sequence[bytes]) -> None:
        """A page restored the widget without plotly's module and asks for it: sent as one binary buffer."""
        if isinstance(content, Mapping) and content.get("event") == "bundle?":
            self.send({"event": "bundle"}, buffers=[_bundle_bytes()])


_carrier: PlotlyBundle | None = None


def plotly_bundle() -> PlotlyBundle | None:
    """The kernel's one ``PlotlyBundle``: an invisible widget that brings plotly's widget module to the page for
    every ``LiveFigure`` (made on first use, again after it was closed). A view that holds figures shows it
    hidden beside them, so that a front end that keeps each output apart (Colab's frames) has it there too.
    ``None`` before plotly 6, whose figures need none."""
    global _carrier
    if _BUNDLE is None:
        return None
    if _carrier is None or _carrier.comm is None:
        _carrier = PlotlyBundle(layout=W.Layout(display="none"))
    return _carrier


def _swap(target: go.FigureWidget, figure: go.Figure) -> None:
    with target.batch_update():
        target.data = ()
        target.add_traces(figure.data)
        target.layout = figure.layout


@cache
def _bundle_bytes() -> bytes:
    """plotly's widget module (plotly.js and its widget code), as UTF-8."""
    bundle = _BUNDLE
    return bundle.read_bytes() if isinstance(bundle, Path) else str(bundle).encode("utf-8")


class LiveFigure(go.FigureWidget):
    """A ``go.FigureWidget`` whose browser-to-Python trace defaults may be stale without an error, whose state
    survives a reload (``persist``) and whose module is not plotly.js (``plotly_bundle()`` brings that once)."""

    if _BUNDLE is not None:
        _esm = _FIGURE_ESM

    def __init__(self, *args: object, **kwargs: object) -> None:
        plotly_bundle()  # before the figure: its comm opens first, so the page starts on plotly.js first
        super().__init__(*args, **kwargs)
        self.on_msg(self._on_page_msg)

    def _on_page_msg(self, _widget: object, content: object, _buffers: Sequence[bytes]) -> None:
        """A click the page module sent as its own message: dispatched to the traces' ``on_click`` callbacks as
        plotly dispatches the trait's."""
        if isinstance(content, Mapping) and content.get("event") == "click" and isinstance(content.get("points"), dict):
            _POINTS(self, {"new": {"event_type": "plotly_click", "points": content["points"],
                                   "device_state": content.get("device_state")}})

    @observe("_js2py_pointsCallback")
    def _handler_js2py_pointsCallback(self, change: dict[str, object]) -> None:
        data = change["new"]
        if _BUNDLE is not None and isinstance(data, dict) and data.get("event_type") == "plotly_click":
            self._js2py_pointsCallback = None  # the page module sent this click as a message too (_on_page_msg)
            return
        _POINTS(self, change)

    def replace(self, figure: go.Figure) -> None:
        """Show ``figure``'s traces and layout instead of this one's (kept for a reload, ``persist``)."""
        _swap(self, figure)
        self.persist()

    def persist(self) -> None:
        """Make the figure as it is now the one a reloaded page draws (plotly.js ignores the change on an open
        page: it already shows it). A full copy: call it after an edit, not on every live redraw."""
        self._widget_layout = deepcopy(self._layout_obj._props)
        self._widget_data = deepcopy(self._data)

    # Traces added, deleted or moved: the page's model learns it from a message, which a model or view that starts
    # later has not seen (plotly.js's widget rebuilds a view from ``_widget_data``); keep that copy whole, so each
    # later restyle's trace indices exist there. (A clean CI run logged "indices must be valid indices for gd.data"
    # on a run's live timeline: restyles of 8 traces on a chart drawn with none.) Only on these edits: a restyle
    # changes no trace count.
    def _send_addTraces_msg(self, new_traces_data: list[dict[str, object]]) -> None:
        super()._send_addTraces_msg(new_traces_data)
        self._widget_data = deepcopy(self._data)

    def _send_deleteTraces_msg(self, delete_inds: list[int]) -> None:
        super()._send_deleteTraces_msg(delete_inds)
        self._widget_data = deepcopy(self._data)

    def _send_moveTraces_msg(self, current_inds: list[int], new_inds: list[int]) -> None:
        super()._send_moveTraces_msg(current_inds, new_inds)
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
