"""Schedule names and their rules: which stages each rank holds and which microbatch counts work.

Names are torch's, case-insensitive. Every rule here is checked before any process starts, so a bad
launch fails in the caller with a message that says which numbers would work.

Example:
    >>> from pipeviz.schedule.traits import canonical, layout
    >>> canonical("interleaved1f1b")
    'Interleaved1F1B'
    >>> layout("ZBVZeroBubble", num_stages=4).stage_ranks    # V shape: rank 0 holds stages 0 and 3
    (0, 1, 1, 0)
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from pipeviz.schedule.mesh import PipelineRank

__all__ = [
    "ALL",
    "KINDS",
    "MULTI",
    "SCHEDULES",
    "SINGLE",
    "V_SHAPED",
    "ZERO_BUBBLE",
    "Action",
    "Kind",
    "Layout",
    "Order",
    "ScheduleError",
    "ScheduleInfo",
    "action",
    "canonical",
    "check_microbatches",
    "info",
    "layout",
    "order_of",
    "orders",
    "parse",
    "validate",
]


class ScheduleError(ValueError):
    """A schedule name or a (stages, microbatches, stages per rank) combination torch cannot run.

    ``report``: for an order that deadlocks, the ``HangReport`` a launch that hung on it would give (``None``
    otherwise); ``setting``: the ``LaunchConfig`` field at fault, where a launch's checks name one."""

    report: object | None = None  # a pipeviz.schedule.hang.HangReport (hang imports this module: not named here)
    setting: str | None = None


@dataclass(frozen=True)
class ScheduleInfo:
    """What a schedule is, as every module asks it: read these traits, never test names.

    Attributes:
        name: torch's spelling.
        stages_per_rank: the default (1, or 2 for the multi-stage schedules); ``layout`` applies it.
        multi: torch's multi-stage runtime (``_PipelineScheduleRuntime``): a list of stages per rank, and each
            cross-rank send and receive an action of its own.
        v_shape: stages placed in a V (rank 0 holds the first and the last), exactly 2 per rank.
        split_backward: backwards split into input-grad (``I``) and weight-grad (``W``) passes (zero bubble).
        forward_only: can run without a loss (torch 2.13's V-shaped schedules fail without a backward).
        microbatches: the microbatch rule: ``"any"``, ``"at_least_stages"`` or ``"rounds"`` (``m`` a multiple of
            ``max(1, m // ranks)``).
        source: where the schedule comes from.
    """

    name: str
    stages_per_rank: int
    multi: bool
    v_shape: bool = False
    split_backward: bool = False
    forward_only: bool = True
    microbatches: str = "any"
    source: str = ""


SCHEDULES: dict[str, ScheduleInfo] = {i.name: i for i in (
    ScheduleInfo("GPipe", 1, False, source="Huang et al. 2019, GPipe"),
    ScheduleInfo("1F1B", 1, False, microbatches="at_least_stages",
                 source="Narayanan et al. 2021, PipeDream-Flush"),
    ScheduleInfo("Interleaved1F1B", 2, True, microbatches="rounds", source="Narayanan et al. 2021, Megatron-LM"),
    ScheduleInfo("LoopedBFS", 2, True, source="Lamy-Poirier 2023, Breadth-First Pipeline Parallelism"),
    ScheduleInfo("InterleavedZeroBubble", 2, True, split_backward=True, microbatches="rounds",
                 source="Qi et al. 2024, Zero Bubble Pipeline Parallelism"),
    ScheduleInfo("ZBVZeroBubble", 2, True, v_shape=True, split_backward=True, forward_only=False,
                 source="Qi et al. 2024, ZB-V"),
    ScheduleInfo("DualPipeV", 2, True, v_shape=True, split_backward=True, forward_only=False,
                 microbatches="at_least_stages", source="DeepSeek's DualPipe repository, the cut-in-half variant"),
)}

ALL = tuple(SCHEDULES)
SINGLE = tuple(n for n, i in SCHEDULES.items() if not i.multi)
MULTI = tuple(n for n, i in SCHEDULES.items() if i.multi)
V_SHAPED = tuple(n for n, i in SCHEDULES.items() if i.v_shape)
ZERO_BUBBLE = tuple(n for n, i in SCHEDULES.items() if i.split_backward)

class Kind(StrEnum):
    """What a compute action does: its letter in torch's notation (a ``str``: ``Kind.F == "F"``)."""

    F = "F"  # forward
    B = "B"  # full backward
    I = "I"  # input-grad pass of a split backward (zero bubble)  # noqa: E741
    W = "W"  # weight-grad pass of a split backward


KINDS = tuple(k.value for k in Kind)  # ("F", "B", "I", "W")


class Action(NamedTuple):
    """One compute action of a schedule: stage, kind (``KINDS``), microbatch. Its text form is torch's: ``2F0``.

    Example:
        >>> Action.parse("2I3"), str(Action(2, Kind.F, 0))
        (Action(2, Kind.I, 3), '2F0')
    """

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    def __repr__(self) -> str:  # short, as lists of them are read: Action(2, Kind.F, 0)
        return f"Action({self.stage}, Kind.{Kind(self.kind).name}, {self.mb})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"2F0"`` -> ``Action(2, "F", 0)``.

        Raises:
            ScheduleError: not ``<stage><kind><microbatch>`` with a kind in ``KINDS``.
        """
        for i, ch in enumerate(text):
            if ch.isalpha():
                if i and ch in KINDS and text[:i].isdigit() and text[i + 1:].isdigit():
                    return cls(int(text[:i]), Kind(ch), int(text[i + 1:]))
                break
        raise ScheduleError(f"Not an action: {text!r}; expected <stage><kind><microbatch> such as '2F0', with a kind "
                            f"among {', '.join(KINDS)} (forward, backward, input-grad, weight-grad).")


Order = list[list[Action]]  # one list of compute actions per pipeline rank, in the order the rank runs them


def info(schedule: str) -> ScheduleInfo:
    """The traits of ``schedule`` (any case).

    Raises:
        ScheduleError: unknown name; the message lists the valid ones.
    """
    return SCHEDULES[canonical(schedule)]


def canonical(name: str) -> str:
    """torch's spelling of a schedule name given in any case.

    Raises:
        ScheduleError: unknown name; the message lists the valid ones.
    """
    if not isinstance(name, str):
        raise ScheduleError(f"Schedule must be a name (str), got {name!r}. Valid: {', '.join(ALL)}.")
    by_lower = {n.lower(): n for n in ALL}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f" Did you mean {by_lower[close[0]]!r}?" if close else ""
    raise ScheduleError(f"Unknown schedule {name!r}.{hint} Valid: {', '.join(ALL)}.")


@dataclass(frozen=True)
class Layout:
    """Where stages run: ``stage_ranks[s]`` is the pipeline rank holding stage ``s``."""

    schedule: str
    num_stages: int
    num_ranks: int
    stage_ranks: tuple[int, ...]

    @property
    def info(self) -> ScheduleInfo:
        return SCHEDULES[self.schedule]

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    @property
    def ranks(self) -> tuple[PipelineRank, ...]:
        """Every pipeline rank, in order."""
        return tuple(PipelineRank(r) for r in range(self.num_ranks))

    def stages_of(self, rank: PipelineRank) -> list[int]:
        """The stages pipeline rank ``rank`` runs (a *pipeline* rank: ``Mesh.coords(process).pp``)."""
        return [s for s, r in enumerate(self.stage_ranks) if r == rank]


def layout(schedule: str, num_stages: int, stages_per_rank: int | None = None) -> Layout:
    """Map stages to ranks for ``schedule`` (loop style; V style for ZBV and DualPipeV).

    Single-stage schedules put one stage on each rank. Multi-stage ones put ``stages_per_rank``
    (default: the schedule's, ``info(schedule).stages_per_rank``) on each; V-shaped ones need exactly 2.

    Raises:
        ScheduleError: the stage count does not fit the schedule; the message says what would.
    """
    sch = info(schedule)
    name = sch.name
    if not sch.multi:
        if stages_per_rank not in (None, 1):
            raise ScheduleError(
                f"{name} runs one stage per rank; got stages_per_rank={stages_per_rank}. "
                f"Fix: drop stages_per_rank, or pick a multi-stage schedule: {', '.join(MULTI)}."
            )
        return Layout(name, num_stages, num_stages, tuple(range(num_stages)))
    v = sch.stages_per_rank if stages_per_rank is None else stages_per_rank
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ScheduleError(f"stages_per_rank must be a positive int, got {v!r}.")
    if sch.v_shape and v != 2:
        raise ScheduleError(f"{name} needs exactly 2 stages per rank; got stages_per_rank={v}.")
    if num_stages % v or num_stages // v < 1:
        fits = [s for s in range(v, 4 * v * 2 + 1, v)]
        raise ScheduleError(
            f"{name} with {v} stages per rank needs a stage count divisible by {v}; the plan has {num_stages}. "
            f"Fix: split into one of {', '.join(map(str, fits[:6]))} stages, or change stages_per_rank."
        )
    ranks = num_stages // v
    if sch.v_shape:
        mapping = tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages))
    else:
        mapping = tuple(s % ranks for s in range(num_stages))
    return Layout(name, num_stages, ranks, mapping)


def check_microbatches(
    schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None,
    batch_size: int | None = None,
) -> None:
    """Raise ``ScheduleError`` unless torch's ``schedule`` accepts ``microbatches`` for this layout.

    The rules are torch 2.13's (``ScheduleInfo.microbatches``): 1F1B and DualPipeV need at least as many
    microbatches as stages; Interleaved1F1B and InterleavedZeroBubble need ``m % max(1, m // ranks) == 0``.
    """
    lay = layout(schedule, num_stages, stages_per_rank)
    name, rule, m, p = lay.schedule, lay.info.microbatches, microbatches, lay.num_ranks
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ScheduleError(f"microbatches must be a positive int, got {m!r}.")

    def ok(k: int) -> bool:
        if rule == "at_least_stages":
            return k >= num_stages
        if rule == "rounds":
            return k % max(1, k // p) == 0
        return True

    def fits(k: int) -> bool:
        return ok(k) and (batch_size is None or batch_size % k == 0)

    if not fits(m):
        top = batch_size if batch_size is not None else 4 * num_stages
        good = [k for k in range(1, top + 1) if fits(k)][:8]
        why = (f"{name} needs at least as many microbatches as stages ({num_stages}){_short_ranks(lay, m)}"
               if rule == "at_least_stages"
               else f"{name} needs microbatches to be a multiple of max(1, microbatches // ranks) with {p} ranks "
                    f"(every rank runs its stages' microbatches in rounds of max(1, {m} // {p}) = {max(1, m // p)}, "
                    f"and {m} is not a whole number of rounds)")
        if ok(m):
            why = f"it does not divide the batch of {batch_size}"
        valid = ", ".join(map(str, good)) or f"none for a batch of {batch_size}; change the batch size"
        raise ScheduleError(f"microbatches={m} does not work: {why}. Valid: {valid}.")


def _short_ranks(lay: Layout, m: int) -> str:
    """Which ranks a too-small microbatch count starves, in words: torch's 1F1B warms rank ``r`` up with
    ``stages - r`` forwards before its first backward (PipeDream-Flush's warm-up)."""
    if lay.schedule != "1F1B":
        return ""
    short = [r for r in range(lay.num_ranks) if lay.num_stages - r > m]
    said = ", ".join(f"rank {r} (stage {r}) {lay.num_stages - r}" for r in short[1:3])
    more = f", and {len(short) - 3} more ranks" if len(short) > 3 else ""
    return (f": rank 0 (stage 0) runs {lay.num_stages} forwards before its first backward"
            f"{', ' + said if said else ''}{more}, but only {m} microbatch{'es' * (m != 1)} exist{'s' * (m == 1)} "
            "(torch 2.13's Schedule1F1B refuses this when built; older torch hung, torchtitan#775)")


# --------------------------------------------------------------------------------------------- orders
def _gpipe(rank: int, num_stages: int, m: int) -> list[Action]:
    # GPipe (Huang et al., 2019): all forwards, then all backwards, in microbatch order (torch's ScheduleGPipe).
    return [Action(rank, Kind.F, i) for i in range(m)] + [Action(rank, Kind.B, i) for i in range(m)]


def _one_f_one_b(rank: int, num_stages: int, m: int) -> list[Action]:
    # 1F1B (PipeDream-Flush, Narayanan et al., 2021) as torch's Schedule1F1B runs it: stage r warms up with
    # min(m, p - r) forwards, then alternates one backward and one forward, then drains the backwards.
    warm = min(m, num_stages - rank)
    out = [Action(rank, Kind.F, i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        out.append(Action(rank, Kind.B, b))
        b += 1
        if f < m:
            out.append(Action(rank, Kind.F, f))
            f += 1
    return out


def orders(schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None) -> Order:
    """Per-rank compute actions (``Action``) in the order torch's runtime executes them; each prints in torch's
    notation.

    ``2F0``: stage 2 forward of microbatch 0; ``B``: full backward; ``I``/``W``: input-grad / weight-grad
    halves of a backward (zero bubble). GPipe and 1F1B are generated here (torch's private visualizer gets
    them wrong); multi-stage schedules come from torch's own ``pipeline_order``, with overlapped F/B pairs
    (DualPipeV) in the order they run.

    Example:
        >>> [[str(a) for a in rank] for rank in orders("1F1B", 2, 3)]
        [['0F0', '0F1', '0B0', '0F2', '0B1', '0B2'], ['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']]
        >>> orders("1F1B", 2, 3)[0][0]
        Action(0, Kind.F, 0)
    """
    lay = layout(schedule, num_stages, stages_per_rank)
    check_microbatches(lay.schedule, num_stages, microbatches, stages_per_rank)
    # GPipe and 1F1B are generated here (torch's private visualizer gets them wrong); the multi-stage ones are torch's.
    if lay.schedule == "GPipe":
        return [_gpipe(r, num_stages, microbatches) for r in range(num_stages)]
    if lay.schedule == "1F1B":
        return [_one_f_one_b(r, num_stages, microbatches) for r in range(num_stages)]
    from pipeviz.adapter import schedule_actions

    return [[Action(s, Kind(k), mb) for s, k, mb in rank]
            for rank in schedule_actions(lay.schedule, lay.num_ranks, num_stages, microbatches)]


def action(given: Action | str) -> Action:
    """``given`` as an ``Action``: itself, or parsed from torch's text (``"2F0"``); for what users type.

    Raises:
        ScheduleError: text that is not an action.
    """
    if isinstance(given, Action):
        return given if isinstance(given.kind, Kind) else Action(given.stage, Kind(given.kind), given.mb)
    if isinstance(given, str):
        return Action.parse(given)
    raise ScheduleError(f"Not an action: {given!r}; expected pv.schedule.Action(stage, Kind.F, mb) or its text "
                        "such as '2F0'.")


def order_of(given: Sequence[Sequence[Action | str]]) -> Order:
    """A per-rank order given as ``Action``s or torch's text (``[["0F0", "0B0"], ["1F0", "1B0"]]``) as ``Action``s:
    the one place where a user's order (``LaunchConfig(order=...)``) is read.

    Raises:
        ScheduleError: not one list of actions per rank, or an entry that is not an action.
    """
    if isinstance(given, str) or not all(isinstance(r, Sequence) and not isinstance(r, str) for r in given):
        raise ScheduleError(f"order must be one list of actions per pipeline rank, got {given!r}. Fix: "
                            "order=[['0F0', '0F1', '0B0', '0B1'], ['1F0', '1B0', '1F1', '1B1']].")
    return [[action(a) for a in rank] for rank in given]


def parse(action: str) -> Action:
    """``"2F0"`` -> ``Action(2, "F", 0)`` (a tuple: ``stage, kind, mb = parse(a)``).

    Raises:
        ScheduleError: not an action, or a kind outside ``KINDS``.
    """
    return Action.parse(action)


def validate(order: Sequence[Sequence[Action | str]], num_stages: int, microbatches: int,
             stage_ranks: tuple[int, ...]) -> None:
    """Check per-rank action lists (``Action``s, or torch's text as users write it: ``"0F0"``): every (stage,
    microbatch) has F then B (or I then W) exactly once, on the rank holding the stage, forward before backward on
    that rank.

    Raises:
        ScheduleError: naming the first broken rule.
    """
    seen: dict[tuple[int, str, int], int] = {}
    for rank, acts in enumerate(order):
        for pos, act in enumerate(acts):
            s, k, m = action(act)
            if not (0 <= s < num_stages and 0 <= m < microbatches):
                raise ScheduleError(f"rank {rank}: {act} is out of range ({num_stages} stages, {microbatches} mb).")
            if stage_ranks[s] != rank:
                raise ScheduleError(f"rank {rank}: {act} runs stage {s}, which lives on rank {stage_ranks[s]}.")
            if (s, k, m) in seen:
                raise ScheduleError(f"rank {rank}: {act} appears twice.")
            seen[(s, k, m)] = pos
    for s in range(num_stages):
        for m in range(microbatches):
            f = seen.get((s, "F", m))
            if f is None:
                raise ScheduleError(f"{s}F{m} is missing.")
            has_b, has_i, has_w = ((s, k, m) in seen for k in "BIW")
            if has_b == (has_i or has_w) or has_i != has_w:
                raise ScheduleError(f"stage {s} microbatch {m} needs either B, or both I and W.")
            first_bwd = seen[(s, "B", m)] if has_b else seen[(s, "I", m)]
            if first_bwd < f:
                raise ScheduleError(f"{s}{'B' if has_b else 'I'}{m} runs before {s}F{m}.")
            if has_i and seen[(s, "W", m)] < seen[(s, "I", m)]:
                raise ScheduleError(f"{s}W{m} runs before {s}I{m}.")
