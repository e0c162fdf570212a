"""The errors a front door raises before anything runs, at the bottom of the import graph so every module can
raise them. Each names the bad value, the valid choices and the fix."""

from __future__ import annotations

__all__ = ["LaunchError"]


class LaunchError(ValueError):
    """A launch that cannot work, found before any process starts."""
