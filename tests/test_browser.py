"""pv.Explorer in a real browser: JupyterLab on 127.0.0.1, headless Chromium, a real mouse click on a rendered
layer node, then Launch. Screenshots go to artifacts/browser/ (git-ignored).

Needs ``/usr/bin/chromium`` (``apt-get install -y chromium``) and ``pip install playwright``; never
``playwright install``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "browser"
CHROME_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

CELL = """\
import pathlib, torch, pipeviz as pv
from pipeviz.zoo import MyNetwork
torch.manual_seed(0)
model, x = MyNetwork(512, [512, 1024, 256]), torch.randn(32, 512)
ex = pv.Explorer(model, example_args=(x,), splits=["layer0"], steps=3)
# The kernel writes its plan on every change: the test reads what the kernel really holds.
ex.observe(lambda change: pathlib.Path("plan.json").write_text(change["new"]), "plan_json")
ex
"""

# Which plotly graph is the layer graph, and where on the page its marker for `name` is.
MARKER_XY = """name => {
  const gd = [...document.querySelectorAll('.pipeviz-explorer .js-plotly-plot')]
      .find(g => g.data && g.data.some(t => t.name === 'layers'));
  if (!gd || !gd._fullLayout || !gd._fullLayout.xaxis) return null;
  gd.scrollIntoView({block: 'center'});
  const t = gd.data.find(t => t.name === 'layers');
  const i = Array.from(t.text).indexOf(name);
  const fl = gd._fullLayout, box = gd.getBoundingClientRect();
  return {x: box.left + fl._size.l + fl.xaxis.l2p(t.x[i]), y: box.top + fl._size.t + fl.yaxis.l2p(t.y[i])};
}"""

# The rendered graph follows the kernel: stage colours of the markers and one dashed line per split.
GRAPH_STATE = """() => {
  const gd = [...document.querySelectorAll('.pipeviz-explorer .js-plotly-plot')]
      .find(g => g.data && g.data.some(t => t.name === 'layers'));
  const t = gd.data.find(t => t.name === 'layers');
  return {colors: new Set(Array.from(t.marker.color)).size,
          splits: (gd.layout.shapes || []).filter(s => s.type === 'line').length};
}"""

KERNEL_IDLE = """path => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  const ctx = w && w.sessionContext;
  const k = ctx && ctx.session && ctx.session.kernel;
  return !!(w && w.context && w.context.path.endsWith(path) && k && k.connectionStatus === 'connected'
            && k.status === 'idle');
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: object, timeout: float, what: str, every: float = 0.2) -> object:
    end = time.time() + timeout
    while time.time() < end:
        value = check()  # type: ignore[operator]
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(params=["jupyterlab", "notebook"])
def lab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """JupyterLab 4 (or Notebook 7) on 127.0.0.1 with private config/data/runtime dirs and a random token;
    yields (notebook url, root dir)."""
    app = request.param
    # In CI (.ci/run installs everything) a missing piece is a failure, never a silent skip.
    missing = pytest.fail if os.environ.get("CI") else pytest.skip
    if importlib.util.find_spec(app) is None:
        missing(f"{app} is not installed (pip install -e '.[test]')")
    cls = "LabApp" if app == "jupyterlab" else "JupyterNotebookApp"
    if not os.path.exists(CHROMIUM):
        missing("chromium is not installed (apt-get install -y chromium)")
    root = tmp_path / "nb"
    root.mkdir()
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "explorer.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"), ("JUPYTER_RUNTIME_DIR", "rt"),
                     ("IPYTHONDIR", "ipython")):
        env[var] = str(tmp_path / sub)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')  # no news toast
    log = open(tmp_path / "lab.log", "w")  # closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", app, "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", f"--{cls}.expose_app_in_browser=True",
         *(["--LabApp.news_url=None"] if app == "jupyterlab" else []),
         f"--{cls}.user_settings_dir={tmp_path / 'settings'}", f"--{cls}.workspaces_dir={tmp_path / 'workspaces'}",
         "--ServerApp.open_browser=False", "--allow-root"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                return r.status == 200
        except OSError:
            return proc.poll() is not None and pytest.fail((tmp_path / "lab.log").read_text()[-3000:])

    try:
        _wait(up, 90, "JupyterLab to start")
        path = "lab/tree/explorer.ipynb?reset&" if app == "jupyterlab" else "notebooks/explorer.ipynb?"
        yield f"{base}/{path}token={token}", root
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def test_click_a_layer_then_launch(lab: tuple[str, Path], request: pytest.FixtureRequest) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    url, root = lab
    shots = ARTIFACTS / request.node.callspec.id
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        console: list[str] = []
        page.on("console", lambda msg: console.append(msg.text))
        try:
            page.goto(url, timeout=90_000)
            page.wait_for_function(KERNEL_IDLE, arg="explorer.ipynb", timeout=90_000, polling=200)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(f"({MARKER_XY})('layer1')", timeout=120_000, polling=250)
            preview = page.locator(".pipeviz-preview-head")
            sync_api.expect(preview).to_contain_text("2 stages", timeout=30_000)
            page.screenshot(path=shots / "1-rendered.png", full_page=True)

            xy = page.evaluate(f"({MARKER_XY})('layer1')")
            page.mouse.move(xy["x"], xy["y"])
            page.wait_for_timeout(300)  # hover first, as a person does; plotly shows the tooltip
            page.mouse.click(xy["x"], xy["y"])
            sync_api.expect(preview).to_contain_text("3 stages", timeout=30_000)
            plan = json.loads(_wait(lambda: _read_plan(root, 3), 30, "the kernel's plan with 3 stages"))
            assert plan["stages"] == [["layer0"], ["layer1"], ["layer2", "output_proj"]]
            assert page.locator(".pipeviz-preview .pipeviz-stage-row").count() == 3
            page.wait_for_function(f"({GRAPH_STATE})().splits === 2", timeout=30_000, polling=200)
            assert page.evaluate(f"({GRAPH_STATE})()") == {"colors": 3, "splits": 2}
            page.screenshot(path=shots / "2-clicked.png", full_page=True)

            page.locator("button.pipeviz-launch").click()
            bars = page.locator(".pipeviz-run-timeline .js-plotly-plot g.trace.bars path")
            _wait(lambda: bars.count() > 0, 120, "measured timeline bars")
            status = page.locator(".pipeviz-run-status")
            sync_api.expect(status).to_have_text("done", timeout=120_000)
            numerics = page.locator(".pipeviz-numerics-check")
            sync_api.expect(numerics).to_contain_text("✓ matches", timeout=60_000)
            assert bars.count() >= 3 * 4 * 2  # forward and backward of every (stage, microbatch) at least
            page.locator(".pipeviz-run-timeline").scroll_into_view_if_needed()
            page.screenshot(path=shots / "3-launched.png", full_page=True)
            assert not [m for m in console if "Error setting state" in m or "cannot set" in m], console
        except Exception:
            page.screenshot(path=shots / "failure.png", full_page=True)
            raise
        finally:
            browser.close()


def _read_plan(root: Path, stages: int) -> str | None:
    path = root / "plan.json"
    try:
        text = path.read_text()
        return text if len(json.loads(text)["stages"]) == stages else None
    except (OSError, ValueError):
        return None
