"""``StepPlayer``: one step of a timeline played action by action in a notebook, with play, pause and one action
forward or back (ipywidgets' ``Play`` and two buttons, so stepping needs no plotly animation), and each rank's
saved activations at that instant. The frames are ``pv.player_figure``'s.

Example:
    >>> player = StepPlayer(pv.simulate(plan, "1F1B", 8)); player
    >>> player.forward(); player.frame          # 1: the first action finished
"""

from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W

from pipeviz.schedule.timeline import Timeline
from pipeviz.widgets.live_figure import LiveFigure, plotly_bundle

__all__ = ["StepPlayer"]


@dataclass(frozen=True)
class _Frame:
    traces: list[int]  # the figure's traces it redraws
    data: list[dict[str, object]]  # their fields at this instant
    title: str  # what finished, when (and the timeline's title under it)


class StepPlayer(W.VBox):
    """A step played action by action (``show(timeline)`` to change it).

    Attributes:
        figure: the chart (``LiveFigure``); frames: ``pv.player_figure``'s frames; slider: the frame shown (0: the
            step's start, k: after the k-th instant an action finished); play: ipywidgets' ``Play`` driving it;
        back_button, forward_button: one action back or forward.
    """

    def __init__(self, timeline: Timeline | None = None, *, speed_ms: int = 350) -> None:
        self.speed_ms = speed_ms
        self.figure = LiveFigure()
        self.figure._config = {"responsive": True}
        self.frames: list[_Frame] = []
        self.slider = W.IntSlider(value=0, min=0, max=0, description="action", readout=False,
                                  continuous_update=True, layout=W.Layout(flex="1 1 auto", min_width="0"))
        self.play = W.Play(value=0, min=0, max=0, interval=speed_ms, description="play", show_repeat=False)
        W.jslink((self.play, "value"), (self.slider, "value"))  # played in the page; Python draws each frame
        self.back_button = W.Button(icon="step-backward", tooltip="one action back", layout=W.Layout(width="40px"))
        self.forward_button = W.Button(icon="step-forward", tooltip="one action forward",
                                       layout=W.Layout(width="40px"))
        self.back_button.on_click(lambda _: self.back())
        self.forward_button.on_click(lambda _: self.forward())
        self.label = W.HTML()
        self.label.add_class("pipeviz-player-label")
        self.slider.observe(lambda change: self._draw(int(change["new"])), "value")
        controls = W.HBox([self.play, self.back_button, self.forward_button, self.slider],
                          layout=W.Layout(align_items="center", max_width="100%"))
        hidden = [b for b in [plotly_bundle()] if b is not None]
        super().__init__([self.label, controls, self.figure, *hidden], layout=W.Layout(max_width="100%"))
        self.add_class("pipeviz-player")
        if timeline is not None:
            self.show(timeline)

    @property
    def frame(self) -> int:
        """The frame shown: 0 the step's start, k after the k-th instant an action finished."""
        return int(self.slider.value)

    def show(self, timeline: Timeline, step: int | None = None) -> None:
        """Play ``timeline``'s ``step`` (default: its first) from its start."""
        from pipeviz.widgets.teaching_figures import player_figure

        fig = player_figure(timeline, step, speed_ms=self.speed_ms)
        self.frames = [_Frame(list(f.traces), [d.to_plotly_json() for d in f.data], str(f.layout.title.text))
                       for f in fig.frames]
        fig.frames = []
        fig.layout.updatemenus, fig.layout.sliders = [], []  # the widget's own controls instead
        fig.layout.margin.b = 40
        self.figure.replace(fig)
        last = len(self.frames) - 1
        self.play.value = self.slider.value = 0
        self.play.max = self.slider.max = last
        self._draw(0)

    def forward(self) -> None:
        """One action forward (at the step's end: stays)."""
        self.slider.value = min(self.frame + 1, self.slider.max)

    def back(self) -> None:
        """One action back (at the start: stays)."""
        self.slider.value = max(self.frame - 1, 0)

    def _draw(self, k: int) -> None:
        if not self.frames:
            return
        frame = self.frames[min(max(k, 0), len(self.frames) - 1)]
        with self.figure.batch_update():
            for i, data in zip(frame.traces, frame.data, strict=True):
                self.figure.data[i].update({key: v for key, v in data.items() if key != "type"})
            self.figure.layout.title.text = frame.title
        self.label.value = f"<span style='font-size:13px'>{frame.title.split('<br>')[0]}</span>"
        self.back_button.disabled = k <= 0
        self.forward_button.disabled = k >= len(self.frames) - 1
