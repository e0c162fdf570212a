"""``Explorer``: see the layer graph, click to split, preview and simulate the stages, launch the run.

The widget is a thin view: ``explorer.plan`` (a ``pv.SplitPlan``) is the one source of truth, mirrored in
the ``plan_json`` trait; every control calls a core function (``plan.toggle``, ``pv.balance``,
``pv.simulate``, ``pv.launch``, ``pv.check_numerics``) and redraws from the result.

Example:
    >>> import torch, pipeviz as pv
    >>> from pipeviz.zoo import MyNetwork
    >>> ex = pv.Explorer(MyNetwork(512, [512, 1024, 256]), example_args=(torch.randn(32, 512),))
    >>> ex                       # click layers to split after them; Launch runs it
    >>> ex.click("layer0")       # what a click on the node does; ex.plan now has 2 stages
    >>> ex.undo()                # back to one stage
    >>> ex.plan = ex.graph.split(["layer0", "layer1"])    # set from code: the view follows
"""

from __future__ import annotations

import html
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack, cast

import ipywidgets as W
import plotly.graph_objects as go
import torch
import traitlets

import pipeviz as pv
from pipeviz.capture.view import GraphView
from pipeviz.cost.options import RECOMPUTE
from pipeviz.graph.model import ModelGraph
from pipeviz.plan.errors import PlanError
from pipeviz.plan.pipe import check_batch_split
from pipeviz.plan.split import SplitPlan
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import UNSET, launch_config
from pipeviz.schedule.timeline import Timeline
from pipeviz.schedule.training import cross_entropy, default_target
from pipeviz.sim.simulate import Comparison
from pipeviz.widgets import panels
from pipeviz.widgets.figures import graph_figure, graph_layout, graph_traces, plural, timeline_figure
from pipeviz.widgets.live_figure import LiveFigure, plotly_bundle
from pipeviz.widgets.panels import Change, guarded, soon
from pipeviz.widgets.player import StepPlayer
from pipeviz.widgets.refusals import one_sentence
from pipeviz.widgets.timeline_view import TimelineView

if TYPE_CHECKING:
    from plotly.callbacks import InputDeviceState, Points

    from pipeviz.planner.cluster import LayoutOption

__all__ = ["Explorer"]

HERE = "this machine"  # the hardware control's default: costs measured or estimated here, in the traced dtype
MODES = ("train", "infer")  # the run switch: train, or forward only
GRAPH_WIDTH = 400  # px: the graph's column; the rest of the row (or the row below, when narrow) is the preview


class ExplorerOptions(TypedDict, total=False):
    """``pv.LaunchConfig`` fields the Explorer takes as keywords beside its own parameters (they override
    ``config``'s): ``pv.Explorer(model, (x,), tp=2, tp_plan={...})``."""

    stages_per_rank: int | None
    timeout: float
    pin_cpus: bool
    on_nonfinite: str
    clip_grad_norm: float | None
    loss_reduction: str
    accumulate: int
    lr_scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None
    eval_every: int | None
    mixed_precision: str | None
    compile: bool | str
    recompute: str | Sequence[str]
    init_seed: int
    dp: int
    dp_shard: bool
    tp: int
    tp_plan: Mapping[str, str] | None
    sequence_parallel: bool
    cp: int
    order: Sequence[Sequence[str]] | None


# The schedule control's help: the one-page cheat sheet (each schedule's bubble, memory, traffic and needs, each
# figure checked against pv.simulate by tests/test_schedules_cheatsheet.py).
SCHEDULE_HELP = ("torch's seven schedules side by side (bubble formula, peak microbatches in flight, traffic per "
                 "boundary, what each needs, when to pick it): the cheat sheet, docs/schedules.md")


class Explorer(W.VBox):
    """One widget to split a model into pipeline stages and run it.

    Graph view (click a layer: split after it, click again: remove the split; shift-click a block, drawn as a
    square, to see its modules; the bar above the graph collapses them again), stage preview (layers, params,
    FLOPs, bytes sent, time and memory, the verdict against the best split there is, the Pipe's structure on
    demand), controls (stages + Balance, undo / redo, schedule, microbatches, steps) with the simulated
    timeline of the current plan, and Launch / Stop with the launch's phases as they happen, a live measured
    timeline, what separates it from the simulation, and a numerics check against the unsplit model.

    Example:
        >>> ex = pv.Explorer(model, example_args=(x,), splits=["layer0"])
        >>> ex.click("layer1"); ex.plan.num_stages          # 3
        >>> ex.undo(); ex.plan.num_stages                   # 2
        >>> ex.launch(); ex.wait(120); ex.run.losses

    Args:
        model: an ``nn.Module`` (traced once here) or an already traced ``pv.ModelGraph``.
        example_args, example_kwargs: one full batch of inputs (what ``pv.trace`` takes).
        splits: the starting plan: a ``SplitPlan`` or layer names to split after (default: one stage).
        schedule, microbatches, steps: starting values of the controls (default: ``config``'s).
        config: a ``pv.LaunchConfig``, the one launch configuration ``pv.launch`` and ``pv.export_torchrun`` take:
            its schedule, microbatches, steps, ``dp`` and ``tp`` start the controls; Launch runs the config the
            controls make (``explorer.launch_config()``) with its other options (timeouts, pinning, ...).
        mode: ``"train"`` (Launch trains: forwards, backwards, optimizer steps) or ``"infer"`` (forward only:
            the simulated timeline has no backwards, Launch runs ``pv.launch`` without a ``loss_fn`` and the
            numerics check compares ``run.outputs`` with the unsplit model's outputs). A switch in the controls.
        target, loss_fn, optimizer: what Launch trains with. Defaults: ``loss_fn`` is ``pv.cross_entropy``
            over the output's last dim and ``target`` random integer classes of that size (seed 0), so a
            classifier or a language model trains as is; ``optimizer`` is SGD with lr 0.1.
        devices: passed to ``pv.launch`` (``"auto"``, ``"cpu"``, ...); default: ``config``'s.
        eval_data: held-out ``(inputs, target)`` batches a training Launch evaluates (``pv.launch``'s
            ``eval_data=``; every ``eval_every`` steps and after the last), drawn with the loss under the run's
            timeline.
        resume: a folder ``run.save(folder)`` wrote: a training Launch goes on from it (``pv.launch``'s
            ``resume=``: weights, optimizer and scheduler state, steps), under the Explorer's split and schedule;
            ``explorer.resume`` may be set (or cleared) between launches.
        depth: granularity of the trace (``None``: the model's natural blocks).
        **options: other ``pv.LaunchConfig`` fields (``tp_plan=``, ``dp=``, ``timeout=``, ...), over ``config``'s.

    Attributes:
        graph: the current ``ModelGraph`` (expand / collapse replace it).
        plan: the current ``SplitPlan``; assign one (or a list of layer names) and the view follows.
        run: the last launched ``pv.Run``.
        sim, sim_here: the simulated timeline of the plan, and the one "as run here" (on this machine's cores).
        sim_view, run_view: the ``TimelineView``s of the simulated and the measured timeline.
        player_button, player: "Step through" under the simulated timeline, and the ``StepPlayer`` it shows (None
            until first shown): the simulated step action by action, with each rank's memory at that instant.
        side_button, comparison, side_figure: "Schedules side by side": ``pv.compare`` of the plan and the controls'
            run (None while hidden), drawn by ``pv.side_by_side_figure``.
        error: text of the last error shown ("" when the last action worked).
        refusal: why Launch would refuse the controls' settings (``pv.launch``'s checks, run at every change;
            shown under the controls with the control at fault outlined, Launch disabled), else None.
    """

    clicked = traitlets.Unicode("", help="layer name the browser clicked; handled, then reset").tag(sync=True)
    expanded = traitlets.Unicode("", help="layer name the browser shift-clicked: expanded, then reset").tag(sync=True)
    plan_json = traitlets.Unicode("", help="the current plan as JSON (SplitPlan.to_json)").tag(sync=True)

    def __init__(
        self, model: torch.nn.Module | ModelGraph, example_args: tuple[object, ...] | torch.Tensor = (),
        example_kwargs: Mapping[str, object] | None = None, *, splits: SplitPlan | Iterable[str] | None = None,
        schedule: str = UNSET, microbatches: int = UNSET, steps: int = UNSET, target: torch.Tensor | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        devices: str | list[str] = UNSET, depth: int | None = None, mode: str = "train",
        eval_data: Iterable[object] | None = None, resume: str | os.PathLike[str] | None = None,
        config: pv.LaunchConfig | None = None, **options: Unpack[ExplorerOptions],
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {list(MODES)}. Fix: mode='train' to train, or "
                             "mode='infer' for a forward-only run.")
        graph = model if isinstance(model, ModelGraph) else pv.trace(model, example_args, example_kwargs, depth=depth)
        self.graph: GraphView = graph
        self.config = launch_config(config, schedule=schedule, microbatches=microbatches, steps=steps,
                                    devices=devices, **options)
        self.target, self.devices = target, self.config.devices
        self.eval_data = list(eval_data) if eval_data is not None else None  # held-out batches (train mode)
        self.resume = resume  # a checkpoint a training Launch continues from
        self.loss_fn, self.optimizer = loss_fn or self.config.loss_fn, optimizer or self.config.optimizer
        self.run: pv.Run | None = None
        self.sim: Timeline | None = None
        self.sim_here: Timeline | None = None
        self.error = ""
        self._plan = graph.split([])
        self._run_plan: SplitPlan | None = None
        self._history: list[SplitPlan] = []
        self._future: list[SplitPlan] = []
        self._syncing = False
        self._finished = threading.Event()
        self._finished.set()
        self._pipe_cache: dict[tuple[str, int], str] = {}
        self._target: torch.Tensor | None = None  # the default target, made once
        self.loaded: LayoutOption | None = None  # the cluster row last loaded (its costs, while the controls match)
        self.refusal: BaseException | None = None  # why the controls' settings cannot launch (None: they can)
        self._build_ui(sched.canonical(self.config.schedule), self.config.microbatches, self.config.steps or 1, mode)
        super().__init__(self._children, layout=W.Layout(width="100%", max_width="100%"))
        self.add_class("pipeviz-explorer")
        self.observe(self._on_clicked, "clicked")
        self.observe(self._on_expanded, "expanded")
        self.observe(self._on_plan_json, "plan_json")
        self._set_plan(splits if splits is not None else self._plan, record=False)
        _warm_up_launches(graph.model)

    # ----------------------------------------------------------------- UI
    def _build_ui(self, schedule: str, microbatches: int, steps: int, mode: str) -> None:
        def box(flex: str = "row wrap", align_items: str = "center") -> W.Layout:
            return W.Layout(display="flex", flex_flow=flex, align_items=align_items, max_width="100%")

        wide = {"description_width": "initial"}
        self.notes = W.HTML(panels.notes_html(self.graph.notes))
        self.notes.add_class("pipeviz-notes")
        self.graph_figure = LiveFigure(graph_figure(self._plan, width=GRAPH_WIDTH))
        self.graph_figure._config = {"displayModeBar": False}  # nothing to zoom; it would cover the title
        self._layers_trace().on_click(self._on_graph_click)
        self.view_bar = W.HBox(layout=box())
        self.view_bar.add_class("pipeviz-view-bar")
        self.stages = W.BoundedIntText(value=1, min=1, max=len(self.graph.layers), description="stages",
                                       layout=W.Layout(width="110px"), style=wide)
        self.stages.observe(self._on_stages, "value")
        self.balance_by = W.Dropdown(options=["time", "flops", "params"], value="time", description="by",
                                     layout=W.Layout(width="120px"), style=wide)
        self.balance_button = W.Button(description="Balance", icon="balance-scale",
                                       layout=W.Layout(width=_balance_width(len(self.graph.layers)), flex="0 0 auto"),
                                       tooltip="pv.balance(graph, stages, by=...): the best split into that many")
        self.balance_button.on_click(lambda _: self.auto_balance())
        self.balance_button.add_class("pipeviz-balance")
        self.undo_button = W.Button(icon="undo", tooltip="undo (explorer.undo())", disabled=True,
                                    layout=W.Layout(width="36px"))
        self.undo_button.on_click(lambda _: self.undo())
        self.undo_button.add_class("pipeviz-undo")
        self.redo_button = W.Button(icon="repeat", tooltip="redo (explorer.redo())", disabled=True,
                                    layout=W.Layout(width="36px"))
        self.redo_button.on_click(lambda _: self.redo())
        self.redo_button.add_class("pipeviz-redo")
        self.schedule = W.Dropdown(options=list(sched.ALL), value=schedule, description="schedule",
                                   layout=W.Layout(width="230px"), style=wide,
                                   tooltip=SCHEDULE_HELP)
        self.microbatches = W.BoundedIntText(value=microbatches, min=1, max=4096, description="microbatches",
                                             layout=W.Layout(width="150px"), style=wide)
        self.steps = W.BoundedIntText(value=steps, min=1, max=100000, description="steps",
                                      layout=W.Layout(width="110px"), style=wide)
        self.dp = W.BoundedIntText(value=self.config.dp, min=1, max=1024, description="dp",
                                   layout=W.Layout(width="90px"), style=wide,
                                   tooltip="data-parallel replicas of the pipeline (pv.launch(..., dp=N))")
        self.tp = W.BoundedIntText(value=self.config.tp, min=1, max=64, description="tp",
                                   layout=W.Layout(width="90px"), style=wide,
                                   tooltip="tensor-parallel shards of every stage (pv.launch(..., tp=K))")
        self.sequence_parallel = W.Checkbox(
            value=self.config.sequence_parallel, description="seq. parallel", indent=False,
            disabled=self.config.tp == 1, layout=W.Layout(width="110px"),
            tooltip="with tp > 1: norms, dropout and the residual stream split by token between the sharded "
                    "regions (pv.launch(..., sequence_parallel=True))")
        self.sequence_parallel.add_class("pipeviz-sequence-parallel")
        self.mesh_view = W.HTML(layout=W.Layout(max_width="100%", overflow="auto"))
        self.mesh_view.add_class("pipeviz-mesh")
        self.mode = W.ToggleButtons(options=list(MODES), value=mode, description="run",
                                    tooltips=["train: forwards, backwards and optimizer steps",
                                              "infer: forward only (no loss_fn; run.outputs)"],
                                    style={"button_width": "56px", "description_width": "initial"})
        self.mode.add_class("pipeviz-mode")
        # The cost model's settings (pv.CostOptions): what hardware the preview, Balance and the simulation cost the
        # plan on — this machine (profiled layer times, the traced dtype) or a named GPU (roofline per op, its dtype)
        # — and the activation recomputation they assume. Launch runs here whatever they say.
        self.hardware = W.Dropdown(options=[(HERE, HERE), *[(n, n) for n in pv.HARDWARE if n != "cpu"]],
                                   value=HERE, description="costs on", layout=W.Layout(width="220px"), style=wide)
        self.hardware.add_class("pipeviz-hardware")
        self.recompute = W.Dropdown(options=list(RECOMPUTE), value="none", description="recompute",
                                    layout=W.Layout(width="170px"), style=wide)
        self.recompute.add_class("pipeviz-recompute")
        # every control the run is described by (steps too: the simulation carries the whole LaunchConfig)
        for w in (self.schedule, self.microbatches, self.steps, self.mode, self.dp, self.tp, self.sequence_parallel,
                  self.hardware, self.recompute):
            w.observe(self._on_controls, "value")
        self.hint = W.HTML()
        self.hint.add_class("pipeviz-hint")
        self.cost_note = W.HTML()  # what a cost setting does (or does not do) on this model
        self.cost_note.add_class("pipeviz-cost-note")
        self.preview = W.HTML(layout=W.Layout(max_width="100%", overflow="auto"))
        self.pipe_button = W.ToggleButton(description="Show Pipe", icon="code", value=False,
                                          tooltip="print torch's Pipe for this plan (traces it: seconds)")
        self.pipe_button.observe(lambda _: self._show_pipe(), "value")
        self.pipe_text = W.HTML(layout=W.Layout(max_width="100%"))
        self.errors = W.HTML(layout=W.Layout(max_width="100%"))  # full width: stretched (100% + margins overflowed)
        self.errors.add_class("pipeviz-error")
        # A setting that cannot launch, said under the controls (the one at fault outlined) the moment it is set
        self.refused = W.HTML(layout=W.Layout(max_width="100%"))
        self.refused.add_class("pipeviz-refused")
        # What Launch and the run report (refused, failed), under the Launch button that caused it
        self.launch_error = W.HTML(layout=W.Layout(max_width="100%"))
        self.launch_error.add_class("pipeviz-launch-error")
        self.sim_heading = W.HTML("<b>Simulated step</b> (current plan)")  # hidden with the chart (one stage)
        self.sim_view = TimelineView(None)
        self.sim_view.add_class("pipeviz-sim-timeline")
        # The simulated step played action by action (made on first use: a StepPlayer draws a figure per action).
        self.player_button = _toggle("Step through", "step-forward", "pipeviz-player-toggle",
                                     "play the simulated step one action at a time, with each rank's saved "
                                     "activations at that instant", self._show_player)
        self.player: StepPlayer | None = None
        self.player_box = W.VBox(layout=W.Layout(max_width="100%"))
        # Every schedule of pv.compare on these ranks, one above the other on one time and one memory axis.
        self.side_button = _toggle("Schedules side by side", "columns", "pipeviz-side-toggle",
                                   "pv.compare on these ranks: every schedule's simulated step on one time axis, its "
                                   "memory per rank on one memory axis", self._show_side_by_side)
        self.side_figure: LiveFigure | None = None
        self.comparison: Comparison | None = None
        self.side_box = W.VBox(layout=W.Layout(max_width="100%"))
        self.player_section = W.VBox([W.HBox([self.player_button, self.side_button]), self.player_box,
                                      self.side_box], layout=W.Layout(display="none", max_width="100%"))
        self.launch_button = W.Button(description="Launch", icon="play", button_style="success",
                                      tooltip="pv.launch(plan, ...) in background processes")
        self.launch_button.on_click(lambda _: self.launch())
        self.launch_button.add_class("pipeviz-launch")
        self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.stop_button.on_click(lambda _: self.stop())
        self.stop_button.add_class("pipeviz-stop")
        self.progress = W.HTML("<i>not launched</i>", layout=W.Layout(flex="1 1 240px", min_width="0"))
        self.progress.add_class("pipeviz-progress")
        self.run_notes = W.HTML()
        self.run_notes.add_class("pipeviz-run-notes")
        self.here_button = W.Button(description="Simulate as run here", icon="calculator",
                                    layout=W.Layout(width="auto", display="none"),
                                    tooltip="pv.simulate(..., cores=<this machine's cores>)")
        self.here_button.on_click(lambda _: self.simulate_here())
        self.here_button.add_class("pipeviz-here")
        self.numerics = W.HTML()
        self.numerics.add_class("pipeviz-numerics")
        self.run_view = TimelineView(None)
        self.run_view.drawn.append(self._on_run_drawn)
        self.run_view.add_class("pipeviz-run-timeline")
        hidden = [w for w in (panels.browser_helper(), plotly_bundle()) if w is not None]  # page helpers; plotly.js
        left = W.VBox([self.view_bar, self.graph_figure, *hidden],
                      layout=W.Layout(flex="0 1 auto", width=f"{GRAPH_WIDTH + 10}px", max_width="100%",
                                      max_height="760px", overflow="auto"))
        left.add_class("pipeviz-graph-column")
        controls = W.VBox([
            W.HBox([self.stages, self.balance_by, self.balance_button, self.undo_button, self.redo_button],
                   layout=box()),
            W.HBox([self.mode, self.schedule, self.microbatches, self.steps], layout=box()),
            W.HBox([self.dp, self.tp, self.sequence_parallel, self.hardware, self.recompute], layout=box()),
            self.hint, self.cost_note, self.refused,
        ], layout=W.Layout(max_width="100%"))
        # Launch sits under the controls that describe the run, its refusals and failures under it: graph, controls,
        # Launch and what it says fit one screen at 1280 px (below the stage preview it was 570-1,416 px away).
        launch_row = W.HBox([self.launch_button, self.stop_button, self.progress], layout=box())
        launch_row.add_class("pipeviz-launch-row")
        right = W.VBox([controls, launch_row, self.launch_error, self.errors, self.preview, self.mesh_view,
                        self.pipe_button, self.pipe_text],
                       layout=W.Layout(flex="1 1 380px", min_width="0", max_width="100%"))
        right.add_class("pipeviz-preview-column")
        self.run_section = W.VBox([self.run_notes, self.here_button, self.numerics, self.run_view],
                                  layout=W.Layout(display="none", max_width="100%"))
        self.run_section.add_class("pipeviz-run-section")
        from pipeviz.widgets.cluster import cluster_accordion  # "Plan for a cluster": self.cluster, collapsed

        self._children = [
            self.notes,
            W.HBox([left, right], layout=box(align_items="flex-start")),
            self.sim_heading, self.sim_view, self.player_section,
            self.run_section,
            cluster_accordion(self),
        ]

    def _layers_trace(self) -> go.Scatter:
        return self.graph_figure.data[-1]

    # ----------------------------------------------------------------- the plan (one source of truth)
    @property
    def plan(self) -> SplitPlan:
        """The current ``SplitPlan``."""
        return self._plan

    @plan.setter
    def plan(self, value: SplitPlan | Iterable[str]) -> None:
        self._set_plan(value)

    def _set_plan(self, value: SplitPlan | Iterable[str], record: bool = True) -> None:
        if not isinstance(value, SplitPlan):
            value = cast(SplitPlan, self.graph.split(list(value)))
        if record and value != self._plan:
            self._history.append(self._plan)
            self._future.clear()
        graph_changed = value.graph is not self.graph
        self.graph, self._plan = value.graph, value
        self._syncing = True
        try:
            self.plan_json = value.to_json()
            self.stages.max = len(self.graph.layers)
            self.balance_button.layout.width = _balance_width(self.stages.max)
            self.stages.value = value.num_stages
        finally:
            self._syncing = False
        self.undo_button.disabled, self.redo_button.disabled = not self._history, not self._future
        self.hint.value, self.balance_button.description = "", "Balance"
        if graph_changed or not self.view_bar.children:
            self.view_bar.children = self._view_controls()
        self._redraw_graph()
        self._refresh_simulation()
        self._mark_run()
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
        """Replace the plan with ``pv.balance(graph, num_stages, by=...)`` (defaults: the controls); among
        splits tied at the optimum, the one the simulator gives the shortest step under the schedule."""
        self._clear_error()
        n = int(num_stages if num_stages is not None else self.stages.value)
        cfg = self.launch_config()  # the tie-break simulates the run Launch would run
        try:
            plan = pv.balance(self.graph, n, by=by or self.balance_by.value, schedule=cfg.schedule,
                              microbatches=cfg.microbatches, stages_per_rank=cfg.layout(n).stages_per_rank,
                              options=self.cost_options())
        except pv.ScheduleError:  # the schedule cannot run n stages: balance without the tie-break
            plan = pv.balance(self.graph, n, by=by or self.balance_by.value, options=self.cost_options())
        self.plan = plan
        return plan

    def undo(self) -> SplitPlan:
        """Go back to the plan before the last change (splits, balance, expand or collapse)."""
        if self._history:
            self._future.append(self._plan)
            self._set_plan(self._history.pop(), record=False)
        return self._plan

    def redo(self) -> SplitPlan:
        """Redo the change ``undo`` took back."""
        if self._future:
            self._history.append(self._plan)
            self._set_plan(self._future.pop(), record=False)
        return self._plan

    @guarded
    def expand(self, name: str) -> None:
        """Show layer ``name``'s child modules as layers (no re-tracing); splits are kept."""
        self._clear_error()
        self.plan = self._plan.onto(self.graph.expand(name))

    @guarded
    def collapse(self, name: str) -> None:
        """Merge every layer inside module ``name`` into one layer (splits inside it are dropped)."""
        self._clear_error()
        self.plan = self._plan.onto(self.graph.collapse(name))

    @guarded
    def regroup(self, depth: int | None = None) -> None:
        """Another granularity: ``None`` for the natural blocks, an int for every module down to that depth."""
        self._clear_error()
        self.plan = self._plan.onto(self.graph.regroup(depth))

    def launch(self) -> pv.Run | None:
        """Start ``pv.launch`` with the current plan and controls; the phases and the timeline show live. A refusal
        is shown under the Launch button (and the status beside it says so); returns None then."""
        self._clear_error()
        try:
            return self._launch()
        except Exception as exc:  # shown where the user pressed, never swallowed
            self._show_error(exc, area=self.launch_error)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.progress.value = (f"<span class='pipeviz-run-status' style='color:#c0392b'><b>refused</b></span> · "
                                   f"{html.escape(first[:160])}")
            return None

    def _launch(self) -> pv.Run:
        if self.run is not None and not self._finished.is_set():
            raise pv.LaunchError("A run is still going. Fix: press Stop (explorer.stop()) first.")
        args, kwargs = self.graph.example_args, dict(self.graph.example_kwargs)
        plan, cfg = self._plan, self.launch_config()
        if cfg.loss_fn is None:  # forward only: no target, loss or optimizer
            run = pv.launch(plan, config=cfg, inputs=args, input_kwargs=kwargs or None)
        else:
            run = pv.launch(plan, config=cfg, inputs=args, input_kwargs=kwargs or None, target=self._launch_target(),
                            eval_data=self.eval_data, resume=self.resume)
        self.run, self._run_plan = run, plan
        self._finished.clear()
        self.numerics.value = self.run_notes.value = ""
        self.here_button.layout.display = "none"
        self.sim_here = None
        self.run_section.layout.display = "flex"
        self.stop_button.disabled, self.launch_button.disabled = False, True
        self.progress.value = panels.progress_html(run)
        self.run_view.attach(run, overlay=self.sim)
        run.subscribe_status(self._on_run_status)
        self._mark_run()
        return run

    def _launch_target(self) -> torch.Tensor:
        if self.target is not None:
            return self.target
        if self._target is None:
            self._target = default_target(self.graph)
        return self._target

    def launch_config(self) -> pv.LaunchConfig:
        """The ``pv.LaunchConfig`` Launch runs: the Explorer's ``config`` with the controls' schedule, microbatches,
        steps, dp, tp and recomputation (run as the simulation costs it: ``pipeviz.schedule.recompute``; in infer
        mode, no loss, optimizer or recomputation); ``pv.export_torchrun(plan, path,
        config=explorer.launch_config(), ...)`` writes the same run for torchrun."""
        schedule = self.schedule.value
        infer = self.mode.value == "infer"
        return self.config.replace(
            schedule=schedule, microbatches=self.microbatches.value, steps=self.steps.value,
            stages_per_rank=self.config.stages_per_rank if sched.info(schedule).multi else None,
            loss_fn=None if infer else self.loss_fn or cross_entropy, optimizer=None if infer else self.optimizer,
            clip_grad_norm=None if infer else self.config.clip_grad_norm,
            accumulate=1 if infer else self.config.accumulate,
            lr_scheduler=None if infer else self.config.lr_scheduler,
            eval_every=None if infer or self.eval_data is None else self.config.eval_every,
            devices=self.devices, dp=self.dp.value, tp=self.tp.value,
            sequence_parallel=bool(self.sequence_parallel.value) and self.tp.value > 1,
            recompute="none" if infer else self.recompute.value)

    @guarded
    def cost_options(self) -> pv.CostOptions:
        """The cost model's settings the controls make (hardware, its dtype, recomputation): what the preview,
        Balance and the simulated timeline use. "this machine" is the default ``pv.CostOptions()`` (profiled
        layer times, the traced dtype); a GPU preset costs each op by its roofline in bfloat16.

        Example:
            >>> ex.hardware.value, ex.recompute.value = "h100-sxm", "full"
            >>> ex.cost_options()        # CostOptions(hardware=Hardware('h100-sxm', ...), dtype='bfloat16', ...)
        """
        row = self._loaded_row()
        if row is not None:  # a cluster row's own costs: its dtype, batch scale, sequence length
            return row.options
        if self.hardware.value == HERE:
            return pv.CostOptions(recompute=self.recompute.value)
        return pv.CostOptions(hardware=self.hardware.value, dtype="bfloat16", recompute=self.recompute.value)

    def _loaded_row(self) -> LayoutOption | None:
        """The loaded cluster row, while the cost controls are still on its hardware and recomputation."""
        row = self.loaded
        hw = row.options.hw if row is not None else None
        if row is None or hw is None or hw.name != self.hardware.value or row.recompute != self.recompute.value:
            return None
        return row

    def stop(self) -> None:
        """Stop the running launch (``run.stop()``)."""
        if self.run is not None:
            self.run.stop()

    @guarded
    def simulate_here(self) -> Timeline | None:
        """Simulate the launched run's plan on this machine's cores (``pv.simulate(..., cores=N)``): with
        more processes than cores, the steps the run measured. Drawn over the measured timeline."""
        run = self.run
        if run is None:
            return None
        cores = _cores()
        # the run's own configuration (schedule, microbatches, stages per rank, layout, training or not)
        self.sim_here = pv.simulate(self._run_plan or self._plan, run.spec.config, cores=cores,
                                    options=self.cost_options())
        self.run_view.update(run.timeline(), overlay=self.sim_here)
        self._explain_run(run)
        return self.sim_here

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
            figs["run"] = timeline_figure(self.run.timeline(), overlay=self.sim_here or self.sim)
        return figs

    # ----------------------------------------------------------------- handlers
    def _on_graph_click(self, trace: go.Scatter, points: Points, state: InputDeviceState) -> None:
        if points.point_inds:
            name = self.graph.layer_names[points.point_inds[0]]
            modifier = any(getattr(state, k, False) for k in ("shift", "alt", "ctrl", "meta"))
            soon(lambda: setattr(self, "expanded" if modifier else "clicked", name))

    def _on_clicked(self, change: Change[str]) -> None:
        if change["new"]:
            self.click(change["new"])
            self.clicked = ""  # so a second click on the same layer is seen again

    def _on_expanded(self, change: Change[str]) -> None:
        if change["new"]:
            name = change["new"]
            self.expanded = ""
            if self.graph.layer(name).expandable:
                self.expand(name)
            else:
                self._show_error(ValueError(f"{name!r} has no modules inside to show (only blocks, drawn as "
                                            "squares, expand)."))

    @guarded
    def _on_plan_json(self, change: Change[str]) -> None:
        if self._syncing or not change["new"] or change["new"] == self._plan.to_json():
            return
        self._clear_error()
        self.plan = SplitPlan.from_json(change["new"], self.graph)

    @guarded
    def _on_controls(self, change: Change[object]) -> None:
        self.sequence_parallel.disabled = self.tp.value == 1  # nothing to split the tokens over
        self._clear_error()
        self._refresh_simulation()
        if self.pipe_button.value:
            self._show_pipe()

    def _on_stages(self, change: Change[int]) -> None:
        # A new stage count is a target for Balance, never a silent replacement of hand-placed splits.
        if self._syncing:
            return
        n = change["new"]
        self.balance_button.description = "Balance" if n == self._plan.num_stages else f"Balance into {n}"
        self.hint.value = "" if n == self._plan.num_stages else (
            f"<span class='pipeviz-hint-text'>Press <b>Balance into {n}</b> to split into "
            f"{plural(n, 'stage')}; your current {plural(self._plan.num_stages, 'stage')} stay until then "
            "(and undo brings them back).</span>")

    def _on_run_status(self, run: pv.Run) -> None:
        # The status line and the buttons first (a cheap update); the charts redraw throttled behind it.
        if run is not self.run:
            return
        self.progress.value = panels.progress_html(run)
        if run.done:
            self.stop_button.disabled, self.launch_button.disabled = True, self.refusal is not None
            if not self._finished.is_set():
                threading.Thread(target=self._finish_run, args=(run,), daemon=True, name="pipeviz-check").start()

    def _on_run_drawn(self, shown: Timeline) -> None:
        # The notes beside the measured chart are rebuilt from the timeline it just drew, as often as it redraws
        # (every 2 s while the ranks take every core): both give the same measured step (mid-run they read
        # 229.54 ms in the notes against 167.61 ms in the chart's title, from two moments of the run).
        run = self.run
        if run is not None and not run.done and shown.source == "measured" and shown.events:
            self._explain_run(run, shown)

    def _finish_run(self, run: pv.Run) -> None:
        try:
            if run.status == "failed":  # under the Launch button and its status line
                self._show_error(RuntimeError(f"The run failed: {run.error}"), area=self.launch_error)
            self._explain_run(run)
            if run.status == "done":
                self.numerics.value = "<i>checking numerics against the unsplit model…</i>"
                try:
                    self.numerics.value = panels.numerics_html(run)
                except Exception as exc:
                    self.numerics.value = "<b>Numerics check:</b> could not train the unsplit model (see the error)."
                    self._show_error(exc, prefix="numerics check: ")
        except Exception as exc:
            self._show_error(exc)
        finally:
            self._finished.set()

    def _explain_run(self, run: pv.Run, shown: Timeline | None = None) -> None:
        named = None if self.hardware.value == HERE else self.hardware.value
        view = self.run_view
        notes = panels.run_notes_html(run, self.sim, self.sim_here, _cores(), _load(), named, shown)
        text = notes + panels.view_note_html(
            view.live_redraws, view.redraw_s, view.busy_interval if view.busy else None, run.mesh.world, _cores())
        if text != self.run_notes.value:
            self.run_notes.value = text
        crowded = run.mesh.world > _cores() or _load() > _cores()
        self.here_button.layout.display = "" if crowded and self.sim_here is None else "none"

    def _mark_run(self) -> None:
        """A finished run's chart says so when the plan has changed since."""
        stale = self.run is not None and self._run_plan is not None and self._run_plan != self._plan
        if stale:
            self.run_section.add_class("pipeviz-stale")
            self.run_view.summary.value = (f"<span class='pipeviz-stale-note'>⚠ this run used an earlier plan "
                                           f"({html.escape(repr(self._run_plan))})</span>")
        else:
            self.run_section.remove_class("pipeviz-stale")

    # ----------------------------------------------------------------- drawing
    def _view_controls(self) -> list[W.Widget]:
        """The bar above the graph: what is expanded, each with a button to fold it back, and the reset."""
        natural = set(self.graph.regroup().layer_names)
        opened: list[str] = []
        for name in self.graph.layer_names:
            if name not in natural:
                outer = next((a for a in reversed(self.graph._tree.ancestors(name)) if a in natural), None)
                if outer is not None and outer not in opened:
                    opened.append(outer)
        label = W.HTML("<span style='font-size:12px'>shift-click a ■ block to open it</span>" if not opened
                       else "<span style='font-size:12px'>opened:</span>")
        buttons: list[W.Widget] = [label]
        for name in opened:
            b = W.Button(description=f"⊖ {panels.short(name)}", tooltip=f"collapse {name}",
                         layout=W.Layout(width="auto", max_width="100%"))
            b.on_click(lambda _, n=name: self.collapse(n))
            b.add_class("pipeviz-collapse")
            buttons.append(b)
        if opened or set(self.graph.layer_names) != natural:
            reset = W.Button(description="natural blocks", icon="compress", layout=W.Layout(width="auto"))
            reset.on_click(lambda _: self.regroup(None))
            buttons.append(reset)
        return buttons

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
        fig.persist()  # a reloaded page draws this plan too, not the first one

    def _refused(self, cfg: pv.LaunchConfig) -> BaseException | None:
        """Why Launch would refuse these settings (``pv.launch``'s own checks, run now: a few ms), else None."""
        if self._plan.num_stages < 2:
            # Nothing to launch until a click splits the model (the preview says so); a microbatch count that
            # cannot split the batch never launches, split or not: said now.
            try:
                check_batch_split(self.graph.batch_size, cfg.microbatches)
            except PlanError as exc:
                return pv.LaunchError(str(exc), setting="microbatches")
            return None
        from pipeviz.runtime.checks import validate_launch

        args, kwargs = self.graph.example_args, dict(self.graph.example_kwargs)
        try:  # (the default target inside too: a model with several outputs has none)
            validate_launch(self._plan, cfg, inputs=args, input_kwargs=kwargs or None,
                            target=None if cfg.loss_fn is None else self._launch_target(),
                            eval_data=None if cfg.loss_fn is None else self.eval_data)
        except Exception as exc:  # LaunchError, ScheduleError, PlanError (each names the value and the fix), or
            return exc  # whatever else Launch would meet first: shown at the controls, never raised from a handler
        return None

    def _show_refusal(self, exc: BaseException | None) -> None:
        """The setting at fault outlined, its refusal under the controls; Launch enabled only without one."""
        self.refusal = exc
        setting = getattr(exc, "setting", None)
        for name, control in self._setting_controls().items():
            if name == setting:
                control.add_class("pipeviz-refused-control")
            else:
                control.remove_class("pipeviz-refused-control")
        if exc is None:
            self.refused.value = ""
        else:
            value = getattr(self.launch_config(), setting) if setting else None
            outline = ("<style>.pipeviz-refused-control input,.pipeviz-refused-control select"
                       "{outline:2px solid #e74c3c;outline-offset:-1px}</style>")
            # one sentence in the widget's words: the control, why, the values that work (the API's message,
            # with its history and its fix in the call's keywords, is exc itself: explorer.refusal)
            self.error = one_sentence(str(exc), setting, value)
            row = self._loaded_row()
            if row is not None:  # the simulation above is the cluster's; Launch runs this notebook's batch here
                own = row.microbatch_size * row.microbatches
                self.error += (f" (the cluster row is simulated on its own batch of {own} per replica; Launch runs "
                               "this notebook's example batch on this machine)")
            self.refused.value = outline + panels.error_html(f"⚠ {self.error}")
        self.launch_button.tooltip = ("pv.launch(plan, ...) in background processes" if exc is None else
                                      f"refused: {str(exc).splitlines()[0][:200]}")
        if self.run is None or self._finished.is_set():
            self.launch_button.disabled = exc is not None

    def _setting_controls(self) -> dict[str, W.Widget]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "steps": self.steps, "dp": self.dp,
                "tp": self.tp, "sequence_parallel": self.sequence_parallel}

    def _refresh_simulation(self) -> None:
        self.sim = None
        failed = False
        schedule = self.schedule.value
        cfg = self.launch_config()  # one description: what is simulated is what Launch runs
        refusal = self._refused(cfg)
        self._show_refusal(refusal)
        row = self._loaded_row()
        if refusal is not None and row is None:
            failed = True  # nothing simulated that could not run: said once, at the control
        elif cfg.loss_fn is None and not sched.info(schedule).forward_only:
            failed = True
            able = ", ".join(n for n, i in sched.SCHEDULES.items() if i.forward_only)
            self._show_error(ValueError(f"{schedule} cannot run forward only: torch 2.13's V-shaped schedules "
                                        f"need a backward. Fix: pick {able}, or switch to train."))
        elif self._plan.num_stages > 1:
            try:  # (a loaded cluster row is simulated on its own batch even where this notebook's cannot run it)
                self.sim = pv.simulate(self._plan, cfg, options=self.cost_options(),
                                       collectives=row.collectives if row is not None else None)
            except (pv.ScheduleError, ValueError) as exc:  # the schedule does not fit the plan: said once, above
                failed = True
                self._show_error(exc, prefix=f"{schedule} cannot run {plural(self._plan.num_stages, 'stage')}: ")
        self.preview.value = panels.preview_html(self._plan, self.sim, self.microbatches.value, failed,
                                                 options=self.cost_options())
        self.mesh_view.value = panels.mesh_html(self._plan, cfg)
        self.cost_note.value = panels.cost_note_html(self.graph, self.cost_options())
        # Shown before it is drawn: the chart takes the width it has when drawn (a hidden one has none).
        self.sim_view.layout.display = "none" if self.sim is None else "flex"
        self.sim_heading.layout.display = "none" if self.sim is None else ""
        self.sim_view.update(self.sim, overlay=None)
        self.sim_view.summary.value = "" if self.sim is None else self.sim_view.summary.value
        self.player_section.layout.display = "none" if self.sim is None else "flex"
        self._show_player()
        self._show_side_by_side()

    def _show_side_by_side(self) -> None:
        """Every schedule side by side under the simulated timeline (``pv.compare`` of the plan, the controls' run),
        following the plan while shown."""
        from pipeviz.widgets.teaching_figures import side_by_side_figure

        self.comparison = None
        if not self.side_button.value or self.sim is None:
            if self.side_box.children:
                self.side_box.children = ()
            return
        cfg = self.launch_config()
        self.comparison = pv.compare(self._plan, microbatches=cfg.microbatches, config=cfg,
                                     options=self.cost_options())
        if not self.comparison.rows:
            self.side_box.children = (W.HTML("<i>no schedule runs this plan here</i>"),)
            return
        fig = side_by_side_figure(self.comparison)
        if self.side_figure is None:
            self.side_figure = LiveFigure()
            self.side_figure._config = {"responsive": True}
            self.side_figure.add_class("pipeviz-side-by-side")
        self.side_figure.replace(fig)
        self.side_box.children = (self.side_figure,)

    def _show_player(self) -> None:
        """The step player under the simulated timeline, following it while shown."""
        if not self.player_button.value or self.sim is None:
            if self.player_box.children:
                self.player_box.children = ()
            return
        if self.player is None:
            self.player = StepPlayer()
        self.player.show(self.sim)
        self.player_box.children = (self.player,)

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
            self.pipe_text.value = (f"<pre style='max-height:320px;overflow:auto;font-size:11px;max-width:100%'>"
                                    f"{html.escape(self._pipe_cache[key])}</pre>")
        except Exception as exc:
            self.pipe_text.value = ""
            self._show_error(exc)

    # ----------------------------------------------------------------- errors
    def _show_error(self, exc: BaseException, prefix: str = "", area: W.HTML | None = None) -> None:
        """``exc`` in an error area: ``errors`` under the controls (default), or ``launch_error`` under Launch."""
        self.error = f"{prefix}{type(exc).__name__}: {exc}" if not prefix.endswith(": ") else f"{prefix}{exc}"
        (area or self.errors).value = panels.error_html(self.error)

    def _clear_error(self) -> None:
        self.error = ""
        self.errors.value = self.launch_error.value = ""

    # ----------------------------------------------------------------- static output
    def _static_html(self) -> str:
        """What a notebook shows without a widget manager (nbconvert HTML, GitHub): the preview and the figures."""
        figs = self.figures()
        parts = [self.preview.value]
        for i, fig in enumerate(figs.values()):
            parts.append(fig.to_html(full_html=False, include_plotlyjs="cdn" if i == 0 else False))
        return "<div class='pipeviz-static'>" + "".join(parts) + "</div>"

    def _repr_mimebundle_(self, **kwargs: object) -> dict[str, object]:
        data = super()._repr_mimebundle_(**kwargs) or {}
        try:
            data["text/html"] = self._static_html()
        except Exception:  # the static fallback must never break the live widget
            pass
        return data

    def __repr__(self) -> str:
        return (f"Explorer({self._plan!r}, schedule={self.schedule.value}, microbatches={self.microbatches.value}, "
                f"mode={self.mode.value})")


def _toggle(description: str, icon: str, css: str, tooltip: str, show: Callable[[], None]) -> W.ToggleButton:
    """A toggle under the simulated timeline that shows (or hides) a view with ``show``."""
    button = W.ToggleButton(description=description, icon=icon, value=False, tooltip=tooltip,
                            layout=W.Layout(width="auto"))
    button.add_class(css)
    button.observe(lambda _: show(), "value")
    return button


def _balance_width(max_stages: int) -> str:
    """A fixed width for the Balance button that fits the longest label it can show ("Balance into <max>").

    Typing a stage count relabels the button ("Balance into 3"), and the count reaches the kernel when the box
    loses focus, i.e. on the press on Balance itself: the new label arrives while the mouse button is down. A
    button sized to its label grew by a word there, and in a controls row a few pixels too narrow for the longer
    label the row wrapped it onto the next line: the release landed beside it and the click was lost (Balance
    kept the old count). Sized for the longest label, it changes text but never moves. 1ch (a digit's width)
    is at least a letter's; 44px is the padding and the icon."""
    return f"calc({len(f'Balance into {max_stages}')}ch + 44px)"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _warm_up_launches(model: torch.nn.Module) -> None:
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
