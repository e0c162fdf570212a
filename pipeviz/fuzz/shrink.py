"""Shrink a failing ``Case`` greedily to a minimal one that fails the same way.

Each round tries simpler neighbours in a fixed order — fewer steps, each mesh dimension at 1, each option at its
default, a two-stage-per-rank schedule replaced by 1F1B or GPipe, one stage fewer, half the microbatches, a smaller
model — and moves to the first that still fails with the same ``kind``; it stops when none does (or after
``max_runs``). A neighbour that is refused or passes is simply not taken.

Example:
    >>> small, outcome, tried = shrink(case, run_case(case))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

from pipeviz.fuzz.models import BUILTIN
from pipeviz.fuzz.runner import Outcome
from pipeviz.fuzz.space import OPTIONS, Case
from pipeviz.schedule import traits as sched

__all__ = ["neighbours", "shrink"]


def _fewer_stages(case: Case) -> Iterator[Case]:
    if case.stages > 2:
        for i in range(len(case.cuts)):
            yield dataclasses.replace(case, cuts=case.cuts[:i] + case.cuts[i + 1:])


def _simpler_schedule(case: Case) -> Iterator[Case]:
    if case.schedule in ("GPipe", "1F1B"):
        return
    single = not sched.info(case.torch_schedule).multi
    cuts = case.cuts if single else case.cuts[1::2] or case.cuts[:1]  # one stage per rank: every other cut
    for name in ("1F1B", "GPipe"):
        yield dataclasses.replace(case, schedule=name, cuts=cuts)
        if cuts != case.cuts:
            yield dataclasses.replace(case, schedule=name, cuts=case.cuts)


def _smaller_model(case: Case, candidates: Callable[[str], Sequence[str]]) -> Iterator[Case]:
    size = BUILTIN[case.model][0] if case.model in BUILTIN else len(BUILTIN)
    for name, (s, _) in BUILTIN.items():
        if s >= size:
            break
        points = list(candidates(name))
        if len(points) < len(case.cuts):
            continue
        step = len(points) / (len(case.cuts) + 1)  # the same number of stages, spread evenly
        cuts = tuple(points[min(len(points) - 1, round(step * (i + 1)) - 1)] for i in range(len(case.cuts)))
        if len(set(cuts)) == len(cuts):
            yield dataclasses.replace(case, model=name, cuts=cuts)


def neighbours(case: Case, candidates: Callable[[str], Sequence[str]]) -> Iterator[Case]:
    """The simpler cases tried next, simplest change first."""
    if case.steps > 1:
        yield dataclasses.replace(case, steps=1)
    for name, degree in case.mesh:
        if degree > 1:
            yield case.with_dim(name, 1)
    for name, _ in case.options:
        yield case.with_option(name, OPTIONS[name][0])
    yield from _simpler_schedule(case)
    yield from _fewer_stages(case)
    m = case.microbatches
    while m > 1:
        m //= 2
        yield dataclasses.replace(case, microbatches=m)
    yield from _smaller_model(case, candidates)


def shrink(case: Case, outcome: Outcome, run: Callable[[Case], Outcome],
           candidates: Callable[[str], Sequence[str]], *, max_runs: int = 80,
           log: Callable[[str], None] | None = None) -> tuple[Case, Outcome, int]:
    """The smallest case found failing as ``case`` fails (same ``outcome.kind``), its outcome, and the runs tried.

    ``run``: the runner (``run_case``); ``candidates(model)``: a model's split points in order."""
    runs, seen = 0, {case}
    while runs < max_runs:
        for cand in neighbours(case, candidates):
            if cand in seen:
                continue
            seen.add(cand)
            runs += 1
            got = run(cand)
            if got.verdict == "failed" and got.kind == outcome.kind:
                if log is not None:
                    log(f"  shrunk: {cand.describe()}")
                case, outcome = cand, got
                break
            if runs >= max_runs:
                break
        else:
            break
    return case, outcome, runs
