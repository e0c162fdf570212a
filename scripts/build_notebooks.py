#!/usr/bin/env python
"""Write the demo notebooks (``notebooks/``) and the lessons (``tutorials/``) from their jupytext sources.

Every notebook is written as a jupytext percent-format script next to it (``notebooks/01_quickstart.py`` for
``notebooks/01_quickstart.ipynb``): markdown cells are ``# %% [markdown]`` blocks of ``# `` comments, code cells
start at ``# %%``. Edit the ``.py`` (ruff lints it like any other Python file), never the ``.ipynb``, then run

    .venv/bin/python scripts/build_notebooks.py            # writes every notebook, without outputs
    .venv/bin/python scripts/build_notebooks.py --check    # exit 1 if a committed notebook is out of date

The notebook metadata is fixed here (python3 kernel; paired with its ``.py`` for jupytext) and cell ids are
deterministic, so a rebuild without changes leaves the files byte-identical whatever the jupytext version.
``SOLUTIONS`` holds a right and a wrong answer for every tutorial's exercise; ``tests/test_notebooks.py``
runs each lesson with both appended and checks that its ``check()`` cell tells them apart.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("notebooks", "tutorials")

# Every notebook, as its path relative to the repository: one per percent-format source in FOLDERS.
NOTEBOOKS: list[str] = sorted(f"{folder}/{src.stem}.ipynb" for folder in FOLDERS
                              for src in (ROOT / folder).glob("*.py"))

# For each tutorial: (a right answer, a wrong answer), as code that sets ``my_answer`` in the executed notebook.
SOLUTIONS: dict[str, tuple[str, str]] = {
    "tutorials/01_why_pipelines.ipynb": ("my_answer = 0.75", "my_answer = 0.25"),
    "tutorials/02_microbatches_and_the_bubble.ipynb": ("my_answer = 35", "my_answer = 34"),
    "tutorials/03_1f1b_and_memory.ipynb": ("my_answer = 3", "my_answer = 8"),
    "tutorials/04_interleaving_and_zero_bubble.ipynb": ("my_answer = 2.25", "my_answer = 4.5"),
    "tutorials/07_balancing_stages.ipynb": (
        "my_answer = [name for name, _ in pv.balance(graph, num_stages=3, by='time').splits]",
        "my_answer = ['layer3', 'layer4']",
    ),
    "tutorials/10_going_multi_host.ipynb": (
        "my_answer = [0, 1, 2, 3, 3, 2, 1, 0]", "my_answer = [0, 1, 2, 3, 0, 1, 2, 3]",
    ),
    "tutorials/05_zero_bubble_and_its_memory.ipynb": (
        "my_answer = min((r for r in pv.compare(plan4, microbatches=8).rows if max(r.memory_bytes) <= LIMIT),\n"
        "                key=lambda r: r.step_time).schedule",
        "my_answer = min(pv.compare(plan4, microbatches=8).rows, key=lambda r: r.step_time).schedule",
    ),
    "tutorials/08_choosing_microbatches.ipynb": (
        "my_answer = min((4, 8, 16, 32, 64), key=lambda m: pv.simulate(None, '1F1B', m, num_stages=4,\n"
        "    costs=pv.Costs.uniform(4, forward=stage_forward(4096 // m),\n"
        "                           backward=2 * stage_forward(4096 // m))).step_time)",
        "my_answer = 32",
    ),
    "tutorials/09_inference_pipelining.ipynb": ("my_answer = 3 / 11", "my_answer = 3 / 8"),
    "tutorials/06_custom_schedules.ipynb": (
        "my_answer = [['0F0', '0F1', '0F2', '0I0', '0W0', '0F3', '0I1', '0W1', '0I2', '0W2', '0I3', '0W3'],\n"
        "             ['1F0', '1F1', '1I0', '1F2', '1I1', '1W0', '1F3', '1I2', '1W1', '1I3', '1W2', '1W3'],\n"
        "             ['2F0', '2I0', '2F1', '2I1', '2F2', '2I2', '2W0', '2F3', '2I3', '2W1', '2W2', '2W3']]",
        "my_answer = [['0F0', '0F1', '0F2', '0I0', '0F3', '0W0', '0I1', '0W1', '0I2', '0W2', '0I3', '0W3'],\n"
        "             ['1F0', '1F1', '1I0', '1F2', '1I1', '1F3', '1W0', '1I2', '1W1', '1I3', '1W2', '1W3'],\n"
        "             ['2F0', '2I0', '2F1', '2I1', '2F2', '2I2', '2F3', '2W0', '2I3', '2W1', '2W2', '2W3']]",
    ),
    "tutorials/11_composing_pp_dp_tp.ipynb": ("my_answer = 3 / 19", "my_answer = 3 / 67"),
    "tutorials/12_long_sequences.ipynb": ("my_answer = [512, 1023, 3072, 3583]", "my_answer = [1024, 2047, 0, 0]"),
    "tutorials/13_moe_in_a_pipeline.ipynb": (
        "loads = [ld for ld in run.expert_tokens if (ld.step, ld.block, ld.mb) == (0, 'blocks.0.experts', 0)]\n"
        "my_answer = max(sum(sum(ld.counts[2 * s:2 * s + 2]) for ld in loads) for s in range(2))",
        "my_answer = 32",
    ),
}

METADATA = {
    "jupytext": {"formats": "ipynb,py:percent"},
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def source(name: str) -> Path:
    """The percent-format script a notebook is generated from."""
    return ROOT / Path(name).with_suffix(".py")


def build(name: str) -> nbformat.NotebookNode:
    """One notebook from its source: no outputs, fixed metadata, deterministic cell ids."""
    text = jupytext.read(source(name), fmt="py:percent")
    stem = Path(name).stem.replace(".", "-")
    nb = nbformat.v4.new_notebook(metadata=copy.deepcopy(METADATA))
    for i, cell in enumerate(text.cells):
        new = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell,
               "raw": nbformat.v4.new_raw_cell}[cell.cell_type]
        nb.cells.append(new(cell.source, id=f"{stem[:50]}-{i:02d}", metadata=dict(cell.metadata)))
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report notebooks that differ from their sources")
    parser.add_argument("--root", type=Path, default=ROOT, help="write under this folder (default: the repository)")
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = args.root / name
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print("wrote", path)
    orphans = sorted({p.relative_to(args.root).as_posix() for folder in FOLDERS
                      for p in (args.root / folder).glob("*.ipynb")} - set(NOTEBOOKS))
    if orphans:
        print("notebooks without a .py source (write one, or delete the notebook):", *orphans, sep="\n  ")
    if stale:
        print("out of date (run scripts/build_notebooks.py):", *stale, sep="\n  ")
    return 1 if stale or orphans else 0


if __name__ == "__main__":
    sys.exit(main())
