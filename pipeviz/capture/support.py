"""The library releases pipeviz is tested with, and the note a user gets on a newer one.

torch is admitted only where CI has tested it (``pyproject.toml``: ``torch>=2.13,<2.16``): pipeviz touches torch
internals (``pipeviz.adapter``), whose contract tests must pass on a release before it is admitted. transformers is
not a dependency of pipeviz; models built with it are traced like any other module. Its minor releases come every two
weeks, so no hard cap below the next major: a model from a transformers release newer than the newest minor CI has
run (``TESTED["transformers"][1]``) is traced as usual, with a note in ``graph.notes`` (and the Explorer) saying so.
CI's newest grid cell (``scripts/grid.py``) installs the newest transformers release at the time it runs.

Example:
    >>> from pipeviz.capture.support import version_note
    >>> version_note("transformers", "5.26.0")
    'transformers 5.26.0 is newer than the newest release pipeviz is tested with (5.25): ...'
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TESTED", "model_notes", "version_note"]

# (oldest, newest) minor release tested by CI (make test, make compat, make grid); tests/test_versions.py checks that
# pyproject.toml and the grid's cells say the same.
TESTED: dict[str, tuple[str, str]] = {"torch": ("2.13", "2.15"), "transformers": ("4.57", "5.25")}


def _minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def version_note(library: str, version: str) -> str | None:
    """A short note when ``library`` ``version`` is newer than the newest minor release CI has tested, else None.

    Example:
        >>> version_note("transformers", "5.25.1") is None
        True
    """
    newest = TESTED[library][1]
    if _minor(version) <= _minor(newest):
        return None
    return (f"{library} {version} is newer than the newest release pipeviz is tested with ({newest}): it is traced "
            "as usual, and the run is still checked against the unsplit model (pv.check_numerics). If something "
            "fails, please report it with the model's config.")


def model_notes(model: nn.Module) -> list[str]:
    """Notes about the libraries ``model``'s modules come from (a transformers release newer than CI has seen)."""
    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return []
    transformers = sys.modules.get("transformers")
    version = getattr(transformers, "__version__", None)
    note = version_note("transformers", version) if isinstance(version, str) else None
    return [note] if note else []
