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

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
import torch
import traitlets

import pipeviz as pv
from pipeviz.errors import LaunchError
from pipeviz.graph.model import ModelGraph
from pipeviz.plan.split import SplitPlan
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import UNSET, launch_config
from pipeviz.schedule.timeline import Timeline
from pipeviz.widgets import panels
from pipeviz.widgets.controls import Controls, row_layout
from pipeviz.widgets.experts import expert_tokens_figure
from pipeviz.widgets.figures import plural, timeline_figure
from pipeviz.widgets.graph_column import GRAPH_WIDTH, GraphColumn
from pipeviz.widgets.graph_figures import graph_figure
from pipeviz.widgets.panels import Change, guarded
from pipeviz.widgets.run_panel import RunPanel, warm_up_launches
from pipeviz.widgets.sim_section import SimSection
from pipeviz.widgets.state import HERE, MODES, ExplorerState, Settings
from pipeviz.widgets.tools import ExplorerTools

__all__ = ["Explorer"]

__all__ += ["GRAPH_WIDTH", "HERE", "MODES"]  # (the graph column's width, the cost setting's default and the run
#                                              switch's values: the views' and the state's, named here as before)


class _Kept:
    """An Explorer attribute one of its parts keeps, one copy of each: ``explorer.config`` is
    ``explorer.state.config``, ``explorer.run`` is ``explorer.runner.run``; ``writable`` ones may be assigned."""

    def __init__(self, part: str, writable: bool = False) -> None:
        self.part, self.writable = part, writable

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Explorer | None, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Explorer, value: object) -> None:
        if not self.writable:
            raise AttributeError(f"Explorer.{self.name} is {self.part}'s; it cannot be assigned.")
        setattr(getattr(obj, self.part), self.name, value)


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
            its schedule, microbatches, steps, ``dp``, ``cp``, ``ep`` and ``tp`` start the controls; Launch runs the
            config the controls make (``explorer.launch_config()``) with its other options (timeouts, pinning, ...).
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
        **options: other ``pv.LaunchConfig`` fields (``tp_plan=``, ``dp=``, ``timeout=``, ...), over ``config``'s:
            ``pv.Explorer(model, (x,), tp=2)`` is ``pv.Explorer(model, (x,), config=pv.LaunchConfig(tp=2))``; an
            unknown one is named with the valid fields (``LaunchConfig.replace``).

    Attributes:
        graph: the current ``ModelGraph`` (expand / collapse replace it).
        plan: the current ``SplitPlan``; assign one (or a list of layer names) and the view follows.
        run: the last launched ``pv.Run``.
        sim, sim_here: the simulated timeline of the plan, and the one "as run here" (on this machine's cores).
        sim_view, run_view: the ``TimelineView``s of the simulated and the measured timeline.
        ep: the expert-parallel input (with ``dp``, ``cp``, ``tp``): a run with ``ep`` > 1 draws its all-to-alls as
            ``A2A`` actions and its tokens per expert (``pv.expert_tokens_figure``) under the measured timeline.
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

    # kept by the Explorer's parts (explorer.config is explorer.state.config, ...): one copy of each
    config, target, devices = _Kept("state", True), _Kept("state", True), _Kept("state", True)
    loss_fn, optimizer, eval_data = _Kept("state", True), _Kept("state", True), _Kept("state", True)
    resume, loaded, graph = _Kept("state", True), _Kept("state", True), _Kept("state")
    run, sim_here = _Kept("runner"), _Kept("runner")
    player, comparison, side_figure = _Kept("sim_section"), _Kept("sim_section"), _Kept("sim_section")

    def __init__(
        self, model: torch.nn.Module | ModelGraph, example_args: tuple[object, ...] | torch.Tensor = (),
        example_kwargs: Mapping[str, object] | None = None, *, splits: SplitPlan | Iterable[str] | None = None,
        schedule: str = UNSET, microbatches: int = UNSET, steps: int = UNSET, target: torch.Tensor | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        devices: str | list[str] = UNSET, depth: int | None = None, mode: str = "train",
        eval_data: Iterable[object] | None = None, resume: str | os.PathLike[str] | None = None,
        config: pv.LaunchConfig | None = None, **options: Any,
    ) -> None:
        Settings(mode=mode)  # a bad mode is named before anything is traced
        graph = model if isinstance(model, ModelGraph) else pv.trace(model, example_args, example_kwargs, depth=depth)
        cfg = launch_config(config, schedule=schedule, microbatches=microbatches, steps=steps, devices=devices,
                            **options)
        self.state = ExplorerState(graph, cfg, Settings(sched.canonical(cfg.schedule), cfg.microbatches,
                                                        cfg.steps or 1, mode=mode, dp=cfg.dp, tp=cfg.tp,
                                                        sequence_parallel=cfg.sequence_parallel, cp=cfg.cp,
                                                        ep=cfg.ep),
                                   target=target, loss_fn=loss_fn, optimizer=optimizer, eval_data=eval_data,
                                   resume=resume)
        self.sim: Timeline | None = None
        self.error = ""
        self.refusal: BaseException | None = None  # why the controls' settings cannot launch (None: they can)
        self._syncing = False
        self._build_ui()
        super().__init__(self._children, layout=W.Layout(width="100%", max_width="100%"))
        self.add_class("pipeviz-explorer")
        self.observe(self._on_clicked, "clicked")
        self.observe(self._on_expanded, "expanded")
        self.observe(self._on_plan_json, "plan_json")
        self._set_plan(splits if splits is not None else self.state.plan, record=False)
        warm_up_launches(graph.model)

    # ----------------------------------------------------------------- UI
    def _build_ui(self) -> None:
        self.notes = W.HTML(panels.notes_html(self.graph.notes))
        self.notes.add_class("pipeviz-notes")
        self.graph_column = GraphColumn(self.plan, lambda name, modifier: setattr(
            self, "expanded" if modifier else "clicked", name), self.collapse, lambda: self.regroup(None))
        self.graph_figure, self.view_bar = self.graph_column.figure, self.graph_column.view_bar
        self.controls = controls = Controls(self.state.settings, len(self.graph.layers), self._on_controls)
        controls.stages.observe(lambda _: controls.target_stages(self.plan.num_stages), "value")
        controls.balance_button.on_click(lambda _: self.auto_balance())
        controls.undo_button.on_click(lambda _: self.undo())
        controls.redo_button.on_click(lambda _: self.redo())
        # the controls' widgets, as the Explorer's attributes (explorer.microbatches.value = 8, ...)
        self.stages, self.balance_by = controls.stages, controls.balance_by
        self.balance_button = controls.balance_button
        self.undo_button, self.redo_button, self.mode = controls.undo_button, controls.redo_button, controls.mode
        self.schedule, self.microbatches, self.steps = controls.schedule, controls.microbatches, controls.steps
        self.dp, self.tp, self.sequence_parallel = controls.dp, controls.tp, controls.sequence_parallel
        self.cp, self.ep = controls.cp, controls.ep
        self.hardware, self.recompute, self.refused = controls.hardware, controls.recompute, controls.refused
        self.hint, self.cost_note = controls.hint, controls.cost_note
        self.mesh_view = W.HTML(layout=W.Layout(max_width="100%", overflow="auto"))
        self.mesh_view.add_class("pipeviz-mesh")
        self.preview = W.HTML(layout=W.Layout(max_width="100%", overflow="auto"))
        self.pipe_view = panels.PipeView(lambda: (self.plan, self.microbatches.value), self._show_error)
        self.pipe_button, self.pipe_text = self.pipe_view.button, self.pipe_view.text
        self.errors = W.HTML(layout=W.Layout(max_width="100%"))  # full width: stretched (100% + margins overflowed)
        self.errors.add_class("pipeviz-error")
        self.sim_section = section = SimSection(self.state)
        self.sim_heading, self.sim_view, self.player_section = section.heading, section.view, section.toggles
        self.player_button, self.player_box = section.player_button, section.player_box
        self.side_button, self.side_box = section.side_button, section.side_box
        self.runner = runner = RunPanel(self.state, lambda: self.sim, self._show_error)
        runner.launch_button.on_click(lambda _: self.launch())
        runner.here_button.on_click(lambda _: self.simulate_here())
        self.launch_button, self.stop_button, self.progress = runner.launch_button, runner.stop_button, runner.progress
        self.launch_error, self.run_notes, self.here_button = runner.launch_error, runner.run_notes, runner.here_button
        self.numerics, self.run_view, self.run_section = runner.numerics, runner.run_view, runner.section
        self.tools = ExplorerTools(self.state, controls.schedule, self._refresh_simulation)  # Synthesize, Export
        self._children = self._layout()

    def _layout(self) -> list[W.Widget]:
        # Launch sits under the controls that describe the run, its refusals and failures under it: graph, controls,
        # Launch and what it says fit one screen at 1280 px (below the stage preview it was 570-1,416 px away).
        right = W.VBox([W.VBox(self.controls.rows(), layout=W.Layout(max_width="100%")), self.tools.synth_row,
                        self.runner.launch_row,
                        self.launch_error, self.errors, self.preview, self.mesh_view, self.pipe_button,
                        self.pipe_text],
                       layout=W.Layout(flex="1 1 380px", min_width="0", max_width="100%"))
        right.add_class("pipeviz-preview-column")
        from pipeviz.widgets.cluster import cluster_accordion  # "Plan for a cluster": self.cluster, collapsed

        return [self.notes, W.HBox([self.graph_column.box, right], layout=row_layout(align_items="flex-start")),
                *self.sim_section.widgets(), self.run_section, self.tools.export_box, cluster_accordion(self)]

    # ----------------------------------------------------------------- the plan (one source of truth: the state's)
    @property
    def plan(self) -> SplitPlan:
        """The current ``SplitPlan``."""
        return self.state.plan

    @plan.setter
    def plan(self, value: SplitPlan | Iterable[str]) -> None:
        self._set_plan(value)

    def _set_plan(self, value: SplitPlan | Iterable[str], record: bool = True) -> None:
        self.state.set_plan(value, record=record)
        self._show_plan()

    def _show_plan(self) -> None:
        """Everything that shows the plan, redrawn from the state's."""
        plan = self.state.plan
        self._syncing = True
        try:
            self.plan_json = plan.to_json()
        finally:
            self._syncing = False
        self.controls.show_plan(plan, self.state.can_undo, self.state.can_redo)
        self.graph_column.show(plan)
        self._refresh_simulation()
        if self.pipe_button.value:
            self.pipe_view.show()

    # ----------------------------------------------------------------- actions (what the controls call)
    @guarded
    def click(self, layer: str) -> SplitPlan | None:
        """Toggle the split after ``layer`` (what clicking its node does). An invalid click leaves the plan
        as it is and shows the reason in the error area."""
        self._clear_error()
        self.state.toggle(layer)
        self._show_plan()
        return self.plan

    @guarded
    def auto_balance(self, num_stages: int | None = None, by: str | None = None) -> SplitPlan | None:
        """Replace the plan with ``pv.balance(graph, num_stages, by=...)`` (defaults: the controls); among
        splits tied at the optimum, the one the simulator gives the shortest step under the schedule."""
        self._clear_error()
        n = int(num_stages if num_stages is not None else self.stages.value)
        self.state.balance(n, by=by or self.balance_by.value)
        self._show_plan()
        return self.plan

    def undo(self) -> SplitPlan:
        """Go back to the plan before the last change (splits, balance, expand or collapse)."""
        if self.state.can_undo:
            self.state.undo()
            self._show_plan()
        return self.plan

    def redo(self) -> SplitPlan:
        """Redo the change ``undo`` took back."""
        if self.state.can_redo:
            self.state.redo()
            self._show_plan()
        return self.plan

    @guarded
    def expand(self, name: str) -> None:
        """Show layer ``name``'s child modules as layers (no re-tracing); splits are kept."""
        self._clear_error()
        self.state.expand(name)
        self._show_plan()

    @guarded
    def collapse(self, name: str) -> None:
        """Merge every layer inside module ``name`` into one layer (splits inside it are dropped)."""
        self._clear_error()
        self.state.collapse(name)
        self._show_plan()

    @guarded
    def regroup(self, depth: int | None = None) -> None:
        """Another granularity: ``None`` for the natural blocks, an int for every module down to that depth."""
        self._clear_error()
        self.state.regroup(depth)
        self._show_plan()

    def launch(self) -> pv.Run | None:
        """Start ``pv.launch`` with the current plan and controls; the phases and the timeline show live. A refusal
        (the one the controls show, a single stage included) stays in its one place, under the controls, and is
        ``explorer.error``; returns None then. What ``pv.launch`` itself raises shows under Launch."""
        self._clear_error()
        try:
            refusal = self.state.refusal() if not self.runner.going else None
            if refusal is not None:  # said once, live, under the controls (Launch is disabled there)
                self._show_refusal(refusal)
                return None
            run = self.runner.launch()
        except Exception as exc:  # shown where the user pressed, never swallowed
            self._show_error(exc, area=self.launch_error)
            return None
        return run

    def launch_config(self) -> pv.LaunchConfig:
        """The ``pv.LaunchConfig`` Launch runs (``ExplorerState.launch_config``): the Explorer's ``config`` with the
        controls' schedule, microbatches, steps, dp, cp, ep, tp and recomputation (in infer mode, no loss, optimizer or
        recomputation); ``pv.export_torchrun(plan, path, config=explorer.launch_config(), ...)`` writes the same
        run for torchrun."""
        return self.state.launch_config()

    @guarded
    def cost_options(self) -> pv.CostOptions:
        """The cost model's settings the controls make (hardware, its dtype, recomputation): what the preview,
        Balance and the simulated timeline use. "this machine" is the default ``pv.CostOptions()`` (profiled
        layer times, the traced dtype); a GPU preset costs each op by its roofline in bfloat16.

        Example:
            >>> ex.hardware.value, ex.recompute.value = "h100-sxm", "full"
            >>> ex.cost_options()        # CostOptions(hardware=Hardware('h100-sxm', ...), dtype='bfloat16', ...)
        """
        return self.state.cost_options()

    def stop(self) -> None:
        """Stop the running launch (``run.stop()``)."""
        self.runner.stop()

    @guarded
    def simulate_here(self) -> Timeline | None:
        """Simulate the launched run's plan on this machine's cores (``pv.simulate(..., cores=N)``): with
        more processes than cores, the steps the run measured. Drawn over the measured timeline."""
        return self.runner.simulate_here()

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until the launched run ended and its numerics check is shown; returns the run's status."""
        return self.runner.wait(timeout)

    def figures(self) -> dict[str, go.Figure]:
        """Plain plotly figures of what the widget shows (graph, simulated and measured timelines, an ep run's tokens
        per expert): they render without a widget manager (nbconvert HTML, static previews)."""
        figs = {"graph": graph_figure(self.plan)}
        if self.sim is not None:
            figs["simulated"] = timeline_figure(self.sim)
        if self.run is not None:
            figs["run"] = timeline_figure(self.run.timeline(), overlay=self.sim_here or self.sim)
            if self.run.expert_tokens:  # a run with ep > 1: the tokens routed to each expert
                figs["expert_tokens"] = expert_tokens_figure(self.run)
        return figs

    # ----------------------------------------------------------------- handlers
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
        if self._syncing or not change["new"] or change["new"] == self.plan.to_json():
            return
        self._clear_error()
        self.plan = SplitPlan.from_json(change["new"], self.graph)

    @guarded
    def _on_controls(self) -> None:
        self.state.update(**self.controls.values())
        self._clear_error()
        self._refresh_simulation()
        if self.pipe_button.value:
            self.pipe_view.show()

    # ----------------------------------------------------------------- drawing
    def _show_refusal(self, refusal: BaseException | None) -> None:
        """The setting at fault outlined, its one-sentence refusal under the controls; Launch enabled only without
        one."""
        self.refusal = refusal
        note = ""
        row = self.state.loaded_row()
        if refusal is not None and row is not None:  # the simulation above is the cluster's; Launch runs this batch
            own = row.microbatch_size * row.microbatches
            note = (f"The cluster row is simulated on its own batch of {own} per replica; Launch runs this notebook's "
                    "example batch on this machine.")
        if refusal is not None:
            self.error = f"{refusal} {note}".strip()  # (what the refusal line shows)
        self.controls.show_refusal(refusal if isinstance(refusal, LaunchError) or refusal is None
                                   else LaunchError(str(refusal)), note)
        self.runner.allow(refusal)

    def _refresh_simulation(self) -> None:
        self.tools.follow()  # a synthesized order out once the plan or settings it was found for changed
        self.sim = None
        failed = False
        cfg = self.launch_config()  # one description: what is simulated is what Launch runs
        refusal = self.state.refusal()
        self._show_refusal(refusal)
        if refusal is not None and self.state.loaded_row() is None:
            failed = True  # nothing simulated that could not run: said once, at the control
        else:
            try:  # (a loaded cluster row is simulated on its own batch even where this notebook's cannot run it)
                self.sim = self.state.simulate()
            except (pv.ScheduleError, ValueError) as exc:  # the schedule does not fit the plan: said once, above
                failed = True
                self._show_error(exc, prefix=f"{cfg.schedule} cannot run {plural(self.plan.num_stages, 'stage')}: ")
        self.preview.value = panels.preview_html(self.plan, self.sim, cfg.microbatches, failed or refusal is not None,
                                                 options=self.cost_options())
        self.mesh_view.value = panels.mesh_html(self.plan, cfg)
        self.cost_note.value = panels.cost_note_html(self.graph, self.cost_options())
        self.sim_section.show(self.sim)
        self.runner.mark()  # a launched run is out of date after any change of plan or setting

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
        return (f"Explorer({self.plan!r}, schedule={self.schedule.value}, microbatches={self.microbatches.value}, "
                f"mode={self.mode.value})")

