"""HTML panels and small helpers behind ``Explorer``: the stage preview, run progress, the numerics check,
error boxes, granularity choices, and handler plumbing.

Everything here takes core objects and returns text or core objects, so it is testable without a browser.
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pipeviz as pv
from pipeviz.costs import stage_costs
from pipeviz.graph import ModelGraph
from pipeviz.plan import SplitPlan, human_bytes
from pipeviz.timeline import COMPUTE, Timeline
from pipeviz.widgets.figures import stage_color

if TYPE_CHECKING:
    from pipeviz.widgets.explorer import Explorer

__all__ = ["error_html", "granularity_options", "guarded", "numerics_html", "preview_html", "progress_html", "soon",
           "stage_times", "static_html"]


IMBALANCE = 1.15  # slowest stage / mean above this is highlighted


def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a UI handler; any exception goes to the widget's error area (observers would swallow it)."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # shown, never swallowed
            self._show_error(exc)
            return None

    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


def soon(fn: Callable[[], None]) -> None:
    """Run ``fn`` after the current comm message is handled (in a kernel), else now.

    A click arrives as a state update of the graph's FigureWidget, handled under that widget's
    ``hold_sync``: figure edits made inside it collapse into one trait sync and never reach the browser.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        fn()
    else:
        loop.call_soon(fn)


def stage_times(plan: SplitPlan, sim: Timeline | None, microbatches: int) -> tuple[list[float], str]:
    """Seconds per microbatch (forward + backward) of each stage: from the simulated timeline, or from FLOPs
    when there is none. Returns (times, source)."""
    if sim is not None and sim.events:
        busy = [0.0] * plan.num_stages
        for e in sim.events:
            if e.kind in COMPUTE and 0 <= e.stage < plan.num_stages:
                busy[e.stage] += e.duration
        return [b / max(1, sim.microbatches) for b in busy], "simulated"
    costs = stage_costs(plan, microbatches)
    return [f + b for f, b in zip(costs.forward, costs.backward, strict=True)], costs.source


def preview_html(plan: SplitPlan, sim: Timeline | None, microbatches: int, note: str = "") -> str:
    """The stage table: layers, params, GFLOPs, bytes sent, estimated time and memory; imbalance highlighted."""
    stages = plan.stages
    times, source = stage_times(plan, sim, microbatches)
    mean = sum(times) / len(times) if times else 0.0
    slowest = max(range(len(times)), key=times.__getitem__) if times else -1
    ratio = times[slowest] / mean if mean > 0 else 1.0
    imbalanced = len(stages) > 1 and ratio > IMBALANCE
    splits = ", ".join(n if p is pv.SplitPoint.END else f"before {n}" for n, p in plan.splits) or "none"
    head = (f"<div class='pipeviz-preview-head'><b>{plan.num_stages} stage{'s' * (plan.num_stages != 1)}</b>"
            f" · splits after: {html.escape(splits)}</div>")
    cell = "padding:2px 8px;text-align:right"
    rows = [f"<tr><th style='{cell}'>stage</th><th style='padding:2px 8px;text-align:left'>layers</th>"
            f"<th style='{cell}'>params</th><th style='{cell}'>GFLOPs</th><th style='{cell}'>sends</th>"
            f"<th style='{cell}'>time/mb ({source})</th><th style='{cell}'>memory</th></tr>"]
    for s, t in zip(stages, times, strict=True):
        names = ", ".join(s.layers) if len(s.layers) <= 4 else f"{s.layers[0]} … {s.layers[-1]} ({len(s.layers)})"
        hot = imbalanced and s.index == slowest
        style = " style='background:#fde2e1;font-weight:bold'" if hot else ""
        swatch = f"<span style='color:{stage_color(s.index)}'>■</span>"
        rows.append(
            f"<tr class='pipeviz-stage-row'{style}><td style='{cell}'>{swatch} {s.index}</td>"
            f"<td style='padding:2px 8px'>{html.escape(names)}</td><td style='{cell}'>{s.params:,}</td>"
            f"<td style='{cell}'>{s.flops / 1e9:.3f}</td><td style='{cell}'>{human_bytes(s.send_bytes)}</td>"
            f"<td style='{cell}'>{t * 1e3:.3f} ms{' ⚠' if hot else ''}</td>"
            f"<td style='{cell}'>{human_bytes(s.memory_bytes)}</td></tr>")
    table = "<table style='border-collapse:collapse;font-size:12px'>" + "".join(rows) + "</table>"
    if len(stages) < 2:
        verdict = "One stage: click a layer (or set stages and Auto-balance) to split."
    elif imbalanced:
        verdict = (f"<span style='color:#c0392b'>⚠ imbalance: stage {slowest} takes {ratio:.2f}× the mean stage time;"
                   " the pipeline runs at the pace of its slowest stage. Auto-balance evens it out.</span>")
    else:
        verdict = f"balanced: slowest stage {ratio:.2f}× the mean"
    extra = ""
    if sim is not None:
        mem = sim.meta.get("memory_bytes")
        if mem:
            extra = " · memory per rank (simulated): " + ", ".join(f"r{r} {human_bytes(m)}" for r, m in enumerate(mem))
        extra = (f"<div>simulated step {sim.step_time * 1e3:.3f} ms · bubble {sim.bubble_fraction:.0%}{extra}</div>")
    if note:
        extra += f"<div><i>{html.escape(note)}</i></div>"
    return f"<div class='pipeviz-preview' style='font-size:12px'>{head}{table}<div>{verdict}</div>{extra}</div>"


def progress_html(run: pv.Run) -> str:
    """One line: status, step i/n, last loss, events so far."""
    loss = f" · loss {run.losses[-1]:.4f}" if run.losses else ""
    color = {"failed": "#c0392b", "done": "#27ae60", "stopped": "#e67e22"}.get(run.status, "#333")
    return (f"<span class='pipeviz-run-status' style='color:{color}'><b>{run.status}</b></span> · "
            f"step {run.step}/{run.steps}{loss} · {len(run.events):,} events")


def numerics_html(run: pv.Run) -> str:
    """``pv.check_numerics(run)`` as one line: the unsplit model trained the same way, compared."""
    check = pv.check_numerics(run)
    mark = ("<span style='color:#27ae60'>✓ matches</span>" if check.ok
            else "<span style='color:#c0392b'>✗ differs from</span>")
    return (f"<div class='pipeviz-numerics-check'><b>Numerics check:</b> {mark} the unsplit model trained the same "
            f"way: max |Δloss| = {check.loss_diff:.2e} over {check.steps} steps, max |Δparam| = "
            f"{check.param_diff:.2e} over {check.tensors} tensors (tolerance {check.tolerance:g}).</div>")


def error_html(text: str) -> str:
    return ("<div style='border:1px solid #e74c3c;background:#fdecea;color:#922;padding:4px 8px;margin:4px 0'>"
            f"<pre style='white-space:pre-wrap;margin:0;font-size:12px'>{html.escape(text)}</pre></div>")


def granularity_options(graph: ModelGraph) -> list[tuple[str, str]]:
    """Dropdown choices: expand a layer, collapse a container of layers, or regroup by depth."""
    options = [("— expand / collapse —", "")]
    options += [(f"⊕ expand {la.name}", f"expand:{la.name}") for la in graph.layers if la.expandable]
    containers: dict[str, int] = {}
    for name in graph.layer_names:
        parts = name.split(".")
        for k in range(1, len(parts)):
            prefix = ".".join(parts[:k])
            containers[prefix] = containers.get(prefix, 0) + 1
    options += [(f"⊖ collapse {p}", f"collapse:{p}") for p, count in containers.items() if count >= 2]
    options += [("natural blocks", "regroup:")] + [(f"every module to depth {d}", f"regroup:{d}") for d in (2, 3, 4, 5)]
    return options


def static_html(explorer: Explorer) -> str:
    """What a notebook shows without a widget manager (nbconvert HTML, GitHub): the preview and the figures."""
    figs = explorer.figures()
    parts = [explorer.preview.value]
    for i, fig in enumerate(figs.values()):
        parts.append(fig.to_html(full_html=False, include_plotlyjs="cdn" if i == 0 else False))
    return "<div class='pipeviz-static'>" + "".join(parts) + "</div>"
