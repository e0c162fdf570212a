"""One self-contained HTML report: graph, stage table, simulated vs measured timelines, schedule comparison.

Used by ``pipeviz demo``; figures are plotly (its JavaScript is embedded once, so the file opens offline).

Example:
    >>> from pipeviz.widgets.report import Section, write_report
    >>> write_report([Section("MyNetwork", plan, comparison, run, simulated, check)], "report.html")
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeviz.plan.preview import human_bytes
from pipeviz.plan.split import SplitPlan
from pipeviz.planner.search import ClusterPlan
from pipeviz.runtime.numerics import NumericsCheck
from pipeviz.schedule.timeline import Timeline
from pipeviz.sim.simulate import Comparison

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["Section", "cluster_table", "comparison_table", "memory_table", "stage_table", "write_report"]


@dataclass
class Section:
    """One model's part of the report."""

    title: str
    plan: SplitPlan
    comparison: Comparison
    measured: Timeline | None = None
    simulated: Timeline | None = None
    check: NumericsCheck | None = None  # pv.check_numerics: the run against the unsplit model
    notes: list[str] = field(default_factory=list)
    cluster: ClusterPlan | None = None  # pv.plan_cluster: the same model planned for a named cluster


_CSS = """
body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px} h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px} td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:right}
td:first-child,th:first-child,td.l,th.l{text-align:left}
.ok{color:#1a7f37;font-weight:600} .bad{color:#c62828;font-weight:600}
.note{color:#555;font-size:13px} .slow{background:#fff3cd}
"""


def stage_table(plan: SplitPlan, costs: Timeline | None = None) -> str:
    """The stage preview as an HTML table; the slowest stage is highlighted."""
    times: dict[int, float] = {}
    if costs is not None:
        for e in costs.events:
            times[e.stage] = times.get(e.stage, 0.0) + e.duration
    slow = max(times, key=times.__getitem__) if times else None
    rows = []
    for s in plan.stages:
        names = ", ".join(s.layers) if len(s.layers) <= 4 else f"{s.layers[0]} … {s.layers[-1]} ({len(s.layers)})"
        t = f"{times[s.index] * 1e3:.2f} ms" if s.index in times else "—"
        cls = ' class="slow"' if s.index == slow and len(plan.stages) > 1 else ""
        rows.append(f"<tr{cls}><td>{s.index}</td><td class=l>{html.escape(names)}</td><td>{s.params:,}</td>"
                    f"<td>{s.flops / 1e6:,.1f}</td><td>{human_bytes(s.send_bytes)}</td>"
                    f"<td>{human_bytes(s.memory_bytes)}</td>"
                    f"<td>{t}</td></tr>")
    return ("<table><tr><th>stage</th><th class=l>layers</th><th>params</th><th>MFLOPs</th><th>sends</th>"
            "<th>memory</th><th>time/step (sim.)</th></tr>" + "".join(rows) + "</table>")


def comparison_table(cmp: Comparison) -> str:
    """``pv.compare``'s rows as an HTML table: every schedule on the same ranks, with its stage count."""
    rows = "".join(
        f"<tr><td>{r.schedule}</td><td>{r.ranks}</td><td>{r.stages}</td>"
        f"<td>{r.step_time * 1e3:.2f} ms</td>"
        f"<td>{r.bubble:.0%}</td><td>{', '.join(human_bytes(b) for b in r.memory_bytes)}</td></tr>"
        for r in cmp.rows
    )
    skipped = "".join(f"<li>{html.escape(k)}: {html.escape(cmp.skipped_why.get(k, v))}.</li>"
                      for k, v in cmp.skipped.items())
    return ("<table><tr><th>schedule</th><th>ranks</th><th>stages</th><th>step</th><th>bubble</th>"
            "<th>memory per rank</th></tr>" + rows + "</table>" + (f"<ul class=note>{skipped}</ul>" if skipped else ""))


def cluster_table(cp: ClusterPlan, top: int = 5) -> str:
    """``pv.plan_cluster``'s best rows as a small HTML table, with the question it answered."""
    head = (f"<p>{cp.gpus} x {html.escape(cp.hardware.name)} ({cp.dtype}, efficiency {cp.hardware.efficiency:g}), "
            f"global batch {cp.global_batch} x {cp.seq_len} tokens, memory limit {human_bytes(cp.memory_limit)}: "
            f"{len(cp.rows)} best of {cp.considered} layouts.</p>")
    if not cp.rows:
        return head + "<p class=note>No layout fits the memory limit.</p>"
    cells = cp.cells(top)  # the planner's own strings: `pipeviz plan` prints the same figures in the same units
    left = {cells[0].index("schedule"), cells[0].index("recompute")}

    def row(r: tuple[str, ...], tag: str) -> str:
        return "<tr>" + "".join(f"<{tag}{' class=l' if j in left else ''}>{html.escape(c)}</{tag}>"
                                for j, c in enumerate(r)) + "</tr>"

    return (head + "<table>" + row(cells[0], "th") + "".join(row(r, "td") for r in cells[1:]) + "</table>"
            + "".join(f"<p class=note>{html.escape(n)}</p>" for n in cp.notes))


def memory_table(measured: Timeline, simulated: Timeline) -> str:
    """Planned against measured memory per process: the simulation's peak of saved activations for the process's
    pipeline rank (``meta["peak_activation_bytes"]``) next to the run's measured peak (``run.activation_memory``:
    what autograd held saved, the same quantity), and the difference. "" when either side lacks the figures."""
    planned = simulated.meta.get("peak_activation_bytes")
    samples = measured.meta.get("activation_memory") or {}
    if not planned or not samples:
        return ""
    mesh = measured.mesh
    rows = []
    for proc in sorted(samples):
        got = max((b for _, b in samples[proc]), default=0)
        pp = mesh.coords(proc).pp if mesh is not None else proc
        if pp >= len(planned):
            continue
        want = planned[pp]
        err = f"{want / got - 1:+.1%}" if got else "—"
        label = mesh.label(proc) if mesh is not None and mesh.world > mesh.pp else f"rank {proc}"
        rows.append(f"<tr><td>{html.escape(label)}</td><td>{human_bytes(want)}</td><td>{human_bytes(got)}</td>"
                    f"<td>{err}</td></tr>")
    return ("<p class=note>Peak saved activations per process, planned (pv.simulate of the run's config) and measured "
            "(what autograd held saved, counted by the run's memory meter).</p><table><tr><th>process</th>"
            "<th>planned</th><th>measured</th><th>planned vs measured</th></tr>" + "".join(rows) + "</table>")


def _check_html(check: NumericsCheck | None) -> str:
    if check is None:
        return ""
    verdict = '<span class="ok">match</span>' if check.ok else '<span class="bad">MISMATCH</span>'
    return (f"<p>Numerics against the unsplit model trained the same way: {verdict} — max loss difference "
            f"{check.loss_diff:.2e}, max parameter difference {check.param_diff:.2e} ({check.steps} steps, "
            f"tolerance {check.tolerance:g}).{' ' + html.escape(check.note) + '.' if check.note else ''}</p>")


def write_report(sections: list[Section], path: str | Path, title: str = "pipeviz demo") -> Path:
    """Write the report; returns its path."""
    import plotly.io as pio

    from pipeviz.widgets.figures import comparison_figure, timeline_figure
    from pipeviz.widgets.graph_figures import graph_figure

    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    first = True

    def fig_html(fig: go.Figure) -> str:
        nonlocal first
        out = pio.to_html(fig, full_html=False, include_plotlyjs=first, config={"displaylogo": False})
        first = False
        return out

    for sec in sections:
        parts.append(f"<h2>{html.escape(sec.title)}</h2>")
        parts += [f"<p class=note>{html.escape(n)}</p>" for n in sec.notes]
        parts.append(f"<p>{html.escape(repr(sec.plan))}</p>")
        parts.append(stage_table(sec.plan, sec.simulated))
        parts.append(fig_html(graph_figure(sec.plan, height=max(300, 34 * len(sec.plan.graph.layers)))))
        if sec.measured is not None:
            parts.append("<h3>Measured run (simulation overlaid)</h3>")
            parts.append(fig_html(timeline_figure(sec.measured, overlay=sec.simulated)))
            parts.append(_check_html(sec.check))
            if sec.simulated is not None:
                parts.append(memory_table(sec.measured, sec.simulated))
        if sec.simulated is not None:
            parts.append("<h3>Why the simulated step takes what it takes</h3><p class=note>The critical path (the "
                         "line: each action freed by the one before it) and every idle gap, with what it waits for "
                         "on hover (pv.critical_path, pv.idle_gaps).</p>")
            parts.append(fig_html(timeline_figure(sec.simulated, why=True)))
        parts.append("<h3>Schedules compared (simulated, every one on the same ranks)</h3>")
        parts.append(comparison_table(sec.comparison))
        parts.append(fig_html(comparison_figure(sec.comparison)))
        if sec.cluster is not None:
            parts.append(f"<h3>Planned for a cluster: {sec.cluster.gpus} x {html.escape(sec.cluster.hardware.name)} "
                         "(simulated, pv.plan_cluster)</h3>")
            parts.append(cluster_table(sec.cluster))
    parts.append("</body></html>")
    out = Path(path)
    out.write_text("\n".join(parts), encoding="utf-8")
    return out
