"""``Explorer``: see the layer graph, click to split, preview and simulate the stages, launch the run.

The widget is a thin view: ``explorer.plan`` (a ``pv.SplitPlan``) is the one source of truth, mirrored in
the ``plan_json`` trait; every control calls a core function (``plan.toggle``, ``pv.balance``,
``pv.simulate``, ``pv.launch``, ``pv.train_reference``) and redraws from the result.

Example:
    >>> import torch, pipeviz as pv
    >>> from pipeviz.zoo import MyNetwork
    >>> ex = pv.Explorer(MyNetwork(512, [512, 1024, 256]), example_args=(torch.randn(32, 512),))
    >>> ex                       # click layers to split after them; Launch runs it
    >>> ex.click("layer0")       # what a click on the node does; ex.plan now has 2 stages
    >>> ex.plan = ex.graph.split(["layer0", "layer1"])    # set from code: the view follows
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable, Iterable
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
import torch
import traitlets

import pipeviz as pv
from pipeviz import schedules as sched
from pipeviz.graph import ModelGraph
from pipeviz.plan import SplitPlan
from pipeviz.timeline import Timeline
from pipeviz.training import cross_entropy, default_target
from pipeviz.widgets import panels
from pipeviz.widgets.figures import graph_figure, graph_layout, graph_traces, timeline_figure
from pipeviz.widgets.panels import guarded, soon
from pipeviz.widgets.timeline_view import TimelineView

GRAPH_WIDTH = 440  # px: plotly would otherwise take its default 700 px, wider than the column


class Explorer(W.VBox):
    """One widget to split a model into pipeline stages and run it.

    Graph view (click a layer: split after it; click again: remove the split), stage preview (layers,
    params, FLOPs, bytes sent, estimated time and memory, imbalance highlighted, the Pipe's structure on
    demand), controls (stages + Auto-balance, schedule, microbatches) with the simulated timeline of the
    current plan, and Launch / Stop with a live measured timeline and a numerics check against the
    unsplit model when the run ends.

    Example:
        >>> ex = pv.Explorer(model, example_args=(x,), splits=["layer0"])
        >>> ex.click("layer1"); ex.plan.num_stages          # 3
        >>> ex.launch(); ex.wait(120); ex.run.losses

    Args:
        model: an ``nn.Module`` (traced once here) or an already traced ``pv.ModelGraph``.
        example_args, example_kwargs: one full batch of inputs (what ``pv.trace`` takes).
        splits: the starting plan: a ``SplitPlan`` or layer names to split after (default: one stage).
        schedule, microbatches, steps: starting values of the controls.
        target, loss_fn, optimizer: what Launch trains with. Defaults: ``loss_fn`` is cross-entropy over the
            output's last dim and ``target`` random integer classes of that size (seed 0), so a classifier or
            a language model trains as is; ``optimizer`` is SGD with lr 0.1.
        devices: passed to ``pv.launch`` (``"auto"``, ``"cpu"``, ...).
        depth: granularity of the trace (``None``: the model's natural blocks).

    Attributes:
        graph: the current ``ModelGraph`` (expand / collapse replace it).
        plan: the current ``SplitPlan``; assign one (or a list of layer names) and the view follows.
        run: the last launched ``pv.Run``.
        sim_view, run_view: the ``TimelineView``s of the simulated and the measured timeline.
        error: text of the error area ("" when the last action worked).
    """

    clicked = traitlets.Unicode("", help="layer name the browser clicked; handled, then reset").tag(sync=True)
    plan_json = traitlets.Unicode("", help="the current plan as JSON (SplitPlan.to_json)").tag(sync=True)

    def __init__(
        self, model: torch.nn.Module | ModelGraph, example_args: tuple[Any, ...] | Any = (),
        example_kwargs: dict[str, Any] | None = None, *, splits: SplitPlan | Iterable[str] | None = None,
        schedule: str = "1F1B", microbatches: int = 4, steps: int = 3, target: torch.Tensor | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: Callable[..., Any] | None = None,
        devices: str | list[str] = "auto", depth: int | None = None,
    ) -> None:
        graph = model if isinstance(model, ModelGraph) else pv.trace(model, example_args, example_kwargs, depth=depth)
        self.graph: ModelGraph = graph
        self.target, self.loss_fn, self.optimizer, self.devices = target, loss_fn, optimizer, devices
        self.run: pv.Run | None = None
        self.sim: Timeline | None = None
        self.error = ""
        self._plan = graph.split([])
        self._syncing = False
        self._finished = threading.Event()
        self._finished.set()
        self._pipe_cache: dict[tuple[str, int], str] = {}
        self._build_ui(sched.canonical(schedule), microbatches, steps)
        super().__init__(self._children)
        self.add_class("pipeviz-explorer")
        self.observe(self._on_clicked, "clicked")
        self.observe(self._on_plan_json, "plan_json")
        self.plan = splits if splits is not None else self._plan

    # ----------------------------------------------------------------- UI
    def _build_ui(self, schedule: str, microbatches: int, steps: int) -> None:
        self.graph_figure = go.FigureWidget(graph_figure(self._plan, width=GRAPH_WIDTH))
        self.graph_figure._config = {"displayModeBar": False}  # nothing to zoom; it would cover the title
        self._layers_trace().on_click(self._on_graph_click)
        self.granularity = W.Dropdown(description="layers", layout=W.Layout(width="95%"))
        self.granularity.observe(self._on_granularity, "value")
        self.stages = W.BoundedIntText(value=1, min=1, max=len(self.graph.layers), description="stages",
                                       layout=W.Layout(width="150px"))
        self.stages.observe(self._on_stages, "value")
        self.balance_by = W.Dropdown(options=["time", "flops", "params"], value="time", description="by",
                                     layout=W.Layout(width="130px"), style={"description_width": "initial"})
        self.balance_button = W.Button(description="Auto-balance", icon="balance-scale",
                                       tooltip="pv.balance(graph, stages, by=...)")
        self.balance_button.on_click(lambda _: self.auto_balance())
        self.schedule = W.Dropdown(options=list(sched.ALL), value=schedule, description="schedule",
                                   layout=W.Layout(width="260px"))
        self.microbatches = W.BoundedIntText(value=microbatches, min=1, max=4096, description="microbatches",
                                             layout=W.Layout(width="190px"), style={"description_width": "initial"})
        self.steps = W.BoundedIntText(value=steps, min=1, max=100000, description="steps",
                                      layout=W.Layout(width="130px"), style={"description_width": "initial"})
        for w in (self.schedule, self.microbatches):
            w.observe(self._on_controls, "value")
        self.preview = W.HTML()
        self.pipe_button = W.ToggleButton(description="Show Pipe", icon="code", value=False,
                                          tooltip="print torch's Pipe for this plan (traces it: seconds)")
        self.pipe_button.observe(lambda _: self._show_pipe(), "value")
        self.pipe_text = W.HTML()
        self.errors = W.HTML(layout=W.Layout(width="100%"))
        self.errors.add_class("pipeviz-error")
        self.sim_view = TimelineView(None)
        self.launch_button = W.Button(description="Launch", icon="play", button_style="success",
                                      tooltip="pv.launch(plan, ...) in background processes")
        self.launch_button.on_click(lambda _: self.launch())
        self.launch_button.add_class("pipeviz-launch")
        self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.stop_button.on_click(lambda _: self.stop())
        self.progress = W.HTML("<i>not launched</i>")
        self.progress.add_class("pipeviz-progress")
        self.numerics = W.HTML()
        self.numerics.add_class("pipeviz-numerics")
        self.run_view = TimelineView(None)
        self.run_view.add_class("pipeviz-run-timeline")
        self._update_granularity_options()
        left = W.VBox([self.granularity, self.graph_figure],
                      layout=W.Layout(flex="0 0 auto", width=f"{GRAPH_WIDTH + 20}px", max_height="760px",
                                      overflow="hidden auto"))
        controls = W.VBox([
            W.HBox([self.stages, self.balance_by, self.balance_button]),
            W.HBox([self.schedule, self.microbatches, self.steps]),
        ])
        right = W.VBox([controls, self.errors, self.preview, self.pipe_button, self.pipe_text],
                       layout=W.Layout(flex="1 1 auto", min_width="420px"))
        self._children = [
            W.HBox([left, right]),
            W.HTML("<b>Simulated step</b> (current plan)"), self.sim_view,
            W.HBox([self.launch_button, self.stop_button, self.progress], layout=W.Layout(align_items="center")),
            self.numerics, self.run_view,
        ]

    def _layers_trace(self) -> Any:
        return self.graph_figure.data[-1]

    # ----------------------------------------------------------------- the plan (one source of truth)
    @property
    def plan(self) -> SplitPlan:
        """The current ``SplitPlan``."""
        return self._plan

    @plan.setter
    def plan(self, value: SplitPlan | Iterable[str]) -> None:
        if not isinstance(value, SplitPlan):
            value = self.graph.split(list(value))
        graph_changed = value.graph is not self.graph
        self.graph, self._plan = value.graph, value
        self._syncing = True
        try:
            self.plan_json = value.to_json()
            self.stages.max = len(self.graph.layers)
            self.stages.value = value.num_stages
        finally:
            self._syncing = False
        if graph_changed:
            self._update_granularity_options()
        self._redraw_graph()
        self._refresh_simulation()
        if self.pipe_button.value:
            self._show_pipe()

    # ----------------------------------------------------------------- actions (what the controls call)
    @guarded
    def click(self, layer: str) -> SplitPlan | None:
        """Toggle the split after ``layer`` (what clicking its node does). An invalid click leaves the plan
        as it is and shows the reason in the error area."""
        self._clear_error()
        self.plan = self._plan.toggle(layer)
        return self._plan

    @guarded
    def auto_balance(self, num_stages: int | None = None, by: str | None = None) -> SplitPlan | None:
        """Replace the plan with ``pv.balance(graph, num_stages, by=...)`` (defaults: the controls)."""
        self._clear_error()
        n = int(num_stages if num_stages is not None else self.stages.value)
        plan = pv.balance(self.graph, n, by=by or self.balance_by.value, schedule=self.schedule.value,
                       microbatches=self.microbatches.value)
        self.plan = plan
        return plan

    @guarded
    def expand(self, name: str) -> None:
        """Show layer ``name``'s child modules as layers (no re-tracing); splits are kept where possible."""
        self._clear_error()
        self._set_graph(self.graph.expand(name))

    @guarded
    def collapse(self, name: str) -> None:
        """Merge every layer inside module ``name`` into one layer."""
        self._clear_error()
        self._set_graph(self.graph.collapse(name))

    @guarded
    def regroup(self, depth: int | None = None) -> None:
        """Another granularity: ``None`` for the natural blocks, an int for every module down to that depth."""
        self._clear_error()
        self._set_graph(self.graph.regroup(depth))

    @guarded
    def launch(self) -> pv.Run | None:
        """Start ``pv.launch`` with the current plan and controls; the run timeline fills in live."""
        self._clear_error()
        if self.run is not None and not self._finished.is_set():
            raise pv.LaunchError("A run is still going. Fix: press Stop (explorer.stop()) first.")
        args, kwargs = self.graph.example_args, dict(self.graph.example_kwargs)
        loss_fn = self.loss_fn or cross_entropy
        target = self.target if self.target is not None else default_target(self.graph)
        plan, schedule, mbs, steps = self._plan, self.schedule.value, self.microbatches.value, self.steps.value
        run = pv.launch(plan, schedule=schedule, microbatches=mbs, steps=steps, inputs=args,
                        input_kwargs=kwargs or None, target=target, loss_fn=loss_fn, optimizer=self.optimizer,
                        devices=self.devices)
        self.run = run
        self._finished.clear()
        self.numerics.value = ""
        self.stop_button.disabled, self.launch_button.disabled = False, True
        self.progress.value = f"<b>starting</b> · {schedule} · {plan.num_stages} stages · step 0/{steps}"
        self.run_view.attach(run, overlay=self.sim)
        run.subscribe(lambda batch: self._on_run_events(run))
        return run

    @guarded
    def stop(self) -> None:
        """Stop the running launch (``run.stop()``)."""
        if self.run is not None:
            self.run.stop()

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until the launched run ended and its numerics check is shown; returns the run's status."""
        if self.run is None:
            return None
        self._finished.wait(timeout)
        return self.run.status

    def figures(self) -> dict[str, go.Figure]:
        """Plain plotly figures of what the widget shows (graph, simulated and measured timelines): they
        render without a widget manager (nbconvert HTML, static previews)."""
        figs = {"graph": graph_figure(self._plan)}
        if self.sim is not None:
            figs["simulated"] = timeline_figure(self.sim)
        if self.run is not None:
            figs["run"] = timeline_figure(self.run.timeline(), overlay=self.sim)
        return figs

    # ----------------------------------------------------------------- handlers
    def _on_graph_click(self, trace: Any, points: Any, state: Any) -> None:
        if points.point_inds:
            name = self.graph.layer_names[points.point_inds[0]]
            soon(lambda: setattr(self, "clicked", name))

    def _on_clicked(self, change: dict[str, Any]) -> None:
        if change["new"]:
            self.click(change["new"])
            self.clicked = ""  # so a second click on the same layer is seen again

    @guarded
    def _on_plan_json(self, change: dict[str, Any]) -> None:
        if self._syncing or not change["new"] or change["new"] == self._plan.to_json():
            return
        self._clear_error()
        self.plan = SplitPlan.from_json(change["new"], self.graph)

    @guarded
    def _on_controls(self, change: dict[str, Any]) -> None:
        self._clear_error()
        self._refresh_simulation()
        if self.pipe_button.value:
            self._show_pipe()

    @guarded
    def _on_stages(self, change: dict[str, Any]) -> None:
        if not self._syncing and change["new"] != self._plan.num_stages:
            self.auto_balance(change["new"])

    @guarded
    def _on_granularity(self, change: dict[str, Any]) -> None:
        action = change["new"]
        if not action:
            return
        verb, _, name = action.partition(":")
        try:
            if verb == "expand":
                self.expand(name)
            elif verb == "collapse":
                self.collapse(name)
            else:
                self.regroup(int(name) if name else None)
        finally:
            self.granularity.value = ""

    def _on_run_events(self, run: pv.Run) -> None:
        if run is not self.run:
            return
        try:
            self.progress.value = panels.progress_html(run)
            if run.done and not self._finished.is_set():
                self.stop_button.disabled, self.launch_button.disabled = True, False
                if run.status == "failed":
                    self._show_error(RuntimeError(f"The run failed: {run.error}"))
                elif run.status == "done":
                    self.numerics.value = "<i>checking numerics against the unsplit model…</i>"
                    try:
                        self.numerics.value = panels.numerics_html(run)
                    except Exception as exc:
                        self.numerics.value = "<b>Numerics check:</b> could not train the unsplit model (see error)."
                        self._show_error(exc, prefix="numerics check: ")
        except Exception as exc:
            self._show_error(exc)
        finally:
            if run.done:
                self._finished.set()

    # ----------------------------------------------------------------- drawing
    def _set_graph(self, graph: ModelGraph) -> None:
        self.plan = self._plan.onto(graph)

    def _redraw_graph(self) -> None:
        fig, traces = self.graph_figure, graph_traces(self._plan)
        with fig.batch_update():
            for trace, spec in zip(fig.data, traces, strict=True):
                trace.update({k: v for k, v in spec.items() if k != "type"})
            layout = graph_layout(self._plan, width=GRAPH_WIDTH)
            # Lists are assigned whole: a nested update would send both 'shapes' and 'shapes.0.y1', which
            # plotly.js rejects ("cannot set shapes.0.y1 and a parent attribute simultaneously").
            fig.layout.shapes, fig.layout.annotations = layout.pop("shapes"), layout.pop("annotations")
            fig.layout.update(layout)

    def _update_granularity_options(self) -> None:
        options = panels.granularity_options(self.graph)
        self._syncing = True
        try:
            self.granularity.options = options
            self.granularity.value = ""
        finally:
            self._syncing = False

    def _refresh_simulation(self) -> None:
        self.sim = None
        note = ""
        if self._plan.num_stages >= 1:
            try:
                self.sim = pv.simulate(self._plan, schedule=self.schedule.value, microbatches=self.microbatches.value)
            except Exception as exc:  # a schedule that does not fit the plan: say why, keep the preview
                note = f"cannot simulate: {exc}"
                self._show_error(exc, prefix=f"{self.schedule.value} with {self._plan.num_stages} stages: ")
        self.preview.value = panels.preview_html(self._plan, self.sim, self.microbatches.value, note)
        self.sim_view.update(self.sim, overlay=None)
        if self.sim is None:
            self.sim_view.summary.value = f"<i>{html.escape(note)}</i>"

    def _show_pipe(self) -> None:
        if not self.pipe_button.value:
            self.pipe_button.description, self.pipe_text.value = "Show Pipe", ""
            return
        self.pipe_button.description = "Hide Pipe"
        key = (self._plan.to_json(), self.microbatches.value)
        try:
            if key not in self._pipe_cache:
                self.pipe_text.value = "<i>tracing the Pipe…</i>"
                self._pipe_cache[key] = str(self._plan.pipe(self.microbatches.value))
            self.pipe_text.value = (f"<pre style='max-height:320px;overflow:auto;font-size:11px'>"
                                    f"{html.escape(self._pipe_cache[key])}</pre>")
        except Exception as exc:
            self.pipe_text.value = ""
            self._show_error(exc)

    # ----------------------------------------------------------------- errors
    def _show_error(self, exc: BaseException, prefix: str = "") -> None:
        self.error = f"{prefix}{type(exc).__name__}: {exc}"
        self.errors.value = panels.error_html(self.error)

    def _clear_error(self) -> None:
        self.error = ""
        self.errors.value = ""

    # ----------------------------------------------------------------- static output
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        data = super()._repr_mimebundle_(**kwargs) or {}
        try:
            data["text/html"] = panels.static_html(self)
        except Exception:  # the static fallback must never break the live widget
            pass
        return data

    def __repr__(self) -> str:
        return f"Explorer({self._plan!r}, schedule={self.schedule.value}, microbatches={self.microbatches.value})"


__all__ = ["Explorer"]
