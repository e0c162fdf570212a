"""Constants measured on a machine, with their measurement: read from ``calibration.json`` beside this module, which
``benchmarks/calibration/cpu_constants.py --write`` rewrites from a new measurement. No figure measured on a
development machine lives in the code as prose: each has an entry saying what it is, what measured it, and when.

Example:
    >>> from pipeviz.cost.calibration import constant, entry
    >>> constant("cpu_contention"), entry("cpu_contention")["measured_by"]
    (1.1, 'benchmarks/calibration/cpu_constants.py --only contention')
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TypedDict

__all__ = ["PATH", "Entry", "constant", "entries", "entry"]


class Entry(TypedDict):
    """One calibrated constant as ``calibration.json`` holds it."""

    value: float
    unit: str
    what: str
    measured_by: str
    measured: str

PATH = Path(__file__).with_name("calibration.json")


@functools.lru_cache(maxsize=1)
def entries() -> dict[str, Entry]:
    """Every calibrated constant: name -> ``{"value", "unit", "what", "measured_by", "measured"}``."""
    return dict(json.loads(PATH.read_text()))


def entry(name: str) -> Entry:
    """One constant's entry.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    table = entries()
    if name not in table:
        raise KeyError(f"No calibrated constant {name!r}; known: {', '.join(sorted(table))}.")
    return table[name]


def constant(name: str) -> float:
    """The value of calibrated constant ``name``."""
    return float(entry(name)["value"])
