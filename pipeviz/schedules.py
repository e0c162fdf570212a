"""Schedule names and their rules: which stages each rank holds and which microbatch counts work.

Names are torch's, case-insensitive. Every rule here is checked before any process starts, so a bad
launch fails in the caller with a message that says which numbers would work.

Example:
    >>> from pipeviz.schedules import canonical, layout
    >>> canonical("interleaved1f1b")
    'Interleaved1F1B'
    >>> layout("ZBVZeroBubble", num_stages=4).stage_ranks    # V shape: rank 0 holds stages 0 and 3
    (0, 1, 1, 0)
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

SINGLE = ("GPipe", "1F1B")
MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
ALL = SINGLE + MULTI
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


class ScheduleError(ValueError):
    """A schedule name or a (stages, microbatches, stages per rank) combination torch cannot run."""


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
    """Where stages run: ``stage_ranks[s]`` is the rank holding stage ``s``."""

    schedule: str
    num_stages: int
    num_ranks: int
    stage_ranks: tuple[int, ...]

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_ranks) if r == rank]

    @property
    def multi(self) -> bool:
        return self.schedule in MULTI


def layout(schedule: str, num_stages: int, stages_per_rank: int | None = None) -> Layout:
    """Map stages to ranks for ``schedule`` (loop style; V style for ZBV and DualPipeV).

    Single-stage schedules put one stage on each rank. Multi-stage ones put ``stages_per_rank``
    (default 2) on each; ZBVZeroBubble and DualPipeV need exactly 2.

    Raises:
        ScheduleError: the stage count does not fit the schedule; the message says what would.
    """
    name = canonical(schedule)
    if name in SINGLE:
        if stages_per_rank not in (None, 1):
            raise ScheduleError(
                f"{name} runs one stage per rank; got stages_per_rank={stages_per_rank}. "
                f"Fix: drop stages_per_rank, or pick a multi-stage schedule: {', '.join(MULTI)}."
            )
        return Layout(name, num_stages, num_stages, tuple(range(num_stages)))
    v = 2 if stages_per_rank is None else stages_per_rank
    if name in V_SHAPED and v != 2:
        raise ScheduleError(f"{name} needs exactly 2 stages per rank; got stages_per_rank={v}.")
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"stages_per_rank must be a positive int, got {v!r}.")
    if num_stages % v or num_stages // v < 1:
        fits = [s for s in range(v, 4 * v * 2 + 1, v)]
        raise ScheduleError(
            f"{name} with {v} stages per rank needs a stage count divisible by {v}; the plan has {num_stages}. "
            f"Fix: split into one of {', '.join(map(str, fits[:6]))} stages, or change stages_per_rank."
        )
    ranks = num_stages // v
    if name in V_SHAPED:
        mapping = tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages))
    else:
        mapping = tuple(s % ranks for s in range(num_stages))
    return Layout(name, num_stages, ranks, mapping)


def check_microbatches(
    schedule: str, num_stages: int, microbatches: int, stages_per_rank: int | None = None,
    batch_size: int | None = None,
) -> None:
    """Raise ``ScheduleError`` unless torch's ``schedule`` accepts ``microbatches`` for this layout.

    The rules are torch 2.13's: 1F1B needs at least as many microbatches as stages; Interleaved1F1B and
    InterleavedZeroBubble need ``m % max(1, m // ranks) == 0``; DualPipeV needs ``m >= stages``.
    """
    lay = layout(schedule, num_stages, stages_per_rank)
    name, m, p = lay.schedule, microbatches, lay.num_ranks
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ScheduleError(f"microbatches must be a positive int, got {m!r}.")

    def ok(k: int) -> bool:
        if name == "1F1B" or name == "DualPipeV":
            return k >= num_stages
        if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
            return k % max(1, k // p) == 0
        return True

    def fits(k: int) -> bool:
        return ok(k) and (batch_size is None or batch_size % k == 0)

    if not fits(m):
        top = batch_size if batch_size is not None else 4 * num_stages
        good = [k for k in range(1, top + 1) if fits(k)][:8]
        why = {
            "1F1B": f"1F1B needs at least as many microbatches as stages ({num_stages})",
            "DualPipeV": f"DualPipeV needs at least as many microbatches as stages ({num_stages})",
        }.get(name, f"{name} needs microbatches to be a multiple of max(1, microbatches // ranks) with {p} ranks")
        if ok(m):
            why = f"it does not divide the batch of {batch_size}"
        valid = ", ".join(map(str, good)) or f"none for a batch of {batch_size}; change the batch size"
        raise ScheduleError(f"microbatches={m} does not work: {why}. Valid: {valid}.")
