"""scripts/check_fences.py (part of `make lint`): the repository's Markdown and notebook markdown close every code
fence, and a fence left open is refused with its file and line, in a Markdown file and in a jupytext markdown cell.

The script runs as `make lint` runs it: a separate process, on the repository or on the paths given.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_fences.py"


def check(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_the_repository_closes_every_fence() -> None:
    result = check()
    assert result.returncode == 0, result.stderr
    assert "every code fence closed" in result.stdout
    count = int(result.stdout.split()[1])
    # The README, docs/*.md and the 17 notebook sources at least: the default really reads the repository.
    assert count >= len(list(ROOT.glob("docs/*.md"))) + len(list(ROOT.glob("tutorials/*.py"))) + 1


def test_an_unclosed_fence_in_markdown_is_refused_with_file_and_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n```bash\nmake demo\n```\n\n## Quickstart\n\n```python\nimport pipeviz\n\n## More\n")
    result = check(page)
    assert result.returncode == 1
    assert f"{page}:9: unclosed code fence '```'" in result.stderr
    assert ":3:" not in result.stderr  # the closed bash block is fine
    assert "1 unclosed code fence(s)" in result.stderr


@pytest.mark.parametrize(("text", "line"), [
    ("- a step\n\n  ```python\n  x = 1\n\nAfter the list.\n", 3),  # closed by the list's end, not by a fence
    ("````md\n```python\nx\n```\n", 1),                             # a longer fence needs as long a closer
    ("~~~\nx\n```\n", 1),                                           # tildes close tildes only
    ("Text.\n\n> ```\n> x\n\nAfter the quote.\n", 3),               # inside a block quote
    ("pv.Explorer(model)\n```\n\nThe rest of the page.\n", 2),      # a stray half-block (docs/memory.md once)
])
def test_commonmark_cases_name_the_opening_line(tmp_path: Path, text: str, line: int) -> None:
    page = tmp_path / "case.md"
    page.write_text(text)
    result = check(page)
    assert result.returncode == 1, result.stdout
    assert f"{page}:{line}: unclosed" in result.stderr


def test_fences_closed_as_commonmark_allows_pass(tmp_path: Path) -> None:
    page = tmp_path / "ok.md"
    page.write_text("- step\n\n  ```python\n  x = 1\n  ```\n\n````md\n```py\nx\n```\n`````\n\n~~~\na\n~~~\n\n"
                    "    ```\n    an indented code block, not a fence\n")
    result = check(page)
    assert result.returncode == 0, result.stderr


def test_an_unclosed_fence_in_a_jupytext_markdown_cell_is_refused_with_file_and_line(tmp_path: Path) -> None:
    source = tmp_path / "lesson.py"
    source.write_text(
        "# %% [markdown]\n"             # 1
        "# # Lesson\n"                   # 2
        "#\n"                            # 3
        "# ```python\n"                  # 4: closed
        "# x = 1\n"                      # 5
        "# ```\n"                        # 6
        "\n"                             # 7
        "# %%\n"                         # 8
        "x = 1  # ```\n"                 # 9: code cell: not Markdown
        "\n"                             # 10
        "# %% [markdown]\n"              # 11
        "# Run it:\n"                    # 12
        "#\n"                            # 13
        "# ~~~bash\n"                    # 14: never closed in its cell
        "# make demo\n"                  # 15
        "\n"                             # 16
        "# %% [markdown]\n"              # 17
        "# ~~~\n"                        # 18: cells are separate documents: this does not close line 14
        "# text\n"                       # 19
        "# ~~~\n")                       # 20
    result = check(source)
    assert result.returncode == 1
    assert f"{source}:14: unclosed code fence '~~~'" in result.stderr
    assert "rest of the cell" in result.stderr
    assert "1 unclosed code fence(s)" in result.stderr


def test_a_missing_path_is_an_error_not_a_pass(tmp_path: Path) -> None:
    result = check(tmp_path / "nope.md")
    assert result.returncode == 2
    assert "no such file" in result.stderr
