"""What a page reload asks of the kernel: an Explorer shown in a real kernel, then the widget restore a reloaded page
gets (ipywidgets' "request_states" on its control comm, exactly as JupyterLab's widget manager sends it, which waits
a fixed 4 s for the answer) and plotly.js, which the page then asks the PlotlyBundle for in a message of its own
(``pipeviz/widgets/live_figure.py``). Prints the bytes the kernel sent when the Explorer was shown, the restore's
models, bytes and seconds, its largest states, and the bundle's answer.

    python benchmarks/speed/widget_restore.py [--repo PATH]   # PATH: a checkout to measure (default: this one)

Measured 2026-12-06, 2 shared cores at load 5-7, a fresh Explorer of a 3-module Sequential (257 widgets), twice
each: shown with 5.30 MB (5.08 MB of it the PlotlyBundle's opening state) both before and after the change; the
restore was 5.36 MB before (the bundle's state 5.08 MB of it), answered in 0.28-0.47 s by an idle kernel, and 0.28 MB
after (no state over 17 kB), in 0.12-0.36 s; plotly.js then came in 0.01-0.05 s as one 4.96 MB buffer (before: the
bundle did not answer).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import time
import uuid
from pathlib import Path
from typing import Any

CODE = """
import torch, pipeviz as pv
from pipeviz.widgets import live_figure
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
display(pv.Explorer(model, example_args=(torch.randn(8, 4),)))
print(live_figure.plotly_bundle().model_id)
"""


def _size(msg: dict[str, Any]) -> int:
    return len(json.dumps(msg["content"])) + sum(len(b) for b in msg["buffers"])


def _reply(kc: Any, comm_id: str, timeout: float) -> dict[str, Any] | None:
    """The next message on ``comm_id`` from the kernel, or None after ``timeout`` seconds of silence."""
    while True:
        try:
            msg: dict[str, Any] = kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            return None
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == comm_id:
            return msg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[2]))
    args = parser.parse_args()
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, "PYTHONPATH": args.repo}, cwd=args.repo)
    try:
        start, shown, out = time.time(), 0, ""
        run = kc.execute(CODE)
        while True:
            msg = kc.get_iopub_msg(timeout=600)
            shown += _size(msg) if msg["msg_type"] == "comm_open" else 0
            out += msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""
            if msg["msg_type"] == "error":
                raise RuntimeError(msg["content"]["evalue"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle" \
                    and msg["parent_header"].get("msg_id") == run:
                break
        bundle_id = out.split()[-1]
        print(f"shown in {time.time() - start:.1f} s: {shown / 1e6:.2f} MB of comm_open")
        control = uuid.uuid4().hex  # what the widget manager opens on a reloaded page
        kc.shell_channel.send(kc.session.msg("comm_open", {"comm_id": control, "target_name":
                                                           "jupyter.widget.control", "data": {}},
                                             metadata={"version": "1.0.0"}))
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": control, "data": {"method": "request_states"}}))
        asked = time.time()
        restore = _reply(kc, control, 60)
        if restore is None:
            raise RuntimeError("no restore from the kernel within 60 s")
        states = restore["content"]["data"]["states"]
        largest = sorted(((len(json.dumps(s)), s["model_name"]) for s in states.values()), reverse=True)[:3]
        print(f"restore: {len(states)} models, {_size(restore) / 1e6:.3f} MB in {time.time() - asked:.2f} s; "
              f"largest states (bytes, model): {largest}")
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": bundle_id, "data": {
            "method": "custom", "content": {"event": "bundle?"}}}))
        asked = time.time()
        answer = _reply(kc, bundle_id, 15)
        print("plotly.js: no answer from the bundle" if answer is None else
              f"plotly.js: {[len(b) for b in answer['buffers']]} bytes in {time.time() - asked:.2f} s")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


if __name__ == "__main__":
    main()
