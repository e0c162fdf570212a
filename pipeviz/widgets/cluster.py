"""``ClusterPanel``: plan the model for a named cluster (``pv.plan_cluster``) and pick a row.

A thin view over the core: a hardware dropdown, a GPU count, a global batch and a Plan button; the ranked
layouts as a list; choosing a row calls ``on_select(option)`` with its ``LayoutOption`` (the Explorer loads
its plan, schedule, microbatches, dp and tp). Testable headless: call ``plan()``, set ``rows.value``.

Example:
    >>> panel = ClusterPanel(graph, on_select=lambda option: print(option.label()))
    >>> panel.gpus.value, panel.hardware.value = 64, "h100-sxm"
    >>> panel.plan()                # pv.plan_cluster(graph, 64, "h100-sxm", ...)
    >>> panel.rows.value = 0        # what a click on the first row does
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Protocol

import ipywidgets as W

import pipeviz as pv
from pipeviz.graph.model import ModelGraph
from pipeviz.plan.split import SplitPlan
from pipeviz.planner.cluster import row_summary
from pipeviz.planner.search import ClusterPlan, LayoutOption
from pipeviz.schedule.config import LaunchConfig
from pipeviz.widgets.panels import Change, error_html

__all__ = ["ClusterPanel", "cluster_accordion", "launch_scaled", "load_layout"]


class ClusterPanel(W.VBox):
    """Hardware, GPU count and global batch in; ``pv.plan_cluster``'s ranked layouts out; a row picked calls
    ``on_select``.

    Args:
        graph: the traced model (meta-device models work), or a function returning it when Plan is pressed (the
            Explorer's current view).
        on_select: called with the chosen ``LayoutOption``.
        hardware, gpus, global_batch: initial values (default global batch: 8 x the traced batch).
        top: rows listed.

    Attributes:
        result: the last ``pv.ClusterPlan`` (None before the first plan); ``selected``: the last row chosen.
    """

    def __init__(self, graph: ModelGraph | Callable[[], ModelGraph],
                 on_select: Callable[[LayoutOption], object] | None = None, hardware: str = "h100-sxm", gpus: int = 8,
                 global_batch: int | None = None, top: int = 10,
                 on_launch: Callable[[LayoutOption], object] | None = None) -> None:
        self._graph, self.on_select, self.on_launch, self.top = graph, on_select, on_launch, top
        self.result: ClusterPlan | None = None
        self.selected: LayoutOption | None = None
        wide = {"description_width": "initial"}
        self.hardware = W.Dropdown(options=list(pv.HARDWARE), value=pv.hardware(hardware).name,
                                   description="hardware", style=wide, layout=W.Layout(width="210px"))
        # Plain int boxes: a bounded one turned a typed 0 into 1 without a word; pv.plan_cluster refuses it by name
        self.gpus = W.IntText(value=gpus, description="GPUs", style=wide, layout=W.Layout(width="130px"))
        self.global_batch = W.IntText(value=global_batch or 8 * (self.graph.batch_size or 1),
                                      description="global batch", style=wide, layout=W.Layout(width="170px"))
        self.plan_button = W.Button(description="Plan", icon="sitemap", tooltip="pv.plan_cluster(...)")
        self.plan_button.on_click(lambda _: self.plan())
        self.summary = W.HTML()
        self.errors = W.HTML()
        self.errors.add_class("pipeviz-error")
        # hidden until a Plan lists rows (it was an empty box before the first one)
        self.rows = W.Select(options=[], rows=min(top, 10), layout=W.Layout(width="100%", display="none"))
        self.rows.add_class("pipeviz-cluster-rows")
        self.rows.observe(self._on_row, "value")
        # under the rows: what their figures mean (m, mb size, reduce, ...) and the tensor-parallel layout priced
        self.legend = W.HTML(layout=W.Layout(display="none"))
        self.legend.add_class("pipeviz-cluster-legend")
        # one click: the chosen row's layout launched here, scaled down (LayoutOption.scaled_down)
        self.launch_button = W.Button(description="Launch here, scaled down", icon="play", disabled=True,
                                      tooltip="the chosen row's schedule, split, recomputation and reduction on this "
                                              "notebook's example batch, at most 4 processes")
        self.launch_button.on_click(lambda _: self.launch_here())
        self.launch_button.layout.display = "none" if on_launch is None else ""
        super().__init__([W.HBox([self.hardware, self.gpus, self.global_batch, self.plan_button]), self.errors,
                          self.summary, self.rows, self.legend, self.launch_button],
                         layout=W.Layout(max_width="100%"))
        self.add_class("pipeviz-cluster")

    @property
    def graph(self) -> ModelGraph:
        """The graph planned (the Explorer's current view when built by ``cluster_accordion``)."""
        return self._graph if isinstance(self._graph, ModelGraph) else self._graph()

    def plan(self) -> ClusterPlan | None:
        """Run ``pv.plan_cluster`` with the controls' values and list its rows (an error goes to the error
        area, as every widget handler's does)."""
        self.errors.value = ""
        try:
            result = pv.plan_cluster(self.graph, self.gpus.value, self.hardware.value,
                                     global_batch=self.global_batch.value,
                                     top=self.top)
        except Exception as exc:  # shown, never swallowed
            self.errors.value = error_html(f"{type(exc).__name__}: {exc}")
            return None
        self.result = result
        head = html.escape(result.table(0).splitlines()[0])
        self.summary.value = (f"<b>{head}</b><br><span style='color:#555'>{len(result.rows)} layouts fit; choose "
                              "one to load its plan, schedule and microbatches (m).</span>")
        self.rows.unobserve(self._on_row, "value")
        try:
            self.rows.options = [(_row_text(i, r), i) for i, r in enumerate(result.rows)]
            self.rows.value = None
        finally:
            self.rows.observe(self._on_row, "value")
        self.rows.layout.display = "" if result.rows else "none"
        self.legend.value = ("<span style='color:#555;font-size:90%'>"
                             + "<br>".join(html.escape(line) for line in result.legend()) + "</span>")
        self.legend.layout.display = "" if result.rows else "none"
        if not result.rows:
            self.errors.value = error_html(result.table().splitlines()[-1])
        return result

    def select(self, index: int) -> LayoutOption:
        """Choose row ``index`` (what a click does): ``on_select`` gets its ``LayoutOption``."""
        if self.result is None or not 0 <= index < len(self.result.rows):
            raise IndexError(f"No row {index}: {len(self.result.rows) if self.result else 0} rows. Fix: plan() "
                             "first, then pick 0 to rows - 1.")
        option = self.result.rows[index]
        self.selected = option
        if self.on_select is not None:
            self.on_select(option)
        self.launch_button.disabled = self.on_launch is None
        return option

    def launch_here(self) -> object:
        """Launch the chosen row here, scaled down (``on_launch``; the Explorer's: ``launch_scaled``); an error goes
        to the error area."""
        self.errors.value = ""
        if self.selected is None or self.on_launch is None:
            self.errors.value = error_html("Choose a row first (and build the panel with on_launch=...).")
            return None
        try:
            return self.on_launch(self.selected)
        except Exception as exc:  # shown, never swallowed
            self.errors.value = error_html(f"{type(exc).__name__}: {exc}")
            return None

    def _on_row(self, change: Change[int | None]) -> None:
        if change["new"] is None:
            return
        try:
            self.select(int(change["new"]))
        except Exception as exc:  # shown, never swallowed
            self.errors.value = error_html(f"{type(exc).__name__}: {exc}")


def _row_text(i: int, r: LayoutOption) -> str:
    return row_summary(i, r)  # the planner's table's units and order (`pipeviz plan` prints the same)


class Loads(Protocol):
    """What a cluster layout is loaded into (the ``Explorer``): its controls, configuration, plan and graph."""

    hardware: W.Dropdown
    recompute: W.Dropdown
    schedule: W.Dropdown
    microbatches: W.BoundedIntText
    dp: W.BoundedIntText
    tp: W.BoundedIntText
    cp: W.BoundedIntText
    ep: W.BoundedIntText
    config: LaunchConfig
    cluster: ClusterPanel | None
    loaded: LayoutOption | None

    @property
    def graph(self) -> ModelGraph: ...

    @property
    def plan(self) -> SplitPlan: ...

    @plan.setter
    def plan(self, plan: SplitPlan) -> None: ...


class Launches(Loads, Protocol):
    """What a cluster layout is launched from (the ``Explorer``): ``Loads`` and a Launch."""

    def launch(self) -> object: ...


def load_layout(explorer: Loads, option: LayoutOption) -> None:
    """Load a cluster layout into the Explorer: its balanced plan and its ``LaunchConfig`` (schedule,
    microbatches, stages per rank, dp, cp, ep, tp, the replicas' reduction), and the hardware and recomputation its
    costs are on (the Explorer's cost controls). While those controls stay on the row's hardware and
    recomputation, the Explorer costs with the row's own ``CostOptions`` and ``Collectives``
    (``explorer.loaded``): it simulates the step the row lists."""
    # first: the controls set below simulate with the row's own costs (its batch scale, dtype, collectives), so the
    # Explorer shows the step the panel listed (a row of 10.01 ms simulated at 15.88 ms with the controls' costs)
    explorer.loaded = option
    hw = option.options.hw
    if hw is not None and hw.name in [value for _, value in explorer.hardware.options]:
        explorer.hardware.value = hw.name
    cfg = option.config
    explorer.config = explorer.config.replace(stages_per_rank=cfg.stages_per_rank, cp=cfg.cp,
                                              dp_reduce=cfg.dp_reduce, dp_shard=cfg.dp_shard)
    explorer.recompute.value = option.recompute
    explorer.schedule.value = cfg.schedule
    explorer.microbatches.value = cfg.microbatches
    # (dp before cp and ep: ep divides dp x cp, and each control's refusal is checked as it changes)
    explorer.dp.value, explorer.tp.value = cfg.dp, cfg.tp
    explorer.cp.value, explorer.ep.value = cfg.cp, cfg.ep
    explorer.plan = option.plan


def launch_scaled(explorer: Launches, option: LayoutOption) -> object:
    """Load ``option`` (``load_layout``) and launch it here at once, scaled down to the Explorer's example batch
    (``LayoutOption.scaled_down``: the same split, schedule, recomputation and reduction; fewer replicas, no tensor
    parallelism, the microbatches that fit, the traced dtype). The Explorer's costs go back to this machine, so its
    simulated timeline is what runs here, and the run's memory track draws that plan's peak under each process's
    measured one (``pipeviz report``: a table of the two)."""
    load_layout(explorer, option)
    cfg = option.scaled_down(explorer.graph.batch_size or 1)
    explorer.loaded = None
    explorer.hardware.value = explorer.hardware.options[0][1]  # this machine: the costs of what runs here
    explorer.config = explorer.config.replace(dp_reduce=cfg.dp_reduce, dp_shard=cfg.dp_shard,
                                              mixed_precision=cfg.mixed_precision)
    explorer.microbatches.value = cfg.microbatches
    explorer.ep.value, explorer.cp.value = cfg.ep, cfg.cp  # (ep first: it must divide the dp x cp set next)
    explorer.dp.value, explorer.tp.value = cfg.dp, cfg.tp
    return explorer.launch()


def cluster_accordion(explorer: Launches) -> W.Accordion:
    """The Explorer's collapsed "Plan for a cluster" section: a ``ClusterPanel`` whose rows load into it, and launch
    here scaled down with one click."""
    panel = ClusterPanel(lambda: explorer.graph, on_select=lambda option: load_layout(explorer, option),
                         on_launch=lambda option: launch_scaled(explorer, option))
    box = W.Accordion(children=[panel], selected_index=None)
    box.set_title(0, "Plan for a cluster")
    explorer.cluster = panel
    return box
