"""``PlanError``: an invalid split plan, raised by every part of ``pipeviz.plan`` (building a plan, checking a
batch split, building its Pipe).

Example:
    >>> try:
    ...     graph.split(["output_proj"])
    ... except PlanError as err:
    ...     print(err)          # names the bad split, the valid ones and the fix
"""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """An invalid split plan; the message names the bad value, the valid choices and the fix."""
