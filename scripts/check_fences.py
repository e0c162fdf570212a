#!/usr/bin/env python
"""Fail on a code fence that nothing closes, in the repository's Markdown and its notebooks' markdown cells.

An unclosed ```` ``` ```` (or ``~~~``) turns everything after it into one code block: on the repository page, on
the docs site and in JupyterLab alike, and ``mkdocs build --strict`` does not notice. This script parses each
document with markdown-it-py's CommonMark parser (so longer fences, tilde fences, fences indented inside list items
and block quotes, and fence-looking lines inside another fence count exactly as CommonMark says) and names the
file and line of every fence that no closing fence ends: one the end of its document, list item or block quote
closes instead.

    .venv/bin/python scripts/check_fences.py                 # every *.md and notebook source of the repository
    .venv/bin/python scripts/check_fences.py README.md a.py  # just these files

What is read: every Markdown file git knows (tracked, or new and not ignored), and the markdown cells of every
jupytext percent-format source in ``notebooks/`` and ``tutorials/`` (``# %% [markdown]`` blocks of ``# `` comments;
each cell is its own document, as a notebook renders it). An explicit ``.py`` path is read the same way, any other
path as Markdown. Exit 0 when every fence closes, 1 with one ``path:line: ...`` message per unclosed fence, 2 on a
path that does not exist.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from markdown_it import MarkdownIt
from markdown_it.rules_block import StateBlock

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_FOLDERS = ("notebooks", "tutorials")
# jupytext's percent format: a cell starts at "# %%"; a markdown cell's header says [markdown] (or [md]).
CELL_START = re.compile(r"^# %%")
MARKDOWN_CELL = re.compile(r"^# %%.*\[(markdown|md)\]")


def _parser() -> MarkdownIt:
    """CommonMark (plus GitHub's tables), with the fence rule wrapped to record whether a closing fence was found.

    markdown-it's fence rule ends an unclosed fence at the end of its container without saying so; the wrapper
    re-reads the last line the fence took, with the rule's own test, and keeps the answer in ``token.meta``.
    """
    md = MarkdownIt("commonmark").enable("table")
    rule = md.block.ruler.__rules__[md.block.ruler.__find__("fence")]
    fence, alt = rule.fn, list(rule.alt)  # alt: a fence may interrupt a paragraph, a list, a block quote

    def fence_with_closing(state: StateBlock, start: int, end: int, silent: bool) -> bool:
        if not fence(state, start, end, silent):
            return False
        if silent:
            return True
        token = state.tokens[-1]
        last = state.line - 1
        closed = False
        if last > start:
            line = state.src[state.bMarks[last] + state.tShift[last]:state.eMarks[last]]
            marker = token.markup[0]
            run = len(line) - len(line.lstrip(marker))
            closed = (not state.is_code_block(last) and run >= len(token.markup)
                      and not line[run:].strip(" \t"))
        token.meta["closed"] = closed
        return True

    md.block.ruler.at("fence", fence_with_closing, {"alt": alt})
    return md


_MD = _parser()


def unclosed_fences(text: str) -> Iterator[tuple[int, str]]:
    """The 0-based line and the markup (```` ``` ````, ``~~~~``, …) of each fence in ``text`` that nothing closes.

    Example:
        >>> list(unclosed_fences("a\\n\\n```python\\nx = 1\\n"))
        [(2, '```')]
    """
    for token in _MD.parse(text):
        if token.type == "fence" and token.map is not None and not token.meta.get("closed", True):
            yield token.map[0], token.markup


def markdown_cells(source: str) -> Iterator[tuple[int, str]]:
    """Each markdown cell of a jupytext percent-format script: (0-based file line of its first line, its text).

    ``# text`` becomes ``text`` and a lone ``#`` an empty line, as jupytext reads them; a cell runs to the next
    ``# %%``.
    """
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        if not MARKDOWN_CELL.match(lines[i]):
            i += 1
            continue
        first = i + 1
        i = first
        while i < len(lines) and not CELL_START.match(lines[i]):
            i += 1
        body = [line[2:] if line.startswith("# ") else "" if line == "#" else line for line in lines[first:i]]
        yield first, "\n".join(body) + "\n"


def check_file(path: Path) -> list[str]:
    """One ``path:line: message`` per unclosed fence in ``path`` (Markdown, or a notebook source if ``.py``)."""
    text = path.read_text(encoding="utf-8")
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    documents = markdown_cells(text) if path.suffix == ".py" else iter([(0, text)])
    where = "the rest of the cell" if path.suffix == ".py" else "the rest of the file"
    return [f"{shown}:{offset + line + 1}: unclosed code fence {markup!r}: {where} renders as code; close it "
            f"with a line of at least {len(markup)} {markup[0]!r} (as indented as the fence, inside a list item)"
            for offset, doc in documents for line, markup in unclosed_fences(doc)]


def repository_files(root: Path = ROOT) -> list[Path]:
    """Every Markdown file git knows in ``root`` (tracked, or untracked and not ignored), and every notebook source."""
    names = subprocess.check_output(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.md",
                 *(f"{folder}/*.py" for folder in NOTEBOOK_FOLDERS)], cwd=root, text=True).splitlines()
    return [root / name for name in sorted(set(names)) if (root / name).is_file()]


def main(argv: list[str]) -> int:
    paths = [Path(arg).resolve() for arg in argv] or repository_files()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"check_fences: no such file: {', '.join(missing)}; pass Markdown files or jupytext .py sources, "
              "or nothing for the whole repository", file=sys.stderr)
        return 2
    problems = [message for path in paths for message in check_file(path)]
    for message in problems:
        print(message, file=sys.stderr)
    if problems:
        print(f"check_fences: {len(problems)} unclosed code fence(s)", file=sys.stderr)
        return 1
    print(f"check_fences: {len(paths)} files, every code fence closed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
