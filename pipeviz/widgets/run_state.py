"""A launched run's state in one vocabulary, shared by the Explorer's status line beside Launch, the measured chart's
title and the numerics line (headless: neither ipywidgets nor plotly).

The words: ``starting`` / ``running``; ``done ✓ matches the unsplit model`` (the numerics check), ``done ✗ differs
from the unsplit model``, ``failed ✗`` with its reason; ``done`` with the numerics ``not conclusive`` (the model draws
random numbers the comparison cannot draw alike: no ✓ then, and the way to a conclusive check in the widget's terms);
``stopped`` (numerics not checked); and ``out of date`` after any change of the plan or of a setting the run was
launched with (``ExplorerState.changes_since_launch``).

Example:
    >>> run_state("stopped").headline
    'stopped · numerics not checked'
    >>> run_state("done", check, changes=["microbatches 4 → 8"]).headline
    'done ✓ matches the unsplit model · out of date: microbatches 4 → 8'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipeviz.runtime.numerics import NumericsCheck

__all__ = ["RunState", "run_state"]

CHANCE = "include chance"  # what check_numerics' note says when random draws could not be lined up


@dataclass(frozen=True)
class RunState:
    """What a run is, in the words every view of it uses.

    Attributes:
        word: ``"starting"``, ``"running"``, ``"done"``, ``"failed"`` or ``"stopped"``.
        mark: ``"✓"`` (done, numerics match), ``"✗"`` (numerics differ, or failed) or ``""`` (no verdict).
        reason: the verdict in words ("matches the unsplit model" after a ✓, "numerics not checked (the run was
            stopped)", the failure's first line, ...); ``""`` while running.
        detail: what the numerics line says after the verdict (the differences and the tolerance, why a check is
            not conclusive and how to make it so); ``""`` when there is nothing more.
        changes: what changed since the launch (empty: the run is of the plan and settings shown).
    """

    word: str
    mark: str = ""
    reason: str = ""
    detail: str = ""
    changes: tuple[str, ...] = ()

    @property
    def stale(self) -> bool:
        """The plan or a setting changed since the launch."""
        return bool(self.changes)

    @property
    def verdict(self) -> str:
        """``"done ✓ matches the unsplit model"``: the word, the mark and the reason."""
        return " ".join(p for p in (self.word + (f" {self.mark}" if self.mark else ""),
                                    f"· {self.reason}" if self.reason and not self.mark else self.reason) if p)

    @property
    def out_of_date(self) -> str:
        """``"out of date: microbatches 4 → 8, the split"``, or ``""``."""
        return f"out of date: {', '.join(self.changes)}" if self.changes else ""

    @property
    def numerics(self) -> str:
        """The numerics line's words (after "Numerics check:"): the verdict and the differences, "not checked" and
        why, or ``""`` while the run goes; "out of date" after them when it is."""
        if self.word == "done" and self.mark:
            text = f"{self.mark} {self.reason} {self.detail}"
        elif self.word == "done" and self.detail:
            text = f"{self.reason.removeprefix('numerics ')}: {self.detail}"
        elif self.word == "done":
            text = self.reason.removeprefix("numerics ")
        elif self.word in ("stopped", "failed"):
            text = f"not checked: the run {'was stopped' if self.word == 'stopped' else 'failed'}."
        else:
            return ""
        return text + (f" · {self.out_of_date}" if self.changes else "")

    @property
    def headline(self) -> str:
        """The verdict, and what made the run out of date: the status line's and the chart title's first words."""
        return " · ".join(p for p in (self.verdict, self.out_of_date) if p)


def run_state(status: str, check: NumericsCheck | None = None, *, checking: bool = False, error: str = "",
              changes: Sequence[str] = ()) -> RunState:
    """The state of a run whose status is ``status`` (``pv.Run.status``), with its numerics ``check`` once made
    (``checking``: being made now), the failure ``error`` and the ``changes`` since its launch."""
    changed = tuple(changes)
    if status == "failed":
        first = error.strip().splitlines()[0] if error.strip() else "see the error under Launch"
        return RunState("failed", "✗", first, changes=changed)
    if status == "stopped":
        return RunState("stopped", reason="numerics not checked", changes=changed)
    if status != "done":
        return RunState(status, changes=changed)
    if check is None:
        reason = "checking numerics against the unsplit model…" if checking else "numerics not checked"
        return RunState("done", reason=reason, changes=changed)
    return _checked(check, changed)


def _checked(check: NumericsCheck, changes: tuple[str, ...]) -> RunState:
    forward = check.output_diff is not None
    diffs = (f"max |Δoutput| {check.output_diff:.2e} over {check.steps} steps" if forward else
             f"max |Δloss| {check.loss_diff:.2e} over {check.steps} steps, max |Δparam| {check.param_diff:.2e} "
             f"over {check.tensors} tensors") + f" (tolerance {check.tolerance:g})"
    what = "run forward the same way" if forward else "trained the same way"
    note = _plain(check.note)
    if CHANCE in check.note:  # random draws the reference could not make alike: no verdict either way
        return RunState("done", reason="numerics not conclusive (random draws)",
                        detail=f"compared with the unsplit model {what}: {diffs}; {note}; with dropout 0 in the "
                               "model's config (or model.eval()) the check compares the computation alone and says ✓ "
                               "or ✗.",
                        changes=changes)
    tail = f"; {note}." if note else "."
    if check.ok:
        return RunState("done", "✓", "matches the unsplit model", f"{what}: {diffs}{tail}", changes)
    return RunState("done", "✗", "differs from the unsplit model", f"{what}: {diffs}{tail}", changes)


def _plain(note: str) -> str:
    """``check_numerics``' note without its code fix ("Fix: model.eval(), ..."), as one clause."""
    note = re.sub(r"\s*\bFix:.*$", "", note.strip(), flags=re.S).rstrip(" .;")
    return note[:1].lower() + note[1:] if note else ""
