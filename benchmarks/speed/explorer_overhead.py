"""What the Explorer's live view costs the run it shows: the same 2-rank Llama run launched from the notebook's code
without a view ("script") and from the Explorer shown in JupyterLab in headless Chromium, whose live timeline and
notes redraw while the ranks run, on this machine's cores, side by side in one kernel.

Two Explorer settings: the live timeline redrawn every 0.25 s (as before 2026-12-03) and every 2 s while the run's
processes take every core (``TimelineView.busy_interval``, the default now). Prints the median step wall time of
each (steps 2-12 of each launch, three launches each, interleaved) and its ratio to the script's.

    python benchmarks/speed/explorer_overhead.py [--reps 3] [--steps 12]

Needs /usr/bin/chromium and playwright (the test extra); never `playwright install`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.jupyter_server import jupyter_server, wait_for

SETUP = """\
import json, pathlib, statistics, torch, pipeviz as pv
from pipeviz.schedule.training import default_target
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
model, ids = LlamaForCausalLM(config), torch.randint(0, 512, (16, 32))
ex = pv.Explorer(model, example_args=(ids,), steps=STEPS)
ex.auto_balance(2)
ex
"""

MEASURE = """\
def median_ms(run):
    assert run.status == "done", run.error
    return round(statistics.median(run.step_walltimes[1:]) * 1e3, 1)

results = {"script": [], "explorer, redraw every 0.25 s": [], "explorer, every 2 s while busy (default)": []}
for rep in range(REPS):
    target = ex.target if ex.target is not None else default_target(ex.graph)
    run = pv.launch(ex.plan, config=ex.launch_config(), inputs=(ids,), target=target)
    run.wait(600)
    results["script"].append(median_ms(run))
    for key, busy in (("explorer, redraw every 0.25 s", 0.25), ("explorer, every 2 s while busy (default)", 2.0)):
        ex.run_view.busy_interval = busy
        ex.launch()
        ex.wait(600)
        results[key].append(median_ms(ex.run))
        results.setdefault(key + " redraws", []).append(getattr(ex.run_view, "live_redraws", None))
pathlib.Path("overhead.json").write_text(json.dumps(results))
"""

IDLE = """path => {
  const app = window.jupyterapp, w = app && app.shell && app.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!(w && w.context && w.context.path.endsWith(path) && k && k.connectionStatus === 'connected'
            && k.status === 'idle');
}"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    cells = [SETUP.replace("STEPS", str(a.steps)), MEASURE.replace("REPS", str(a.reps))]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, jupyter_server(Path(tmp), "jupyterlab", cells) as (url, root):
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu",
                                                                         "--disable-dev-shm-usage"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(url, timeout=90_000)
            page.wait_for_function(IDLE, arg="explorer.ipynb", timeout=90_000, polling=200)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            out = root / "overhead.json"
            wait_for(out.exists, 60 * 30, "the measurements", every=1.0)
            browser.close()
        results = json.loads(out.read_text())
    script = statistics.median(results["script"])
    print(f"2-rank Llama (4 layers x 128), 1F1B, 4 microbatches, {a.steps} steps, {a.reps} launches each, "
          f"{time.time() - t0:.0f} s in all; median step wall time (steps 2-{a.steps}):")
    for key, values in results.items():
        if key.endswith("redraws"):
            continue
        med = statistics.median(values)
        redraws = results.get(key + " redraws")
        extra = f"   live redraws per run {redraws}" if redraws else ""
        print(f"  {key:<42} {med:7.1f} ms  x{med / script:.2f}   {values}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
