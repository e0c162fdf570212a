"""Run one ``Case``: a refusal before any process starts, or real processes checked against the unsplit model.

The verdicts: ``passed`` (the run matches ``check_numerics`` at the project's tolerance), ``refused`` (a
``LaunchError`` naming the setting at fault, raised before any process started) and ``failed`` (everything else: a
refusal that names no setting or is not a ``LaunchError``, a run that crashed or hung, a numerical difference).
A failure's ``kind`` is what the shrinker keeps while it simplifies the case.

Example:
    >>> outcome = run_case(case)
    >>> outcome.verdict, outcome.kind, outcome.detail
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeviz.errors import LaunchError
from pipeviz.fuzz.models import FuzzModel, build_model
from pipeviz.fuzz.space import Case, config_fields, custom_order
from pipeviz.graph.model import ModelGraph, trace
from pipeviz.plan.errors import PlanError
from pipeviz.runtime.launch import launch
from pipeviz.runtime.numerics import check_numerics
from pipeviz.runtime.run import Run
from pipeviz.schedule.config import LaunchConfig
from pipeviz.schedule.training import sgd, warmup_cosine
from pipeviz.schedule.traits import ScheduleError

__all__ = ["REFUSALS", "Outcome", "build_case", "refusal", "run_case"]

RUN_TIMEOUT = 240.0  # seconds a case's processes may take in all (a hang is found by the run's own timeout first)


@dataclass(frozen=True)
class Outcome:
    """``verdict``: ``"passed"``, ``"refused"`` or ``"failed"``; ``kind``: the failure's class (``"numerics"``,
    ``"crashed"``, ``"unnamed refusal"``, ``"build"``), empty otherwise; ``detail``: the message or the check."""

    verdict: str
    kind: str = ""
    detail: str = ""


# What a front door refuses with before any process starts (pv.launch's "Raises"); each must name its setting.
REFUSALS = (LaunchError, ScheduleError, PlanError)


def refusal(exc: Exception) -> Outcome:
    """The verdict on what a launch raised: a refusal naming its setting, or a failure (the ``kind`` keeps the
    message's words without its numbers, so shrinking stays on this refusal)."""
    setting = getattr(exc, "setting", None)
    if isinstance(exc, REFUSALS) and setting:
        return Outcome("refused", "", f"{type(exc).__name__} [{setting}]: {exc}")
    why = "naming no setting" if isinstance(exc, REFUSALS) else "not a LaunchError"
    words = " ".join(re.sub(r"[0-9]+", "N", str(exc)).split()[:6])
    return Outcome("failed", f"unnamed refusal ({type(exc).__name__}: {words})",
                   f"pv.launch raised {type(exc).__name__}, {why}: {exc}")


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The fuzzer's AdamW (a module-level function: the ranks unpickle it)."""
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-3)


OPTIMIZERS: dict[str, Callable[..., Any]] = {"sgd": sgd(lr=0.1), "adamw": adamw}
SCHEDULERS: dict[str, Callable[..., Any]] = {"warmup_cosine": warmup_cosine(1, 4)}


def _freeze(model: torch.nn.Module) -> None:
    """Freeze the first module that holds parameters of its own (an embedding, a first layer), as a fine-tune
    freezes part of a base."""
    for name, child in model.named_modules():
        own = list(child.parameters(recurse=False))
        if name and own:  # (the root's own, e.g. a position table, left trainable)
            for p in own:
                p.requires_grad_(False)
            return


def build_case(case: Case) -> tuple[FuzzModel, ModelGraph, LaunchConfig]:
    """The case's model (its batch), traced graph and launch configuration (without ``resume``)."""
    fm = build_model(case.model, case.seed)
    if case.option("freeze"):
        _freeze(fm.model)
    graph = trace(fm.model, example_args=fm.inputs)
    fields = dict(config_fields(case))
    if case.schedule.startswith("custom:"):
        fields["order"] = custom_order(case.schedule, case.stages, case.microbatches)
    sched_name = case.option("lr_scheduler")
    cfg = LaunchConfig(loss_fn=fm.loss_fn, optimizer=OPTIMIZERS[str(case.option("optimizer"))],
                       lr_scheduler=SCHEDULERS[str(sched_name)] if sched_name else None, timeout=60.0,
                       ).replace(**fields)
    return fm, graph, cfg


def _checkpoint(fm: FuzzModel, graph: ModelGraph, cfg: LaunchConfig, folder: str) -> str | None:
    """Train one step under another layout (GPipe, two stages at the middle split point) and save it there: the
    case then resumes from it. An error (the message) when that first run cannot run."""
    points = graph.split_candidates
    first = LaunchConfig(schedule="GPipe", microbatches=2, steps=1, loss_fn=fm.loss_fn, optimizer=cfg.optimizer,
                         lr_scheduler=cfg.lr_scheduler, timeout=60.0)
    try:
        run = launch(graph.split([points[len(points) // 2]]), first, inputs=fm.inputs, target=fm.target)
    except Exception as exc:
        return f"the run that saves the checkpoint to resume from was refused: {type(exc).__name__}: {exc}"
    if run.wait(RUN_TIMEOUT) != "done":
        run.stop()
        return f"the run that saves the checkpoint to resume from failed: {run.error}"
    run.save(folder)
    return None


def _launch(case: Case, fm: FuzzModel, graph: ModelGraph, cfg: LaunchConfig, folder: str) -> Run | Outcome:
    """The case launched, or its outcome when it cannot be."""
    try:
        plan = graph.split(list(case.cuts))
    except PlanError as exc:  # split points valid one by one, not together (an empty stage between): said so
        return Outcome("refused", "", f"PlanError [split]: {exc}")
    except Exception as exc:
        return Outcome("failed", "build", f"graph.split({list(case.cuts)}) raised {type(exc).__name__}: {exc}")
    resume = None
    if case.option("resume"):
        err = _checkpoint(fm, graph, cfg, folder)
        if err is not None:
            return Outcome("failed", "crashed", err)
        resume = folder
    try:
        return launch(plan, cfg, inputs=fm.inputs, target=fm.target, resume=resume)
    except Exception as exc:
        return refusal(exc)


def run_case(case: Case) -> Outcome:
    """Launch ``case`` and check it (``check_numerics``); never raises for what the case does."""
    try:
        fm, graph, cfg = build_case(case)
    except REFUSALS as exc:  # a LaunchConfig field refused on construction (a degree, an order)
        return refusal(exc)
    except Exception as exc:
        return Outcome("failed", "build", f"building the case raised {type(exc).__name__}: {exc}")
    with tempfile.TemporaryDirectory(prefix="pipeviz-fuzz-") as folder:
        run = _launch(case, fm, graph, cfg, folder)
        if isinstance(run, Outcome):
            return run
        status = run.wait(RUN_TIMEOUT)
        if status != "done":
            run.stop()
            return Outcome("failed", "crashed", f"the run ended {status!r}: {run.error}")
        try:
            check = check_numerics(run)
        except Exception as exc:
            return Outcome("failed", "crashed", f"check_numerics raised {type(exc).__name__}: {exc}")
    if not check.ok:
        return Outcome("failed", "numerics", str(check))
    return Outcome("passed", "", str(check))


