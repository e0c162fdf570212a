"""Tensor-parallel collectives timed: DTensor sends its all-reduces, all-gathers and reduce-scatters through
``torch.distributed._functional_collectives`` (``funcol``), which returns at once and waits when the result is
first used (``wait_tensor``); inside ``timed_collectives`` each is timed from its launch to the end of its wait."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["COLLECTIVES", "timed_collectives"]

# The funcol entry points DTensor's redistribution and placements call (torch 2.13–2.15); those a torch lacks
# are skipped.
COLLECTIVES = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_to_all_single")


@contextlib.contextmanager
def timed_collectives(record: Callable[[str, float, float], None]) -> Iterator[None]:
    """Inside the block, ``record(name, start, end)`` (wall clock) for every functional collective: ``start``
    when it was launched, ``end`` when the wait on its result returned (at once if torch waited inside)."""
    from torch.distributed import _functional_collectives as funcol

    # keyed by id, holding a weak reference to check it: a result never waited through wait_tensor leaves its entry
    # behind, and a later tensor given the same id must not be taken for it (an extra event, counted in the wrong
    # step: seen once in several runs of the TP event-count test)
    pending: dict[int, tuple[str, float, weakref.ref[torch.Tensor]]] = {}
    originals: dict[str, Callable[..., torch.Tensor]] = {n: getattr(funcol, n) for n in COLLECTIVES
                                                         if hasattr(funcol, n)}
    original_wait: Callable[[torch.Tensor], torch.Tensor] = funcol.wait_tensor

    def timed(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object, **kwargs: object) -> torch.Tensor:
            start = time.time()
            out = fn(*args, **kwargs)
            inner = getattr(out, "elem", None)
            if isinstance(out, funcol.AsyncCollectiveTensor) and not out.completed and inner is not None:
                pending[id(inner)] = (name, start, weakref.ref(inner))
            else:  # already waited (a traced or synchronous call)
                record(name, start, time.time())
            return out
        return call

    def wait(tensor: torch.Tensor) -> torch.Tensor:
        out = original_wait(tensor)
        launched = pending.pop(id(tensor), None)
        if launched is not None and launched[2]() is tensor:
            record(launched[0], launched[1], time.time())
        return out

    for name, fn in originals.items():
        setattr(funcol, name, timed(name, fn))
    funcol.wait_tensor = wait
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(funcol, name, fn)
        funcol.wait_tensor = original_wait
