"""Tensor-parallel collectives timed: DTensor sends its all-reduces, all-gathers and reduce-scatters through
``torch.distributed._functional_collectives`` (``funcol``), which returns at once and waits when the result is
first used (``wait_tensor``); inside ``timed_collectives`` each is timed from its launch to the end of its wait."""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["COLLECTIVES", "FAULTS", "PLANT_FAULT_ENV", "plant_fault", "timed_collectives"]

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


# A testing hook (docs/fuzz.md): PIPEVIZ_PLANT_FAULT=<collective> in a rank's environment makes every process
# scale that collective's floating-point input by (1 + FAULT_SCALE) before it runs, so every process gets the same
# slightly wrong result: a silent fault no check on the ranks can see, which only a comparison with the unsplit model
# finds (the fuzzer's own test plants it). Each name covers torch.distributed's call and DTensor's functional one.
PLANT_FAULT_ENV = "PIPEVIZ_PLANT_FAULT"
FAULT_SCALE = 1e-2
FAULTS: dict[str, tuple[tuple[str, int], ...]] = {  # name -> (function, index of the tensor it reduces or gathers)
    "all_reduce": (("all_reduce", 0),),
    "reduce_scatter": (("reduce_scatter_tensor", 1), ("funcol.reduce_scatter_tensor", 0)),
    "all_gather": (("all_gather_into_tensor", 1), ("funcol.all_gather_tensor", 0)),
}


def plant_fault(name: str | None = None) -> str | None:
    """Plant the fault ``name`` (default: ``$PIPEVIZ_PLANT_FAULT``) into this process's collectives, for testing that
    a check finds it; returns the name planted (None: none). Never set in a real run.

    Raises:
        ValueError: an unknown name (the valid ones listed).
    """
    name = os.environ.get(PLANT_FAULT_ENV, "") if name is None else name
    if not name:
        return None
    if name not in FAULTS:
        raise ValueError(f"{PLANT_FAULT_ENV}={name!r} is not a collective pipeviz can plant a fault into; valid: "
                         f"{', '.join(FAULTS)}. Fix: one of those, or unset it.")
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    def faulty(fn: Callable[..., object], index: int, in_place: bool) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            import torch

            tensor = args[index] if len(args) > index else None
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                if in_place:  # all_reduce reduces in place: the result is the sum of the scaled inputs
                    tensor.mul_(1 + FAULT_SCALE)
                else:
                    args = (*args[:index], tensor * (1 + FAULT_SCALE), *args[index + 1:])
            return fn(*args, **kwargs)
        return call

    for target, index in FAULTS[name]:
        module, attr = (funcol, target[7:]) if target.startswith("funcol.") else (dist, target)
        setattr(module, attr, faulty(getattr(module, attr), index, in_place=module is dist and attr == "all_reduce"))
    if name == "all_reduce":  # DTensor's all-reduce returns a new tensor
        funcol.all_reduce = faulty(funcol.all_reduce, 0, in_place=False)
    return name
