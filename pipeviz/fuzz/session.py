"""``fuzz()``: draw compositions from a seed for a time budget, run each, shrink the first failure and write its
reproductions. ``pipeviz fuzz`` is this function.

Example:
    >>> report = fuzz(seconds=60, seed=0, out="fuzz-out")
    >>> report.tried, report.passed, report.refused, report.failed
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeviz.fuzz.models import build_model, builtin_models
from pipeviz.fuzz.runner import Outcome, build_case, run_case
from pipeviz.fuzz.shrink import shrink
from pipeviz.fuzz.space import Case, draw_case
from pipeviz.graph.model import trace

__all__ = ["FuzzReport", "fuzz", "write_repro"]


@dataclass
class FuzzReport:
    """What a fuzz session did: counts, and the failure (the case drawn, the shrunk one, its outcome, the files)."""

    seed: int
    tried: int = 0
    passed: int = 0
    refused: int = 0
    failed: int = 0
    failure: Case | None = None
    shrunk: Case | None = None
    outcome: Outcome | None = None
    shrink_runs: int = 0
    files: list[Path] = field(default_factory=list)
    refusals: dict[str, int] = field(default_factory=dict)  # the setting a refusal named -> count

    def summary(self) -> str:
        named = ", ".join(f"{k} {v}" for k, v in sorted(self.refusals.items()))
        return (f"fuzz seed {self.seed}: {self.tried} cases tried, {self.passed} passed, {self.refused} refused"
                f"{f' ({named})' if named else ''}, {self.failed} failed")


_SCRIPT = '''"""A pipeviz fuzz failure, shrunk: {kind}.

Found by `pipeviz fuzz --seed {seed}`; the case drawn was
    {drawn}
and the smallest that fails the same way is
    {small}
{fault}Run: python {name}   (exits 1 while it still fails; 0 once fixed)
"""

import sys

from pipeviz.fuzz import Case, build_case, run_case

CASE = {case!r}

if __name__ == "__main__":
    model, graph, config = build_case(CASE)  # the model and its batch, its trace, the one pv.LaunchConfig
    print("plan: graph.split(" + repr(list(CASE.cuts)) + ")")
    print("config:", config)
    # pv.launch(graph.split(CASE.cuts), config, inputs=model.inputs, target=model.target) (after a checkpoint
    # another layout saved, with resume=, when CASE resumes), then pv.check_numerics(run)
    outcome = run_case(CASE)
    print(outcome.verdict, outcome.kind, outcome.detail)
    sys.exit(1 if outcome.verdict == "failed" else 0)
'''


def write_repro(out: str | os.PathLike[str], drawn: Case, small: Case, outcome: Outcome, seed: int) -> list[Path]:
    """Write ``repro.py`` (runs the shrunk case and checks it; exits 1 while it fails) and ``repro_torchrun.py``
    (the same processes under torchrun: ``pv.export_torchrun``) into ``out``; returns the files written."""
    from pipeviz.runtime.export import export_torchrun

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    fault = os.environ.get("PIPEVIZ_PLANT_FAULT")
    script = folder / "repro.py"
    script.write_text(_SCRIPT.format(
        kind=f"{outcome.kind}: {outcome.detail.splitlines()[0] if outcome.detail else ''}", seed=seed,
        drawn=drawn.describe(), small=small.describe(), case=small, name=script.name,
        fault=f"(with PIPEVIZ_PLANT_FAULT={fault} set, as when it was found)\n" if fault else ""))
    files = [script]
    note = folder / "README.txt"
    lines = [f"pipeviz fuzz --seed {seed}: {outcome.kind}", f"drawn:  {drawn.describe()}",
             f"shrunk: {small.describe()}", "", outcome.detail, ""]
    try:
        fm, graph, cfg = build_case(small)
        torchrun = export_torchrun(graph.split(list(small.cuts)), folder / "repro_torchrun.py", cfg,
                                   inputs=fm.inputs, target=fm.target)
        files.append(torchrun)
        lines.append(f"torchrun --nproc-per-node {small.world} {torchrun.name}  (the same processes under torchrun"
                     f"{'; without the checkpoint it resumed from' if small.option('resume') else ''})")
    except Exception as exc:  # a refusal is itself the failure, or torchrun cannot take this case
        lines.append(f"no torchrun script: pv.export_torchrun raised {type(exc).__name__}: {exc}")
    note.write_text("\n".join(lines) + "\n")
    return [*files, note]


def _candidates() -> Callable[[str], Sequence[str]]:
    cache: dict[str, list[str]] = {}

    def points(model: str) -> Sequence[str]:
        if model not in cache:
            fm = build_model(model)
            cache[model] = trace(fm.model, example_args=fm.inputs).split_candidates
        return cache[model]
    return points


def fuzz(seconds: float, seed: int, out: str | os.PathLike[str], *, model: str | None = None,
         cases: int | None = None, log: Callable[[str], None] = print,
         run: Callable[[Case], Outcome] = run_case) -> FuzzReport:
    """Draw cases from ``seed`` and run each until ``seconds`` have passed (or ``cases`` were tried), stopping at
    the first failure: shrunk, written to ``out`` (``write_repro``). The same seed draws the same cases.

    Args:
        seconds: the time budget (a case started within it runs to its end).
        seed: the cases drawn.
        out: where a failure's scripts go.
        model: one model instead of the built-in ones: a ``BUILTIN`` name, a ``.py`` file defining
            ``fuzz_model()`` or ``module:function`` (``pipeviz.fuzz.models``).
        cases: at most this many cases.
        log: where each case's line goes.
        run: the runner (``run_case``).
    """
    rng, report = random.Random(seed), FuzzReport(seed)
    models = [model] if model else builtin_models()
    if model:
        build_model(model)  # a user model that cannot be built is named now
    candidates = _candidates()
    start = time.monotonic()
    while time.monotonic() - start < seconds and (cases is None or report.tried < cases):
        case = draw_case(rng, models, candidates, seed=seed)
        outcome = run(case)
        report.tried += 1
        log(f"[{report.tried}] {outcome.verdict:7s} {case.describe()}"
            + (f"\n          {outcome.detail.splitlines()[0][:300]}" if outcome.verdict != "passed" else ""))
        if outcome.verdict == "passed":
            report.passed += 1
        elif outcome.verdict == "refused":
            report.refused += 1
            setting = outcome.detail.partition("[")[2].partition("]")[0]
            report.refusals[setting] = report.refusals.get(setting, 0) + 1
        else:
            report.failed += 1
            log(f"failure ({outcome.kind}); shrinking ...")
            small, got, runs = shrink(case, outcome, run, candidates, log=log)
            report.failure, report.shrunk, report.outcome, report.shrink_runs = case, small, got, runs
            report.files = write_repro(out, case, small, got, seed)
            log(f"shrunk in {runs} runs to: {small.describe()}\n  {got.detail.splitlines()[0][:300]}")
            log("wrote " + ", ".join(str(f) for f in report.files))
            break
    log(report.summary())
    return report
