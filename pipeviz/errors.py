"""The errors a front door raises before anything runs, at the bottom of the import graph so every module can
raise them. Each names the bad value, the valid choices and the fix."""

from __future__ import annotations

__all__ = ["LaunchError"]


class LaunchError(ValueError):
    """A launch that cannot work, found before any process starts.

    ``setting``: the ``LaunchConfig`` field at fault when one is (``"microbatches"``, ``"dp"``, ``"tp"``,
    ``"schedule"``, ``"steps"``, ``"order"``), so a view can show the refusal beside that control; ``None``
    otherwise. (A ``ScheduleError`` or ``PlanError`` raised by the same checks carries it too.)
    """

    setting: str | None = None

    def __init__(self, message: str, setting: str | None = None) -> None:
        super().__init__(message)
        if setting is not None:
            self.setting = setting
