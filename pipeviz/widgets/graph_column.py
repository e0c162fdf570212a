"""``GraphColumn``: the Explorer's layer graph (a click on a layer: split after it, or remove the split; a shift-click
on a block, drawn as a square: its modules) and the bar above it that folds opened blocks back. A view of a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import ipywidgets as W
import plotly.graph_objects as go

from pipeviz.capture.view import GraphView
from pipeviz.plan.split import SplitPlan
from pipeviz.widgets import panels
from pipeviz.widgets.controls import row_layout
from pipeviz.widgets.graph_figures import graph_figure, graph_layout, graph_traces
from pipeviz.widgets.live_figure import LiveFigure, plotly_bundle
from pipeviz.widgets.panels import soon

if TYPE_CHECKING:
    from plotly.callbacks import InputDeviceState, Points

__all__ = ["GRAPH_WIDTH", "GraphColumn"]

GRAPH_WIDTH = 400  # px: the graph's column; the rest of the row (or the row below, when narrow) is the preview


class GraphColumn:
    """The graph ``figure`` (a ``LiveFigure``), the ``view_bar`` above it, in one scrolling column (``box``).

    Args:
        plan: the plan drawn first.
        on_click: called with a layer's name and whether a modifier (shift, ...) was held, after the click's own
            message is handled.
        on_collapse: called with an opened block's name (its button on the bar); ``on_regroup``: "natural blocks".
    """

    def __init__(self, plan: SplitPlan, on_click: Callable[[str, bool], None], on_collapse: Callable[[str], None],
                 on_regroup: Callable[[], None]) -> None:
        self.plan = plan
        self._on_click, self._on_collapse, self._on_regroup = on_click, on_collapse, on_regroup
        self.figure = LiveFigure(graph_figure(plan, width=GRAPH_WIDTH))
        self.figure._config = {"displayModeBar": False}  # nothing to zoom; it would cover the title
        self.figure.data[-1].on_click(self._clicked)
        self.view_bar = W.HBox(layout=row_layout())
        self.view_bar.add_class("pipeviz-view-bar")
        self._bar_graph: GraphView | None = None  # the graph the bar was built for
        hidden = [w for w in (panels.browser_helper(), plotly_bundle()) if w is not None]  # page helpers; plotly.js
        self.box = W.VBox([self.view_bar, self.figure, *hidden],
                          layout=W.Layout(flex="0 1 auto", width=f"{GRAPH_WIDTH + 10}px", max_width="100%",
                                          max_height="760px", overflow="auto"))
        self.box.add_class("pipeviz-graph-column")

    def _clicked(self, trace: go.Scatter, points: Points, state: InputDeviceState) -> None:
        if points.point_inds:
            name = self.plan.graph.layer_names[points.point_inds[0]]
            modifier = any(getattr(state, k, False) for k in ("shift", "alt", "ctrl", "meta"))
            soon(lambda: self._on_click(name, modifier))

    def show(self, plan: SplitPlan) -> None:
        """Draw ``plan`` (and the bar, when its graph changed)."""
        self.plan = plan
        if plan.graph is not self._bar_graph:
            self._bar_graph = plan.graph
            self.view_bar.children = self._bar(plan.graph)
        fig, traces = self.figure, graph_traces(plan)
        with fig.batch_update():
            for trace, spec in zip(fig.data, traces, strict=True):
                trace.update({k: v for k, v in spec.items() if k != "type"})
            layout = graph_layout(plan, width=GRAPH_WIDTH)
            # Lists are assigned whole: a nested update would send both 'shapes' and 'shapes.0.y1', which
            # plotly.js rejects ("cannot set shapes.0.y1 and a parent attribute simultaneously").
            fig.layout.shapes, fig.layout.annotations = layout.pop("shapes"), layout.pop("annotations")
            fig.layout.update(layout)
        fig.persist()  # a reloaded page draws this plan too, not the first one

    def _bar(self, graph: GraphView) -> list[W.Widget]:
        """The bar above the graph: what is expanded, each with a button to fold it back, and the reset."""
        natural = set(graph.regroup().layer_names)
        opened: list[str] = []
        for name in graph.layer_names:
            if name not in natural:
                outer = next((a for a in reversed(graph._tree.ancestors(name)) if a in natural), None)
                if outer is not None and outer not in opened:
                    opened.append(outer)
        label = W.HTML("<span style='font-size:12px'>shift-click a ■ block to open it</span>" if not opened
                       else "<span style='font-size:12px'>opened:</span>")
        buttons: list[W.Widget] = [label]
        for name in opened:
            b = W.Button(description=f"⊖ {panels.short(name)}", tooltip=f"collapse {name}",
                         layout=W.Layout(width="auto", max_width="100%"))
            b.on_click(lambda _, n=name: self._on_collapse(n))
            b.add_class("pipeviz-collapse")
            buttons.append(b)
        if opened or set(graph.layer_names) != natural:
            reset = W.Button(description="natural blocks", icon="compress", layout=W.Layout(width="auto"))
            reset.on_click(lambda _: self._on_regroup())
            buttons.append(reset)
        return buttons
