"""The supported versions, pyproject's ranges and the CI version grid (scripts/grid.py, ``make grid``) say the
same thing: every release the grid tests is admitted, every torch minor release admitted is tested, and the
grid's transformers cells include the floor's minor release and the newest one admitted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement  # pytest's own dependency
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def _grid() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pipeviz_grid", ROOT / "scripts" / "grid.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    return {r.name: r for r in reqs}


def _pinned(pin: str) -> Version:
    return Version(Version(pin.split("==", 1)[1]).public)  # "torch==2.13.0+cpu" -> 2.13.0


def test_pyproject_admits_every_release_the_grid_tests() -> None:
    reqs = _requirements()
    for cell in _grid().CELLS:
        for pin in (cell.torch, cell.transformers):
            name = pin.split("==", 1)[0]
            assert reqs[name].specifier.contains(_pinned(pin)), f"pyproject's {reqs[name]} excludes {cell.name}'s {pin}"


def test_every_torch_minor_release_pyproject_admits_has_a_grid_cell() -> None:
    spec = _requirements()["torch"].specifier
    admitted = {(2, m) for m in range(0, 40) if spec.contains(Version(f"2.{m}.0"))}
    tested = {(v.major, v.minor) for v in (_pinned(c.torch) for c in _grid().CELLS)}
    assert admitted and admitted <= tested, f"torch {sorted(admitted - tested)} admitted by pyproject but untested"


def test_the_grid_tests_the_transformers_floor_and_newest() -> None:
    spec = _requirements()["transformers"].specifier
    floors = [Version(s.version) for s in spec if s.operator == ">="]
    caps = [Version(s.version) for s in spec if s.operator == "<" and Version(s.version).minor > 0]
    tested = sorted(_pinned(c.transformers) for c in _grid().CELLS)
    assert floors, "pyproject's transformers needs a floor (>=)"
    assert (tested[0].major, tested[0].minor) == (floors[0].major, floors[0].minor), (tested, str(spec))
    if caps:  # "<5.25": the newest admitted minor release, 5.24, is tested
        assert (tested[-1].major, tested[-1].minor) == (caps[0].major, caps[0].minor - 1), (tested, str(spec))


def test_the_grids_compat_rows_exist() -> None:
    from tests.compat import ROWS

    grid, names = _grid(), {r.name for r in ROWS}
    assert set(grid.TRAIN_ROWS) | set(grid.META_ROWS) <= names, "scripts/grid.py selects rows tests/compat.py lacks"
