"""Expert parallelism in the views: which routed experts each process computes (the Explorer's mesh box, with
``ep`` > 1), and the tokens routed to each expert per microbatch (``run.expert_tokens``) drawn as a heatmap per MoE
block with its load imbalance (max / mean) in the titles and the hover.

The experts are found as ``pipeviz.adapter.expert_graph`` finds them in a stage graph, here by module name on the
model itself (the mesh box redraws at every change of a control: no stage is built for it): a ``<block>.experts``
``nn.ModuleList`` (``pipeviz.zoo.MoENet``, transformers 4.x Mixtral / Qwen2-MoE) or transformers 5.x's fused experts
(a 3-D ``gate_up_proj``).

Example:
    >>> run = pv.launch(plan, "1F1B", 4, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, dp=2, ep=2)
    >>> run.wait(); pv.expert_tokens_figure(run).show()    # experts x microbatches, per block
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from torch import nn

if TYPE_CHECKING:
    from pipeviz.plan.split import SplitPlan
    from pipeviz.runtime.reducer import ExpertLoad
    from pipeviz.runtime.run import Run
    from pipeviz.schedule.mesh import Mesh

__all__ = ["expert_blocks", "expert_imbalance", "expert_share_lines", "expert_tokens_figure"]

_EXPERTS = re.compile(r"(^|\.)experts$")


def expert_blocks(model: nn.Module) -> list[tuple[str, int]]:
    """The model's MoE blocks as ``(experts' module name, routed expert count)``, in module order: an
    ``nn.ModuleList`` named ``...experts``, or a module named so with a 3-D ``gate_up_proj`` (fused experts)."""
    out = []
    for name, mod in model.named_modules():
        if not _EXPERTS.search(name):
            continue
        if isinstance(mod, nn.ModuleList) and len(mod):
            out.append((name, len(mod)))
        elif getattr(getattr(mod, "gate_up_proj", None), "ndim", 0) == 3:
            out.append((name, int(mod.gate_up_proj.shape[0])))
    return out


def _stage_of(plan: SplitPlan, block: str) -> int | None:
    """The stage whose layers hold ``block`` (a layer that is the block, inside it, or holds it)."""
    for info in plan.stages:
        if any(block == la or block.startswith(la + ".") or la.startswith(block + ".") for la in info.layers):
            return info.index
    return None


def _span(lo: int, hi: int) -> str:
    return f"expert {lo}" if hi - lo == 1 else f"experts {lo}–{hi - 1}"


def expert_share_lines(plan: SplitPlan, mesh: Mesh) -> list[str]:
    """The mesh box's words for ``mesh.ep`` > 1: per stage its MoE blocks, then per ep share the processes in it and
    the experts they compute (share r: experts [r·E/ep, (r+1)·E/ep) of each block's E); empty at ep 1, or for a
    model without routed experts (Launch's refusal says that)."""
    ep = mesh.ep
    blocks = expert_blocks(plan.graph.model) if ep > 1 else []
    if not blocks:
        return []
    per_stage: dict[int | None, list[str]] = {}
    for name, count in blocks:
        per_stage.setdefault(_stage_of(plan, name), []).append(f"{name} ({count})")
    where = "; ".join(f"{'stage ' + str(s) if s is not None else 'unplaced'}: {', '.join(names)}"
                      for s, names in per_stage.items())
    lines = [f"routed experts by stage: {where}"]
    counts = sorted({c for _, c in blocks if c % ep == 0})
    for r in range(ep):
        replicas = [d for d in range(mesh.dp) if d % ep == r]
        ranks = [int(mesh.rank(p, dp=d)) for p in range(mesh.pp) for d in replicas]
        held = ", ".join(f"{_span(r * c // ep, (r + 1) * c // ep)} of each block of {c}" for c in counts)
        lines.append(f"ep{r}: processes {', '.join(map(str, ranks))} (replica{'s' * (len(replicas) > 1)} "
                     f"{', '.join(map(str, replicas))} of each stage) compute {held}")
    lines.append(f"each process holds 1/{ep} of the routed experts (their weights, gradients and optimizer state) and "
                 "computes them; the router and shared experts are whole on every process")
    return lines


def _loads(source: Run | Sequence[ExpertLoad]) -> list[ExpertLoad]:
    """A run's ``expert_tokens``, or the records themselves."""
    return list(source if isinstance(source, Sequence) else source.expert_tokens)


def _grids(loads: Sequence[ExpertLoad]) -> dict[str, tuple[int, list[tuple[int, int]], np.ndarray]]:
    """Per block (in stage, then name order): its stage, the (step, mb) columns, and tokens [expert, column] summed
    over the replicas."""
    blocks: dict[str, tuple[int, dict[tuple[int, int], np.ndarray]]] = {}
    for ld in loads:
        _, cols = blocks.setdefault(ld.block, (ld.stage, {}))
        counts = np.asarray(ld.counts, dtype=np.int64)
        key = (ld.step, ld.mb)
        cols[key] = cols[key] + counts if key in cols else counts
    out = {}
    for name, (stage, cols) in sorted(blocks.items(), key=lambda kv: (kv[1][0], _natural(kv[0]))):
        keys = sorted(cols)
        out[name] = (stage, keys, np.stack([cols[k] for k in keys], axis=1))
    return out


def _natural(name: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _ratio(z: np.ndarray) -> float:
    """max / mean of tokens over experts (1.0: perfectly even; 0 tokens: 1.0)."""
    mean = float(z.mean())
    return float(z.max()) / mean if mean > 0 else 1.0


def expert_imbalance(source: Run | Sequence[ExpertLoad]) -> dict[str, tuple[float, float]]:
    """Per MoE block: (max / mean tokens per expert over the whole run, the same of its worst microbatch), the
    replicas' tokens summed. 1.0 is an even load; ``E`` (the expert count) all tokens on one expert."""
    out = {}
    for name, (_, _, z) in _grids(_loads(source)).items():
        out[name] = (_ratio(z.sum(axis=1)), max(_ratio(z[:, c]) for c in range(z.shape[1])))
    return out


def expert_tokens_figure(source: Run | Sequence[ExpertLoad], *, height: int | None = None) -> go.Figure:
    """Tokens routed to each expert per microbatch (``run.expert_tokens``, a run with ``ep`` > 1): one heatmap per MoE
    block, experts down, microbatches (of each step) across, the replicas' tokens summed; each block's title says its
    load imbalance (max / mean tokens per expert over the run, and in its worst microbatch), the hover every cell's
    count and its microbatch's max / mean.

    Raises:
        ValueError: no tokens recorded (a run without ``ep``, or before its first forward).
    """
    from plotly.subplots import make_subplots

    grids = _grids(_loads(source))
    if not grids:
        raise ValueError("No tokens per expert to draw: run.expert_tokens is empty (a run launched with ep > 1 records "
                         "them from its first forward). Fix: pv.launch(..., dp=D, ep=N) with a MoE model.")
    ratios = expert_imbalance(_loads(source))
    titles = [f"{n} (stage {s}): max/mean {ratios[n][0]:.2f}, worst microbatch {ratios[n][1]:.2f}"
              for n, (s, _, _) in grids.items()]
    fig = make_subplots(rows=len(grids), cols=1, subplot_titles=titles, vertical_spacing=min(0.3 / len(grids), 0.12))
    steps = {k[0] for _, keys, _ in grids.values() for k in keys}
    for row, (name, (_, keys, z)) in enumerate(grids.items(), start=1):
        x = [f"mb {m}" if len(steps) == 1 else f"s{s + 1} mb {m}" for s, m in keys]
        per_mb = [_ratio(z[:, c]) for c in range(z.shape[1])]
        custom = np.array([[per_mb[c] for c in range(z.shape[1])]] * z.shape[0])
        fig.add_trace(go.Heatmap(
            z=z, x=x, y=[f"expert {e}" for e in range(z.shape[0])], coloraxis="coloraxis", customdata=custom,
            name=name, hovertemplate=(f"<b>{name}</b> %{{y}} · %{{x}}<br>%{{z}} tokens<br>max/mean in this microbatch "
                                      "%{customdata:.2f}<extra></extra>")), row=row, col=1)
    worst = max(ratios, key=lambda n: ratios[n][0])
    fig.update_layout(
        title=f"Tokens per expert (replicas summed) · most imbalanced: {worst}, max/mean {ratios[worst][0]:.2f}",
        coloraxis={"colorscale": "Viridis", "colorbar": {"title": "tokens"}},
        height=height or 120 + 110 * len(grids), margin={"t": 70, "b": 30, "l": 70, "r": 10})
    fig.update_annotations(font_size=11)
    return fig
