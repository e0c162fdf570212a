"""HTML panels and small helpers behind ``Explorer``: the stage preview and its verdict, run progress, why a
measured step differs from the simulated one, the numerics check, notes, error boxes, and handler plumbing.

Everything here takes core objects and returns text or core objects, so it is testable without a browser.
"""

from __future__ import annotations

import asyncio
import html
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Concatenate, Generic, ParamSpec, Protocol, TypedDict, TypeVar

import pipeviz as pv
from pipeviz.cost.model import selective_saves_nothing, stage_costs, time_source
from pipeviz.cost.options import CostOptions
from pipeviz.plan.preview import human_bytes
from pipeviz.plan.split import SplitPlan
from pipeviz.planner.balance import slowest_stage
from pipeviz.schedule.timeline import COMPUTE, Timeline
from pipeviz.widgets.experts import expert_share_lines
from pipeviz.widgets.figures import plural, stage_color
from pipeviz.widgets.run_state import RunState
from pipeviz.widgets.tp_notes import tp_notes

if TYPE_CHECKING:
    import ipywidgets as W

    from pipeviz.capture.view import GraphView

__all__ = ["Change", "PipeView", "browser_helper", "cost_note_html", "error_html", "guarded", "mesh_html", "notes_html",
           "numerics_html", "preview_html", "progress_html", "run_notes_html", "run_state_html", "short", "soon",
           "stage_times", "verdict_html", "view_note_html"]


T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")


class Change(TypedDict, Generic[T]):
    """What ``traitlets``' ``observe`` hands a handler: the trait's ``name``, its ``old`` and ``new`` values (a
    ``T``), the widget that owns it, and the notification's ``type`` (``"change"``)."""

    name: str
    old: T
    new: T
    owner: object
    type: str


class _ShowsErrors(Protocol):
    """A widget with an error area (``Explorer``)."""

    def _show_error(self, exc: BaseException, prefix: str = ...) -> None: ...


W_ = TypeVar("W_", bound=_ShowsErrors)


def guarded(method: Callable[Concatenate[W_, P], R]) -> Callable[Concatenate[W_, P], R | None]:
    """Run a UI handler; any exception goes to the widget's error area (observers would swallow it), and the
    handler returns None."""

    def wrapper(self: W_, /, *args: P.args, **kwargs: P.kwargs) -> R | None:
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


# Two jobs for the page that only a script in it can do (an anywidget, invisible, inside the graph column):
# - JupyterLab and Notebook 7 take a shift-mousedown inside a cell as "extend the cell selection" and then swallow
#   its mouseup, so plotly never ends the click: a shift-click on a block did nothing and left plotly's invisible
#   drag cover over the page (the next click anywhere then expanded the block). Shift-mousedowns on the graph
#   column stay there: plotly's own handler (on the drag layer, inside the column) runs before this one.
# - plotly.js measures a responsive chart's box when it first draws it and again only on a window resize. A new
#   Explorer's simulated timeline was drawn before its box had its width (at plotly's default 700 px in an 848 px
#   box at 1280 px) and stayed so until the window changed. When a timeline's box and one of its charts (the Gantt
#   chart; the loss chart under a run's, drawn while hidden) differ in width, the page gets the resize event plotly
#   listens for (at most a few times per chart).
BROWSER_HELPER_ESM = """
export default {
  render({ el }) {
    let tries = 0;
    const attach = () => {
      const column = el.closest('.pipeviz-graph-column');
      const explorer = el.closest('.pipeviz-explorer');
      if (!column || !explorer) { if (tries++ < 200) setTimeout(attach, 50); return; }
      if (column.dataset.pipevizShiftGuard) return;
      column.dataset.pipevizShiftGuard = '1';
      column.addEventListener('mousedown', e => { if (e.shiftKey) e.stopPropagation(); });
      const nudged = new WeakMap();
      let pending = false;
      const check = () => {
        pending = false;
        let resize = false;
        for (const box of explorer.querySelectorAll('.pipeviz-timeline')) {
          for (const plot of box.querySelectorAll('.js-plotly-plot')) {  // the Gantt chart, the loss chart
            const svg = plot.querySelector('.main-svg');
            if (!svg || !box.clientWidth || !plot.clientWidth) continue;  // not drawn yet, or hidden
            if (Math.abs(svg.getBoundingClientRect().width - box.clientWidth) > 2 && (nudged.get(plot) || 0) < 5) {
              nudged.set(plot, (nudged.get(plot) || 0) + 1);
              resize = true;
            }
          }
        }
        if (resize) window.dispatchEvent(new Event('resize'));
      };
      const schedule = () => { if (!pending) { pending = true; setTimeout(check, 100); } };
      new ResizeObserver(schedule).observe(explorer);
      schedule();
    };
    attach();
  }
};
"""


def browser_helper() -> W.DOMWidget | None:
    """An invisible widget to put inside the graph column: it keeps shift-clicks on the graph away from the
    notebook's cell selection and keeps the timelines as wide as their boxes (see ``BROWSER_HELPER_ESM``).
    ``None`` without anywidget (plotly < 6)."""
    global _BrowserHelper
    try:
        import anywidget
        import ipywidgets as W
    except ImportError:
        return None
    if _BrowserHelper is None:
        _BrowserHelper = type("BrowserHelper", (anywidget.AnyWidget,), {"_esm": BROWSER_HELPER_ESM})
    return _BrowserHelper(layout=W.Layout(display="none"))


_BrowserHelper: type[W.DOMWidget] | None = None  # an anywidget.AnyWidget subclass


def stage_times(plan: SplitPlan, sim: Timeline | None, microbatches: int,
                options: CostOptions | None = None) -> tuple[list[float], str]:
    """Seconds per microbatch (forward + backward) of each stage: from the simulated timeline, or from
    ``pipeviz.costs`` (in ``options``' settings) when there is none. Returns (times, where the layer times come
    from: ``"measured"``, ``"roofline"`` or ``"flops"``, the same word with and without a simulation)."""
    source = time_source(plan.graph, options or CostOptions())
    if sim is not None and sim.events:
        busy = [0.0] * plan.num_stages
        for e in sim.events:
            if e.kind in COMPUTE and 0 <= e.stage < plan.num_stages:
                busy[e.stage] += e.duration
        return [b / max(1, sim.microbatches) for b in busy], source
    costs = stage_costs(plan, microbatches, options=options)
    return [f + b for f, b in zip(costs.forward, costs.backward, strict=True)], source


def _ms(seconds: float) -> str:
    """A duration in ms with three significant decimals, in µs below 0.1 ms (a small model on an H100)."""
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.2f} µs"


def short(name: str, limit: int = 40) -> str:
    """A long layer name shortened in the middle (the full name goes in a tooltip)."""
    return name if len(name) <= limit else name[: limit // 2 - 1] + "…" + name[-(limit // 2):]


def _names_cell(layers: tuple[str, ...]) -> str:
    """A stage's layers in a narrow column: two names at most (first … last and the count beyond two; the last
    without the dotted prefix it shares with the first), each breakable after a dot; every name in the tooltip."""
    if len(layers) <= 2:
        words = [f"{n}," for n in layers[:-1]] + [layers[-1]]
    else:
        first, last = layers[0], layers[-1]
        shared = 0  # whole dotted parts only: "transformer.h.1" and "transformer.h.10" share "transformer.h."
        for a, b in zip(first.split(".")[:-1], last.split(".")[:-1], strict=False):
            if a != b:
                break
            shared += len(a) + 1
        cut = shared
        words = [first, "…", last[cut:], f"({len(layers)})"]
    # A break may fall after a dot or between words, never inside a word (a column squeezed to one letter broke
    # "transformer.wte" into "transformer.wt / e", and put commas on lines of their own).
    shown = " ".join(html.escape(w).replace(".", ".<wbr>") for w in words)
    return f"<span title='{html.escape(', '.join(layers))}'>{shown}</span>"


def verdict_html(plan: SplitPlan, options: CostOptions | None = None, refused: bool = False) -> str:
    """How the plan's slowest stage compares with the best split into as many stages that exists (layer times in
    ``options``' settings). ``refused``: the settings cannot launch (said once, at the controls): no "✓" then, and
    one stage is only named (the refusal says the click)."""
    n = plan.num_stages
    if n < 2:
        return ("One stage: nothing to compare yet." if refused else
                "One stage: click a layer to split after it, or set stages and press Balance.")
    slowest, optimum = slowest_stage(plan, "time", options)
    if optimum <= 0 or slowest <= optimum * (1 + 1e-6):
        if refused:  # a balanced split is still no run: no ✓ beside a refusal that disables Launch
            return (f"<span class='pipeviz-verdict pipeviz-balanced'>The split is balanced (the slowest stage at the "
                    f"optimum for {plural(n, 'stage')}), but Launch is refused: see above.</span>")
        return (f"<span class='pipeviz-verdict pipeviz-balanced' style='color:#1a7f37'>✓ balanced: the slowest "
                f"stage is at the optimum, the best any split into {plural(n, 'stage')} reaches.</span>")
    return (f"<span class='pipeviz-verdict pipeviz-imbalanced' style='color:#c0392b'>⚠ imbalance: the slowest stage "
            f"takes {slowest / optimum:.2f}× the best slowest stage a split into {plural(n, 'stage')} reaches; "
            "the pipeline runs at its pace. Balance evens it out.</span>")


_SOURCES = {"measured": "profiled (pv.profile)", "roofline": "from the hardware's roofline",
            "flops": "from FLOPs at a nominal rate"}


def preview_html(plan: SplitPlan, sim: Timeline | None, microbatches: int, failed: bool = False,
                 options: CostOptions | None = None) -> str:
    """The stage table (layers, params, GFLOPs, bytes sent, time, memory), the slowest stage highlighted, the
    verdict against the optimum, and the simulated step. ``failed``: the settings cannot launch or the schedule
    could not be simulated (said once, above): times are estimates and say so, and the verdict has no ✓.
    ``options`` (``pv.CostOptions``): the
    hardware, dtype and recomputation the times, the memory column and the verdict are in (default: this
    machine, the traced dtype)."""
    stages = plan.stages
    times, source = stage_times(plan, sim, microbatches, options)
    custom = options is not None and options != CostOptions()
    memory = plan.stage_memory(options) if custom else [s.memory_bytes for s in stages]
    peaks = sim.meta.get("memory_bytes") if sim is not None else None
    # One stage per rank: the column is the simulated peak of the stage's rank, which follows the schedule's
    # microbatches in flight, dp and tp (it stayed the one-microbatch estimate while "memory per rank" moved)
    stage_is_rank = peaks is not None and sim is not None and sim.num_ranks == len(stages) == len(peaks)
    if stage_is_rank and peaks is not None:
        memory = [int(peaks[r]) for r in range(len(stages))]
    mem_label = "its rank's simulated peak" if stage_is_rank else "with one microbatch in flight"
    slowest = max(range(len(times)), key=times.__getitem__) if times else -1
    splits = ", ".join(n if p is pv.SplitPoint.END else f"before {n}" for n, p in plan.splits) or "none"
    head = (f"<div class='pipeviz-preview-head'><b>{plural(plan.num_stages, 'stage')}</b>"
            f" · splits after: {html.escape(splits).replace('.', '.<wbr>')}</div>")  # (wraps at a dot or a space)
    cell = "padding:2px 3px;text-align:right;white-space:nowrap"
    # headers in the body's weight, grey: bold ones were the widest cell of four columns (the table is ~420 px
    # wide beside the graph at 1280 px with JupyterLab's file browser open)
    th = f"{cell};font-weight:normal;color:#555"
    rows = [f"<tr><th style='{th}'>stage</th><th style='{th};text-align:left'>layers</th>"
            f"<th style='{th}'>params</th><th style='{th}'>GFLOPs</th><th style='{th}'>sends/mb</th>"
            f"<th style='{th}'>time/mb</th><th style='{th}'>memory</th></tr>"]
    for s, t, mem in zip(stages, times, memory, strict=True):
        hot = len(stages) > 1 and s.index == slowest
        style = " style='background:#fdf2e9'" if hot else ""
        swatch = f"<span style='color:{stage_color(s.index)}'>■</span>"
        rows.append(
            f"<tr class='pipeviz-stage-row'{style}><td style='{cell}'>{swatch} {s.index}</td>"
            f"<td style='padding:2px 3px'>{_names_cell(s.layers)}</td>"
            f"<td style='{cell}'>{s.params:,}</td>"
            f"<td style='{cell}'>{s.flops / 1e9:.3f}</td>"
            f"<td style='{cell}'>{human_bytes(s.send_bytes / max(microbatches, 1))}</td>"
            f"<td style='{cell}'>{_ms(t)}</td><td style='{cell}'>{human_bytes(mem)}</td></tr>")
    # What the time and memory columns are, under the table in the same words whatever changes (the header read
    # "estimated from flops" or "simulated" by turns, and its width pushed the last columns out of view).
    how = "in the simulated step" if sim is not None else "estimated, no simulation"
    caption = (f"<div class='pipeviz-table-caption' style='color:#666;font-size:11px'>time/mb: a stage's forward + "
               f"backward of one microbatch ({how}; layer times {_SOURCES.get(source, source)}) · memory: "
               f"{mem_label}</div>")
    # contain:inline-size: the table's width does not widen the preview; the table scrolls in its own box.
    table = ("<div class='pipeviz-table-box' style='max-width:100%;overflow-x:auto;contain:inline-size'>"
             "<table style='border-collapse:collapse;font-size:12px'>" + "".join(rows) + "</table></div>")
    extra = ""
    if sim is not None:
        ranks = sim.meta.get("memory_bytes")
        per_rank = (" · memory per rank: " + ", ".join(f"r{r} {human_bytes(m)}" for r, m in enumerate(ranks))) \
            if ranks else ""
        extra = (f"<div>simulated step {_ms(sim.step_time)} · bubble {sim.bubble_fraction:.0%}"
                 f"{per_rank}</div>")
    return (f"<div class='pipeviz-preview' style='font-size:12px;max-width:100%'>{head}{table}{caption}"
            f"<div>{verdict_html(plan, options, failed)}</div>{extra}</div>")


def mesh_html(plan: SplitPlan, config: pv.LaunchConfig) -> str:
    """The processes a launch of ``plan`` with ``config`` starts (``config.mesh``): a row per pipeline rank (the
    stages it holds, in their colours), a column per replica, share and shard (a header row per dimension), each
    cell the process rank (its coordinates in the tooltip). Empty for a one-stage plan or a layout that cannot run."""
    from pipeviz.schedule.mesh import DIMS

    if plan.num_stages < 2:
        return ""
    try:
        lay = config.layout(plan.num_stages)
        mesh = config.mesh(plan.num_stages)
    except ValueError:
        return ""
    cell = "padding:2px 5px;border:1px solid #ddd;white-space:nowrap;text-align:center"
    inner = [d for d in mesh.dims if d != "pp"]  # the dims of the columns, outermost first
    words = {"dp": "replica", "cp": "share", "tp": "shard"}
    columns = [mesh.coords(r) for r in mesh.pipeline()] if not inner else [
        mesh.coords(r) for r in range(mesh.world) if mesh.coords(r).pp == 0]
    # One header row per dim, each label spanning the columns under it ("replica 0" over "shard 0 | shard 1"), and
    # each cell the process rank alone: a dp x tp table fits a narrow column (one "replica 1 · shard 1" header
    # per column was cut at "repli…" at 1280 px).
    rows = [] if inner else [f"<tr><th style='{cell}'></th><th style='{cell}'>process rank</th></tr>"]
    for level, d in enumerate(inner):
        heads: list[tuple[tuple[int, ...], int]] = []  # (the coordinates so far, the columns it spans)
        for c in columns:
            key = tuple(getattr(c, e) for e in inner[:level + 1])
            if heads and heads[-1][0] == key:
                heads[-1] = (key, heads[-1][1] + 1)
            else:
                heads.append((key, 1))
        corner = (f"<th style='{cell};text-align:left' rowspan={len(inner)}>process rank</th>" if level == 0 else "")
        rows.append("<tr>" + corner + "".join(
            f"<th style='{cell}' colspan={span}>{words[d]} {key[-1]}</th>" for key, span in heads) + "</tr>")
    for p in lay.ranks:
        held = lay.stages_of(p)
        swatches = " ".join(f"<span style='color:{stage_color(s)}'>■</span>{s}" for s in held)
        ranks = [mesh.rank(p, dp=c.dp, tp=c.tp, cp=c.cp) for c in columns] if inner else [mesh.rank(p)]
        cells = "".join(f"<td style='{cell}' title='process {r}: {html.escape(mesh.label(r))}'>{r}</td>"
                        for r in ranks)
        rows.append(f"<tr class='pipeviz-mesh-row'><th style='{cell};text-align:left'>pp{p}: stage"
                    f"{'s' * (len(held) > 1)} {swatches}</th>{cells}</tr>")
    shards = ""
    if mesh.tp > 1:  # what each shard holds: heads, hidden units, what stays whole
        from pipeviz.schedule.tensor_parallel import shard_summary, sharded_modules

        try:
            lines = shard_summary(plan.graph.model, sharded_modules(plan, config.tp_plan, mesh.tp), mesh.tp)
        except Exception:  # a tp_plan Launch refuses: said at the controls
            lines = []
        if config.sequence_parallel:
            lines.append(f"sequence parallel: between the sharded regions (norms, dropout, the residual stream) "
                         f"each shard holds 1/{mesh.tp} of the tokens")
        shards = "".join(f"<div class='pipeviz-shards'>{html.escape(line).replace('.', '.<wbr>')}</div>"
                         for line in lines)
    if mesh.cp > 1:  # which tokens each share holds (the zig-zag chunks of adapter.context_graph)
        shards += "".join(f"<div class='pipeviz-shares'>{html.escape(line)}</div>" for line in _share_lines(mesh.cp))
    # with ep > 1: which routed experts each ep share computes (pipeviz.widgets.experts)
    shards += "".join(f"<div class='pipeviz-experts'>{html.escape(t)}</div>" for t in expert_share_lines(plan, mesh))
    what = " × ".join(f"{getattr(mesh, d)} {_DIM_WORDS[d]}" for d in mesh.dims)
    degrees = ", ".join(f"{d}={getattr(mesh, d)}" for d in DIMS if d != "cp" or mesh.cp > 1) + (
        f", ep={mesh.ep}" if mesh.ep > 1 else "")
    return (f"<div class='pipeviz-mesh-box' style='font-size:12px;max-width:100%;overflow-x:auto'>"
            f"<b>{mesh.world} process{'es' * (mesh.world != 1)}</b> ({what}: pv.Mesh({degrees}))"
            f"<table style='border-collapse:collapse'>{''.join(rows)}</table>{shards}</div>")


def _share_lines(cp: int) -> list[str]:
    """Per cp share, the tokens it holds of every sequence: chunks r and 2·cp−1−r of 2·cp equal chunks."""
    n = 2 * cp
    return [f"cp{r}: tokens of chunks {r} and {n - 1 - r} of {n} (fractions {r}/{n}–{r + 1}/{n} and "
            f"{n - 1 - r}/{n}–{n - r}/{n} of every sequence; 1/{cp} of its tokens)" for r in range(cp)]


_DIM_WORDS = {"pp": "pipeline ranks", "dp": "replicas", "cp": "sequence shares", "tp": "shards"}


_STATE_COLORS = {"✓": "#1a7f37", "✗": "#c0392b"}


def run_state_html(state: RunState) -> str:
    """A run's state in its one vocabulary (``run_state``): the verdict, coloured by its mark, and "out of date"
    in orange when the plan or a setting changed since the launch; what the status line and the chart title
    start with."""
    color = _STATE_COLORS.get(state.mark, "#e67e22" if state.word == "stopped" else "#333")
    stale = (f" · <span class='pipeviz-out-of-date' style='color:#e67e22'>⚠ {html.escape(state.out_of_date)}</span>"
             if state.stale else "")
    return (f"<span class='pipeviz-run-status' style='color:{color}'><b>{html.escape(state.verdict)}</b></span>"
            f"{stale}")


def progress_html(run: pv.Run, state: RunState | None = None) -> str:
    """One line: the run's state (``run_state_html``; default: its status alone), what it is doing now and since
    when, step i/n, last loss, events so far."""
    loss = f" · loss {run.losses[-1]:.4f}" if run.losses else ""
    elapsed = (run.phases[-1][0] if run.phases else 0.0) if run.done else time.time() - run.started_at
    total = run.steps or "?"
    phase = "" if run.phase in (run.status, f"step {run.step}/{total}") else f" · {html.escape(run.phase)}"
    return (f"{run_state_html(state or RunState(run.status))}<span class='pipeviz-run-phase'>{phase}</span> · "
            f"step {run.step}/{total}{loss} · {len(run.events):,} events · {elapsed:.1f} s")


def cost_note_html(graph: GraphView, options: CostOptions | None) -> str:
    """What the cost settings change on this model, when it is less than they say: selective recomputation on
    a fused attention keeps nothing less than no recomputation (``pv.plan_cluster`` notes the same)."""
    if options is not None and options.recompute == "selective" and selective_saves_nothing(graph, options):
        return ("<span class='pipeviz-hint-text'>Note: selective recomputation = none here: the model's attention is "
                "fused (no stored scores to drop); full recomputation saves memory.</span>")
    return ""


def run_notes_html(run: pv.Run, sim: Timeline | None, here: Timeline | None, cores: int, load: float,
                   hardware: str | None = None, shown: Timeline | None = None) -> str:
    """Why the measured step differs from the simulated one, next to both numbers. ``hardware``: the named
    hardware the simulation costs the plan on (not this machine's), said beside its step. ``shown``: the
    timeline the chart beside the notes drew (default: the run's now), so both give the same measured step."""
    tl = shown if shown is not None else run.timeline()
    if not tl.events:
        return ""
    measured = tl.step_time
    parts = [f"measured step {measured * 1e3:.2f} ms"]
    if sim is not None and sim.schedule == run.schedule and sim.num_stages == run.layout.num_stages:
        where = f"on {hardware}, not this machine" if hardware else "a core per rank"
        parts.append(f"simulated {sim.step_time * 1e3:.2f} ms ({where})")
    if here is not None:
        parts.append(f"simulated as run here ({plural(here.meta.get('cores') or cores, 'core')}) "
                     f"{here.step_time * 1e3:.2f} ms")
    why = []
    procs = run.mesh.world  # every process, replicas and shards included, not the pipeline ranks only
    if procs > cores:
        why.append(f"{procs} processes share {plural(cores, 'CPU core')} here, so ranks wait for a core "
                   "and every step is longer than the simulation (which gives each rank a core of its own)")
    if load > cores:
        why.append(f"the machine is busy (load average {load:.1f} on {plural(cores, 'core')})")
    tp = getattr(run.spec, "tp", 1)
    if tp > 1 and sim is not None:
        why += tp_notes(measured, sim, here, tp, procs, cores)
    text = " · ".join(parts)
    if why:
        text += "<br><span class='pipeviz-why'>Why they differ: " + "; ".join(why) + ".</span>"
    return f"<div style='font-size:12px'>{text}</div>"


def view_note_html(redraws: int, seconds: float, busy_interval: float | None, processes: int, cores: int) -> str:
    """What the live view costs the run it shows: its redraws and their time in the kernel, and, while the
    processes take every core, that it redraws less often (the browser's drawing is not counted here: measured
    in ``benchmarks/speed/explorer_overhead.py``)."""
    if not redraws:
        return ""
    text = f"live view: {plural(redraws, 'redraw')}, {seconds * 1e3:.0f} ms of the kernel's time"
    if busy_interval is not None:
        text += (f"; {processes} processes take the {plural(cores, 'core')} here, so it redraws every "
                 f"{busy_interval:g} s (each redraw, in the kernel and the browser, is time taken from the ranks)")
    return f"<div class='pipeviz-view-note' style='font-size:11px;color:#555'>{text}.</div>"


def numerics_html(state: RunState) -> str:
    """The numerics line: ``pv.check_numerics(run)`` in the run's state words (``RunState.numerics``: ✓ or ✗ with
    the differences, "not conclusive" and why, "not checked" after Stop), ``""`` while the run goes."""
    text = state.numerics
    if not text:
        return ""
    color = _STATE_COLORS.get(state.mark, "#333")
    return (f"<div class='pipeviz-numerics-check' style='color:{color}'><b>Numerics check:</b> "
            f"{html.escape(text)}</div>")


def error_html(text: str, mono: bool = True) -> str:
    """A red box. It wraps at spaces only (a word too long for the line scrolls sideways): ``overflow-wrap:
    anywhere`` broke words in the middle ("it do|es not divide"). ``mono``: a traceback's monospace; a refusal's
    one sentence is set in the page's font."""
    font = "" if mono else "font-family:inherit;"
    return ("<div style='border:1px solid #e74c3c;background:#fdecea;color:#922;padding:4px 8px;margin:4px 0;"
            "max-width:100%;box-sizing:border-box'><pre style='white-space:pre-wrap;overflow-wrap:normal;"
            f"word-break:normal;margin:0;{font}font-size:12px;max-height:240px;overflow:auto'>{html.escape(text)}"
            "</pre></div>")


def notes_html(notes: list[str]) -> str:
    """pipeviz's notices about the model (fixes it applied to its own copies), as short notes."""
    return "".join(f"<div style='font-size:11px;color:#555'>Note: {html.escape(n)}</div>" for n in notes)


class PipeView:
    """"Show Pipe": torch's ``Pipe`` for the plan (``plan.pipe(microbatches)``, traced once per plan and count: seconds)
    printed under a toggle (``button``, ``text``), following the plan while shown.

    Args:
        current: the plan and microbatch count to show now.
        show_error: where a tracing failure goes (the Explorer's error area).
    """

    def __init__(self, current: Callable[[], tuple[SplitPlan, int]],
                 show_error: Callable[[BaseException], None]) -> None:
        import ipywidgets as W

        self._current, self._show_error = current, show_error
        self._cache: dict[tuple[str, int], str] = {}
        self.button = W.ToggleButton(description="Show Pipe", icon="code", value=False,
                                     tooltip="print torch's Pipe for this plan (traces it: seconds)")
        self.button.observe(lambda _: self.show(), "value")
        self.text = W.HTML(layout=W.Layout(max_width="100%"))

    def show(self) -> None:
        if not self.button.value:
            self.button.description, self.text.value = "Show Pipe", ""
            return
        self.button.description = "Hide Pipe"
        plan, microbatches = self._current()
        key = (plan.to_json(), microbatches)
        try:
            if key not in self._cache:
                self.text.value = "<i>tracing the Pipe…</i>"
                self._cache[key] = str(plan.pipe(microbatches))
            self.text.value = (f"<pre style='max-height:320px;overflow:auto;font-size:11px;max-width:100%'>"
                               f"{html.escape(self._cache[key])}</pre>")
        except Exception as exc:
            self.text.value = ""
            self._show_error(exc)
