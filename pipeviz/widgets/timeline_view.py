"""``TimelineView``: a live Gantt chart of a ``Run`` (or any ``Timeline``) in a notebook.

Example:
    >>> run = pv.launch(plan, schedule="1F1B", microbatches=8, steps=20, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    >>> pv.TimelineView(run, overlay=pv.simulate(plan, "1F1B", 8))     # fills in while the run goes
    >>> pv.TimelineView(pv.simulate(plan, "ZBVZeroBubble", 8))         # a static timeline
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

import ipywidgets as W
import plotly.graph_objects as go

from pipeviz.runtime.live import Live
from pipeviz.schedule.timeline import COMPUTE, Event, Timeline
from pipeviz.widgets.figures import (
    GL_THRESHOLD,
    loss_layout,
    loss_traces,
    time_origin,
    timeline_layout,
    timeline_title,
    timeline_traces,
    why_traces,
)
from pipeviz.widgets.live_figure import LiveFigure, plotly_bundle

if TYPE_CHECKING:
    from pipeviz.widgets.panels import Change

__all__ = ["TimelineView"]


SECONDS_PER_EVENT = 1e-4  # live redraw spacing per event drawn: 10,000 events -> at most one redraw a second


@overload
def _plain(value: dict[str, object]) -> dict[str, object]: ...


@overload
def _plain(value: object) -> object: ...


def _plain(value: object) -> object:
    """``value`` with every numpy array turned into plain Python lists (``tolist`` gives Python scalars)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and hasattr(value, "dtype"):
        return tolist()
    return value


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _processes(run: Live) -> int:
    """The run's processes (every replica and shard), or its ranks when it has no mesh (a watched job)."""
    mesh = getattr(run, "mesh", None)
    world = getattr(mesh, "world", None)
    return world if isinstance(world, int) else run.timeline().num_ranks


def _timer(seconds: float, fn: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()
    return timer


class TimelineView(W.VBox):
    """A Gantt chart per rank (F / B / I / W and communication), microbatch labels, an optional simulated
    overlay and zoom (drag to zoom, double-click to reset, or pick one step). Attached to a ``Run`` it
    redraws as events arrive, at most once per ``interval`` seconds (once a second from 10,000 events on),
    from one trace per event kind (WebGL segments above 3,000 events), so long runs stay smooth.

    Example:
        >>> view = pv.TimelineView(run); view           # live
        >>> view.timeline                               # the Timeline drawn last

    Args:
        source: a ``pv.Run`` or ``pv.watch(folder)`` (live: any ``pv.Live``), a ``pv.Timeline`` (static) or
            ``None`` (empty until ``update``/``attach``).
        overlay: a simulated ``Timeline`` drawn thinly under each measured step.
        interval: minimum seconds between live redraws.
        busy_interval: minimum seconds between live redraws while the run's processes take every core of this
            machine: then each redraw (the kernel's work and the browser's) is taken from the ranks, which measured
            their steps up to 4-10x the simulated ones under a redraw every 0.25 s (benchmarks/speed/
            explorer_overhead.py measures it). The final redraw when the run ends is never delayed.
        cores: the cores the run's processes share (default: this machine's, as ``pv.launch`` runs here).
        title: a fixed title; default describes the timeline (schedule, step time, bubble).
        height: pixels; default grows with the number of ranks.
        clock, later: the throttle's time source and how it schedules the pending redraw (``later(seconds,
            fn)``; default a daemon ``threading.Timer``): tests drive the throttle with their own.

    Attributes:
        figure: the ``plotly.graph_objects.FigureWidget``.
        loss_chart: under it, an attached training run's loss per step and held-out loss (``run.eval_losses``),
            shown once the run has one.
        why: a checkbox: draw the critical path and every idle gap, whose hover says what it waits for
            (``pv.critical_path``, ``pv.idle_gaps``; of the step picked, else the timeline's; up to 3,000 events).
        redraws: how many times the chart was redrawn.
        last_redraw_s: seconds the last redraw took in Python; redraw_s and live_redraws: the time and the count
            of the redraws since the last ``attach``.
        busy: the attached run's processes take every core here (redraws spaced by ``busy_interval``).
    """

    def __init__(self, source: Live | Timeline | None = None, *, overlay: Timeline | None = None,
                 interval: float = 0.25, busy_interval: float = 2.0, cores: int | None = None,
                 title: str | None = None, height: int | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 later: Callable[[float, Callable[[], None]], object] | None = None) -> None:
        self.figure = LiveFigure()
        # An attached training run's loss per step and held-out loss (hidden until the run has a loss).
        self.loss_chart = LiveFigure(data=loss_traces([]), layout=loss_layout())
        self.loss_chart._config = {"responsive": True}
        self.loss_chart.layout.autosize = True
        self.loss_chart.add_class("pipeviz-loss-chart")
        # (a column: its chart stretches to the width; in a row box it kept plotly's 700 px)
        self.loss_box = W.VBox([self.loss_chart], layout=W.Layout(display="none", width="100%"))
        # Follow the window's width (plotly.js re-measures on resize; the layout's autosize keeps it allowed to).
        self.figure._config = {"responsive": True}
        self.summary = W.HTML()
        self.step_select = W.Dropdown(options=[("all steps", -1)], value=-1, description="zoom",
                                      layout=W.Layout(width="180px"))
        self.step_select.observe(self._on_step, "value")
        # Why the step takes what it takes: the critical path and what each idle gap waits for (pv.critical_path,
        # pv.idle_gaps), drawn over the chart; the gaps' hover says what they wait for.
        self.why = W.Checkbox(value=False, description="why", indent=False, layout=W.Layout(width="64px"),
                              tooltip="the critical path and, on hover, what each idle gap waits for")
        self.why.add_class("pipeviz-why-toggle")
        self.why.observe(lambda _: self.redraw(), "value")
        tools = W.HBox([self.why, self.step_select], layout=W.Layout(flex="0 0 auto", align_items="center",
                                                                     overflow="visible"))
        super().__init__([W.HBox([self.summary, tools],
                                 layout=W.Layout(justify_content="space-between", align_items="center")),
                          self.figure, self.loss_box,
                          *[b for b in [plotly_bundle()] if b is not None]])  # plotly.js, once per page, hidden
        self.add_class("pipeviz-timeline")
        self.interval, self.busy_interval, self.redraws, self.last_redraw_s = interval, busy_interval, 0, 0.0
        self.redraw_s, self.live_redraws, self.busy = 0.0, 0, False
        self._cores = cores
        self._title, self._height = title, height
        self._status = ""  # set_status's
        self._shown: Timeline | None = None  # the timeline the summary describes (the last drawn)
        self._overlay = overlay
        self._timeline: Timeline | None = None
        self._run: Live | None = None
        # Called with the timeline just drawn, after every draw: what sits beside the chart (the Explorer's run
        # notes) shows the same snapshot's figures as its title.
        self.drawn: list[Callable[[Timeline], None]] = []
        self._lock = threading.RLock()
        self._clock, self._later = clock, later or _timer
        self._last = -float("inf")
        self._timer: Any = None
        self._mode: tuple[bool, bool] | None = None
        if isinstance(source, Live) and not isinstance(source, Timeline):
            self.attach(source)
        elif isinstance(source, Timeline):
            self.update(source)
        elif source is not None:
            raise TypeError(f"TimelineView() takes a pv.Run, a pv.watch(folder) or a pv.Timeline, got "
                            f"{type(source).__name__}.")
        else:
            self.summary.value = "<i>no timeline yet</i>"

    # ----------------------------------------------------------------- public
    def set_status(self, status_html: str) -> None:
        """What the chart's title starts with: a launched run's state in the Explorer's words ("done ✓ ... · out of
        date: microbatches 4 → 8"), ``""`` for none; kept across redraws."""
        self._status = status_html
        if self._shown is not None:
            self._show_summary(self._shown)

    def _show_summary(self, shown: Timeline) -> None:
        self._shown = shown
        title = f"<b>{timeline_title(shown)}</b>" if self._title is None else self._title
        text = " · ".join(p for p in (self._status, title) if p)
        if text != self.summary.value:
            self.summary.value = text

    @property
    def timeline(self) -> Timeline | None:
        """The ``Timeline`` drawn last."""
        return self._timeline

    @property
    def overlay(self) -> Timeline | None:
        return self._overlay

    @property
    def run(self) -> Live | None:
        return self._run

    @property
    def event_count(self) -> int:
        """Events in the chart now."""
        return len(self._timeline.events) if self._timeline is not None else 0

    def update(self, timeline: Timeline | None, overlay: Timeline | bool | None = False) -> None:
        """Show ``timeline`` now (``overlay=False`` keeps the current overlay, ``None`` removes it)."""
        with self._lock:
            if overlay is not False:
                self._overlay = overlay  # type: ignore[assignment]
            self._timeline = timeline
            self._draw()

    def attach(self, run: Live, overlay: Timeline | bool | None = False) -> None:
        """Follow ``run`` (a ``pv.Run`` or a ``pv.watch(folder)`` of an exported torchrun job): redraw
        (throttled) whenever its events arrive, and once more when it ends."""
        if not isinstance(run, Live):
            raise TypeError(f"attach() takes a pv.Run or a pv.watch(folder), got {type(run).__name__}.")
        with self._lock:
            if overlay is not False:
                self._overlay = overlay  # type: ignore[assignment]
            self._run = run
            self.busy = _processes(run) >= (self._cores or _cores())
            self.redraw_s, self.live_redraws = 0.0, 0
            self._timeline = run.timeline()
            self._draw()

        def follow(batch: list[Event]) -> None:
            self._on_events(run, batch)

        run.subscribe(follow)

    def redraw(self) -> None:
        """Redraw from the attached run's events now (or the current timeline)."""
        with self._lock:
            if self._timer is not None and hasattr(self._timer, "cancel"):
                self._timer.cancel()
            self._timer = None
            if self._run is not None:
                self._timeline = self._run.timeline()
            self._draw()

    def static_figure(self) -> go.Figure:
        """A plain plotly ``Figure`` of what is shown (renders without widgets, e.g. in nbconvert HTML)."""
        return go.Figure(self.figure)

    def _repr_mimebundle_(self, **kwargs: object) -> dict[str, object]:
        data = super()._repr_mimebundle_(**kwargs) or {}
        try:  # without a widget manager (nbconvert HTML) the chart still renders, statically
            data["text/html"] = (f"<div class='pipeviz-static'>{self.summary.value}"
                                 f"{self.static_figure().to_html(full_html=False, include_plotlyjs='cdn')}</div>")
        except Exception:  # the fallback must never break the live widget
            pass
        return data

    # ----------------------------------------------------------------- live
    def _on_events(self, run: Live, batch: list[Event]) -> None:
        if run is not self._run:  # a newer run was attached
            return
        if run.done:
            self.redraw()
            return
        with self._lock:
            # A browser needs ~0.4 s to draw 10,000 events without a GPU: space redraws out as the run grows.
            interval = max(self.busy_interval if self.busy else self.interval, len(run.events) * SECONDS_PER_EVENT)
            wait = interval - (self._clock() - self._last)
            if wait <= 0:
                self.redraw()
            elif self._timer is None:
                # Draw what is pending once the interval has passed, even if no further batch arrives.
                self._timer = self._later(wait, self._flush) or True

    def _flush(self) -> None:
        """Draw what arrived since the last redraw (the pending redraw the throttle scheduled)."""
        with self._lock:
            self._timer = None
        self.redraw()

    # ----------------------------------------------------------------- drawing
    def _draw(self) -> None:
        t0 = time.perf_counter()
        tl, overlay = self._timeline, self._overlay
        fig = self.figure
        if tl is None:  # nothing measured yet: show the overlay alone, or an empty chart
            tl, overlay = (overlay, None) if overlay is not None else (Timeline([], 1, 1, 1, "-", source="empty"), None)
        traces = timeline_traces(tl, overlay)
        if self.why.value and tl.events and len(tl.events) <= GL_THRESHOLD:
            step = self.step_select.value if self.step_select.value != -1 else None
            traces += why_traces(tl, step)
        if len(tl.events) <= GL_THRESHOLD:
            # Plain lists, not numpy arrays: plotly's FigureWidget compares what the browser sends back with a
            # bar trace's properties using `if not value`, which raises on an array ("truth value ... is
            # ambiguous"). Larger timelines are WebGL segments, where lists would cost 10x the redraw time.
            traces = [_plain(t) for t in traces]
        layout = timeline_layout(tl, overlay, title="", height=self._height)  # the summary line is the title
        mode = (traces[0]["type"] if traces else "", len(traces))
        if mode != self._mode:
            # The kind of chart changed (first draw, or SVG bars -> WebGL segments): replace the traces.
            fig.data = ()
            fig.add_traces(traces)
            self._mode = mode  # type: ignore[assignment]
        else:
            with fig.batch_update():
                for trace, spec in zip(fig.data, traces, strict=True):
                    trace.update({k: v for k, v in spec.items() if k != "type"})
        if fig.layout.height != layout["height"] and fig.layout.autosize:
            # plotly.js turns autosize off (and pins the width) when a relayout sets the height without it:
            # unset it here, so that the height goes with it below and the width keeps following the container.
            fig.layout.autosize = None
        with fig.batch_update():
            fig.layout.update({k: v for k, v in layout.items() if k != "xaxis"})
            if self.step_select.value == -1:
                fig.layout.xaxis.update(layout["xaxis"])
        self._update_steps(tl)
        self._draw_losses()
        self._show_summary(tl)
        self.redraws += 1
        self.live_redraws += 1
        self._last = self._clock()
        self.last_redraw_s = time.perf_counter() - t0
        self.redraw_s += self.last_redraw_s
        for callback in self.drawn:
            callback(tl)

    def _draw_losses(self) -> None:
        """The attached run's losses so far (``run.losses``, ``run.eval_losses``), when it has any."""
        run = self._run
        losses = list(run.losses) if run is not None else []
        evals = list(getattr(run, "eval_losses", []))
        self.loss_box.layout.display = "flex" if losses or evals else "none"
        if not (losses or evals):
            return
        with self.loss_chart.batch_update():
            for trace, spec in zip(self.loss_chart.data, loss_traces(losses, evals), strict=True):
                trace.update({"x": spec["x"], "y": spec["y"]})

    def _update_steps(self, tl: Timeline) -> None:
        steps = tl.steps if tl.source == "measured" else []
        # counted from 1, as the status line's "step k/n" counts them (events carry 0-based step numbers)
        options = [("all steps", -1)] + [(f"step {s + 1}", s) for s in steps]
        if list(self.step_select.options) != options:
            value = self.step_select.value
            self.step_select.options = options
            self.step_select.value = value if value in [o[1] for o in options] else -1

    def _on_step(self, change: Change[int]) -> None:
        tl = self._timeline
        if tl is None:
            return
        if self.why.value:  # the critical path and gaps of the step picked
            self.redraw()
        if change["new"] == -1:
            self.figure.layout.xaxis.autorange = True
            return
        evs = [e for e in tl.step_events(change["new"]) if e.kind in COMPUTE]
        if evs:
            t0 = time_origin(tl)
            lo, hi = min(e.start for e in evs) - t0, max(e.end for e in evs) - t0
            pad = 0.03 * (hi - lo)
            self.figure.layout.xaxis.range = [(lo - pad) * 1e3, (hi + pad) * 1e3]
