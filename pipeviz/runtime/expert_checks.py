"""The checks before spawn for expert parallelism (``LaunchConfig.ep``): a layout the mesh admits, the settings it
runs with, and stages whose MoE blocks it can shard (``pipeviz.adapter.expert_graph``), each refused naming ep.

Example:
    >>> experts_layout(draft)            # a plan check: ep's degree and the settings beside it
    >>> expert_stages(plan, spec)        # after the spec: every MoE block's experts divide by ep
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeviz.errors import LaunchError

if TYPE_CHECKING:
    from pipeviz.plan.split import SplitPlan
    from pipeviz.runtime.spec import LaunchSpec

__all__ = ["expert_overlap", "expert_stages", "experts_layout"]


def _unsupported(cfg: Any) -> list[tuple[str, str]]:
    """(what it is, the fix) for each setting set beside ep that expert parallelism does not run with."""
    out = []
    if cfg.tp > 1:
        out.append((f"tp={cfg.tp}", "tp=1"))
    if cfg.cp > 1:
        out.append((f"cp={cfg.cp}", "cp=1 (ep carved out of dp alone)"))
    if cfg.dp_shard:
        out.append(("dp_shard=True (FSDP2)", "dp_shard=False"))
    if cfg.dp_reduce in ("zero1", "ddp"):
        out.append((f"dp_reduce={cfg.dp_reduce!r}", "dp_reduce='overlap' or 'after_flush'"))
    if cfg.mixed_precision is not None:
        out.append((f"mixed_precision={cfg.mixed_precision!r}", "mixed_precision=None"))
    if cfg.compile:
        out.append((f"compile={cfg.compile!r}", "compile=False"))
    rec = cfg.recompute
    if (rec != "none") if isinstance(rec, str) else any(r != "none" for r in rec):
        out.append((f"recompute={rec!r}", "recompute='none'"))
    if cfg.order is not None:
        out.append(("a custom order=", "one of torch's schedules"))
    return out


def experts_layout(d: Any) -> None:
    """Expert parallelism (``LaunchConfig.ep``): an ep dividing dp × cp (``Mesh``), a training run, and none of the
    settings it does not run with (each named with ep, and the fix)."""
    cfg = d.config
    if cfg.ep == 1:
        return
    cfg.mesh(d.plan.num_stages)  # (an ep that does not divide dp x cp: MeshError, named "ep" by the caller)
    for what, fix in _unsupported(cfg):
        raise LaunchError(f"ep={cfg.ep} with {what}: expert parallelism runs beside pipeline and data parallelism "
                          f"only (eager, fp32, no recompute; gradients averaged by the overlapped or after-flush "
                          f"reduction). Fix: {fix}, or ep=1.", setting="ep")
    if not d.plan.graph.capture.traced:
        raise LaunchError(f"ep={cfg.ep}: expert parallelism shards the experts of a traced graph; this plan's stages "
                          "are module copies (pv.manual_plan). Fix: a plan from pv.trace, or ep=1.", setting="ep")


def expert_stages(plan: SplitPlan, spec: LaunchSpec) -> None:
    """The launch's stages (cached for it) searched for MoE blocks: refused, naming ep, where none has routed experts,
    where a block's experts do not divide by ep, or where pipeviz cannot cut a block's experts out."""
    from pipeviz.adapter.expert_graph import ExpertError, find_blocks, schedule
    from pipeviz.runtime.payloads import launch_stages

    ep = spec.ep
    stages, _ = launch_stages(plan, spec)
    found = []
    for runner in stages.runners:
        try:
            blocks = find_blocks(runner.stage)  # type: ignore[arg-type]
            schedule(runner.stage.graph, blocks)  # type: ignore[arg-type]
        except ExpertError as exc:
            raise LaunchError(f"ep={ep}: stage {runner.index}: {exc}. Fix: ep=1.", setting="ep") from exc
        found += [(runner.index, b) for b in blocks]
    if not found:
        raise LaunchError(f"ep={ep}: the model has no routed experts (no module named '<block>.experts.<e>' in an "
                          "nn.ModuleList, nor transformers' fused experts) for expert parallelism to shard. Fix: ep=1, "
                          "or a mixture-of-experts model.", setting="ep")
    for stage, b in found:
        if b.count % ep:
            fits = [str(e) for e in range(1, b.count + 1) if b.count % e == 0 and (spec.dp * spec.cp) % e == 0]
            raise LaunchError(f"ep={ep} does not divide the {b.count} routed experts of {b.name} (stage {stage}): each "
                              f"of ep processes holds an equal block of them. Valid ep: {', '.join(fits)}. "
                              "Fix: one of those.", setting="ep")


def expert_overlap(d: Any) -> None:
    """``ep_overlap`` and ``ep_delay`` where they can run (``pipeviz.schedule.ep_overlap``): ep > 1, DualPipeV's
    order; refused naming the value and the valid choices."""
    from pipeviz.schedule.ep_overlap import ep_overlap_refusal

    why = ep_overlap_refusal(d.config)
    if why is not None:
        raise LaunchError(why, setting="ep_overlap" if why.startswith("ep_overlap") else "ep_delay")
