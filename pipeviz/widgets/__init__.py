"""Notebook views over the core: ``Explorer``, ``TimelineView`` and plain plotly figures.

Nothing here is imported by ``import pipeviz``: the names below load ipywidgets and plotly on first use
(``pv.Explorer``, ``pv.timeline_figure``, ... reach them through the package's lazy attributes).

Example:
    >>> from pipeviz.widgets import Explorer, TimelineView, comparison_figure, graph_figure, timeline_figure
"""

from __future__ import annotations

_LAZY = {
    "Explorer": "pipeviz.widgets.explorer",
    "TimelineView": "pipeviz.widgets.timeline_view",
    "comparison_figure": "pipeviz.widgets.figures",
    "expert_tokens_figure": "pipeviz.widgets.experts",
    "graph_figure": "pipeviz.widgets.graph_figures",
    "player_figure": "pipeviz.widgets.teaching_figures",
    "side_by_side_figure": "pipeviz.widgets.teaching_figures",
    "timeline_figure": "pipeviz.widgets.figures",
    "write_report": "pipeviz.widgets.report",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeviz.widgets' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
