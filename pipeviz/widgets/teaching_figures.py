"""Figures for teaching a schedule: several schedules side by side on one time axis and one memory axis
(``side_by_side_figure``), and one step played action by action with each rank's saved activations at that instant
(``player_figure``). Plain ``plotly.graph_objects.Figure``s: they run in JupyterLab, Notebook 7, an nbconvert or
``write_html`` page and on a projector, without a kernel.

Example:
    >>> cmp = pv.compare(plan, microbatches=8)
    >>> pv.side_by_side_figure(cmp).show()                        # every schedule that runs, one row each
    >>> pv.player_figure(pv.simulate(plan, "ZBVZeroBubble", 8)).show()   # play, pause, drag or click to step
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from pipeviz.schedule.timeline import COMPUTE, Event, Timeline
from pipeviz.widgets.figures import KIND_COLORS, MEMORY_COLOR, time_origin, timeline_title, timeline_traces

if TYPE_CHECKING:
    from pipeviz.sim.simulate import Comparison

__all__ = ["player_figure", "side_by_side_figure"]

MIB = 2**20
GANTT_SHARE = 0.78  # of the width: the Gantt charts; the rest, the memory bars


def _timelines(source: Comparison | Mapping[str, Timeline] | Sequence[Timeline]) -> list[tuple[str, Timeline]]:
    if isinstance(source, Mapping):
        return [(str(k), v) for k, v in source.items()]
    from pipeviz.sim.simulate import Comparison

    if isinstance(source, Comparison):  # in its rows' order
        return [(r.schedule, source.timelines[r.schedule]) for r in source.rows if r.schedule in source.timelines]
    return [(str(getattr(t, "schedule", "")), t) for t in source]


def side_by_side_figure(source: Comparison | Mapping[str, Timeline] | Sequence[Timeline], *,
                        why: bool = False) -> go.Figure:
    """Schedules one above the other on one time axis, each with its ranks' peak memory on one memory axis beside
    it: the bubble, the step and the memory of each, comparable by eye.

    Example:
        >>> pv.side_by_side_figure(pv.compare(plan, microbatches=8))
        >>> pv.side_by_side_figure([pv.simulate(plan, "1F1B", 8), pv.simulate(plan, "ZBVZeroBubble", 8)])

    Args:
        source: a ``pv.compare`` result (its rows, in its order), a dict of name -> ``Timeline`` or a list of
            ``Timeline``s.
        why: each row with its critical path and idle gaps (``pv.timeline_figure(..., why=True)``).
    """
    from plotly.subplots import make_subplots

    from pipeviz.widgets.figures import why_traces

    rows = _timelines(source)
    if not rows:
        raise ValueError("side_by_side_figure() needs at least one timeline; got none. Fix: pass pv.compare(...) "
                         "or a list of pv.simulate(...) timelines.")
    bad = [type(t).__name__ for _, t in rows if not isinstance(t, Timeline)]
    if bad:
        raise TypeError(f"side_by_side_figure() draws pv.Timeline objects, got {bad[0]}.")
    heights = [max(t.num_ranks, 1) + 1.2 for _, t in rows]
    fig = make_subplots(rows=len(rows), cols=2, shared_xaxes="columns", column_widths=[GANTT_SHARE, 1 - GANTT_SHARE],
                        row_heights=[h / sum(heights) for h in heights], horizontal_spacing=0.04,
                        vertical_spacing=min(0.5 / len(rows), 0.3 / max(len(rows) - 1, 1)),
                        subplot_titles=[x for name, t in rows for x in (_short_title(name, t), "")])
    top = max((max(_memory(t)) for _, t in rows if _memory(t)), default=0) / MIB
    for i, (name, tl) in enumerate(rows, start=1):
        traces = timeline_traces(tl, labels=len(tl.events) <= 400) + (why_traces(tl) if why else [])
        for tr in traces:
            tr = dict(tr, legendgroup=str(tr.get("legendgroup", "")).split("-")[-1], showlegend=False)
            fig.add_trace(tr, row=i, col=1)
        ranks = max(tl.num_ranks, 1)
        fig.update_yaxes(tickmode="array", tickvals=list(range(ranks)),
                         ticktext=[tl.process_label(r) for r in range(ranks)], range=[ranks - 0.5, -0.5],
                         zeroline=False, fixedrange=True, row=i, col=1)
        memory = _memory(tl)
        if memory:
            fig.add_trace(go.Bar(x=[b / MIB for b in memory], y=list(range(len(memory))), orientation="h",
                                 marker={"color": MEMORY_COLOR}, showlegend=False, name=f"{name}: memory",
                                 hovertemplate="rank %{y}: %{x:.2f} MiB<extra>" + name + "</extra>"), row=i, col=2)
        fig.update_yaxes(range=[ranks - 0.5, -0.5], showticklabels=False, fixedrange=True, row=i, col=2)
        fig.update_xaxes(range=[0, top * 1.05 or 1], row=i, col=2)  # one memory axis for every row
    # The legend: one entry per kind, once.
    for kind in sorted({e.kind for _, t in rows for e in t.events}, key=list(KIND_COLORS).index):
        fig.add_trace(go.Bar(x=[None], y=[None], name=kind, marker={"color": KIND_COLORS[kind]}, showlegend=True),
                      row=1, col=1)
    fig.update_xaxes(title_text="time (ms)", row=len(rows), col=1)
    fig.update_xaxes(title_text="peak memory (MiB)", row=len(rows), col=2)
    fig.update_layout(barmode="overlay", height=int(90 + 52 * sum(heights)), autosize=True, hovermode="closest",
                      margin={"l": 60, "r": 10, "t": 60, "b": 40}, plot_bgcolor="#fafafa",
                      legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1, "xanchor": "right",
                              "font": {"size": 10}},
                      title={"text": "Schedules side by side: one time axis, one memory axis", "font": {"size": 13},
                             "x": 0.01, "xanchor": "left", "y": 0.995, "yanchor": "top"})
    fig.update_annotations(font={"size": 11}, xanchor="left", x=0)
    return fig


def _short_title(name: str, tl: Timeline) -> str:
    if not tl.events:
        return f"{name}: no events"
    return f"{name}: step {tl.step_time * 1e3:.2f} ms · bubble {tl.bubble_fraction:.0%}"


def _memory(tl: Timeline) -> list[int]:
    return list(tl.memory_bytes or tl.peak_activation_bytes or [])


def _curve(tl: Timeline) -> dict[int, list[tuple[float, int]]]:
    """Per rank, saved-activation bytes over time: a simulation's ``activation_curve``, a run's
    ``activation_memory`` (its samples)."""
    raw = tl.meta.get("activation_curve") or tl.meta.get("activation_memory") or {}
    return {int(r): [(float(t), int(b)) for t, b in track] for r, track in raw.items()}


def _at(track: Sequence[tuple[float, int]], t: float) -> int:
    """The last value of ``track`` at or before ``t`` (0 before its first)."""
    value = 0
    for when, size in track:
        if when > t + 1e-12:
            break
        value = size
    return value


def player_figure(timeline: Timeline, step: int | None = None, *, speed_ms: int = 350) -> go.Figure:
    """One step of ``timeline`` played action by action: the Gantt chart fills in as actions finish, a line marks
    the instant, and the bars under it show each rank's saved activations then. Play and pause with the buttons;
    step one action forward or back with the slider (one tick per finished action: click the next or the previous
    one, or drag).

    Example:
        >>> pv.player_figure(pv.simulate(plan, "1F1B", 8)).show()
        >>> pv.player_figure(run.timeline(), step=2).write_html("step2.html")

    Args:
        timeline: a simulated or measured ``Timeline``.
        step: which step (default: the first).
        speed_ms: milliseconds per action while playing.
    """
    from plotly.subplots import make_subplots

    if not isinstance(timeline, Timeline):
        raise TypeError(f"player_figure() needs a pv.Timeline, got {type(timeline).__name__}.")
    steps = timeline.steps
    if not steps:
        raise ValueError("player_figure() needs a timeline with events; this one has none (a run not started yet?).")
    step = steps[0] if step is None else step
    if step not in steps:
        raise ValueError(f"step={step} is not in this timeline; its steps are {steps}. Fix: one of those.")
    events = timeline.step_events(step)
    t0 = time_origin(timeline) if timeline.source == "measured" else 0.0
    done_at = sorted({e.end for e in events if e.kind in COMPUTE})
    instants = [min(e.start for e in events), *done_at]
    ranks = max(timeline.num_ranks, 1)
    curve = _curve(timeline)
    top = max([b for track in curve.values() for _, b in track] + [1]) / MIB
    fig = make_subplots(rows=2, cols=1, row_heights=[0.68, 0.32], vertical_spacing=0.2,
                        subplot_titles=("", "saved activations at this instant (MiB)"))
    head = timeline_title(timeline)

    def title(label: str, ms: float) -> str:
        return f"<b>{label}</b> · {ms:.2f} ms<br><span style='font-size:11px'>{head}</span>"

    # The whole step, faint: what is still to come.
    fig.add_trace(go.Bar(**_bars(events, faint=True, t0=t0), name="to come", showlegend=False), row=1, col=1)
    kinds = [k for k in KIND_COLORS if any(e.kind == k for e in events)]
    for kind in kinds:  # what has finished, per kind (the frames fill these)
        fig.add_trace(go.Bar(**_bars([], kind=kind), name=kind), row=1, col=1)
    fig.add_trace(go.Scatter(x=[0, 0], y=[-0.5, ranks - 0.5], mode="lines", name="now", showlegend=False,
                             line={"color": "#111", "width": 1.5, "dash": "dot"}, hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Bar(x=[0] * ranks, y=[f"rank {r}" for r in range(ranks)], orientation="h", showlegend=False,
                         marker={"color": MEMORY_COLOR}, name="saved activations",
                         hovertemplate="%{y}: %{x:.2f} MiB<extra></extra>"), row=2, col=1)
    dynamic = list(range(1, len(fig.data)))
    frames, labels = [], []
    for k, t in enumerate(instants):
        finished = [e for e in events if e.end <= t + 1e-12]
        data = [go.Bar(**_bars([e for e in finished if e.kind == kind], kind=kind, t0=t0)) for kind in kinds]
        ms = (t - t0) * 1e3
        data.append(go.Scatter(x=[ms, ms], y=[-0.5, ranks - 0.5]))
        sizes = [_at(curve.get(r, []), t) / MIB for r in range(ranks)]
        data.append(go.Bar(x=sizes, y=[f"rank {r}" for r in range(ranks)],
                           text=[f"{s:.2f}" for s in sizes], textposition="outside"))
        last = max((e for e in finished if e.kind in COMPUTE), key=lambda e: e.end, default=None)
        label = "start" if last is None else f"{last.label} done"
        frames.append(go.Frame(name=str(k), data=data, traces=dynamic,
                               layout={"title": {"text": title(label, ms)}}))
        labels.append(label)
    fig.frames = frames
    first = frames[0]
    for i, tr in zip(dynamic, first.data, strict=True):
        fig.data[i].update(tr)
    end_ms = (max(e.end for e in events) - t0) * 1e3
    fig.update_xaxes(range=[(instants[0] - t0) * 1e3, end_ms * 1.02], title_text="time (ms)", row=1, col=1)
    fig.update_yaxes(tickmode="array", tickvals=list(range(ranks)),
                     ticktext=[timeline.process_label(r) for r in range(ranks)], range=[ranks - 0.5, -0.5],
                     fixedrange=True, row=1, col=1)
    fig.update_xaxes(range=[0, top * 1.25], row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    _player_layout(fig, labels, ranks, speed_ms, title("start", (instants[0] - t0) * 1e3))
    return fig


def _player_layout(fig: go.Figure, labels: list[str], ranks: int, speed_ms: int, title: str) -> None:
    """The player's size, title, legend, play / pause buttons and its slider (one tick per label)."""
    play = {"frame": {"duration": speed_ms, "redraw": True}, "transition": {"duration": 0}, "fromcurrent": True,
            "mode": "immediate"}
    pause = {"frame": {"duration": 0, "redraw": False}, "transition": {"duration": 0}, "mode": "immediate"}
    fig.update_layout(
        height=200 + 100 * ranks, barmode="overlay", autosize=True, plot_bgcolor="#fafafa",
        margin={"l": 60, "r": 20, "t": 80, "b": 40}, title={"text": title,
                                                             "font": {"size": 13}, "x": 0.01, "xanchor": "left"},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right", "font": {"size": 10}},
        updatemenus=[{"type": "buttons", "direction": "left", "showactive": False, "x": 0, "y": -0.08,
                      "xanchor": "left", "yanchor": "top", "pad": {"r": 8, "t": 0},
                      "buttons": [{"label": "▶ play", "method": "animate", "args": [None, play]},
                                  {"label": "❚❚ pause", "method": "animate", "args": [[None], pause]}]}],
        sliders=[{"active": 0, "x": 0.16, "len": 0.84, "y": -0.04, "yanchor": "top", "pad": {"t": 0},
                  "currentvalue": {"prefix": "after ", "font": {"size": 11}},
                  "steps": [{"label": lab, "method": "animate",
                             "args": [[str(k)], {"frame": {"duration": 0, "redraw": True}, "mode": "immediate",
                                                 "transition": {"duration": 0}}]}
                            for k, lab in enumerate(labels)]}])


def _bars(events: Sequence[Event], *, kind: str | None = None, faint: bool = False,
          t0: float = 0.0) -> dict[str, object]:
    """A horizontal bar trace's fields for ``events`` (one bar per event, on its rank's row)."""
    start = [(e.start - t0) * 1e3 for e in events]
    width = [(e.end - e.start) * 1e3 for e in events]
    compute = [e.kind in COMPUTE for e in events]
    colour = "#d9d9d9" if faint else KIND_COLORS.get(kind or "", "#888")
    return {"base": start, "x": width, "y": [e.rank for e in events], "orientation": "h",
            "width": [0.62 if c else 0.25 for c in compute], "marker": {"color": colour, "line": {"width": 0}},
            "text": [e.label if c else "" for e, c in zip(events, compute, strict=True)],
            "textposition": "inside", "insidetextanchor": "middle", "textfont": {"size": 9, "color": "white"},
            "customdata": [e.label for e in events],
            "hovertemplate": "%{customdata}: %{x:.3f} ms<extra></extra>" if not faint else "%{customdata}<extra>"
                             "to come</extra>"}
