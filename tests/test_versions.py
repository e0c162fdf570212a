"""The supported versions, pyproject's ranges and the CI version grid (scripts/grid.py, ``make grid``) say the
same thing: every release the grid tests is admitted, every torch minor release admitted is tested, and the
grid's transformers cells include the floor's minor release and the newest one admitted."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement  # pytest's own dependency
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pipeviz.capture.support import TESTED, version_note

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
    """The release a pin names, or a range's floor: "torch==2.13.0+cpu" -> 2.13.0, "transformers>=5.25,<6" -> 5.25."""
    spec = SpecifierSet(pin[len(Requirement(pin).name):])
    exact = [s for s in spec if s.operator == "=="]
    return Version(Version((exact or [s for s in spec if s.operator == ">="])[0].version).public)


def _minor(v: Version | str) -> tuple[int, int]:
    v = Version(str(v))
    return v.major, v.minor


def test_pyproject_admits_every_release_the_grid_tests() -> None:
    reqs = _requirements()
    for cell in _grid().CELLS:
        for pin in (cell.torch, cell.transformers):
            name = Requirement(pin).name
            assert reqs[name].specifier.contains(_pinned(pin)), f"pyproject's {reqs[name]} excludes {cell.name}'s {pin}"


def test_every_torch_minor_release_pyproject_admits_has_a_grid_cell() -> None:
    spec = _requirements()["torch"].specifier
    admitted = {(2, m) for m in range(0, 40) if spec.contains(Version(f"2.{m}.0"))}
    tested = {_minor(_pinned(c.torch)) for c in _grid().CELLS}
    assert admitted and admitted <= tested, f"torch {sorted(admitted - tested)} admitted by pyproject but untested"
    assert (min(admitted), max(admitted)) == tuple(_minor(v) for v in TESTED["torch"]), (admitted, TESTED)


def test_transformers_is_capped_at_the_next_major_at_most_and_the_grid_runs_the_floor_and_the_newest() -> None:
    spec = _requirements()["transformers"].specifier
    floors = [Version(s.version) for s in spec if s.operator == ">="]
    caps = [Version(s.version) for s in spec if s.operator in ("<", "<=")]
    assert floors, "pyproject's transformers needs a floor (>=)"
    # A minor release every two weeks: a cap below the next major would refuse the newest release within weeks.
    assert all(c.minor == 0 and c.micro == 0 and spec.contains(f"{c.major - 1}.999") for c in caps), str(spec)
    cells = _grid().CELLS
    tested = sorted(_pinned(c.transformers) for c in cells)
    assert _minor(tested[0]) == _minor(floors[0]) == _minor(TESTED["transformers"][0]), (tested, str(spec))
    # The newest cell is a range from the newest minor release pipeviz was tested with up to pyproject's cap, resolved
    # to the newest release when the grid runs (scripts/grid.py: resolve).
    newest = [c for c in cells if "==" not in c.transformers]
    assert len(newest) == 1, [c.transformers for c in cells]
    rng = Requirement(newest[0].transformers).specifier
    assert _minor(_pinned(newest[0].transformers)) == _minor(TESTED["transformers"][1]), newest[0]
    assert {s.version for s in rng if s.operator == "<"} == {str(c) for c in caps}, (str(rng), str(spec))


def test_a_newer_transformers_than_tested_gets_a_note_not_a_refusal() -> None:
    newest = Version(TESTED["transformers"][1])
    assert version_note("transformers", f"{newest.major}.{newest.minor}.3") is None
    assert version_note("transformers", f"{newest.major}.{newest.minor - 1}.0") is None
    note = version_note("transformers", f"{newest.major}.{newest.minor + 1}.0")
    assert note is not None and f"({newest.major}.{newest.minor})" in note and "check_numerics" in note


def test_python_floor_ruff_and_mypy_agree() -> None:
    """requires-python is the floor CI checks: ruff and mypy read the code as that Python would (mypy flags a
    standard-library name the floor lacks, such as typing.Unpack before 3.11)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = Version(SpecifierSet(meta["project"]["requires-python"]).__iter__().__next__().version)
    assert meta["tool"]["ruff"]["target-version"] == f"py{floor.major}{floor.minor}"
    assert meta["tool"]["mypy"]["python_version"] == f"{floor.major}.{floor.minor}"
    assert sys.version_info[:2] >= (floor.major, floor.minor)


def test_the_grids_compat_rows_exist() -> None:
    from tests.compat import ROWS

    grid, names = _grid(), {r.name for r in ROWS}
    assert set(grid.TRAIN_ROWS) | set(grid.META_ROWS) <= names, "scripts/grid.py selects rows tests/compat.py lacks"
