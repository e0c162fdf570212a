"""Plotly figures over the core objects: a timeline's Gantt chart, its memory and loss, and schedules compared (the
layer graph of a plan: ``pipeviz.widgets.graph_figures``).

They are plain ``plotly.graph_objects.Figure`` objects, so they render wherever plotly does (JupyterLab,
Notebook 7, nbconvert HTML) without any widget; ``pv.Explorer`` and ``pv.TimelineView`` put the same
traces into live ``FigureWidget``s.

Example:
    >>> from pipeviz.widgets.figures import timeline_figure
    >>> timeline_figure(run.timeline(), overlay=pv.simulate(plan, "1F1B", 4)).show()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go

from pipeviz.schedule.timeline import COMPUTE, KINDS, Event, Timeline

if TYPE_CHECKING:
    from pipeviz.sim.simulate import Comparison

__all__ = ["GL_THRESHOLD", "KIND_COLORS", "STAGE_COLORS", "comparison_figure", "loss_figure", "loss_layout",
           "loss_traces", "plural", "stage_color", "time_origin", "timeline_figure", "timeline_layout",
           "timeline_title", "timeline_traces", "why_traces"]


STAGE_COLORS = ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692", "#B6E880",
                "#FF97FF", "#FECB52")
KIND_COLORS = {"F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#54A24B", "COMM": "#BAB0AC", "DP": "#B279A2",
               "TP": "#9D755D", "CP": "#EECA3B", "A2A": "#D62728", "EVAL": "#72B7B2"}
KIND_ORDER = ("F", "B", "I", "W", "COMM", "DP", "TP", "CP", "A2A", "EVAL")
# Above this many events a Gantt chart is drawn as WebGL line segments: thousands of SVG bars make the
# browser stutter on every live redraw, GL segments do not.
GL_THRESHOLD = 3000
LABEL_LIMIT = 800  # microbatch labels only while they can be read
OVERLAY_STEPS = 50  # the simulated step is laid over at most this many measured steps


def stage_color(stage: int) -> str:
    """The colour of stage ``stage`` everywhere (graph nodes, preview rows)."""
    return STAGE_COLORS[stage % len(STAGE_COLORS)]


# --------------------------------------------------------------------------------------------- timeline
def _columns(events: Sequence[Event]) -> dict[str, np.ndarray]:
    """Event fields as arrays (one pass; 10,000 events take a few ms)."""
    if not events:
        empty = np.zeros(0)
        return {k: empty for k in ("rank", "stage", "mb", "start", "end", "step")} | {"kind": np.zeros(0, dtype=object)}
    rows = [(e.rank, e.stage, e.mb, e.start, e.end, e.step) for e in events]
    arr = np.asarray(rows, dtype=float)
    cols = {k: arr[:, i] for i, k in enumerate(("rank", "stage", "mb", "start", "end", "step"))}
    cols["kind"] = np.asarray([e.kind for e in events], dtype=object)
    return cols


def _shifted_overlay(overlay: Timeline, measured: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The simulated step repeated at the start of each measured step (or at 0 without measurements)."""
    sim = _columns(overlay.events)
    if not len(sim["start"]):
        return sim
    # Drawn on the rows of the processes its ranks stand for (a simulation's pipeline rank r: process pp r, dp 0).
    sim["rank"] = np.asarray([overlay.process_of(int(r)) for r in sim["rank"]], dtype=float)
    sim_start = sim["start"].min()
    starts = [0.0]
    if len(measured["start"]):
        comp = np.isin(measured["kind"], COMPUTE)
        steps = np.unique(measured["step"][comp])[:OVERLAY_STEPS]
        starts = [float(measured["start"][comp & (measured["step"] == s)].min()) for s in steps] or [0.0]
    parts = []
    for i, t0 in enumerate(starts):
        part = dict(sim)
        part["start"] = sim["start"] - sim_start + t0
        part["end"] = sim["end"] - sim_start + t0
        part["step"] = np.full(len(sim["start"]), float(i))
        parts.append(part)
    return {k: np.concatenate([p[k] for p in parts]) for k in sim}


def timeline_traces(timeline: Timeline, overlay: Timeline | None = None, *, gl: bool | None = None,
                    labels: bool | None = None) -> list[dict[str, object]]:
    """Plotly trace dicts for a Gantt chart: one trace per event kind (and per overlay kind), built from
    arrays, never one shape per event.

    Args:
        timeline: the events to draw (measured or simulated).
        overlay: a simulated timeline drawn thinly under each measured step.
        gl: WebGL line segments instead of SVG bars; default: above ``GL_THRESHOLD`` events.
        labels: microbatch labels on bars; default: up to ``LABEL_LIMIT`` events.
    """
    cols = _columns(timeline.events)
    n = len(cols["start"])
    over = _shifted_overlay(overlay, cols) if overlay is not None else None
    t0 = time_origin(timeline)
    for c in (cols, over):
        if c is not None and t0:
            c["start"], c["end"] = c["start"] - t0, c["end"] - t0
    gl = n > GL_THRESHOLD if gl is None else gl
    labels = n <= LABEL_LIMIT if labels is None else labels
    multi = timeline.num_stages > timeline.pipeline_ranks
    # (name, columns, is overlay, y offset in the rank's row, bar width, opacity)
    # With an overlay, the measured bars take the lower part of a rank's row and the simulated step a band
    # above them, wide enough to see.
    sources = [(timeline.source, cols, False, 0.0 if overlay is None else 0.14, 0.62 if overlay is None else 0.44, 1.0)]
    if overlay is not None and over is not None:
        sources.append((f"{overlay.source} (overlay)", over, True, -0.27, 0.22, 0.55))
    traces: list[dict[str, object]] = []
    for name, c, is_overlay, y_shift, width, opacity in sources:
        for kind in KIND_ORDER:
            sel = c["kind"] == kind if len(c["kind"]) else np.zeros(0, dtype=bool)
            start, end = c["start"][sel] * 1e3, c["end"][sel] * 1e3
            rank, stage, mb, step = c["rank"][sel], c["stage"][sel], c["mb"][sel], c["step"][sel]
            # steps counted from 1 in the hover, as the status line and the zoom count them
            custom = np.stack([stage, mb, step + 1, end - start], axis=1) if len(start) else np.zeros((0, 4))
            legend = f"{kind} · {KINDS.get(kind, kind)}" + (" (overlay)" if is_overlay else "")
            common = {"name": legend, "legendgroup": f"{name}-{kind}", "opacity": opacity,
                      "showlegend": bool(len(start)), "meta": [name, kind]}
            hover = (f"<b>{kind}</b> stage %{{customdata[0]:.0f}} · mb %{{customdata[1]:.0f}} · "
                     f"step %{{customdata[2]:.0f}}<br>%{{customdata[3]:.3f}} ms<extra>{name}</extra>")
            if gl:
                # Each event is a thick segment [start, end] followed by a gap.
                xs = np.column_stack([start, end, np.full(len(start), np.nan)]).ravel()
                ys = np.repeat(rank + y_shift, 3)
                traces.append({"type": "scattergl", "mode": "lines", "x": xs, "y": ys,
                               "customdata": np.repeat(custom, 3, axis=0), "hovertemplate": hover,
                               "line": {"color": KIND_COLORS[kind], "width": 4 if is_overlay else 14}, **common})
                continue
            text = None
            if labels and len(start):
                text = [f"{s:.0f}{kind}{m:.0f}" if multi else f"{m:.0f}" for s, m in zip(stage, mb, strict=True)]
                if kind not in COMPUTE or is_overlay:
                    text = None
            traces.append({"type": "bar", "orientation": "h", "base": start, "x": end - start, "y": rank + y_shift,
                           "width": width if kind in COMPUTE else 0.4 * width,  # communication: a thin bar
                           "customdata": custom, "hovertemplate": hover, "text": text,
                           "textposition": "inside", "insidetextanchor": "middle",
                           "textfont": {"size": 10, "color": "white"},
                           "marker": {"color": KIND_COLORS[kind], "line": {"width": 0}}, **common})
    return traces + memory_traces(timeline, overlay, t0)


MEMORY_COLOR = "#2F4B7C"


def memory_traces(timeline: Timeline, overlay: Timeline | None = None, t0: float = 0.0) -> list[dict[str, object]]:
    """A measured run's memory track under each rank's row: the bytes of tensors saved for backward over time
    (``run.activation_memory``), scaled to the largest peak of any rank, with the simulated peak of that rank
    (``overlay.peak_activation_bytes``) as a dotted line at its height. Nothing for a simulated timeline."""
    samples: dict[Any, list[tuple[float, int]]] = timeline.meta.get("activation_memory") or {}
    if not samples:
        return []
    predicted = list(overlay.meta.get("peak_activation_bytes") or []) if overlay is not None else []
    top = max([b for s in samples.values() for _, b in s] + [max(predicted, default=0), 1])
    traces: list[dict[str, object]] = []
    for i, (rank, track) in enumerate(sorted((int(r), s) for r, s in samples.items())):
        times = np.array([t for t, _ in track]) - t0
        sizes = np.array([b for _, b in track], dtype=float)
        base = rank + 0.48  # the bottom of the rank's row (rank 0 on top): 0 bytes; the peak 0.16 higher
        traces.append({"type": "scatter", "mode": "lines", "x": times * 1e3, "y": base - 0.16 * sizes / top,
                       "line": {"color": MEMORY_COLOR, "width": 1, "shape": "hv"}, "name": "saved activations",
                       "legendgroup": "memory", "showlegend": i == 0, "meta": ["memory", "MEM"],
                       "customdata": sizes / 2**20, "hovertemplate": f"rank {rank}: %{{customdata:.2f}} MiB saved "
                       "for backward<extra>measured memory</extra>"})
        pipe = timeline.pipeline_of(rank) if overlay is not None else rank  # the prediction is per pipeline rank
        if pipe < len(predicted) and len(times):
            y = base - 0.16 * predicted[pipe] / top
            traces.append({"type": "scatter", "mode": "lines", "x": [times.min() * 1e3, times.max() * 1e3],
                           "y": [y, y], "line": {"color": MEMORY_COLOR, "width": 1, "dash": "dot"},
                           "name": "simulated peak", "legendgroup": "memory-sim", "showlegend": i == 0,
                           "meta": ["memory", "MEMSIM"], "hovertemplate": f"rank {rank}: simulated peak "
                           f"{predicted[pipe] / 2**20:.2f} MiB<extra></extra>"})
    return traces


def time_origin(timeline: Timeline) -> float:
    """Seconds drawn as 0: a measured run's first event (process start-up is not shown), else 0."""
    if timeline.source == "measured" and timeline.events:
        return min(e.start for e in timeline.events)
    return 0.0


def timeline_layout(timeline: Timeline, overlay: Timeline | None = None, *, title: str | None = None,
                    height: int | None = None) -> dict[str, object]:
    """The layout for ``timeline_traces``: one row per rank (rank 0 on top), time in ms."""
    ranks = max(timeline.num_ranks, overlay.num_ranks if overlay is not None else 0, 1)
    if title is None:
        title = timeline_title(timeline)
    measured = timeline.source == "measured"
    return {
        "title": {"text": title, "font": {"size": 13}, "x": 0.01, "xanchor": "left"},
        "height": height or 130 + 46 * ranks,
        # The width follows the container (without it plotly fixes 700 px at the first draw: too wide for a
        # narrow notebook, and never re-measured; with it every redraw and window resize re-measures).
        "autosize": True,
        "margin": {"l": 60, "r": 10, "t": 56, "b": 36},
        "barmode": "overlay",
        "uniformtext": {"minsize": 8, "mode": "hide"},
        "xaxis": {"title": {"text": "time since the first event (ms)" if measured else "time (ms)"}, "zeroline": False},
        "yaxis": {"tickmode": "array", "tickvals": list(range(ranks)),
                  "ticktext": [timeline.process_label(r) for r in range(ranks)],
                  "range": [ranks - 0.5, -0.5], "zeroline": False, "fixedrange": True},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right",
                   "font": {"size": 10}},
        "dragmode": "zoom",
        "hovermode": "closest",
        "plot_bgcolor": "#fafafa",
    }


def timeline_title(timeline: Timeline) -> str:
    """One line: source, schedule, shape, step time and bubble."""
    head = (f"{timeline.source} · {timeline.schedule} · {timeline.num_stages} stages on {timeline.num_ranks} ranks · "
            f"{timeline.microbatches} microbatches")
    if not timeline.events:
        return head + " · no events yet"
    return (f"{head} · step {timeline.step_time * 1e3:.2f} ms · bubble {timeline.bubble_fraction:.0%} · "
            f"{len(timeline.events):,} events")


PATH_COLOR = "#111111"
IDLE_COLOR = "#9E9E9E"


def why_traces(timeline: Timeline, step: int | None = None) -> list[dict[str, object]]:
    """Plotly trace dicts for why ``step`` takes as long as it does (``pv.critical_path``, ``pv.idle_gaps``,
    ``pipeviz.sim.why.handoffs``): an arrow for every hand-off between ranks (from the end of the action that produced
    the data to the start of the one that used it), the critical path as a line through its actions, rank to rank,
    and every idle gap as a faint bar whose hover says what it waits for."""
    from pipeviz.sim.why import critical_path, handoffs, idle_gaps

    t0 = time_origin(timeline)
    path = critical_path(timeline, step)
    gaps = idle_gaps(timeline, step)
    traces: list[dict[str, object]] = []
    links = handoffs(timeline, step)
    if links:  # an arrow from each action to the one on another rank it hands its result to
        xs: list[float | None] = []
        ys: list[float | None] = []
        sizes: list[int] = []
        for a, b in links:
            xs += [(a.end - t0) * 1e3, (b.start - t0) * 1e3, None]
            ys += [a.rank, b.rank, None]
            sizes += [0, 7, 0]
        traces.append({
            "type": "scatter", "mode": "lines+markers", "name": "hand-offs", "meta": ["why", "DEP"], "x": xs,
            "y": ys, "line": {"color": "#555555", "width": 0.8}, "opacity": 0.55, "hoverinfo": "skip",
            "marker": {"symbol": "arrow", "angleref": "previous", "size": sizes, "color": "#555555"}})
    if gaps:
        traces.append({
            "type": "bar", "orientation": "h", "name": "idle: what it waits for", "meta": ["why", "IDLE"],
            "base": [(g.start - t0) * 1e3 for g in gaps], "x": [g.duration * 1e3 for g in gaps],
            "y": [g.rank for g in gaps], "width": 0.62, "opacity": 0.35,
            "marker": {"color": IDLE_COLOR, "line": {"width": 0}}, "hovertext": [g.reason for g in gaps],
            "hovertemplate": "<b>idle</b> %{x:.3f} ms<br>%{hovertext}<extra></extra>"})
    if path:
        traces.append({
            "type": "scatter", "mode": "lines+markers", "name": "critical path", "meta": ["why", "PATH"],
            "x": [((e.start + e.end) / 2 - t0) * 1e3 for e in path], "y": [e.rank for e in path],
            "line": {"color": PATH_COLOR, "width": 2}, "marker": {"size": 5, "color": PATH_COLOR},
            "hovertext": [f"{e.kind} stage {e.stage} · mb {e.mb} · rank {e.rank}" for e in path],
            "hovertemplate": "<b>critical path</b><br>%{hovertext}<extra></extra>"})
    return traces


def timeline_figure(timeline: Timeline, overlay: Timeline | None = None, *, title: str | None = None,
                    height: int | None = None, gl: bool | None = None, labels: bool | None = None,
                    why: bool = False) -> go.Figure:
    """A Gantt chart of ``timeline``: one row per rank, colours for F / B / I / W and communication,
    microbatch labels, optionally a simulated timeline overlaid under each measured step. Zoom with the
    mouse (double-click resets).

    Example:
        >>> timeline_figure(pv.simulate(plan, "1F1B", 8)).show()
        >>> timeline_figure(run.timeline(), overlay=pv.simulate(plan, "1F1B", 8))

    Args:
        timeline: a ``Timeline`` (``run.timeline()`` or ``pv.simulate(...)``).
        overlay: a simulated ``Timeline`` drawn thinly under the measured bars, one copy per step.
        title: the title; default says source, schedule, step time and bubble.
        height: pixels; default grows with the number of ranks.
        gl: force WebGL segments (``True``) or SVG bars (``False``); default by event count.
        labels: force microbatch labels on or off.
        why: draw the critical path and every idle gap with what it waits for (``why_traces``).

    Returns:
        ``plotly.graph_objects.Figure``.
    """
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline_figure() needs a pv.Timeline, got {type(timeline).__name__}.")
    fig = go.Figure(layout=timeline_layout(timeline, overlay, title=title, height=height))
    fig.add_traces(timeline_traces(timeline, overlay, gl=gl, labels=labels))
    if why:
        fig.add_traces(why_traces(timeline))
    return fig


# --------------------------------------------------------------------------------------------- graph
LOSS_HEIGHT = 200  # px: the loss chart under a run's timeline


def loss_traces(losses: Sequence[float], eval_losses: Sequence[tuple[int, float]] = ()) -> list[dict[str, object]]:
    """A run's loss per step (counted from 1, as the status line counts steps) and, with ``eval_data=``, the
    held-out loss after the steps it was evaluated at: two traces, always both (a live chart updates them)."""
    return [
        {"type": "scatter", "mode": "lines+markers", "name": "training loss", "x": list(range(1, len(losses) + 1)),
         "y": [float(x) for x in losses], "line": {"color": "#4C78A8"},
         "hovertemplate": "step %{x}: training loss %{y:.4f}<extra></extra>"},
        {"type": "scatter", "mode": "lines+markers", "name": "held-out loss", "x": [s + 1 for s, _ in eval_losses],
         "y": [float(v) for _, v in eval_losses], "line": {"color": "#E45756", "dash": "dot"},
         "marker": {"symbol": "diamond", "size": 9},
         "hovertemplate": "after step %{x}: held-out loss %{y:.4f}<extra></extra>"},
    ]


def loss_layout() -> dict[str, object]:
    return {"height": LOSS_HEIGHT, "margin": {"l": 50, "r": 10, "t": 10, "b": 35}, "autosize": True,
            "xaxis": {"title": {"text": "step"}, "dtick": 1, "rangemode": "tozero"},
            "yaxis": {"title": {"text": "loss"}}, "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom"},
            "showlegend": True}


def loss_figure(losses: Sequence[float], eval_losses: Sequence[tuple[int, float]] = ()) -> go.Figure:
    """The loss per step and the held-out loss (``run.losses``, ``run.eval_losses``) as a plain plotly figure."""
    return go.Figure(data=loss_traces(losses, eval_losses), layout=loss_layout())


def plural(n: int, word: str) -> str:
    """``"1 stage"``, ``"3 stages"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"



# --------------------------------------------------------------------------------------------- schedules
def comparison_figure(cmp: Comparison) -> go.Figure:
    """Bar chart of step time and bubble per schedule for a ``pv.compare`` result.

    Example:
        >>> comparison_figure(pv.compare(plan, microbatches=8)).show()
    """
    from plotly.subplots import make_subplots

    names = [r.schedule for r in cmp.rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("step time (ms)", "bubble"))
    fig.add_trace(go.Bar(x=names, y=[r.step_time * 1e3 for r in cmp.rows], name="step"), 1, 1)
    fig.add_trace(go.Bar(x=names, y=[r.bubble for r in cmp.rows], name="bubble"), 1, 2)
    fig.update_layout(showlegend=False, height=320, margin={"t": 40, "b": 40, "l": 40, "r": 10})
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return fig

