#!/usr/bin/env python3
"""pipeviz installed as a library, not as a checkout (``make wheel``, a step of ``.ci/run``).

1. Builds the sdist and, from it, the wheel (``python -m build``: so the sdist carries what the wheel is built from),
   checks their metadata as PyPI renders it (``twine check --strict``) and that every file the wheel ships comes
   from the sdist.
2. Installs the wheel, not editable, into a fresh venv under ``build/`` with the extra a notebook user picks
   (``pipeviz[notebook]``), beside the CPU torch the README's setup pins (``TORCH``, default ``torch==2.13.0``).
3. From a folder outside the clone (so the checkout cannot be imported by accident): imports every public name,
   runs ``pipeviz demo --model classic`` and executes lesson 01 headless (``jupyter nbconvert --execute``) with the
   installed package.

    python scripts/check_wheel.py [--keep]      # --keep: leave build/wheel-venv for a look

Writes only under ``build/`` in the clone (and pip's own cache). Exit status 0 when every step passed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "build" / "dist"
VENV = REPO / "build" / "wheel-venv"
LESSON = REPO / "tutorials" / "01_why_pipelines.ipynb"

IMPORTS = """
import os, sys
import pipeviz as pv
assert "site-packages" in pv.__file__, f"pipeviz imported from {pv.__file__}, not the installed wheel"
missing = [n for n in pv.__all__ if not hasattr(pv, n)]
assert not missing, f"public names missing: {missing}"
views = [getattr(pv, n) for n in pv._VIEWS]  # ipywidgets and plotly come with the notebook extra
import pipeviz.widgets, pipeviz.cli, pipeviz.zoo, pipeviz.runtime.worker, pipeviz.adapter
print(f"pipeviz {pv.__version__} from {os.path.dirname(pv.__file__)}: {len(pv.__all__)} public names, "
      f"{len(views)} views, python {sys.version.split()[0]}")
"""


def step(title: str, cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    t = time.time()
    shown = " ".join(c if "\n" not in c else "<script>" for c in cmd)
    print(f"check_wheel: {title}: $ {shown}", flush=True)
    res = subprocess.run(cmd, text=True, **kw)  # type: ignore[call-overload]
    if res.returncode:
        raise SystemExit(f"check_wheel: FAILED: {title} (exit {res.returncode})")
    print(f"check_wheel: {title}: ok in {time.time() - t:.0f} s", flush=True)
    return res


def built_files() -> tuple[Path, Path]:
    wheels, sdists = sorted(OUT.glob("pipeviz-*.whl")), sorted(OUT.glob("pipeviz-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise SystemExit(f"check_wheel: expected one wheel and one sdist in {OUT}, found {wheels + sdists}")
    return wheels[0], sdists[0]


def check_contents(wheel: Path, sdist: Path) -> None:
    """Every module and data file of the wheel is in the sdist; the sdist has what building needs."""
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.startswith("pipeviz/")}
    with tarfile.open(sdist) as t:
        root, *_ = t.getnames()[0].split("/")
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    missing = sorted(shipped - names)
    needed = {"pyproject.toml", "README.md", "LICENSE", "pipeviz/py.typed", "pipeviz/__init__.py"} - names
    if missing or needed:
        raise SystemExit(f"check_wheel: the sdist {root} lacks {missing + sorted(needed)}")
    sources = {str(p.relative_to(REPO)) for p in (REPO / "pipeviz").rglob("*.py")}
    if sources - shipped:
        raise SystemExit(f"check_wheel: the wheel lacks {sorted(sources - shipped)}")
    print(f"check_wheel: the wheel ships {len(shipped)} files, all from the sdist ({len(names)} files)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep build/wheel-venv afterwards")
    a = ap.parse_args()
    t0 = time.time()
    import tomllib

    floor = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"].removeprefix(">=")
    if sys.version_info[:2] != tuple(int(x) for x in floor.split(".")[:2]):
        raise SystemExit(f"check_wheel: run it with Python {floor}, pyproject's floor (this is "
                         f"{sys.version.split()[0]}): the wheel is checked on the oldest Python it admits")
    shutil.rmtree(OUT, ignore_errors=True)
    step("build the sdist, then the wheel from it", [sys.executable, "-m", "build", "--outdir", str(OUT), str(REPO)],
         stdout=subprocess.DEVNULL)
    wheel, sdist = built_files()
    step("metadata as PyPI shows it", [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)])
    check_contents(wheel, sdist)

    shutil.rmtree(VENV, ignore_errors=True)
    step("a fresh venv", [sys.executable, "-m", "venv", str(VENV)])
    py, bindir = str(VENV / "bin" / "python"), VENV / "bin"
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch = os.environ.get("TORCH", "torch==2.13.0")  # the Makefile's pin: no CUDA build on a CPU machine
    step("torch as the README's setup installs it", [*pip, torch])
    step("the wheel with the notebook extra", [*pip, "-c", "/dev/stdin", f"{wheel}[notebook]"],
         input=f"{torch}\n")  # held to the torch just installed
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ""}
    env.pop("PYTHONPATH")
    with tempfile.TemporaryDirectory(prefix="pipeviz-wheel-") as away:
        step("import every public name", [py, "-c", IMPORTS], cwd=away, env=env)
        step("pipeviz demo --model classic", [str(bindir / "pipeviz"), "demo", "--model", "classic",
                                               "--output", os.path.join(away, "report.html")], cwd=away, env=env,
             stdout=subprocess.DEVNULL)
        if not os.path.getsize(os.path.join(away, "report.html")):
            raise SystemExit("check_wheel: the demo wrote an empty report")
        lesson = Path(away) / LESSON.name
        shutil.copy(LESSON, lesson)
        step(f"lesson {LESSON.stem} headless", [str(bindir / "jupyter"), "nbconvert", "--to", "html", "--execute",
                                                "--ExecutePreprocessor.timeout=600", str(lesson)], cwd=away, env=env,
             stderr=subprocess.DEVNULL)
    if not a.keep:
        shutil.rmtree(VENV, ignore_errors=True)
    print(f"check_wheel: all passed in {time.time() - t0:.0f} s ({wheel.name}, {sdist.name})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
