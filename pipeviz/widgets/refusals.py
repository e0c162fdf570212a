"""Why the Explorer's settings cannot launch, each as one sentence in the widget's terms: the control and its value,
why, and the values that would launch (``ExplorerState.refusal`` asks these; headless: neither ipywidgets nor plotly).

The settings that can never launch on this batch (a microbatch count that does not divide it, data-parallel replicas
that cannot share it, a schedule that needs a backward in a forward-only run) are refused at any stage count, before
the model is split; so is one stage (a click on a layer splits it); the rest come from ``pv.launch``'s own checks
(``validate_launch``), reworded into one sentence that ends with the fix in the widget's terms: the control to set,
or the click. The history and the references behind a rule live in the docs (docs/schedules.md), not here.

Example:
    >>> microbatches_refusal(plan, config.replace(microbatches=5), batch=32)
    LaunchError('microbatches 5 cannot launch: it does not divide the batch of 32; valid: 4, 8, 16, 32 (1 and 2 are
    fewer than the 3 stages 1F1B needs); set microbatches to one of them.')
"""

from __future__ import annotations

import re

from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig

__all__ = ["SCHEDULES_DOC", "dp_refusal", "forward_only_refusal", "microbatches_refusal", "one_sentence",
           "stages_refusal"]

SCHEDULES_DOC = "docs/schedules.md"  # the schedules cheat sheet: every schedule's bubble, memory, traffic and rules
# the fix after "valid: ...", in the widget's terms (its controls)
FIX = {"schedule": "; pick one of them in schedule, or click layers to change the stage count",
       "microbatches": "; set microbatches to one of them", "dp": "; set dp to one of them",
       "tp": "; set tp to one of them", "ep": "; set ep to one of them"}
LABELS = {"schedule": "schedule", "microbatches": "microbatches", "steps": "steps", "dp": "dp", "tp": "tp",
          "ep": "ep", "sequence_parallel": "seq. parallel", "recompute": "recompute"}  # each control, as labelled


def divisors(n: int) -> list[int]:
    """``12`` -> ``[1, 2, 3, 4, 6, 12]``."""
    return [k for k in range(1, n + 1) if n % k == 0]


def _listed(values: list[int] | list[str], empty: str) -> str:
    return ", ".join(map(str, values)) if values else empty


def forward_only_refusal(config: LaunchConfig) -> LaunchError | None:
    """A schedule that needs a backward, in a forward-only run (no ``loss_fn``: the run switch on infer)."""
    name = sched.canonical(config.schedule)
    if config.loss_fn is not None or sched.info(name).forward_only:
        return None
    able = [n for n, i in sched.SCHEDULES.items() if i.forward_only]
    shape = "V-shaped " if sched.info(name).v_shape else ""
    return LaunchError(f"schedule {name} cannot run forward only: torch's {shape}schedule needs a backward; valid in "
                       f"infer mode: {', '.join(able)}; pick one of them in schedule, or switch run to train.",
                       setting="schedule")


def dp_refusal(config: LaunchConfig, batch: int | None) -> LaunchError | None:
    """Data-parallel replicas that cannot share the batch equally."""
    dp, m = config.dp, config.microbatches
    if batch is None or batch % dp == 0:
        return None
    valid = [d for d in divisors(batch) if batch // d % m == 0]
    return LaunchError(f"dp {dp} cannot launch: {dp} replicas cannot share the batch of {batch} equally; valid with "
                       f"{m} microbatches: {_listed(valid, f'none until microbatches divides the batch of {batch}')}"
                       f"{FIX['dp'] if valid else ''}.", setting="dp")


def _rule_ok(plan: SplitPlan, config: LaunchConfig, k: int, rows: int) -> bool:
    """Whether torch's schedule takes ``k`` microbatches of ``rows`` on this plan (``check_microbatches``)."""
    try:
        sched.check_microbatches(config.schedule, plan.num_stages, k, config.stages_per_rank, batch_size=rows)
    except sched.ScheduleError:
        return False
    return True


def _rule(plan: SplitPlan, config: LaunchConfig, m: int) -> str:
    """The schedule's microbatch rule, as it applies to ``m`` on this plan."""
    lay = config.layout(plan.num_stages)
    name, ranks = lay.schedule, lay.num_ranks
    if lay.info.microbatches == "at_least_stages":
        return f"{name} on {plan.num_stages} stages needs at least {plan.num_stages} microbatches"
    return (f"{name} on {ranks} ranks runs each rank's microbatches in rounds of {max(1, m // ranks)}, and {m} is not "
            "a whole number of rounds")


def microbatches_refusal(plan: SplitPlan, config: LaunchConfig, batch: int | None) -> LaunchError | None:
    """A microbatch count that does not divide the batch (each replica's share of it), at any stage count; from 2
    stages on, also one torch's schedule does not take on this plan. ``None`` when the stage count itself does not
    fit the schedule (that refusal is the schedule's)."""
    m, dp = config.microbatches, config.dp
    if batch is None or batch % dp:
        return None
    rows = batch // dp
    split = plan.num_stages > 1
    if split:
        try:
            config.layout(plan.num_stages)
        except sched.ScheduleError:
            return None
    valid = [k for k in divisors(rows) if not split or _rule_ok(plan, config, k, rows)]
    if m in valid:
        return None
    if rows % m:
        why = (f"it does not divide the batch of {batch}" if dp == 1 else
               f"it does not divide the {rows} rows each of the {dp} data-parallel replicas takes from the batch of "
               f"{batch}")
    else:
        why = _rule(plan, config, m)
    missing = [k for k in divisors(rows) if k not in valid and k != m]
    note = _why_missing(plan, config, missing) if missing and rows % m else ""
    fix = FIX["microbatches"] if valid else ""
    return LaunchError(f"microbatches {m} cannot launch: {why}; valid: "
                       f"{_listed(valid, f'none for a batch of {rows} (trace the model on another batch)')}{note}"
                       f"{fix}.", setting="microbatches")


def _why_missing(plan: SplitPlan, config: LaunchConfig, missing: list[int]) -> str:
    """Why the divisors of the batch left out of "valid" are: the schedule's rule on this plan."""
    lay = config.layout(plan.num_stages)
    are = "is" if len(missing) == 1 else "are"
    if lay.info.microbatches == "at_least_stages":
        return f" ({_and(missing)} {are} fewer than the {plan.num_stages} stages {lay.schedule} needs)"
    rounds = "is not a whole number" if len(missing) == 1 else "are not whole numbers"
    return f" ({_and(missing)} {rounds} of {lay.schedule}'s rounds on {lay.num_ranks} ranks)"


def _and(values: list[int]) -> str:
    """``[1, 2, 3]`` -> ``"1, 2 and 3"``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def stages_refusal(plan: SplitPlan) -> LaunchError | None:
    """A plan of one stage: no pipeline to launch yet (what Launch says when pressed then)."""
    if plan.num_stages > 1:
        return None
    return LaunchError("Launch needs at least 2 stages and the plan has 1: click a layer in the graph to split after "
                       "it (or set stages to 2 and press Balance).", setting="stages")


_FIX = re.compile(r"\s*\bFix:.*$", re.S)
# a parenthesis of torch's history or a tracker's number ("(torch 2.13's ...; older torch hung, torchtitan#775)"):
# the docs' (docs/schedules.md), not the widget's
_HISTORY = re.compile(r"\s*\([^()]*(?:\btorch \d|#\d)[^()]*\)")
_BREAK = re.compile(r"\.\s+(?=[A-Z(])")  # a sentence ends: the next starts with a capital or a parenthesis


def one_sentence(exc: BaseException, config: LaunchConfig, valid: list[str] | None = None) -> LaunchError:
    """``pv.launch``'s refusal ``exc`` as one sentence naming the control, why, and (``valid``) the values that would
    launch, with no keyword fix: its later sentences become clauses, its "Fix: ..." (written for code) is dropped;
    ``err.setting`` and the cause are kept."""
    setting = getattr(exc, "setting", None)
    reason = _BREAK.sub("; ", _HISTORY.sub("", _FIX.sub("", str(exc).strip()))).rstrip(" .;:")
    if valid is not None and setting == "ep":  # the checks' "Valid ep: ..." said once, as "valid here" below
        reason = re.sub(r";?\s*Valid ep: [\d, ]+$", "", reason)
    if setting in LABELS:
        value = getattr(config, setting)
        shown = "on" if value is True else "off" if value is False else value
        for said in (repr(value), str(value)):  # the message's own "tp=2 ..." once the sentence starts "tp 2"
            reason = re.sub(rf"^{re.escape(setting)}={re.escape(said)}\b[:,]?\s*(but\s+)?", "", reason)
        sentence = f"{LABELS[setting]} {shown} cannot launch: {reason}"
    else:
        sentence = f"Launch would refuse these settings: {reason}"
    if valid is not None:
        sentence += f"; valid here: {_listed(valid, 'none with the other settings as they are')}"
        sentence += FIX.get(str(setting), "") if valid else ""
    refusal = LaunchError(sentence + ".", setting=setting)
    refusal.__cause__ = exc
    return refusal
