"""``SimSection``: the simulated step under the Explorer's controls: its timeline, "Step through" (the step action by
action, with each rank's memory at that instant) and "Schedules side by side" (``pv.compare`` on these ranks), each
following the plan and the settings while shown. A view over an ``ExplorerState`` and the timeline it simulated.
"""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as W

import pipeviz as pv
from pipeviz.schedule.timeline import Timeline
from pipeviz.sim.simulate import Comparison
from pipeviz.widgets.live_figure import LiveFigure
from pipeviz.widgets.player import StepPlayer
from pipeviz.widgets.state import ExplorerState
from pipeviz.widgets.timeline_view import TimelineView

__all__ = ["SimSection"]


class SimSection:
    """The simulated step's heading, its ``TimelineView`` (``view``) and the two toggles under it.

    Attributes:
        player_button, player: "Step through", and the ``StepPlayer`` it shows (None until first shown).
        side_button, comparison, side_figure: "Schedules side by side": ``pv.compare`` of the plan and the settings'
            run (None while hidden), drawn by ``pv.side_by_side_figure``.
    """

    def __init__(self, state: ExplorerState) -> None:
        self.state = state
        self.sim: Timeline | None = None
        self.heading = W.HTML("<b>Simulated step</b> (current plan)")  # hidden with the chart (one stage)
        self.view = TimelineView(None)
        self.view.add_class("pipeviz-sim-timeline")
        # The simulated step played action by action (made on first use: a StepPlayer draws a figure per action).
        self.player_button = _toggle("Step through", "step-forward", "pipeviz-player-toggle",
                                     "play the simulated step one action at a time, with each rank's saved "
                                     "activations at that instant", self.show_player)
        self.player: StepPlayer | None = None
        self.player_box = W.VBox(layout=W.Layout(max_width="100%"))
        # Every schedule of pv.compare on these ranks, one above the other on one time and one memory axis.
        self.side_button = _toggle("Schedules side by side", "columns", "pipeviz-side-toggle",
                                   "pv.compare on these ranks: every schedule's simulated step on one time axis, its "
                                   "memory per rank on one memory axis", self.show_side_by_side)
        self.side_figure: LiveFigure | None = None
        self.comparison: Comparison | None = None
        self.side_box = W.VBox(layout=W.Layout(max_width="100%"))
        self.toggles = W.VBox([W.HBox([self.player_button, self.side_button]), self.player_box, self.side_box],
                              layout=W.Layout(display="none", max_width="100%"))

    def widgets(self) -> list[W.Widget]:
        return [self.heading, self.view, self.toggles]

    def show(self, sim: Timeline | None) -> None:
        """``sim`` (None: nothing simulated, all hidden) in the chart and in whatever toggle is on."""
        self.sim = sim
        # Shown before it is drawn: the chart takes the width it has when drawn (a hidden one has none).
        self.view.layout.display = "none" if sim is None else "flex"
        self.heading.layout.display = "none" if sim is None else ""
        self.view.update(sim, overlay=None)
        self.view.summary.value = "" if sim is None else self.view.summary.value
        self.toggles.layout.display = "none" if sim is None else "flex"
        self.show_player()
        self.show_side_by_side()

    def show_side_by_side(self) -> None:
        """Every schedule side by side under the simulated timeline (``pv.compare`` of the plan, the settings' run),
        following the plan while shown."""
        from pipeviz.widgets.teaching_figures import side_by_side_figure

        self.comparison = None
        if not self.side_button.value or self.sim is None:
            if self.side_box.children:
                self.side_box.children = ()
            return
        cfg = self.state.launch_config()
        self.comparison = pv.compare(self.state.plan, microbatches=cfg.microbatches, config=cfg,
                                     options=self.state.cost_options())
        if not self.comparison.rows:
            self.side_box.children = (W.HTML("<i>no schedule runs this plan here</i>"),)
            return
        rows = {r.schedule: self.comparison.timelines[r.schedule] for r in self.comparison.rows}
        # a custom (synthesized) order, as simulated above, first among torch's schedules on these ranks
        fig = side_by_side_figure(self.comparison if cfg.order is None else
                                  {f"custom order ({cfg.schedule}'s placement)": self.sim, **rows})
        if self.side_figure is None:
            self.side_figure = LiveFigure()
            self.side_figure._config = {"responsive": True}
            self.side_figure.add_class("pipeviz-side-by-side")
        self.side_figure.replace(fig)
        self.side_box.children = (self.side_figure,)

    def show_player(self) -> None:
        """The step player under the simulated timeline, following it while shown."""
        if not self.player_button.value or self.sim is None:
            if self.player_box.children:
                self.player_box.children = ()
            return
        if self.player is None:
            self.player = StepPlayer()
        self.player.show(self.sim)
        self.player_box.children = (self.player,)


def _toggle(description: str, icon: str, css: str, tooltip: str, show: Callable[[], None]) -> W.ToggleButton:
    """A toggle under the simulated timeline that shows (or hides) a view with ``show``."""
    button = W.ToggleButton(description=description, icon=icon, value=False, tooltip=tooltip,
                            layout=W.Layout(width="auto"))
    button.add_class(css)
    button.observe(lambda _: show(), "value")
    return button
