"""MkDocs hooks for the documentation site (``mkdocs.yml``: ``hooks:``): the notebooks and the API reference.

Nothing here names a lesson: the lessons (``tutorials/*.ipynb``) and demos (``notebooks/*.ipynb``) are found by glob
on every build, so renumbering or adding one needs no change here or in ``mkdocs.yml``.

- **Notebooks.** Each is staged into ``build/docs-notebooks/<folder>/<name>.ipynb`` and added to the site as
  ``<folder>/<name>.ipynb`` (mkdocs-jupyter renders it; ``execute: false``, so nothing runs here). The staged copy is
  the executed one the notebook tests keep in ``artifacts/notebooks/`` (``tests/test_notebooks.py``: outputs and
  plotly figures included, run with ``PLOTLY_RENDERER=notebook``) when there is one, else the committed notebook,
  which has no outputs, with a note saying so at its top. ``PIPEVIZ_DOCS_EXECUTED=require`` (what ``.ci/run``
  sets) makes a missing executed copy, or one with an error in a cell, fail the build instead.
  ``PIPEVIZ_DOCS_EXECUTED=DIR`` reads the executed copies from another folder. Each is listed in the nav under
  "Lessons" or "Demos" by its first heading, and on the page holding ``<!-- pipeviz:notebooks -->``.
- **API reference.** ``<!-- pipeviz:api -->`` on a page becomes one mkdocstrings block per name in
  ``pipeviz.__all__`` (read with ``ast``, nothing imported), grouped by the module it comes from, then the views
  ``pv.Explorer`` and friends, which the package loads lazily (``_VIEWS``, ``pipeviz/widgets/__init__.py``).
- **plotly.js once**: each executed notebook carries plotly.js (4.6 MB) inline; each page loads one shared copy
  (``assets/javascripts/plotly-<version>.min.js``) instead, which keeps the site a quarter of the size.
- **Links between notebooks** (``../notebooks/01_quickstart.ipynb#glossary``, as they read in JupyterLab) point at the
  notebooks' pages; one to a notebook that does not exist is a warning, which fails the strict build.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import posixpath
import re
import shutil
from pathlib import Path
from typing import Any, ClassVar

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.utils import get_relative_url

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"tutorials": "Lessons", "notebooks": "Demos"}  # repository folder -> nav section
STAGE = ROOT / "build" / "docs-notebooks"
log = logging.getLogger("mkdocs.plugins.pipeviz")

# Names in pipeviz.__all__ that are another library's: shown as a line, not rendered from their source.
FOREIGN = {"SplitPoint": "torch's `torch.distributed.pipelining.SplitPoint`, re-exported (`BEGINNING`, `END`)."}
# The API reference's sections, by the module a name is imported from (first match wins); a new module's names land
# under "More" until it is given a section here.
SECTIONS = [
    ("Tracing and plans", ("pipeviz.graph.model", "pipeviz.capture.export", "pipeviz.plan",
    "pipeviz.graph.manual")),
    ("Running", ("pipeviz.runtime", "pipeviz.schedule.training", "pipeviz.runtime.numerics",
                 "pipeviz.capture.weights", "pipeviz.runtime.live", "pipeviz.runtime.export")),
    ("Simulating, balancing and planning", ("pipeviz.sim.simulate", "pipeviz.planner.balance",
                                            "pipeviz.planner.search", "pipeviz.schedule.timeline",
                                            "pipeviz.sim.why", "pipeviz.sim.trace_import")),
    ("Costs and hardware", ("pipeviz.cost", "pipeviz.hardware", "pipeviz.profile")),
    ("Layouts and schedules", ("pipeviz.schedule.mesh", "pipeviz.schedule.traits")),
]


def notebooks() -> list[tuple[str, Path]]:
    """Every lesson and demo as (site path, committed notebook), lessons first, each folder sorted by name."""
    return [(f"{folder}/{p.name}", p) for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.ipynb"))]


def _title(nb: dict[str, Any], fallback: str) -> str:
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell.get("source", "")).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def _note(text: str) -> dict[str, Any]:
    return {"cell_type": "markdown", "metadata": {}, "source": text, "id": "pipeviz-docs-note"}


class _State:
    titles: ClassVar[dict[str, str]] = {}  # site path -> title, filled by on_config
    missing: ClassVar[list[str]] = []
    scripts: ClassVar[dict[str, str]] = {}  # site path -> plotly.js, one per version met


def _executed_dir() -> tuple[Path, bool]:
    setting = os.environ.get("PIPEVIZ_DOCS_EXECUTED", "")
    if setting in ("", "require"):
        return ROOT / "artifacts" / "notebooks", setting == "require"
    return Path(setting).resolve(), False


def _stage() -> None:
    """Copy each notebook to STAGE: the executed copy where there is one, else the committed one with a note."""
    folder, required = _executed_dir()
    if STAGE.exists():
        shutil.rmtree(STAGE)
    problems, missing = [], []
    for site, source in notebooks():
        executed = folder / site
        if executed.is_file():
            nb = json.loads(executed.read_text(encoding="utf-8"))
            errors = [o for c in nb.get("cells", []) for o in c.get("outputs", [])
                      if o.get("output_type") == "error"]
            if errors:
                problems.append(f"{executed}: {errors[0].get('ename')}: {errors[0].get('evalue')}")
        else:
            missing.append(site)
            nb = json.loads(source.read_text(encoding="utf-8"))
            where = 1 if nb.get("cells") and nb["cells"][0].get("cell_type") == "markdown" else 0
            nb["cells"].insert(where, _note(
                "> **Shown without outputs.** This build found no executed copy of this notebook\n"
                "> (`artifacts/notebooks/`, which the notebook tests write), so it shows the code alone. CI's\n"
                "> documentation shows every notebook with its outputs; locally, `make test` and `make compat` then\n"
                "> `make docs` do, or run it yourself (`pipeviz lab`)."))
        _State.titles[site] = _title(nb, Path(site).stem)
        target = STAGE / site
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")
    if required and (missing or problems):
        raise PluginError("PIPEVIZ_DOCS_EXECUTED=require: "
                          + "; ".join([f"no executed copy of {m} in {folder}" for m in missing] + problems))
    for problem in problems:
        log.warning("a cell failed in %s", problem)  # a warning fails a strict build
    if missing:
        log.info("pipeviz: %d of %d notebooks shown without outputs (no executed copy in %s)",
                 len(missing), len(notebooks()), folder)
    _State.missing = missing


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Stage the notebooks and list them in the nav under their folder's section."""
    _State.scripts = {}
    _stage()
    nav = config.nav or []
    for folder, section in FOLDERS.items():
        entries = [{_State.titles[site]: site} for site, _ in notebooks() if site.startswith(folder + "/")]
        for item in nav:
            if isinstance(item, dict) and section in item:
                item[section] = [*(item[section] or []), *entries]
                break
        else:
            nav.append({section: entries})
    config.nav = nav
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into its pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    for site, _ in notebooks():
        # A file of its own folder (not File.generated): mkdocs-jupyter's wrapper finds it by src_dir.
        files.append(File(site, src_dir=str(STAGE), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files


def _api_markdown() -> str:
    tree = ast.parse((ROOT / "pipeviz" / "__init__.py").read_text(encoding="utf-8"))
    origin: dict[str, str] = {}
    names: list[str] = []
    views: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                origin[alias.asname or alias.name] = node.module
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "__all__":
                names = list(ast.literal_eval(node.value))
            elif node.targets[0].id == "_VIEWS":
                views = list(ast.literal_eval(node.value))
    widgets = ast.parse((ROOT / "pipeviz" / "widgets" / "__init__.py").read_text(encoding="utf-8"))
    lazy: dict[str, str] = next(ast.literal_eval(n.value) for n in widgets.body if isinstance(n, ast.Assign)
                                and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "_LAZY")
    groups: dict[str, list[str]] = {title: [] for title, _ in SECTIONS}
    groups["More"] = []
    for name in names:
        module = origin.get(name, "")
        title = next((t for t, prefixes in SECTIONS
                      if any(module == m or module.startswith(m + ".") for m in prefixes)), "More")
        groups[title].append(name)
    out = []
    for title, members in groups.items():
        if not members:
            continue
        out.append(f"## {title}\n")
        for name in members:
            if name in FOREIGN:
                out.append(f"### `pipeviz.{name}`\n\n{FOREIGN[name]}\n")
            else:
                out.append(f"::: pipeviz.{name}\n")
    out.append("## Views\n\nLoaded on first use (`import pipeviz` imports neither ipywidgets nor plotly).\n")
    out += [f"::: {lazy[name]}.{name}\n" for name in views if name in lazy]
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if "<!-- pipeviz:api -->" in markdown:
        markdown = markdown.replace("<!-- pipeviz:api -->", _api_markdown())
    if "<!-- pipeviz:notebooks -->" in markdown:
        rows = []
        for folder, section in FOLDERS.items():
            rows.append(f"\n**{section}** (`{folder}/`)\n")
            for site, _ in notebooks():
                if site.startswith(folder + "/"):
                    shown = " (shown without outputs)" if site in _State.missing else ""
                    rows.append(f"- [{_State.titles[site]}]({site}){shown}")
        markdown = markdown.replace("<!-- pipeviz:notebooks -->", "\n".join(rows) + "\n")
    return markdown


# The script plotly's notebook renderer puts before a notebook's first figure: plotly.js itself, banner first.
_PLOTLY_JS = re.compile(r"<script>(/\*\*\n\* plotly\.js v([0-9][0-9.]*)\n.*?)</script>", re.DOTALL)
_NB_LINK = re.compile(r'href="([^"#:]+\.ipynb)(#[^"]*)?"')
# A lesson's link to a docs page, as it reads in the repository (../docs/schedules.md): the page on the site.
_DOC_LINK = re.compile(r'href="([^"#:]+\.md)(#[^"]*)?"')


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """In a notebook's page, a link to another notebook (relative to the notebook) goes to that notebook's page."""
    if not page.file.src_uri.endswith(".ipynb"):
        return html

    def repoint(match: re.Match[str]) -> str:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), match.group(1)))
        found = files.get_file_from_path(target)
        if found is None:
            log.warning("%s links to %s, which is not a lesson or demo", page.file.src_uri, match.group(1))
            return match.group(0)
        return f'href="{found.url_relative_to(page.file)}{match.group(2) or ""}"'

    html = _NB_LINK.sub(repoint, html)

    def to_page(match: re.Match[str]) -> str:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), match.group(1)))
        found = files.get_file_from_path(target.removeprefix("docs/"))
        if found is None:
            log.warning("%s links to %s, which is not a page of the docs", page.file.src_uri, match.group(1))
            return match.group(0)
        return f'href="{found.url_relative_to(page.file)}{match.group(2) or ""}"'

    html = _DOC_LINK.sub(to_page, html)

    def shared(match: re.Match[str]) -> str:
        path = f"assets/javascripts/plotly-{match.group(2)}.min.js"
        _State.scripts[path] = match.group(1)
        return f'<script src="{get_relative_url(path, page.url)}"></script>'

    return _PLOTLY_JS.sub(shared, html)


def on_post_build(config: MkDocsConfig) -> None:
    for path, script in _State.scripts.items():
        target = Path(config.site_dir) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(script, encoding="utf-8")
