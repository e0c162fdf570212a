"""Notebook views over the core: ``Explorer``, ``TimelineView`` and plain plotly figures.

Nothing here is imported by ``import pipeviz``: the names below load ipywidgets and plotly on first use,
and ``pipeviz.widgets.losses`` (what a launched run's default loss pickles by reference) loads neither.

Example:
    >>> from pipeviz.widgets import Explorer, TimelineView, graph_figure, timeline_figure
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "Explorer": "pipeviz.widgets.explorer",
    "TimelineView": "pipeviz.widgets.timeline_view",
    "graph_figure": "pipeviz.widgets.figures",
    "timeline_figure": "pipeviz.widgets.figures",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeviz.widgets' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
