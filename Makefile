# `make demo` and `make test` set everything up in ./.venv on first use, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without an NVIDIA GPU pin the local CPU build: an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test compat grid wheel lint bench calibrate render docs screenshots fuzz clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[notebook,checkpoints,test,docs]"
	touch $@

demo: setup
	$(VENV)/bin/pipeviz demo

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) scripts/build_notebooks.py --check
	$(PY) scripts/check_fences.py

# The quick checks first; then mypy (50 s cold on a fresh clone) runs beside pytest, whose processes leave a core idle
# a third of the time on 2 cores (user+sys 7.5 of 10.4 min measured): `make test` 10 min 21 s -> the suite's own time.
# Either failing fails the target; mypy's report is printed after pytest's.
test: setup
	$(PY) -m ruff check .
	$(PY) scripts/build_notebooks.py --check
	$(PY) scripts/check_fences.py
	@$(PY) -m mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(PY) -m pytest; tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 && test $$typed -eq 0

# The compatibility step (the `compat` marker): the HF matrix (20 architectures x 3 schedules, and each built on
# the meta device), the LLaMA / Mixtral / MoE families under the 4 schedules `make test` leaves out, the heavier
# composition tests and notebooks (demos 03-06, lessons 02 onwards), Mixtral under every schedule.
# Two pytest workers (pytest-xdist): a launch's processes leave a core idle much of the time (they start, import
# torch, wait on each other), and the step outgrew CI's 45 minutes serially; the browser test then runs alone, as
# a user's machine has it (a page under a doubled load is not what it checks).
compat: setup
	$(PY) -m pytest -m "compat and not browser" -n 2
	$(PY) -m pytest -m "compat and browser"

# The version grid: the adapter, runtime and family tests and chosen compat rows under each supported (torch,
# transformers) pair, one venv per pair, built once into ${PIPEVIZ_GRID_CACHE:-/var/cache/pipeviz-grid} outside the
# clone and rebuilt when its pins or pyproject's dependencies change. Prints a table per cell; see scripts/grid.py.
grid:
	$(PYTHON) scripts/grid.py

# pipeviz as a user installs it: the sdist and the wheel built from it (metadata checked), the wheel installed with
# the notebook extra into a fresh venv on pyproject's floor Python, every public name imported, `pipeviz demo --model
# classic` and lesson 01 run from outside the clone. Writes only under build/. See scripts/check_wheel.py.
wheel: setup
	$(PY) scripts/check_wheel.py

# The composition fuzzer (docs/fuzz.md): random compositions checked against the unsplit model for FUZZ_SECONDS,
# from FUZZ_SEED; a failure is shrunk and written to build/fuzz/ (repro.py, repro_torchrun.py) and exits 1.
FUZZ_SECONDS ?= 180
FUZZ_SEED ?= 0
fuzz: setup
	$(VENV)/bin/pipeviz fuzz --seconds $(FUZZ_SECONDS) --seed $(FUZZ_SEED) --out build/fuzz

# Executed HTML renderings of every lesson and demo notebook (outputs and plotly figures embedded, readable offline)
# in build/html/ (gitignored), with an index; exits 1 if a notebook fails. See scripts/render.py.
render: setup
	$(PY) scripts/render.py --out build/html

# The documentation site in build/site/ (mkdocs.yml, docs/, scripts/docs_hooks.py; open build/site/index.html): the pages
# in docs/, the lessons and demos with their outputs, the API reference from the docstrings. Strict: a broken link
# to a page or an anchor, or any other warning, fails it; links to other sites are not checked (CI reaches no network
# but the package registries). The notebooks are the executed copies the notebook tests keep in artifacts/notebooks/
# (nothing runs here); one without such a copy is shown without outputs, with a note. PIPEVIZ_DOCS_EXECUTED=require
# (.ci/run) fails instead. NO_MKDOCS_2_WARNING: Material's end-of-life notice, recorded in docs/about.md.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The README's pictures (docs/images/): taken by the real-browser test in JupyterLab, of what it just checked.
screenshots: setup
	PIPEVIZ_README_IMAGES=docs/images $(PY) -m pytest -q "tests/test_browser.py::test_explorer_as_a_user_meets_it[jupyterlab]"

bench: setup
	$(PY) benchmarks/speed/preview_latency.py

# Re-measure the constants in pipeviz/cost/calibration.json on this machine (per-action overhead, gloo's all-reduce
# efficiency, core contention) and print them beside the recorded ones; `--write` records them. Run it idle.
calibrate: setup
	$(PY) benchmarks/calibration/cpu_constants.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info build
