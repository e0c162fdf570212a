"""``Controls``: the Explorer's settings as widgets, a view over ``ExplorerState``'s ``Settings``: the stage count
with Balance, undo and redo, the run switch, schedule, microbatches, steps, dp, tp, sequence parallelism, what the
costs assume, and the one line that says why the settings cannot launch (the control at fault outlined).

The controls write the state (``values()`` is what ``ExplorerState.update`` takes) and show what it says; they hold
no setting of their own.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as W

import pipeviz as pv
from pipeviz.cost.options import RECOMPUTE
from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.schedule import traits as sched
from pipeviz.widgets import panels
from pipeviz.widgets.figures import plural
from pipeviz.widgets.refusals import SCHEDULES_DOC
from pipeviz.widgets.state import HERE, MODES, Settings

__all__ = ["Controls", "row_layout", "schedule_help"]

WIDE = {"description_width": "initial"}
OUTLINE = ("<style>.pipeviz-refused-control input,.pipeviz-refused-control select"
           "{outline:2px solid #e74c3c;outline-offset:-1px}</style>")


def row_layout(flex: str = "row wrap", align_items: str = "center") -> W.Layout:
    """A row of controls that wraps rather than sticking out of its column."""
    return W.Layout(display="flex", flex_flow=flex, align_items=align_items, max_width="100%")


def balance_width(max_stages: int) -> str:
    """A fixed width for the Balance button that fits the longest label it can show ("Balance into <max>").

    Typing a stage count relabels the button ("Balance into 3"), and the count reaches the kernel when the box
    loses focus, i.e. on the press on Balance itself: the new label arrives while the mouse button is down. A
    button sized to its label grew by a word there, and in a controls row a few pixels too narrow for the longer
    label the row wrapped it onto the next line: the release landed beside it and the click was lost (Balance
    kept the old count). Sized for the longest label, it changes text but never moves. 1ch (a digit's width)
    is at least a letter's; 44px is the padding and the icon."""
    return f"calc({len(f'Balance into {max_stages}')}ch + 44px)"


def schedule_help(schedule: str) -> str:
    """What the schedule is, in a line (from its traits), and where every schedule is compared: the help beside
    the schedule control."""
    i = sched.info(schedule)
    ranks = ("two stages per rank in a V" if i.v_shape else f"{i.stages_per_rank} stages per rank, looped"
             if i.multi else "one stage per rank")
    rule = {"any": "any microbatch count", "at_least_stages": "at least as many microbatches as stages",
            "rounds": "microbatches in whole rounds per rank"}[i.microbatches]
    backward = "; a split backward (input and weight gradients apart)" if i.split_backward else ""
    train = "" if i.forward_only else "; training only"
    return (f"{i.name} ({i.source}): {ranks}; {rule}{backward}{train}. Every schedule's bubble, memory, traffic and "
            f"when to pick it: the schedules cheat sheet, {SCHEDULES_DOC}.")


class Controls:
    """The settings' widgets (each an attribute: ``stages``, ``schedule``, ``microbatches``, ...), laid out in
    ``rows``; ``values()`` reads them as ``Settings`` fields. ``on_change`` runs after any setting changes."""

    def __init__(self, settings: Settings, layers: int, on_change: Callable[[], None]) -> None:
        self.stages = W.BoundedIntText(value=1, min=1, max=layers, description="stages",
                                       layout=W.Layout(width="110px"), style=WIDE)
        self.balance_by = W.Dropdown(options=["time", "flops", "params"], value="time", description="by",
                                     layout=W.Layout(width="120px"), style=WIDE)
        self.balance_button = W.Button(description="Balance", icon="balance-scale",
                                       layout=W.Layout(width=balance_width(layers), flex="0 0 auto"),
                                       tooltip="pv.balance(graph, stages, by=...): the best split into that many")
        self.balance_button.add_class("pipeviz-balance")
        self.undo_button = _icon_button("undo", "undo (explorer.undo())", "pipeviz-undo")
        self.redo_button = _icon_button("repeat", "redo (explorer.redo())", "pipeviz-redo")
        self._run_controls(settings)
        self._cost_controls(settings)
        self.hint = W.HTML()
        self.hint.add_class("pipeviz-hint")
        self.cost_note = W.HTML()  # what a cost setting does (or does not do) on this model
        self.cost_note.add_class("pipeviz-cost-note")
        # A setting that cannot launch, said under the controls (the one at fault outlined) the moment it is set
        self.refused = W.HTML(layout=W.Layout(max_width="100%"))
        self.refused.add_class("pipeviz-refused")
        self._syncing = False
        self._on_change = on_change
        for w in self.settings_widgets().values():
            w.observe(self._changed, "value")

    def _run_controls(self, s: Settings) -> None:
        self.schedule = W.Dropdown(options=list(sched.ALL), value=s.schedule, description="schedule",
                                   layout=W.Layout(width="230px"), style=WIDE)
        self.schedule_help = W.HTML(layout=W.Layout(flex="0 0 auto"))
        self.schedule_help.add_class("pipeviz-schedule-help")
        self.microbatches = W.BoundedIntText(value=s.microbatches, min=1, max=4096, description="microbatches",
                                             layout=W.Layout(width="150px"), style=WIDE)
        self.steps = W.BoundedIntText(value=s.steps, min=1, max=100000, description="steps",
                                      layout=W.Layout(width="110px"), style=WIDE)
        self.dp = W.BoundedIntText(value=s.dp, min=1, max=1024, description="dp", layout=W.Layout(width="90px"),
                                   style=WIDE, tooltip="data-parallel replicas of the pipeline (pv.launch(..., dp=N))")
        self.tp = W.BoundedIntText(value=s.tp, min=1, max=64, description="tp", layout=W.Layout(width="90px"),
                                   style=WIDE, tooltip="tensor-parallel shards of every stage (pv.launch(..., tp=K))")
        self.cp = W.BoundedIntText(value=s.cp, min=1, max=64, description="cp", layout=W.Layout(width="90px"),
                                   style=WIDE, tooltip="context-parallel shares of every sequence: each process of a "
                                                       "stage holds 1/cp of its tokens (pv.launch(..., cp=N))")
        self.ep = W.BoundedIntText(value=s.ep, min=1, max=1024, description="ep", layout=W.Layout(width="90px"),
                                   style=WIDE, tooltip="expert-parallel shares of every MoE block's routed experts, "
                                                       "carved out of the dp replicas: each holds 1/ep of them "
                                                       "(pv.launch(..., dp=D, ep=N))")
        self.ep.add_class("pipeviz-ep")
        self.sequence_parallel = W.Checkbox(
            value=s.sequence_parallel, description="seq. parallel", indent=False, disabled=s.tp == 1,
            layout=W.Layout(width="110px"),
            tooltip="with tp > 1: norms, dropout and the residual stream split by token between the sharded "
                    "regions (pv.launch(..., sequence_parallel=True))")
        self.sequence_parallel.add_class("pipeviz-sequence-parallel")
        self.mode = W.ToggleButtons(options=list(MODES), value=s.mode, description="run",
                                    tooltips=["train: forwards, backwards and optimizer steps",
                                              "infer: forward only (no loss_fn; run.outputs)"],
                                    style={"button_width": "56px", "description_width": "initial"})
        self.mode.add_class("pipeviz-mode")
        self.show_schedule_help()

    def _cost_controls(self, s: Settings) -> None:
        # The cost model's settings (pv.CostOptions): what hardware the preview, Balance and the simulation cost the
        # plan on — this machine (profiled layer times, the traced dtype) or a named GPU (roofline per op, its dtype)
        # — and the activation recomputation they assume. Launch runs here whatever they say.
        self.hardware = W.Dropdown(options=[(HERE, HERE), *[(n, n) for n in pv.HARDWARE if n != "cpu"]],
                                   value=s.hardware, description="costs on", layout=W.Layout(width="220px"),
                                   style=WIDE)
        self.hardware.add_class("pipeviz-hardware")
        self.recompute = W.Dropdown(options=list(RECOMPUTE), value=s.recompute, description="recompute",
                                    layout=W.Layout(width="170px"), style=WIDE)
        self.recompute.add_class("pipeviz-recompute")

    def rows(self) -> list[W.Widget]:
        """The controls as laid out in the Explorer's right column, the refusal line last."""
        return [W.HBox([self.stages, self.balance_by, self.balance_button, self.undo_button, self.redo_button],
                       layout=row_layout()),
                W.HBox([self.mode, self.schedule, self.schedule_help, self.microbatches, self.steps],
                       layout=row_layout()),
                W.HBox([self.dp, self.cp, self.ep, self.tp, self.sequence_parallel, self.hardware, self.recompute],
                       layout=row_layout()),
                self.hint, self.cost_note, self.refused]

    def settings_widgets(self) -> dict[str, W.ValueWidget]:
        """Every control the run is described by (steps too: the simulation carries the whole LaunchConfig), by its
        ``Settings`` field."""
        return {"schedule": self.schedule, "microbatches": self.microbatches, "steps": self.steps, "mode": self.mode,
                "dp": self.dp, "cp": self.cp, "ep": self.ep, "tp": self.tp, "sequence_parallel": self.sequence_parallel,
                "hardware": self.hardware, "recompute": self.recompute}

    def values(self) -> dict[str, object]:
        """The settings as the controls show them (``ExplorerState.update(**controls.values())``)."""
        return {name: w.value for name, w in self.settings_widgets().items()}

    def _changed(self, _change: object) -> None:
        self.sequence_parallel.disabled = self.tp.value == 1  # nothing to split the tokens over
        self.show_schedule_help()
        self._on_change()

    def show_schedule_help(self) -> None:
        """The help beside the schedule control, and its tooltip: the chosen schedule, and the cheat sheet."""
        text = schedule_help(self.schedule.value)
        self.schedule.tooltip = text
        shown = (f"<span title='{html.escape(text, quote=True)}' style='cursor:help;font-size:12px;color:#2a6099'>"
                 "(?)</span>")
        if shown != self.schedule_help.value:
            self.schedule_help.value = shown

    def show_plan(self, plan: SplitPlan, can_undo: bool, can_redo: bool) -> None:
        """The stage count and the undo / redo buttons for ``plan``; any "Balance into" hint gone."""
        self._syncing = True
        try:
            self.stages.max = len(plan.graph.layers)
            self.balance_button.layout.width = balance_width(self.stages.max)
            self.stages.value = plan.num_stages
        finally:
            self._syncing = False
        self.undo_button.disabled, self.redo_button.disabled = not can_undo, not can_redo
        self.hint.value, self.balance_button.description = "", "Balance"

    def target_stages(self, current: int) -> None:
        """A stage count typed (``stages``): a target for Balance, never a silent replacement of hand-placed
        splits; ``current`` is the plan's."""
        if self._syncing:
            return
        n = self.stages.value
        self.balance_button.description = "Balance" if n == current else f"Balance into {n}"
        self.hint.value = "" if n == current else (
            f"<span class='pipeviz-hint-text'>Press <b>Balance into {n}</b> to split into "
            f"{plural(n, 'stage')}; your current {plural(current, 'stage')} stay until then "
            "(and undo brings them back).</span>")

    def show_refusal(self, refusal: LaunchError | None, note: str = "") -> None:
        """The control at fault outlined and the refusal's one sentence under the controls (``note``: a remark in
        smaller print under it); nothing when ``refusal`` is None."""
        setting = getattr(refusal, "setting", None)
        for name, control in self.settings_widgets().items():
            if name == setting:
                control.add_class("pipeviz-refused-control")
            else:
                control.remove_class("pipeviz-refused-control")
        if refusal is None:
            self.refused.value = ""
            return
        small = f"<div style='font-size:11px;color:#555'>{html.escape(note)}</div>" if note else ""
        self.refused.value = OUTLINE + panels.error_html(f"⚠ {refusal}", mono=False) + small


def _icon_button(icon: str, tooltip: str, css: str) -> W.Button:
    button = W.Button(icon=icon, tooltip=tooltip, disabled=True, layout=W.Layout(width="36px"))
    button.add_class(css)
    return button
