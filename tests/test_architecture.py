"""The package's shape: no import cycles, and a core that never imports a view library.

The import graph is read from the source with ``ast``: every ``import`` counts, at module level, inside a function
(a lazy import is still a dependency) or under ``if TYPE_CHECKING:`` (a type is a dependency too): no cycle at any
level.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipeviz"
VIEW_LIBRARIES = ("ipywidgets", "plotly", "anywidget")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Modules imported by one file (pipeviz modules by full name, others by top-level package)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path, name, modules) if m in modules and m != name}
            for name, path in modules.items()}


def _is_core(name: str) -> bool:
    # The views and the command line (an application of both) are not core; the package root exposes the
    # views only through its lazy ``__getattr__`` (pv.Explorer loads ipywidgets when first used).
    return not (name.startswith("pipeviz.widgets") or name == "pipeviz.cli")


def test_the_import_graph_has_no_cycles() -> None:
    graph = _graph()
    # The package root re-exports the public API, so every module it imports depends on it being importable:
    # modules importing the root (only the views and the CLI may) are checked for cycles without that edge.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt == "pipeviz" and not _is_core(node):
                continue
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_core_never_imports_a_view_library() -> None:
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        if not _is_core(name):
            continue
        imports = _imports(path, name, modules)
        bad = sorted(m for m in imports if m.split(".")[0] in VIEW_LIBRARIES or m.startswith("pipeviz.widgets"))
        if name == "pipeviz":
            bad = [m for m in bad if m != "pipeviz.widgets"]  # the root's lazy __getattr__ (checked below)
        if bad:
            offenders.append(f"{name}: {bad}")
    assert not offenders, "core modules importing views: " + "; ".join(offenders)
    root = (PACKAGE / "__init__.py").read_text()
    assert "importlib.import_module(\"pipeviz.widgets\")" in root and "import plotly" not in root


# The parts, bottom up (docs/development.md, "Layout"): a module imports only from its own part or parts below it.
LAYERS = ("base", "adapter", "capture", "plan", "graph", "schedule", "cost", "sim", "planner", "runtime", "face",
          "fuzz", "widgets", "cli")
# The modules under every part: a module's error types and its deprecation helper, and the version.
BASE = {"pipeviz.errors", "pipeviz._compat", "pipeviz.version"}


def layer(name: str) -> str:
    """The part a module belongs to: its folder under ``pipeviz/``, else the package's face (the root, ``zoo`` and
    the old import paths kept working)."""
    if name in BASE:
        return "base"
    if name == "pipeviz.cli":
        return "cli"
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "face"


def _upward(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            # A leaf (a module importing nothing of pipeviz: a formula, constants) adds no tangle wherever it sits;
            # two do: the memory rule a StageInfo's figure uses (cost.rule) and the machine's measured constants
            # a Profile defaults to (cost.calibration).
            if LAYERS.index(layer(dep)) > LAYERS.index(layer(name)) and graph[dep]:
                out.append(f"{name} ({layer(name)}) imports {dep} ({layer(dep)})")
    return out


def test_imports_point_down_the_layers() -> None:
    graph = _graph()
    assert _upward(graph) == []
    # and the check can fail: an import of the runtime from the capture part is one
    planted = {**graph, "pipeviz.capture.export": graph["pipeviz.capture.export"] | {"pipeviz.runtime.run"}}
    assert _upward(planted) == ["pipeviz.capture.export (capture) imports pipeviz.runtime.run (runtime)"]


def test_every_module_is_in_a_part_and_few_lie_flat() -> None:
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= 16, flat
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {"base", "face", "cli"}


def test_core_modules_importing_the_package_root() -> None:
    # A core module importing ``pipeviz`` itself would close a cycle through the root's re-exports.
    graph = _graph()
    assert sorted(n for n, deps in graph.items() if "pipeviz" in deps and _is_core(n)) == []


@pytest.mark.slow
def test_the_core_runs_without_the_notebook_stack() -> None:
    # pip install pipeviz (no [notebook] extra): trace, plan, balance, simulate work with torch alone.
    code = textwrap.dedent("""
        import sys
        class NoViews:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("ipywidgets", "plotly", "anywidget", "jupyterlab"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoViews())
        import torch, pipeviz as pv
        from pipeviz.zoo import MyNetwork
        graph = pv.trace(MyNetwork(8, [8, 8, 8, 8]), example_args=(torch.randn(4, 8),))
        plan = pv.balance(graph, 2)  # compare holds the 2 ranks: 4-stage splits for the 2-stages-per-rank rows
        print(plan.num_stages, pv.simulate(plan, "1F1B", 2).step_time > 0, len(pv.compare(plan, microbatches=4).rows))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2", "True", "7"]


def test_run_and_watch_satisfy_the_one_interface_the_views_use(tmp_path: Path) -> None:
    import typing

    import pipeviz as pv
    from pipeviz.runtime.export import Watch
    from pipeviz.runtime.run import Run

    watch = pv.watch(tmp_path, timeout=0.1)
    assert isinstance(watch, pv.Live)
    watch.stop()
    members = set(typing.get_type_hints(pv.Live)) | {"done", "subscribe", "wait", "stop", "timeline"}
    for cls in (Run, Watch):
        missing = [m for m in members if not hasattr(cls, m) and m not in _init_attributes(cls)]
        assert not missing, f"{cls.__name__} lacks {missing}"


def _init_attributes(cls: type) -> set[str]:
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    targets = [t for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AnnAssign)
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return {t.attr for t in flat if isinstance(t, ast.Attribute)}


def _long_functions() -> list[str]:
    """Functions over 80 lines, their docstrings aside."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = node.body[0]
                doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str)
                start = (first.end_lineno or first.lineno) + 1 if doc else node.lineno
                if (node.end_lineno or start) - start + 1 > 80:
                    out.append(f"{path.relative_to(PACKAGE.parent)}:{node.name}")
    return out


def test_modules_and_functions_stay_small() -> None:
    # Split a long module by collaborating classes or functions over a value (docs/development.md).
    long_modules = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                          if len(p.read_text().splitlines()) > 500)
    assert len(long_modules) <= 3, long_modules
    assert len(_long_functions()) <= 4, _long_functions()


def test_no_private_name_crosses_a_module() -> None:
    crossing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeviz"):
                crossing += [f"{path.relative_to(PACKAGE.parent)}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []


def test_the_public_surface_is_narrow() -> None:
    """At most 45 public names; no public function or method takes more than 3 positional parameters, and at most 5
    public functions take more than 8 (the configuration types carry the rest)."""
    import inspect

    import pipeviz as pv

    assert len(pv.__all__) <= 45, len(pv.__all__)
    wide, positional = [], []
    for name in pv.__all__:
        obj = getattr(pv, name)
        members = [(name, obj)] if inspect.isfunction(obj) else [
            (f"{name}.{m}", f) for m, f in vars(obj).items() if inspect.isfunction(f) and not m.startswith("_")
        ] if inspect.isclass(obj) and obj.__module__.startswith("pipeviz") else []
        for label, fn in members:
            params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
            if sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params) > 3:
                positional.append(label)
            if sum(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) > 8:
                wide.append(label)
    assert positional == []
    assert len(wide) <= 5, wide
