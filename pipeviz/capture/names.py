"""Names in messages: a long list shortened, and the near misses of a mistyped name (``difflib``), the way every
error that names a bad value says what would have been valid."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

__all__ = ["listed", "suggest"]


def listed(names: Sequence[str], limit: int = 20) -> str:
    """``"a, b, c"``; past ``limit`` names, the first ones and how many in all."""
    return ", ".join(names[:limit]) + (f", … ({len(names)} in all)" if len(names) > limit else "")


def suggest(name: str, pool: list[str]) -> str:
    """``"Did you mean 'layer1'?"`` for the close matches of ``name`` in ``pool``, else ``""``."""
    close = difflib.get_close_matches(name, pool, n=3, cutoff=0.8)
    return f"Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
