"""The layer graph of a plan as a plotly figure: a marker per layer coloured by stage and sized by FLOPs, skip
connections as dotted arcs, a dashed line at every split, and a hover that says what a click there does.

A plain ``plotly.graph_objects.Figure`` (``graph_figure``); the Explorer's graph column draws the same traces and
layout into a live figure.

Example:
    >>> from pipeviz.widgets.graph_figures import graph_figure
    >>> graph_figure(graph.split(["layer0"])).show()
"""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np
import plotly.graph_objects as go

from pipeviz.plan.preview import human_bytes
from pipeviz.plan.split import SplitPlan
from pipeviz.widgets.figures import plural, stage_color

__all__ = ["ARC_ROOM", "LABEL_CHARS", "GraphLayers", "graph_figure", "graph_layers", "graph_layout", "graph_traces",
           "short_name"]


def _count(n: float) -> str:
    """A count in SI units (FLOPs): ``2.1e9`` -> ``"2.1 G"``."""
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.0f}" if unit == "" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} P"


def _arc(y0: float, y1: float, bulge: float, points: int = 16) -> tuple[list[float], list[float]]:
    """A quadratic Bezier from (0, y0) to (0, y1) bulging right to x = bulge."""
    t = np.linspace(0.0, 1.0, points)
    xs = 2 * (1 - t) * t * (2 * bulge)
    ys = (1 - t) ** 2 * y0 + 2 * (1 - t) * t * (y0 + y1) / 2 + t**2 * y1
    return [*xs.tolist(), None], [*ys.tolist(), None]


ARC_ROOM = 1.0  # the widest a skip arc bulges right of the markers (x data units; the stage labels sit past it)
LABEL_CHARS = 26  # longer layer names are shortened in the middle on the graph (the hover has them whole)


def short_name(name: str, limit: int = LABEL_CHARS) -> str:
    """``transformer.h.11.attn.c_proj`` -> ``transformer.h…attn.c_proj`` (the ends kept)."""
    if len(name) <= limit:
        return name
    head = (limit - 1) // 2
    return name[:head] + "…" + name[-(limit - 1 - head):]


def _action(plan: SplitPlan, name: str, expandable: bool) -> str:
    """What a click on the layer does, truthfully."""
    g = plan.graph
    if name == g.layer_names[-1]:
        what = "the last layer: no split after it"
    elif not g.can_split_after(name):
        what = "no split after it (only glue ops would follow)"
    elif any(n == name for n, _ in plan.splits) or plan.stage_of(name) != plan.stage_of(
            g.layer_names[g.layer_names.index(name) + 1]):
        what = "click: remove the split after it"
    else:
        what = "click: split after it"
    return what + (" · shift-click: expand its modules" if expandable else "")


class GraphLayers(TypedDict):
    """Per-layer lists the graph figure draws (``graph_layers``)."""

    names: list[str]
    labels: list[str]
    stages: list[int]
    y: list[int]
    size: list[float]
    symbol: list[str]
    custom: list[list[object]]


def graph_layers(plan: SplitPlan) -> GraphLayers:
    """Per-layer arrays the graph figure draws (name, stage, cost, position, glyph, what a click does)."""
    g = plan.graph
    stage_of = {name: s.index for s in plan.stages for name in s.layers}
    layers = g.layers
    max_flops = max((la.flops for la in layers), default=0) or 1
    return {
        "names": [la.name for la in layers],
        "labels": [short_name(la.name) + (" ⊕" if la.expandable else "") for la in layers],
        "stages": [stage_of[la.name] for la in layers],
        "y": list(range(len(layers))),
        "size": [11 + 21 * float(np.sqrt(la.flops / max_flops)) for la in layers],
        # A block that opens up (shift-click) is a square; a leaf module a circle.
        "symbol": ["square" if la.expandable else "circle" for la in layers],
        "custom": [[la.name, la.kind + (" (a block: shift-click to expand)" if la.expandable else ""),
                    f"{la.params:,}", _count(la.flops), human_bytes(la.out_bytes), stage_of[la.name],
                    _action(plan, la.name, la.expandable)] for la in layers],
    }


def graph_traces(plan: SplitPlan) -> list[dict[str, object]]:
    """Traces of the layer graph: chain edges, skip edges (arcs to the right) and the layer markers (last)."""
    g = plan.graph
    pos = {name: i for i, name in enumerate(g.layer_names)}
    chain_x: list[float | None] = []
    chain_y: list[float | None] = []
    skip_x: list[float | None] = []
    skip_y: list[float | None] = []
    lanes: list[tuple[int, int]] = []
    arcs: list[tuple[int, int, float]] = []
    for a, b in g.edges:
        i, j = pos[a], pos[b]
        if j - i == 1:
            chain_x += [0, 0, None]
            chain_y += [i, j, None]
            continue
        # Nested / overlapping skips get their own lane so arcs do not sit on top of each other.
        lane = sum(1 for (p, q) in lanes if p < j and i < q)
        lanes.append((i, j))
        arcs.append((i, j, 0.35 + 0.2 * lane + 0.02 * (j - i)))
    # Many overlapping skips (a residual MLP's 21) would bulge past the plot's right edge and over the stage
    # labels: their lanes are squeezed, in order, into the room left of the labels.
    squeeze = min(1.0, ARC_ROOM / max((b for _, _, b in arcs), default=1.0))
    for i, j, bulge in arcs:
        xs, ys = _arc(i, j, bulge * squeeze)
        skip_x += xs
        skip_y += ys
    d = graph_layers(plan)
    hover = ("<b>%{customdata[0]}</b><br>kind: %{customdata[1]}<br>params: %{customdata[2]}<br>"
             "FLOPs: %{customdata[3]}<br>output: %{customdata[4]}<br>stage %{customdata[5]}<br>"
             "<i>%{customdata[6]}</i><extra></extra>")
    return [
        {"type": "scatter", "mode": "lines", "x": chain_x, "y": chain_y, "hoverinfo": "skip", "name": "edges",
         "line": {"color": "#999", "width": 2}, "showlegend": False},
        {"type": "scatter", "mode": "lines", "x": skip_x, "y": skip_y, "hoverinfo": "skip", "name": "skip edges",
         "line": {"color": "#c0392b", "width": 1.5, "dash": "dot"}, "showlegend": bool(skip_x)},
        {"type": "scatter", "mode": "markers+text", "x": [0.0] * len(d["names"]), "y": d["y"], "name": "layers",
         "text": d["labels"], "textposition": "middle left", "textfont": {"size": 11}, "customdata": d["custom"],
         "hovertemplate": hover, "showlegend": False,
         "marker": {"size": d["size"], "color": [stage_color(s) for s in d["stages"]], "symbol": d["symbol"],
                    "line": {"color": "#333", "width": 1}, "opacity": 0.95}},
    ]


def graph_layout(plan: SplitPlan, *, height: int | None = None, width: int | None = None) -> dict[str, object]:
    """Layout with stage bands and a dashed split line between stages."""
    n = len(plan.graph.layers)
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for s in plan.stages:
        lo, hi = plan.graph.layer_names.index(s.layers[0]), plan.graph.layer_names.index(s.layers[-1])
        shapes.append({"type": "rect", "xref": "paper", "x0": 0, "x1": 1, "y0": lo - 0.5, "y1": hi + 0.5,
                       "fillcolor": stage_color(s.index), "opacity": 0.08, "line": {"width": 0}, "layer": "below"})
        annotations.append({"xref": "paper", "x": 1, "xanchor": "right", "y": (lo + hi) / 2, "showarrow": False,
                            "text": f"stage {s.index}", "font": {"color": stage_color(s.index), "size": 11}})
        if s.index < plan.num_stages - 1:
            shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": hi + 0.5, "y1": hi + 0.5,
                           "line": {"color": "#333", "width": 2, "dash": "dash"}})
    return {
        "height": height or max(260, 60 + 30 * n),
        "width": width,
        "margin": {"l": 10, "r": 10, "t": 30, "b": 10},
        "title": {"text": f"{short_name(type(plan.graph.model).__name__, 20)} · {plural(n, 'layer')} · "
                          f"{plural(plan.num_stages, 'stage')}", "font": {"size": 12}, "x": 0.01},
        "xaxis": {"visible": False, "range": [-2.4, 1.6], "fixedrange": True},
        "yaxis": {"visible": False, "range": [n - 0.5, -0.7], "fixedrange": True},
        "shapes": shapes,
        "annotations": annotations,
        "hovermode": "closest",
        "dragmode": False,
        "clickmode": "event",
        "plot_bgcolor": "white",
        "legend": {"x": 1, "xanchor": "right", "y": 0, "font": {"size": 10}},
    }


def graph_figure(plan: SplitPlan, *, height: int | None = None, width: int | None = None) -> go.Figure:
    """The layer graph of ``plan`` top-down: markers coloured by stage and sized by FLOPs, skip connections
    as dotted arcs, a dashed line at every split. Hover shows name, kind, params, FLOPs and output bytes.

    Example:
        >>> graph_figure(graph.split(["layer0"])).show()

    Returns:
        ``plotly.graph_objects.Figure``; its last trace (``"layers"``) has one marker per layer.
    """
    fig = go.Figure(layout=graph_layout(plan, height=height, width=width))
    fig.add_traces(graph_traces(plan))
    return fig
