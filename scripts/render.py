#!/usr/bin/env python
"""Execute every lesson and demo notebook and write a readable HTML rendering of each, outputs and figures included.

    .venv/bin/python scripts/render.py                      # all notebooks -> build/html/ (what `make render` runs)
    .venv/bin/python scripts/render.py tutorials/01_why_pipelines.ipynb --jobs 1 --out /tmp/html
    .venv/bin/python scripts/render.py --executed artifacts/notebooks   # pages of what the tests just ran (CI)

Each notebook runs with nbclient in a temporary folder of its own (anything it writes stays out of the
repository), with ``PLOTLY_RENDERER=notebook`` so that plotly figures are stored as HTML that carries plotly.js
itself: the pages open offline, without a kernel. Widget views (``pv.TimelineView``, ``pv.Explorer``) keep their
static fallback. Lessons are rendered as a reader meets them: exercise placeholders unanswered (the check cell says
"Not yet"). ``--executed DIR`` runs nothing: it renders the executed copies ``tests/test_notebooks.py`` keeps
(``artifacts/notebooks/``), which is how CI keeps the pages at no extra cost. ``index.html`` links every page with
its run time; the exit status is 1 if any notebook failed (its page is still written, with the error in the
failing cell) or, with ``--executed``, was not executed.
"""

from __future__ import annotations

import argparse
import html
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbclient
import nbformat
from nbclient.exceptions import CellExecutionError
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tutorials", "notebooks")
CELL_TIMEOUT = 300


def notebooks() -> list[str]:
    """Every generated notebook, lessons first, as paths relative to the repository."""
    return [f"{folder}/{p.name}" for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.ipynb"))]


def execute(name: str) -> tuple[nbformat.NotebookNode, float, str | None]:
    """Run a copy of ``name`` in a temporary folder; returns the executed notebook, its seconds and an error."""
    with tempfile.TemporaryDirectory(prefix="pipeviz_render_") as tmp:
        folder = Path(tmp)
        shutil.copy(ROOT / name, folder / Path(name).name)
        nb = nbformat.read(folder / Path(name).name, as_version=4)
        client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                         resources={"metadata": {"path": str(folder)}})
        start = time.perf_counter()
        error = None
        try:
            client.execute()
        except CellExecutionError as err:  # keep the page: the error is in its cell
            error = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        except Exception as err:  # a dead kernel or a timeout: still write what ran
            error = f"{type(err).__name__}: {err}"
        return nb, time.perf_counter() - start, error


def write_page(name: str, nb: nbformat.NotebookNode, out: Path) -> Path:
    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": Path(name).stem}})
    path = out / Path(name).with_suffix(".html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body, encoding="utf-8")
    return path


def write_index(results: list[tuple[str, float, str | None]], out: Path, seconds: bool = True) -> Path:
    rows = []
    for name, run, error in results:
        href = html.escape(Path(name).with_suffix(".html").as_posix())
        status = "ok" if error is None else f"failed: {html.escape(error)}"
        when = f"{run:.0f} s" if seconds else "by the tests"
        rows.append(f"<tr><td><a href='{href}'>{html.escape(name)}</a></td><td>{when}</td><td>{status}</td></tr>")
    page = ("<!doctype html><meta charset='utf-8'><title>pipeviz: lessons and notebooks</title>"
            "<h1>pipeviz: lessons and notebooks, executed</h1>"
            "<table><tr><th>notebook</th><th>run</th><th>status</th></tr>" + "".join(rows) + "</table>")
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def render_executed(names: list[str], folder: Path, out: Path) -> int:
    """Pages from notebooks executed elsewhere (``folder/<name>``); a missing or failed one is listed as such."""
    results: list[tuple[str, float, str | None]] = []
    for name in names:
        path = folder / name
        if not path.is_file():
            results.append((name, 0.0, f"not executed (no {path})"))
            continue
        nb = nbformat.read(path, as_version=4)
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
        write_page(name, nb, out)
        results.append((name, 0.0, f"{errors[0].get('ename')}: {errors[0].get('evalue')}" if errors else None))
    index = write_index(results, out, seconds=False)
    missing = [name for name, _, error in results if error]
    print(f"{len(results) - len(missing)}/{len(results)} pages from {folder}: {index}"
          + (f"; not rendered: {', '.join(missing)}" if missing else ""))
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to render (default: every lesson and demo)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "html", help="output folder (build/html)")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks executed at once (default 2)")
    parser.add_argument("--executed", type=Path, default=None,
                        help="render the executed notebooks in this folder (as the tests keep them), running nothing")
    args = parser.parse_args(argv)
    names = args.names or notebooks()
    unknown = [n for n in names if not (ROOT / n).is_file()]
    if unknown:
        parser.error(f"no such notebook: {', '.join(unknown)}; valid: {', '.join(notebooks())}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.executed is not None:
        return render_executed(names if args.names else notebooks(), args.executed, args.out)
    os.environ["PLOTLY_RENDERER"] = "notebook"  # kernels inherit it: figures as HTML that carries plotly.js
    start = time.perf_counter()

    def one(name: str) -> tuple[str, float, str | None]:
        nb, seconds, error = execute(name)
        path = write_page(name, nb, args.out)
        print(f"{'ok    ' if error is None else 'FAILED'} {seconds:6.1f} s  {path}"
              + (f"  ({error})" if error else ""), flush=True)
        return name, seconds, error

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(one, names))
    index = write_index(results, args.out)
    failed = [name for name, _, error in results if error]
    print(f"{len(results) - len(failed)}/{len(results)} rendered in {time.perf_counter() - start:.0f} s: {index}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
