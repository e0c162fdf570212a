"""Calls in the forms earlier releases took, still working, with a ``DeprecationWarning`` that names the new form.

Example:
    >>> @positional_legacy("stages_per_rank", "costs")
    ... def simulate(plan=None, config=None, microbatches=None, *, stages_per_rank=None, costs=None): ...
    >>> simulate(plan, "1F1B", 4, 2)     # works; warns: pass stages_per_rank= by keyword
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

__all__ = ["deprecated", "positional_legacy"]

P = ParamSpec("P")
R = TypeVar("R")


def deprecated(message: str, stacklevel: int = 3) -> None:
    """Warn that a form is retired (``DeprecationWarning``), pointing at the caller's caller."""
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def positional_legacy(*names: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Let the keyword-only parameters ``names`` of the decorated function still be passed by position, after its
    positional ones and in this order (how pipeviz 0.2 took them), with a ``DeprecationWarning``. The signature
    shown (``help``, ``inspect``) is the function's own."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        sig = inspect.signature(fn).parameters
        npos = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in sig.values())
        missing = [n for n in names if n not in sig]
        if missing and not any(p.kind == p.VAR_KEYWORD for p in sig.values()):
            raise TypeError(f"{fn.__qualname__} has no parameter {missing[0]!r}")

        call = cast("Callable[..., R]", fn)  # called with the arguments moved to keywords

        @functools.wraps(fn)
        def inner(*args: object, **kwargs: object) -> R:
            if len(args) > npos:
                extra = args[npos:]
                if len(extra) > len(names):
                    raise TypeError(f"{fn.__name__}() takes at most {npos + len(names)} positional arguments "
                                    f"({len(args)} given)")
                given = names[:len(extra)]
                twice = [n for n in given if n in kwargs]
                if twice:
                    raise TypeError(f"{fn.__name__}() got multiple values for argument {twice[0]!r}")
                deprecated(f"{fn.__name__}(): pass {', '.join(f'{n}=' for n in given)} by keyword; by position they "
                           "are deprecated since pipeviz 0.3 and will be refused.")
                kwargs.update(zip(given, extra, strict=True))
                args = args[:npos]
            return call(*args, **kwargs)

        return cast("Callable[P, R]", inner)

    return wrap
