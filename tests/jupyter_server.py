"""A private JupyterLab 4 (or Notebook 7) server on 127.0.0.1 with one notebook, for the real-browser test
(``tests/test_browser.py``) and the view-cost benchmark (``benchmarks/speed/explorer_overhead.py``).

Example:
    >>> with jupyter_server(tmp_path, "jupyterlab", [CELL]) as (url, root):
    ...     page.goto(url)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["jupyter_server", "wait_for"]

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: object, timeout: float, what: str, every: float = 0.2) -> object:
    """``check()`` once it is truthy; ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    end = time.time() + timeout
    while time.time() < end:
        value = check()  # type: ignore[operator]
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def jupyter_server(tmp_path: Path, app: str, cells: Sequence[str], name: str = "explorer.ipynb",
                   ) -> Iterator[tuple[str, Path]]:
    """Start ``app`` ("jupyterlab" or "notebook") with private config/data/runtime dirs and a random token, over a
    notebook ``name`` of ``cells`` in ``tmp_path/nb``; yields (the notebook's url, that dir). Stopped on exit."""
    import nbformat

    cls = "LabApp" if app == "jupyterlab" else "JupyterNotebookApp"
    root = tmp_path / "nb"
    root.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / name)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"), ("JUPYTER_RUNTIME_DIR", "rt"),
                     ("IPYTHONDIR", "ipython")):
        env[var] = str(tmp_path / sub)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
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
            if proc.poll() is not None:
                raise RuntimeError((tmp_path / "lab.log").read_text()[-3000:]) from None
            return False

    try:
        wait_for(up, 90, f"{app} to start")
        path = f"lab/tree/{name}?reset&" if app == "jupyterlab" else f"notebooks/{name}?"
        yield f"{base}/{path}token={token}", root
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
