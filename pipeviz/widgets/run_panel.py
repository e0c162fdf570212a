"""``RunPanel``: the Explorer's Launch and Stop, the launch's phases as they happen, and the run it started: its live
measured timeline, what separates it from the simulation, and the numerics check against the unsplit model.

A view over an ``ExplorerState`` (what Launch runs: its plan and ``launch_config()``) and the ``pv.Run`` it starts.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import ipywidgets as W
import torch

import pipeviz as pv
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.numerics import NumericsCheck
from pipeviz.schedule.timeline import Timeline
from pipeviz.widgets import panels
from pipeviz.widgets.controls import row_layout
from pipeviz.widgets.experts import expert_tokens_figure
from pipeviz.widgets.live_figure import LiveFigure
from pipeviz.widgets.run_state import RunState, run_state
from pipeviz.widgets.state import HERE, ExplorerState
from pipeviz.widgets.timeline_view import TimelineView

__all__ = ["RunPanel"]

ShowError = Callable[[BaseException, str, "W.HTML | None"], None]  # (error, prefix, area): the Explorer's error areas


class RunPanel:
    """Launch / Stop with the launch's status line (``launch_row``), what Launch and the run report under it
    (``launch_error``), and the run's section (``section``: notes, "Simulate as run here", the numerics check, the
    measured timeline).

    Args:
        state: what Launch runs.
        simulated: the simulated timeline of the plan now (drawn under the measured one as its overlay).
        show_error: shows an error in one of the Explorer's areas (``launch_error`` for what Launch caused).
    """

    def __init__(self, state: ExplorerState, simulated: Callable[[], Timeline | None], show_error: ShowError) -> None:
        self.state, self._simulated, self._show_error = state, simulated, show_error
        self.run: pv.Run | None = None
        self.run_plan: SplitPlan | None = None  # the plan the last run launched
        self.sim_here: Timeline | None = None
        self.check: NumericsCheck | None = None  # the last run's numerics check, once made
        self.checking = False  # being made now
        self.check_error = ""  # why it could not be made
        self.finished = threading.Event()
        self.finished.set()
        self.refused = False  # the settings cannot launch (Launch stays disabled when a run ends)
        self.launch_button = W.Button(description="Launch", icon="play", button_style="success",
                                      tooltip="pv.launch(plan, ...) in background processes")
        self.launch_button.add_class("pipeviz-launch")
        self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.stop_button.on_click(lambda _: self.stop())
        self.stop_button.add_class("pipeviz-stop")
        self.progress = W.HTML("<i>not launched</i>", layout=W.Layout(flex="1 1 240px", min_width="0"))
        self.progress.add_class("pipeviz-progress")
        # What Launch and the run report (refused, failed), under the Launch button that caused it
        self.launch_error = W.HTML(layout=W.Layout(max_width="100%"))
        self.launch_error.add_class("pipeviz-launch-error")
        self.run_notes = W.HTML()
        self.run_notes.add_class("pipeviz-run-notes")
        self.here_button = W.Button(description="Simulate as run here", icon="calculator",
                                    layout=W.Layout(width="auto", display="none"),
                                    tooltip="pv.simulate(..., cores=<this machine's cores>)")
        self.here_button.add_class("pipeviz-here")
        self.numerics = W.HTML()
        self.numerics.add_class("pipeviz-numerics")
        self.run_view = TimelineView(None)
        self.run_view.drawn.append(self._on_drawn)
        self.run_view.add_class("pipeviz-run-timeline")
        # With ep > 1: the tokens routed to each expert per microbatch (run.expert_tokens), redrawn with the timeline
        self.expert_chart = LiveFigure()
        self.expert_chart._config = {"responsive": True}
        self.expert_chart.add_class("pipeviz-expert-tokens")
        self.expert_box = W.VBox([self.expert_chart], layout=W.Layout(display="none", width="100%"))
        self._experts_drawn = 0  # how many ExpertLoad records the chart shows
        self.launch_row = W.HBox([self.launch_button, self.stop_button, self.progress], layout=row_layout())
        self.launch_row.add_class("pipeviz-launch-row")
        self.section = W.VBox([self.run_notes, self.here_button, self.numerics, self.run_view, self.expert_box],
                              layout=W.Layout(display="none", max_width="100%"))
        self.section.add_class("pipeviz-run-section")

    @property
    def going(self) -> bool:
        """A launched run has not ended yet (or its numerics check is still running)."""
        return self.run is not None and not self.finished.is_set()

    def allow(self, refusal: BaseException | None) -> None:
        """Launch enabled only when the settings can launch (and no run is going); its tooltip says why not."""
        self.refused = refusal is not None
        self.launch_button.tooltip = ("pv.launch(plan, ...) in background processes" if refusal is None else
                                      "refused: the reason is under the controls")
        if not self.going:
            self.launch_button.disabled = refusal is not None

    def launch(self) -> pv.Run:
        """``pv.launch`` of the state's plan and configuration, shown live; raises what ``pv.launch`` raises."""
        if self.going:
            raise pv.LaunchError("A run is still going. Fix: press Stop (explorer.stop()) first.")
        state = self.state
        args, kwargs = state.graph.example_args, dict(state.graph.example_kwargs)
        plan, cfg = state.plan, state.launch_config()
        if cfg.loss_fn is None:  # forward only: no target, loss or optimizer
            run = pv.launch(plan, config=cfg, inputs=args, input_kwargs=kwargs or None)
        else:
            run = pv.launch(plan, config=cfg, inputs=args, input_kwargs=kwargs or None, target=state.launch_target(),
                            eval_data=state.eval_data, resume=state.resume)
        self.run, self.run_plan, self.check, self.checking, self.check_error = run, plan, None, False, ""
        state.launched()
        self.finished.clear()
        self.numerics.value = self.run_notes.value = ""
        self.here_button.layout.display = "none"
        self.expert_box.layout.display, self._experts_drawn = "none", 0
        self.sim_here = None
        self.section.layout.display = "flex"
        self.stop_button.disabled, self.launch_button.disabled = False, True
        self.show_state()
        self.run_view.attach(run, overlay=self._simulated())
        run.subscribe_status(self._on_status)
        return run

    def stop(self) -> None:
        """Stop the running launch (``run.stop()``)."""
        if self.run is not None:
            self.run.stop()

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until the launched run ended and its numerics check is shown; returns the run's status."""
        if self.run is None:
            return None
        self.finished.wait(timeout)
        return self.run.status

    def simulate_here(self) -> Timeline | None:
        """The launched run's plan simulated on this machine's cores (``pv.simulate(..., cores=N)``), drawn over the
        measured timeline."""
        run = self.run
        if run is None:
            return None
        # the run's own configuration (schedule, microbatches, stages per rank, layout, training or not)
        self.sim_here = pv.simulate(self.run_plan or self.state.plan, run.spec.config, cores=_cores(),
                                    options=self.state.cost_options())
        self.run_view.update(run.timeline(), overlay=self.sim_here)
        self.explain(run)
        return self.sim_here

    def run_state(self) -> RunState | None:
        """The last run's state in the one vocabulary (``run_state``): running, done ✓/✗ with its reason, stopped and
        not checked, out of date since any change of the plan or a setting; None before the first Launch."""
        run = self.run
        if run is None:
            return None
        return run_state(run.status, self.check, checking=self.checking, error="the error is under Launch",
                         changes=self.state.changes_since_launch())

    def show_state(self) -> None:
        """The run's state, in the same words, in the status line beside Launch, the measured chart's title and
        the numerics line (after every status change, the numerics check, and any change of plan or setting)."""
        run, now = self.run, self.run_state()
        if run is None or now is None:
            return
        self.progress.value = panels.progress_html(run, now)
        self.run_view.set_status(panels.run_state_html(now))
        numerics = panels.numerics_html(now) if not self.check_error else (
            f"<div class='pipeviz-numerics-check'><b>Numerics check:</b> {self.check_error}</div>")
        if numerics != self.numerics.value:
            self.numerics.value = numerics
        if now.stale:
            self.section.add_class("pipeviz-stale")
        else:
            self.section.remove_class("pipeviz-stale")

    def mark(self, plan: SplitPlan | None = None) -> None:
        """A change of the plan or a setting: the run's state says whether it is out of date (``show_state``)."""
        self.show_state()

    def _on_status(self, run: pv.Run) -> None:
        # The status line and the buttons first (a cheap update); the charts redraw throttled behind it.
        if run is not self.run:
            return
        self.show_state()
        if run.done:
            self.stop_button.disabled, self.launch_button.disabled = True, self.refused
            if not self.finished.is_set():
                threading.Thread(target=self._finish, args=(run,), daemon=True, name="pipeviz-check").start()

    def _on_drawn(self, shown: Timeline) -> None:
        # The notes beside the measured chart are rebuilt from the timeline it just drew, as often as it redraws
        # (every 2 s while the ranks take every core): both give the same measured step (mid-run they read
        # 229.54 ms in the notes against 167.61 ms in the chart's title, from two moments of the run).
        run = self.run
        if run is not None and not run.done and shown.source == "measured" and shown.events:
            self.explain(run, shown)
            self.show_experts(run)

    def show_experts(self, run: pv.Run) -> None:
        """The tokens-per-expert chart (``expert_tokens_figure``) of a run with ``ep`` > 1, shown once it has records
        and redrawn when more came in (as often as the timeline redraws, and once the run ended)."""
        loads = list(run.expert_tokens)
        if not loads or len(loads) == self._experts_drawn:
            return
        self.expert_chart.replace(expert_tokens_figure(loads))
        self._experts_drawn = len(loads)
        self.expert_box.layout.display = "flex"

    def _finish(self, run: pv.Run) -> None:
        try:
            if run.status == "failed":  # under the Launch button and its status line
                self._show_error(RuntimeError(f"The run failed: {run.error}"), "", self.launch_error)
            self.explain(run)
            self.show_experts(run)
            if run.status == "done":
                self.checking = True
                self.show_state()
                try:
                    self.check = pv.check_numerics(run)
                except Exception as exc:
                    self.check_error = "could not train the unsplit model (see the error)."
                    self._show_error(exc, "numerics check: ", None)
                finally:
                    self.checking = False
            self.show_state()
        except Exception as exc:
            self._show_error(exc, "", None)
        finally:
            self.finished.set()

    def explain(self, run: pv.Run, shown: Timeline | None = None) -> None:
        """The notes beside the measured chart: what separates it from the simulation, and how the view keeps up."""
        hardware = self.state.settings.hardware
        view = self.run_view
        notes = panels.run_notes_html(run, self._simulated(), self.sim_here, _cores(), _load(),
                                      None if hardware == HERE else hardware, shown)
        text = notes + panels.view_note_html(
            view.live_redraws, view.redraw_s, view.busy_interval if view.busy else None, run.mesh.world, _cores())
        if text != self.run_notes.value:
            self.run_notes.value = text
        crowded = run.mesh.world > _cores() or _load() > _cores()
        self.here_button.layout.display = "" if crowded and self.sim_here is None else "none"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def warm_up_launches(model: torch.nn.Module) -> None:
    """Start the rank processes' fork server in the background (it imports torch once, for seconds), so the
    first Launch does not wait for it."""
    from pipeviz.capture.weights import is_meta
    from pipeviz.runtime.procs import context

    preload = model if is_meta(model) else None  # a meta model's ranks build their stages from its modules
    threading.Thread(target=lambda: _quietly(lambda: context(preload)), daemon=True, name="pipeviz-warm-up").start()


def _quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # a failure here shows again, with its message, at Launch
        time.sleep(0)
