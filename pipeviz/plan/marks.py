"""Split markers on one call of a module that runs several times.

torch's ``split_spec`` names a module, and its marker fires on every call: a module applied twice would
cut the model twice. pipeviz's per-call split points (``"shared@1"``: the second call) wrap that module's
``forward`` on pipeviz's own copy so that torch's ``pipe_split()`` runs at that call only; torch's
``pipeline()`` then splits at the marker as it does for ``pipe_split()`` written in a forward.

Example:
    >>> mark_calls(model_copy, [("encoder.layer", 3, SplitPoint.END)])   # after the 4th call
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.pipelining import SplitPoint, pipe_split

__all__ = ["mark_calls"]


def mark_calls(model: nn.Module, marks: Sequence[tuple[str, int, SplitPoint]]) -> None:
    """Make ``pipe_split()`` run before (BEGINNING) or after (END) call ``k`` of each named module.

    Patches ``forward`` of ``model`` (a copy: never the user's model) and of the named modules; call
    counters restart at every call of ``model``.
    """
    if not marks:
        return
    counts: dict[str, int] = {}
    wanted: dict[str, set[tuple[int, SplitPoint]]] = {}
    for fqn, call, point in marks:
        wanted.setdefault(fqn, set()).add((call, point))
    for fqn, points in wanted.items():
        mod = model.get_submodule(fqn)
        mod.forward = _counted(mod.forward, fqn, points, counts)
    root = model.forward

    def restart(*args: object, **kwargs: object) -> object:
        counts.clear()
        return root(*args, **kwargs)

    model.forward = restart


def _counted(forward: Callable[..., object], fqn: str, points: set[tuple[int, SplitPoint]], counts: dict[str, int]
             ) -> Callable[..., object]:
    def wrapped(*args: object, **kwargs: object) -> object:
        call = counts.get(fqn, 0)
        counts[fqn] = call + 1
        if (call, SplitPoint.BEGINNING) in points:
            pipe_split()
        out = forward(*args, **kwargs)
        if (call, SplitPoint.END) in points:
            pipe_split()
        return out

    return wrapped
