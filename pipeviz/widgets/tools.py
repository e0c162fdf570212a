"""The Explorer's tools beside its controls: **Synthesize** (``pv.synthesize_schedule`` on the current plan and
settings, within a memory limit per rank; the order found is then what the Explorer simulates, compares and launches)
and the **export menu** (the plan and settings for torchrun, torchtitan or Megatron-LM).

The logic is headless and testable without a browser: ``parse_memory`` reads the limit box, a ``Synthesizer`` holds
the order it put into an ``ExplorerState`` (and takes it out when the plan or the settings it was found for change),
``export_plan`` writes an export of the state; ``ExplorerTools`` is the thin view over them.

Example:
    >>> syn = Synthesizer(state)
    >>> syn.synthesize(parse_memory("2 GB"))     # the state's LaunchConfig now carries the order (order=...)
    >>> pv.launch(state.plan, state.launch_config(), inputs=(x,), target=y)    # what Launch then runs
    >>> export_plan(state, "torchtitan", "pp.toml").text                      # the TOML (and the order's CSV)
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ipywidgets as W

import pipeviz as pv
from pipeviz.plan.split import SplitPlan
from pipeviz.planner.synthesize import MemoryLimitError, Synthesis
from pipeviz.schedule import traits as sched
from pipeviz.widgets.controls import row_layout
from pipeviz.widgets.panels import error_html
from pipeviz.widgets.state import ExplorerState

__all__ = ["EXPORTS", "ExplorerTools", "Exported", "Synthesizer", "export_plan", "parse_memory"]

# The memory box's units: powers of 2, as pipeviz's memory figures count them (1 MB = 1 MiB = 2**20 bytes)
UNITS = {"": 2**20, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
         "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
EXPORTS = ("torchrun", "torchtitan", "megatron")  # the export menu's choices
DEFAULT_PATHS = {"torchrun": "train_pp.py", "torchtitan": "torchtitan.toml", "megatron": ""}
_FIX = re.compile(r"\s*\bFix:.*$", re.S)
_BREAK = re.compile(r"\.\s+(?=[A-Z(])")  # one sentence ends, the next begins


def parse_memory(text: str) -> int | None:
    """The memory limit box's text as bytes per rank: ``"512 MB"``, ``"1.5 GB"``, ``"300"`` (MB), blank: None (no
    limit). MB and GB count 2**20 and 2**30 bytes, as the memory figures do.

    Raises:
        ValueError: text that is not a positive size, in one sentence naming what it takes.
    """
    if not text.strip():
        return None
    found = _SIZE.match(text)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"memory limit {text.strip()!r} is not a size per rank: type a positive number with MB or "
                         "GB (512 MB, 1.5 GB; a bare number is MB), or leave it blank for no limit.")
    return math.floor(float(found.group(1)) * UNITS[unit])


def mib(n: float) -> str:
    """Bytes as MiB with 2 decimals, rounded up (a limit typed as shown is enough): ``mib(284128) == '0.28 MB'``."""
    return f"{math.ceil(n / 2**20 * 100) / 100:.2f} MB"


def _sentence(prefix: str, exc: BaseException) -> str:
    """``exc``'s message as one sentence after ``prefix``: its later sentences as clauses, its "Fix: ..." (written
    for code) dropped."""
    reason = _BREAK.sub("; ", _FIX.sub("", str(exc).strip())).rstrip(" .;:")
    # a clause that began a sentence starts lower-case ("; its layers"), a name does not ("; MyNetwork has")
    reason = re.sub(r"; ([A-Z][a-z]*)\b", lambda m: f"; {m.group(1).lower()}", reason)
    return f"{prefix}{reason}."


class Synthesizer:
    """Synthesize the fastest order for an ``ExplorerState``'s plan and settings, and keep it there while it fits.

    ``synthesize(limit)`` runs ``pv.synthesize_schedule(state.plan, state.launch_config(), memory_limit=limit)`` and
    puts the order into ``state.config`` (``order=``, with the schedule that places its stages in the settings), so
    the state's simulation, comparison and launch configuration are the order's. ``follow()`` takes it out again once
    the plan, the schedule, the microbatches or the run mode differ from those it was found for (it would no longer
    run); ``clear()`` takes it out at once.

    Attributes:
        state: the Explorer's state.
        synthesis: the ``pv.Synthesis`` in use (None when no synthesized order is).
        dropped: why ``follow()`` last took the order out ("" if it did not).
    """

    def __init__(self, state: ExplorerState) -> None:
        self.state = state
        self.synthesis: Synthesis | None = None
        self.dropped = ""
        self._made_for: tuple[SplitPlan, str, int, str] | None = None
        self._before: tuple[object, int | None] = (None, None)  # the config's own order and stages per rank

    def _key(self) -> tuple[SplitPlan, str, int, str]:
        s = self.state.settings
        return self.state.plan, s.schedule, s.microbatches, s.mode

    def synthesize(self, memory_limit: int | None = None) -> Synthesis:
        """The fastest order found within ``memory_limit`` bytes per rank (None: no limit), put into the state.

        Returns:
            The ``pv.Synthesis``; ``state.settings.schedule`` is now the schedule whose placement it uses.

        Raises:
            MemoryLimitError: no order fits; ``err.smallest`` is the least limit one does, and the message (one
                sentence) says so in the memory box's units.
            ValueError: a plan of one stage, or a forward-only run (nothing to order but forwards).
        """
        state = self.state
        if state.plan.num_stages < 2:
            raise ValueError("Synthesize needs a pipeline of at least 2 stages and the plan has 1: click a layer in "
                             "the graph to split after it, or press Balance.")
        if state.settings.mode != "train":
            raise ValueError("Synthesize orders forwards and backwards, and the run is forward only: switch run to "
                             "train.")
        self.clear()
        cfg = state.launch_config()
        row = state.loaded_row()
        try:
            syn = pv.synthesize_schedule(state.plan, cfg.replace(order=None), memory_limit,
                                         options=state.cost_options(),
                                         collectives=row.collectives if row is not None else None)
        except MemoryLimitError as exc:
            shape = f"{state.plan.num_stages} stages x {cfg.microbatches} microbatches"
            raise MemoryLimitError(
                f"No order of these {shape} fits {mib(memory_limit or 0)} per rank: the smallest feasible limit is "
                f"{mib(exc.smallest)} (one microbatch at a time on the fullest rank), so type at least that, or add "
                "stages, microbatches or recomputation.", exc.smallest) from exc
        self._before = (state.config.order, state.config.stages_per_rank)
        state.config = state.config.replace(order=syn.order, stages_per_rank=syn.config.stages_per_rank)
        state.update(schedule=sched.canonical(syn.config.schedule))
        self.synthesis, self._made_for, self.dropped = syn, self._key(), ""
        return syn

    def clear(self) -> bool:
        """Take the synthesized order out of the state (the schedule's own order runs again); False if none was in."""
        if self.synthesis is None:
            return False
        order, spr = self._before
        if self.state.config.order == self.synthesis.order:  # (unless the config was replaced since)
            self.state.config = self.state.config.replace(order=order, stages_per_rank=spr)
        self.synthesis, self._made_for = None, None
        return True

    def follow(self) -> bool:
        """Take the order out once the plan or the settings it was found for changed; True if it did (``dropped``
        says why)."""
        if self.synthesis is None or self._made_for is None:
            return False
        before, now = self._made_for, self._key()
        if before == now:
            return False
        what = ("the plan" if before[0] != now[0] else f"schedule {before[1]}" if before[1] != now[1] else
                f"{before[2]} microbatches" if before[2] != now[2] else "training")
        self.clear()
        self.dropped = (f"The synthesized order was found for {what} and no longer runs here, so the schedule's own "
                        "order is back; press Synthesize for this one.")
        return True

    def summary(self) -> str:
        """What the order in use is, beside torch's schedules on the same ranks (``Synthesis.table``)."""
        syn = self.synthesis
        if syn is None:
            return ""
        placed = "in a V (as ZBVZeroBubble places them)" if syn.placement == "v" else (
            f"looped (as {syn.config.schedule} places them)")
        fits = [k for k in syn.fits if syn.fits[k].step_time <= syn.step_time * (1 + 1e-9)]
        tie = f"; as fast as {', '.join(fits)}" if fits else ""
        return (f"Synthesized order in use: {syn.step_time * 1e3:.3f} ms per step, stages placed {placed}, found by "
                f"{syn.policy} among {syn.evaluated} orders{tie}.\n\n{syn.table()}")


@dataclass(frozen=True)
class Exported:
    """An export of the Explorer's plan and settings: ``kind`` (one of ``EXPORTS``), ``text`` (what was written, or
    Megatron-LM's flags), ``files`` written, ``note`` (what the export cannot carry, or "")."""

    kind: str
    text: str
    files: tuple[Path, ...] = ()
    note: str = ""


def export_plan(state: ExplorerState, kind: str, path: str | Path | None = None) -> Exported:
    """Export the state's plan and ``launch_config()``: ``"torchrun"`` (``pv.export_torchrun``: a script and its
    payload at ``path``), ``"torchtitan"`` (``pv.export_torchtitan``: a TOML fragment at ``path``, the order's schedule
    CSV beside it for a custom or synthesized order) or ``"megatron"`` (``pv.megatron_layout``: Megatron-LM's flags,
    no file).

    Raises:
        ValueError: an unknown kind, no path, or one stage; and what the export function refuses (``PlanError``,
            ``LaunchError``, ``ScheduleError``), reworded as one sentence (``__cause__`` keeps the original).
    """
    if kind not in EXPORTS:
        raise ValueError(f"Unknown export {kind!r}; valid: {', '.join(EXPORTS)}.")
    if state.plan.num_stages < 2:
        raise ValueError(f"A {kind} export needs a pipeline of at least 2 stages and the plan has 1: click a layer "
                         "in the graph to split after it, or press Balance.")
    target = Path(path if path is not None and str(path).strip() else DEFAULT_PATHS[kind] or ".")
    if kind != "megatron" and target.is_dir():
        raise ValueError(f"The {kind} export needs a file path, and {str(target)!r} is a folder: type a file name "
                         f"such as {DEFAULT_PATHS[kind]}.")
    try:
        if kind == "torchrun":
            return _torchrun(state, target)
        if kind == "torchtitan":
            return _torchtitan(state, target)
        return _megatron(state)
    except (pv.PlanError, pv.LaunchError, pv.ScheduleError, ValueError, OSError) as exc:
        names = {"torchrun": "torchrun", "torchtitan": "torchtitan", "megatron": "Megatron-LM"}
        refusal = ValueError(_sentence(f"The {names[kind]} export refuses this plan: ", exc))
        raise refusal from exc


def _torchrun(state: ExplorerState, target: Path) -> Exported:
    cfg = state.launch_config()
    args, kwargs = state.graph.example_args, dict(state.graph.example_kwargs)
    train = cfg.loss_fn is not None
    script = pv.export_torchrun(state.plan, target, cfg, inputs=args, input_kwargs=kwargs or None,
                                target=state.launch_target() if train else None,
                                eval_data=state.eval_data if train else None, resume=state.resume if train else None)
    world = cfg.mesh(state.plan.num_stages).world
    text = (f"# {script} and its payload {script.with_suffix('.payload.pkl').name} beside it\n"
            f"torchrun --nproc-per-node {world} {script}\n"
            f"# pv.watch('{script.stem}_events') follows the run live")
    return Exported("torchrun", text, (script, script.with_suffix(".payload.pkl")))


def _torchtitan(state: ExplorerState, target: Path) -> Exported:
    cfg = state.launch_config()
    toml = pv.export_torchtitan(state.plan, cfg, target)
    files, text = [toml], toml.read_text()
    if cfg.order is not None:
        table = toml.with_name(f"{toml.stem}.schedule.csv")
        files.append(table)
        text += f"\n# {table.name} (the order, one row of actions per pipeline rank):\n{table.read_text()}"
    return Exported("torchtitan", text, tuple(files))


def _megatron(state: ExplorerState) -> Exported:
    cfg = state.launch_config()
    lay = cfg.layout(state.plan.num_stages)
    flags = [f"--pipeline-model-parallel-size {lay.num_ranks}",
             f"--pipeline-model-parallel-layout '{pv.megatron_layout(state.plan)}'",
             f"--tensor-model-parallel-size {cfg.tp}", f"--context-parallel-size {cfg.cp}"]
    batch = state.graph.batch_size
    if batch is not None and batch % (cfg.dp * cfg.microbatches) == 0:
        flags += [f"--micro-batch-size {batch // (cfg.dp * cfg.microbatches)}",
                  f"--global-batch-size {batch * cfg.accumulate}"]
    notes = []
    if lay.info.v_shape:
        notes.append(f"Megatron runs stage i on pipeline rank i % {lay.num_ranks}, not in {lay.schedule}'s V")
    if cfg.order is not None:
        notes.append("Megatron runs its own (interleaved) 1F1B, so the custom order does not carry over")
    return Exported("megatron", " \\\n  ".join(flags), note="; ".join(notes) + "." if notes else "")


class ExplorerTools:
    """The view: the Synthesize row (``synth_row``: memory limit, Synthesize, torch's order; ``synth_note`` under it)
    and the export menu (``export_box``, a collapsed accordion: kind, path, Export, the text written).

    Args:
        state: the Explorer's state.
        schedule: the schedule control (set to the schedule placing a synthesized order's stages).
        refresh: redraws the Explorer from the state (its simulation, refusal and comparison).

    Attributes:
        synthesizer: the headless ``Synthesizer``; ``exported``: the last ``Exported`` (None before one).
        error: the sentence last shown by a tool ("" when the last action worked).
    """

    def __init__(self, state: ExplorerState, schedule: W.Dropdown, refresh: Callable[[], None]) -> None:
        self.state, self._schedule, self._refresh = state, schedule, refresh
        self.synthesizer = Synthesizer(state)
        self.exported: Exported | None = None
        self.error = ""
        self.memory_limit = W.Text(value="", placeholder="no limit", description="memory limit",
                                   style={"description_width": "initial"}, layout=W.Layout(width="190px"),
                                   tooltip="per rank, in MB or GB (512 MB, 1.5 GB); blank: no limit")
        self.memory_limit.add_class("pipeviz-memory-limit")
        self.synth_button = W.Button(description="Synthesize", icon="magic", layout=W.Layout(width="auto"),
                                     tooltip="pv.synthesize_schedule(plan, config, memory_limit=...): the fastest "
                                             "order of forwards and backwards found within the limit")
        self.synth_button.add_class("pipeviz-synthesize")
        self.synth_button.on_click(lambda _: self.synthesize())
        self.clear_button = W.Button(description="torch's order", icon="times", layout=W.Layout(
            width="auto", display="none"), tooltip="back to the schedule's own order")
        self.clear_button.add_class("pipeviz-synthesize-clear")
        self.clear_button.on_click(lambda _: self.clear())
        self.synth_note = W.HTML(layout=W.Layout(max_width="100%", overflow="auto"))
        self.synth_note.add_class("pipeviz-synthesis")
        self.synth_row = W.VBox([W.HBox([self.memory_limit, self.synth_button, self.clear_button],
                                        layout=row_layout()), self.synth_note], layout=W.Layout(max_width="100%"))
        self.export_box = self._export_menu()

    def _export_menu(self) -> W.Accordion:
        self.export_kind = W.Dropdown(options=[("torchrun script", "torchrun"), ("torchtitan TOML", "torchtitan"),
                                               ("Megatron-LM flags", "megatron")], value="torchrun",
                                      description="export", style={"description_width": "initial"},
                                      layout=W.Layout(width="220px"))
        self.export_path = W.Text(value=DEFAULT_PATHS["torchrun"], description="to", layout=W.Layout(width="260px"),
                                  style={"description_width": "initial"})
        self.export_button = W.Button(description="Export", icon="download", layout=W.Layout(width="auto"))
        self.export_button.add_class("pipeviz-export")
        self.export_button.on_click(lambda _: self.export())
        self.export_kind.observe(lambda _: self._kind_changed(), "value")
        self.export_text = W.Textarea(value="", disabled=True, layout=W.Layout(width="100%", height="220px"))
        self.export_text.add_class("pipeviz-export-text")
        self.export_note = W.HTML(layout=W.Layout(max_width="100%"))
        self.export_note.add_class("pipeviz-export-note")
        box = W.VBox([W.HBox([self.export_kind, self.export_path, self.export_button], layout=row_layout()),
                      self.export_note, self.export_text], layout=W.Layout(max_width="100%"))
        menu = W.Accordion(children=[box], selected_index=None)
        menu.set_title(0, "Export (torchrun, torchtitan, Megatron-LM)")
        return menu

    # ----------------------------------------------------------------- Synthesize
    def synthesize(self) -> Synthesis | None:
        """Synthesize within the memory box's limit and draw the order (the schedule control follows); a refusal is
        shown under the row as one sentence and returns None."""
        self.error = ""
        try:
            syn = self.synthesizer.synthesize(parse_memory(self.memory_limit.value))
        except (ValueError, pv.ScheduleError) as exc:  # (MemoryLimitError is a ScheduleError)
            self._say(str(exc) if isinstance(exc, MemoryLimitError) or "Fix:" not in str(exc)
                      else _sentence("Synthesize refuses these settings: ", exc))
            return None
        if self._schedule.value != self.state.settings.schedule:
            self._schedule.value = self.state.settings.schedule  # -> the Explorer's controls -> refresh
        else:
            self._refresh()
        self.show()
        return syn

    def clear(self) -> None:
        """Back to the schedule's own order."""
        if self.synthesizer.clear():
            self._refresh()
        self.show()

    def follow(self) -> None:
        """What the Explorer calls before it redraws: the order taken out if it no longer fits, and said so."""
        if self.synthesizer.follow():
            self._say(self.synthesizer.dropped, error=False)
            self.clear_button.layout.display = "none"

    def show(self) -> None:
        """The row's note: the order in use beside torch's schedules, or nothing."""
        active = self.synthesizer.synthesis is not None
        self.clear_button.layout.display = "" if active else "none"
        text = self.synthesizer.summary()
        self.synth_note.value = (f"<pre style='font-size:11px;margin:2px 0'>{html.escape(text)}</pre>" if text
                                 else "")

    def _say(self, sentence: str, error: bool = True) -> None:
        self.error = sentence if error else ""
        self.synth_note.value = error_html(sentence) if error else f"<i>{html.escape(sentence)}</i>"

    # ----------------------------------------------------------------- export
    def _kind_changed(self) -> None:
        kind = self.export_kind.value
        self.export_path.value = DEFAULT_PATHS[kind]
        self.export_path.disabled = kind == "megatron"

    def export(self) -> Exported | None:
        """Export the plan and settings as the menu says; the text written shows in the text area, a refusal as one
        sentence above it (and None)."""
        self.error = ""
        try:
            out = export_plan(self.state, self.export_kind.value, self.export_path.value)
        except ValueError as exc:
            self.error = str(exc)
            self.export_note.value = error_html(self.error)
            self.export_text.value = ""
            return None
        self.exported = out
        written = ", ".join(str(f) for f in out.files)
        note = (f"Written: {written}." if written else "") + (f" {out.note}" if out.note else "")
        self.export_note.value = f"<i>{html.escape(note.strip())}</i>"
        self.export_text.value = out.text
        return out
