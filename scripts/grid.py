#!/usr/bin/env python3
"""The CI version grid (``make grid``): the adapter, runtime, compat and family tests under each supported
(torch, transformers) pair, each in its own venv.

Venvs live outside the clone, in ``${PIPEVIZ_GRID_CACHE:-/var/cache/pipeviz-grid}/<cell>-<hash>``, so CI runs on
the same machine build each one once; the hash covers the cell's pins, the shared test pins, this build recipe
and pyproject.toml's dependency list, and a venv whose hash changed (or that is missing) is rebuilt.

pipeviz itself is NOT installed into the cached venvs: an editable install would point at whichever clone built
the venv. The tests run with the clone on ``PYTHONPATH`` instead (``python -m pytest`` from the repo root, and
spawned workers inherit the parent's ``sys.path``), which is what ``pip install --no-deps -e .`` gives, without
pip ever weighing pyproject's torch range against the cell's pin.

Usage::

    python3 scripts/grid.py                 # build what is missing, run every cell, print the table
    python3 scripts/grid.py --cells t2.15   # cells whose name contains any of these (comma-separated)
    python3 scripts/grid.py --build-only    # only build (or find) the venvs
    python3 scripts/grid.py -- -x           # extra pytest arguments after --

Measured 2026-12-01 on the 2-core machine while other test suites ran on it (load 3-7): venv builds 96 s (2.13,
local wheel), 147-293 s (2.14.1 from disk, 5.6 GB), 294-695 s (2.15.0, ~3 GB download, 5.6 GB); tests per cell
5.5 / 8.8 / 6.6 min wall, 2.0 / 3.0 / 2.7 min CPU (pytest and its rank processes); 21.5 min with every venv cached.
While a cell's tests run, the next venv is built.

Exit status: 0 when every cell passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("PIPEVIZ_GRID_CACHE", "/var/cache/pipeviz-grid"))
PYTHON = os.environ.get("PIPEVIZ_GRID_PYTHON", sys.executable)
RECIPE = 1  # bump when the build steps below change: every cached venv is then rebuilt


@dataclass(frozen=True)
class Cell:
    """One (torch, transformers) pair and whatever else it must pin to install."""

    name: str
    torch: str  # an exact pin, installed first and alone
    transformers: str
    extra: tuple[str, ...] = ()  # pins this transformers needs beside its own ranges
    # False: pip's configuration files are not read for this venv's installs (PIP_CONFIG_FILE=os.devnull), so a
    # machine's own constraints (this image caps torch at 2.14.1 in /etc/xdg/pip) do not refuse the cell's pin;
    # the cell's constraints file still holds torch to it. Nothing outside the cache is touched.
    pip_config: bool = True
    # The Python the venv is built with ("3.13": found on PATH or under pyenv; None: PIPEVIZ_GRID_PYTHON or this one).
    python: str | None = None
    # Environment the cell's tests run with: OTHER_KERNELS makes torch's CPU ops and MKL take other code paths than
    # make test's, as another CPU would (a test exact only on one machine's kernels fails here).
    env: tuple[tuple[str, str], ...] = ()
    # Every dependency pyproject declares (the core's, the notebook and checkpoints extras', the test extra's
    # transformers) pinned at its lower bound, all together: what `pip install "pipeviz[notebook]"` promises works.
    floors: bool = False
    # Installed last, without their dependencies: readers the exports are checked against (torchtitan's config
    # classes, Megatron-Core's layout parser), whose own dependency trees (datasets, wandb, ...) their readers need
    # none of.
    no_deps: tuple[str, ...] = ()
    # The tests this cell runs instead of the grid's TESTS: a small selection (CI's whole run, .ci/run, must stay
    # within 45 minutes).
    tests: tuple[str, ...] = ()


# Three launches, one per runtime path (one stage per rank; tied weights; the V shape with a split backward): the new
# cells' share of tests/test_runtime.py (4 s in all).
RUNS = tuple(f"tests/test_runtime.py::test_every_schedule_matches_unsplit_model[{case}]"
             for case in ("GPipe-mlp", "1F1B-tied", "ZBVZeroBubble-skip"))

# ATen's vectorised kernels without AVX (ATEN_CPU_CAPABILITY=default) and MKL's conditional numerical reproducibility
# in its compatible code path (MKL_CBWR=COMPATIBLE): each changes the last bits of a Linear's output here.
OTHER_KERNELS = (("ATEN_CPU_CAPABILITY", "default"), ("MKL_CBWR", "COMPATIBLE"))

CELLS = (
    # The oldest torch with the 4.x line: 4.57 still accepts huggingface_hub < 1.0 only (its own range says so).
    # "+cpu": the local CPU wheel (/opt/wheels); the plain PyPI 2.13.0 is a multi-GB CUDA build.
    Cell("t2.13-tf4.57", "torch==2.13.0+cpu", "transformers==4.57.6", ("huggingface_hub<1.0",)),
    # torch 2.14.1's CUDA build lies on this machine's disk (/opt/pypi-more): 5.5 GB in the venv, no download.
    Cell("t2.14-tf5.23", "torch==2.14.1", "transformers==5.23.0", env=OTHER_KERNELS),
    # torch 2.15 is only on PyPI (a CUDA build, ~3 GB download), which this machine's pip configuration refuses
    # (pip_config=False). transformers: the newest release at the time the grid runs (a range, resolved against the
    # index when the venv is looked up: a new release gets a venv of its own).
    # Python 3.13: the newest this machine has, beside make test's 3.11 (pyproject's floor).
    Cell("t2.15-tf-newest", "torch==2.15.0", "transformers>=5.25,<6", pip_config=False, python="3.13"),
    # Every declared floor at once, on the floor Python (3.11) and torch (2.13, the local CPU wheel): the core, the
    # views (plotly's FigureWidget, ipywidgets, anywidget at their floors) and launches (cloudpickle's, and
    # safetensors' in the Explorer's resume).
    Cell("floors", "torch==2.13.0+cpu", "transformers==4.57.1", ("huggingface_hub<1.0",), floors=True,
         tests=("tests/test_plan.py", "tests/test_simulate.py", "tests/test_figures.py", "tests/test_widgets.py",
                "tests/test_export_torchtitan.py", *RUNS)),
    # Python 3.12, admitted and otherwise never run (make test runs 3.11, the newest cell 3.13); torch 2.14.1 for
    # cp312 comes from PyPI (a CUDA build: triton, which Megatron-Core imports, comes with it). The exports are
    # checked here by torchtitan's and Megatron-Core's own readers (megatron-core 0.19 needs Python >= 3.12).
    # Python 3.14 is not in the grid: no registry these machines reach has it (Debian 12's apt stops at 3.11, PyPI
    # and npm ship no CPython 3.14 interpreter; pyenv and portable-python download from python.org and GitHub).
    Cell("py3.12", "torch==2.14.1", "transformers==5.23.0", ("tyro==1.0.17",), python="3.12",
         no_deps=("torchtitan==0.3.0", "megatron-core==0.19.2"),
         tests=("tests/test_adapter.py", "tests/test_export_torchtitan.py", "tests/test_megatron_layout.py", *RUNS)),
)

# The same test tools in every cell (the versions the main .venv runs), pinned so a rebuild changes nothing else.
TOOLS = ("pytest==9.2.0", "pytest-timeout==2.4.0", "psutil==7.2.2", "cloudpickle==3.1.3", "numpy==2.4.6",
         "safetensors==0.8.0")

# Context and expert parallelism, one launch per route (20 s a cell on a quiet machine): cp's key/value exchanges
# (GPT-2, Llama: torch's SDPA and transformers' attention), ep's all-to-alls with each process holding its experts,
# DualPipeV's OVERLAP_F_B pairs run at once (torch's register_custom_function), the expert graph, and the split
# refused inside a routed block (torch.export's unbacked sizes).
CP_EP = ("tests/test_cp_launch.py::test_pp2_cp2_exact_and_its_exchanges_counted",
         "tests/test_ep_launch.py::test_moenet_pp2_dp2_ep2_under_1f1b_is_exact_with_a2a_actions_and_tokens_per_expert",
         "tests/test_ep_launch.py::test_the_expert_graph_computes_a_stage_as_traced",
         "tests/test_ep_overlap.py::test_pp2_dp2_ep2_dualpipev_overlapped_is_exact_and_runs_forward_beside_backward",
         "tests/test_moe_split.py")

# What each cell runs: one path through each runtime route, sized for CI (the grid's three cells, venv builds
# included, should stay near 20 min on 2 cores, after `make test` and `make compat` have run everything once).
# - tests/test_adapter.py, whole: every torch internal pipeviz touches, checked against the cell's torch.
# - tests/test_regions.py without `other-4`: no_grad / autocast regions traced, refused inside, trained exactly.
# - tests/test_runtime.py, whole: plain models under all 7 schedules (one stage per rank; several stages per rank;
#   the backward split into input and weight gradients; the V shape), skips and tied weights, plus HF GPT-2, BERT
#   and T5, and the process/event machinery.
# - tests/test_families.py without its `other-4` parametrizations: LLaMA, Mixtral and the routed MoE under the
#   three schedules that take the three runtime paths, and the manual route (torch's data-dependent trace error).
#   The other four schedules take the same paths; `make compat` runs them.
# - tests/test_compat.py (the HF matrix, ~5 min alone for 20 rows x 2 tests): training under GPipe, 1F1B and a
#   multi-stage schedule for the rows whose code differs most between transformers releases (the rotary decoders
#   and the MoE: TRAIN_ROWS), and the meta-device build (each rank runs HF's own initialisers, whose handling of
#   buffers changed between releases) for a wider set (META_ROWS). Rows not in tests/compat.py are not selected.
# - tests/test_hf_moe.py: transformers 4.x's MoE blocks traced through pipeviz.adapter.hf_moe (nothing patched on 5.x).
# - tests/test_custom_order.py: a custom order run by torch's private _PipelineScheduleRuntime (5 s).
# - tests/test_tensor_parallel_hf.py: HF models on DTensors (torch's sharding rules and private handler table,
#   transformers' ops and masks differ by version; 60-90 s).
# - tests/test_loss_reduction.py: the schedules' scale_grads switch and loss_parallel's summed cross-entropy
#   (torch's attributes; 15 s).
# - tests/test_recompute_runtime.py: torch.utils.checkpoint's non-reentrant frames and GraphExecGroup under the
#   schedules' split backward; tests/test_overlap_reduction.py: async all-reduces and their futures on gloo;
#   tests/test_training_hf.py: every training option on HF models (transformers' code paths).
# - tests/test_comm_order.py: torch's own send/receive order (pipeline_order_with_comms, _add_send_recv), which
#   every launch plays for deadlock; tests/test_shapes.py's plain-torch test (3 schedules, 5 s): stages traced again
#   per input shape, bound to one set of parameters.
TESTS = ("tests/test_adapter.py", "tests/test_regions.py", "tests/test_runtime.py", "tests/test_families.py",
         "tests/test_compat.py", "tests/test_hf_moe.py", "tests/test_custom_order.py",
         "tests/test_tensor_parallel_hf.py", "tests/test_loss_reduction.py",
         "tests/test_accumulation.py", "tests/test_lr_and_eval.py", "tests/test_checkpoint.py",
         "tests/test_compile.py", "tests/test_mixed_precision.py", "tests/test_recompute_runtime.py",
         "tests/test_overlap_reduction.py", "tests/test_training_hf.py", "tests/test_comm_order.py",
         "tests/test_shapes.py::test_batches_of_several_lengths_train_like_the_unsplit_model",
         *CP_EP)
TRAIN_ROWS = ("Llama", "GPT-NeoX", "Qwen2-MoE", "mBART")
META_ROWS = ("GPT-2", "Llama", "GPT-NeoX", "Qwen2-MoE", "Mixtral", "BERT", "T5")


def select_args(cell: Cell) -> list[str]:
    def rows(names: tuple[str, ...]) -> str:
        return " or ".join(f"[{r}]" for r in names)  # "[Qwen2]" does not match "[Qwen2-MoE]"

    if cell.tests:  # the cell's own small selection, slow tests included (-m overrides pyproject's markers)
        return [*cell.tests, "-m", "not compat"]
    # -m "compat or not compat" overrides pyproject's addopts (-m "not compat"): the compat tests run too.
    # (not the coverage rows: an option's test widened to the other schedules, whose code paths run here already)
    return [*TESTS, "-m", "(compat or not compat) and not coverage",
            "-k", f"not other-4 and (not test_compat.py or (unsplit_model and ({rows(TRAIN_ROWS)}))"
                  f" or (meta_device and ({rows(META_ROWS)})))"]


def pyproject_dependencies() -> list[str]:
    import tomllib

    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def floor_pins() -> list[str]:
    """``name==X`` for every ``name>=X`` pyproject declares: the core's dependencies, the notebook and checkpoints
    extras, and the test extra's transformers (torch is the cell's own pin, checked equal to its floor)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in [*project["dependencies"], *extras["notebook"], *extras["checkpoints"],
                                     *(t for t in extras["test"] if t.startswith("transformers"))]]
    pins = []
    for req in reqs:
        low = [spec.version for spec in req.specifier if spec.operator == ">="]
        if not low:
            raise SystemExit(f"grid: pyproject's {req} has no lower bound (>=) for the floors cell to pin")
        pins.append(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}=={low[0]}")
    return pins


def cell_pins(cell: Cell) -> tuple[str, list[str]]:
    """The cell's transformers and its other pins: the floors for a floors cell (torch and transformers are the
    cell's own pins, checked equal to the floors), then TOOLS, less any package a floor already pins."""
    transformers, pins = cell.transformers, list(cell.extra)
    if cell.floors:
        floors = floor_pins()
        for own in (cell.torch, cell.transformers):
            name, version = own.split("==")
            floor = next(p for p in floors if p.startswith(f"{name}=="))
            if Version(Version(version).base_version) != Version(floor.split("==")[1]):  # 2.13.0+cpu is 2.13
                raise SystemExit(f"grid: the floors cell pins {own}, pyproject's floor is {floor}")
        pins += [p for p in floors if not p.startswith(("torch==", "transformers=="))]
    pinned = {re.split(r"[\[=<>]", p)[0].lower() for p in pins}
    return transformers, [*pins, *(t for t in TOOLS if t.split("==")[0].lower() not in pinned)]


def cell_hash(cell: Cell) -> str:
    key = {"cell": [cell.torch, cell.transformers, *cell.extra, cell.pip_config, *cell.no_deps],
           "pins": cell_pins(cell), "tools": TOOLS, "recipe": RECIPE,
           "python": subprocess.run([interpreter(cell), "-c", "import sys; print(sys.version)"], capture_output=True,
                                    text=True, check=True).stdout.strip(),
           "pyproject": pyproject_dependencies()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def interpreter(cell: Cell) -> str:
    """The Python the cell's venv is built with: ``python3.X`` on PATH, else pyenv's newest 3.X.*, else (said on
    stdout) ``PYTHON``."""
    if cell.python is None:
        return PYTHON
    found = shutil.which(f"python{cell.python}")
    if found and subprocess.run([found, "-V"], capture_output=True).returncode == 0:  # a pyenv shim may refuse
        return found
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    versions = sorted((p for p in root.glob(f"{cell.python}.*") if p.name.split(".")[-1].isdigit()
                       and (p / "bin" / "python3").exists()), key=lambda p: int(p.name.split(".")[-1]))
    if versions:
        return str(versions[-1] / "bin" / "python3")
    # Not on this machine: the cell still runs (on PYTHON), and the table says which Python it ran on.
    print(f"grid: {cell.name} asks for Python {cell.python}: no python{cell.python} on PATH, none under {root}; "
          f"using {PYTHON}", flush=True)
    return PYTHON


def pip_env(cell: Cell) -> dict[str, str]:
    """The environment of the cell's pip runs: the caller's, with pip's configuration files switched off for a
    cell that asks (``os.devnull`` is pip's documented way to read none). No file outside the cache is changed."""
    env = dict(os.environ)
    if not cell.pip_config:
        env["PIP_CONFIG_FILE"] = os.devnull
        env.pop("PIP_CONSTRAINT", None)
    return env


def pip(venv: Path, *args: str, env: dict[str, str] | None = None) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    print("grid: $", " ".join(cmd[3:]), flush=True)
    res = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, env=env)
    # This machine's extra local indexes lack most projects: pip warns once per package; the rest is shown.
    noise = "is ignored: it is neither a file nor a directory"
    sys.stderr.write("".join(line for line in res.stderr.splitlines(True) if noise not in line))
    res.check_returncode()


def resolve(cell: Cell) -> tuple[Cell, str]:
    """The cell with its transformers range resolved to the newest release that installs from the index now, with
    its dependencies, beside the cell's torch (``pip install --dry-run --report``, nothing installed), and a note
    when a newer release exists that does not install here (a dependency the index lacks); an exact pin is returned
    as it is. Raises ``RuntimeError`` when the index cannot be asked."""
    if "==" in cell.transformers or cell.floors:
        return cell, ""

    def ask(*args: str) -> str:
        cmd = [interpreter(cell), "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", "-",
               "--disable-pip-version-check", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, env=pip_env(cell))
        if res.returncode != 0:
            raise RuntimeError(f"cannot resolve {' '.join(args)!r}: {res.stderr.strip()[-500:]}")
        report = json.loads(res.stdout)["install"]
        return next(i["metadata"]["version"] for i in report if i["metadata"]["name"].lower() == "transformers")

    version = ask(cell.transformers, cell.torch, *cell_pins(cell)[1])
    newest = ask("--no-deps", cell.transformers)
    note = "" if newest == version else (f"transformers {newest} is out but does not install from this index (a "
                                         f"dependency is missing there): this cell runs {version}")
    return replace(cell, transformers=f"transformers=={version}"), note


def build(cell: Cell, target: Path) -> float:
    """Create the cell's venv at ``target`` (built aside, then renamed: a half-built venv is never reused)."""
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{target.name}-", dir=CACHE))
    try:
        subprocess.run([interpreter(cell), "-m", "venv", str(tmp)], check=True)
        env = pip_env(cell)
        # torch first and alone, exactly pinned; every later install is constrained to the same torch, so no
        # other requirement can ever swap it for a (CUDA) build of another version.
        pip(tmp, cell.torch, env=env)
        constraints = tmp / "grid-constraints.txt"
        constraints.write_text(cell.torch + "\n")
        transformers, pins = cell_pins(cell)
        pip(tmp, "-c", str(constraints), transformers, *pins, env=env)
        if cell.no_deps:
            pip(tmp, "--no-deps", *cell.no_deps, env=env)
        check = ("import torch, transformers; print('grid: torch', torch.__version__, '| transformers', "
                 "transformers.__version__)")
        subprocess.run([str(tmp / "bin" / "python"), "-c", check], check=True)
        freeze = subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True,
                                check=True).stdout
        (tmp / "grid-freeze.txt").write_text(freeze)
        seconds = time.time() - t0
        (tmp / "grid-built.json").write_text(json.dumps({"cell": cell.name, "seconds": round(seconds, 1)}))
        tmp.rename(target)  # the venv's python finds its site-packages from pyvenv.cfg: renaming is safe
        return seconds
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure(cell: Cell) -> tuple[Path, str]:
    """The cell's venv, built if missing; older venvs of the same cell are removed (5 GB each). A cell whose
    transformers is a range is resolved first; when the index cannot be asked, its newest cached venv is used."""
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        cell, note = resolve(cell)
        if note:
            print(f"grid: {cell.name}: {note}", flush=True)
            NOTES.setdefault(cell.name, []).append(note)
    except RuntimeError as exc:
        cached = sorted(CACHE.glob(f"{cell.name}-*/grid-built.json"), key=lambda p: p.stat().st_mtime)
        if not cached:
            raise
        print(f"grid: {exc}; using the cached {cached[-1].parent.name}", flush=True)
        return cached[-1].parent, "cached (index unreachable)"
    target = CACHE / f"{cell.name}-{cell_hash(cell)}"
    with open(CACHE / f".{cell.name}.lock", "w") as lock:  # two CI runs on one machine: one builds, one waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "grid-built.json").exists():
            return target, "cached"
        # Older venvs of this cell, and half-built ones a killed run left (the lock says none is being built now).
        for old in [*CACHE.glob(f"{cell.name}-*"), *CACHE.glob(f".build-{cell.name}-*")]:
            print(f"grid: removing stale {old}", flush=True)
            shutil.rmtree(old, ignore_errors=True)
        print(f"grid: building {target}", flush=True)
        seconds = build(cell, target)
        return target, f"built {seconds:.0f} s"


NOTES: dict[str, list[str]] = {}  # cell name -> what resolving it found (printed with the table)


@dataclass
class Outcome:
    cell: Cell
    venv: str = ""
    versions: str = ""
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    cpu: float = 0.0  # user + sys of pytest and every rank process: a load-independent measure of the cell's cost
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_cell(cell: Cell, venv: Path, extra: list[str]) -> Outcome:
    out = Outcome(cell)
    py = str(venv / "bin" / "python")
    probe = ("import json, sys, torch, transformers, tomllib\n"
             "from pip._vendor.packaging.requirements import Requirement\n"
             "deps = tomllib.load(open('pyproject.toml', 'rb'))['project']\n"
             "reqs = [Requirement(r) for r in deps['dependencies'] + deps['optional-dependencies']['test']]\n"
             "have = {'torch': torch.__version__.split('+')[0], 'transformers': transformers.__version__}\n"
             "bad = [f'pyproject {r} excludes {r.name} {have[r.name]}' for r in reqs\n"
             "       if r.name in have and not r.specifier.contains(have[r.name], prereleases=True)]\n"
             "from pip._vendor.packaging.specifiers import SpecifierSet\n"
             "py = '.'.join(map(str, sys.version_info[:3]))\n"
             "if not SpecifierSet(deps['requires-python']).contains(py):\n"
             "    bad.append(f\"pyproject's requires-python {deps['requires-python']} excludes python {py}\")\n"
             "print(json.dumps([f\"python {sys.version.split()[0]} | torch {torch.__version__} | transformers \"\n"
             "                  f\"{transformers.__version__}\", bad]))")
    res = subprocess.run([py, "-c", probe], cwd=REPO, capture_output=True, text=True)
    if res.returncode == 0:
        out.versions, out.notes = json.loads(res.stdout)
        if cell.python and f"python {cell.python}." not in out.versions:
            out.notes.append(f"asked for Python {cell.python}, ran on {out.versions.split(' |')[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = {**os.environ, **dict(cell.env),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        cmd = [py, "-m", "pytest", *select_args(cell), "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra]
        shown = " ".join(f"{k}={v}" for k, v in cell.env)
        print(f"\n===== grid cell {cell.name}: {out.versions}{' | ' + shown if shown else ''} =====", flush=True)
        print("grid: $", " ".join(cmd[1:]), flush=True)
        t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, cwd=REPO, env=env)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        out.seconds, out.cpu = time.time() - t0, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        if xml.exists():
            for case in ET.parse(xml).iter("testcase"):
                tid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                bad = case.find("failure")
                if bad is None:
                    bad = case.find("error")
                if bad is not None:
                    out.failed += 1
                    out.failures.append(f"{tid}: {first_error(bad.get('message') or '', bad.text or '')}")
                elif case.find("skipped") is not None:
                    out.skipped += 1
                else:
                    out.passed += 1
        else:
            out.failures.append("pytest wrote no report (crashed?)")
            out.failed += 1
    return out


def first_error(message: str, report: str = "") -> str:
    """The failure's first line; where that only announces what follows ("launch failed in the parent
    process:", "Regex pattern did not match."), also the exception or the actual message it announces, from the
    report's ``E`` lines (junit's message attribute is shortened)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "?"
    head = lines[0]
    if head.endswith((":", "did not match.")):
        said = [m.group(1) for m in re.finditer(r"^E\s+((?:[\w.]*(?:Error|Exception)|Actual message)\b.*)$",
                                                 report, re.MULTILINE)]
        if said:
            head += " ... " + said[-1].strip()
    return head[:300]


def table(outcomes: list[Outcome]) -> str:
    head = (f"{'cell':<16} {'versions':<58} {'venv':<13} {'passed':>6} {'failed':>6} {'skipped':>7} {'time':>7}"
            f" {'cpu':>7}")
    lines = [head, "-" * len(head)]
    for o in outcomes:
        lines.append(f"{o.cell.name:<16} {o.versions:<58} {o.venv:<13} {o.passed:>6} {o.failed:>6} {o.skipped:>7} "
                     f"{o.seconds / 60:>5.1f} m {o.cpu / 60:>5.1f} m")
    for o in outcomes:
        for note in [*NOTES.get(o.cell.name, []), *o.notes]:
            lines.append(f"  {o.cell.name}: note: {note}")
        for f in o.failures:
            lines.append(f"  {o.cell.name}: FAILED {f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="", help="comma-separated substrings of cell names (default: all)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = ap.parse_args()
    wanted = [w for w in args.cells.split(",") if w]
    cells = [c for c in CELLS if not wanted or any(w in c.name for w in wanted)]
    if not cells:
        print(f"grid: no cell matches {args.cells!r}; cells: {', '.join(c.name for c in CELLS)}", file=sys.stderr)
        return 2
    t0 = time.time()
    outcomes = []
    # Venvs are built one after another in a thread while the cells whose venvs are ready run their tests: a build
    # mostly waits on the disk and the network (torch 2.15's ~3 GB download), the tests on the CPUs.
    with ThreadPoolExecutor(max_workers=1) as builder:
        venvs = {cell: builder.submit(ensure, cell) for cell in cells}
        for cell in cells:
            try:
                venv, how = venvs[cell].result()
            except Exception as exc:
                outcomes.append(Outcome(cell, venv="build failed", failed=1, failures=[f"venv build: {exc!r}"]))
                continue
            print(f"grid: {cell.name}: {venv} ({how})", flush=True)
            if not args.build_only:
                o = run_cell(cell, venv, args.pytest_args)
                o.venv = how
                outcomes.append(o)
    if args.build_only:
        return 0 if not outcomes else 1
    print(f"\n===== version grid ({(time.time() - t0) / 60:.1f} min in all) =====")
    print(table(outcomes))
    return 0 if all(o.failed == 0 and o.passed > 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
