"""Scale out: export a plan to a torchrun script for many hosts, and watch its per-rank event files.

Example:
    >>> pv.export_torchrun(plan, "train_pp.py", schedule="1F1B", microbatches=8, steps=100,
    ...                    inputs=(x,), target=y, loss_fn=F.cross_entropy)
    $ torchrun --nproc-per-node 4 train_pp.py                                   # one host
    $ torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 --master-port 29500 train_pp.py
    >>> w = pv.watch("train_pp_events")            # live: w.events, w.losses, w.timeline(), TimelineView(w)

The script trains exactly as ``pv.launch`` does (same stages, relays, tied-gradient sums, schedule, and
numerics); every host needs pipeviz installed and the ``.payload.pkl`` file written next to the script.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from pipeviz._compat import positional_legacy
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.torchrun import run_rank
from pipeviz.runtime.watch import Watch, watch
from pipeviz.schedule.config import UNSET, LaunchConfig, launch_config

# run_rank, Watch and watch live in pipeviz.runtime; their names here are the ones scripts exported before 0.3 import.
__all__ = ["Watch", "export_torchrun", "run_rank", "watch"]

_SCRIPT = '''#!/usr/bin/env python
"""Pipeline-parallel training exported by pipeviz {version}: {summary}.

Run with torchrun, one process per rank ({ranks} ranks):
    torchrun --nproc-per-node {ranks} {name}
    torchrun --nnodes N --node-rank I --nproc-per-node K --master-addr HOST --master-port PORT {name}
Each rank writes JSON lines to {events}/rank<R>.jsonl (events, losses, step ends); pipeviz.watch(folder)
shows them live. Needs pipeviz on every host and {payload} next to this script.
"""
import os
import sys

from pipeviz.runtime.torchrun import run_rank


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    events = os.environ.get("PIPEVIZ_EVENTS", os.path.join(here, {events!r}))
    sys.exit(run_rank(os.path.join(here, {payload!r}), events))
'''


@positional_legacy("microbatches", "steps")
def export_torchrun(
    plan: SplitPlan, path: str | os.PathLike[str], config: LaunchConfig | str | None = None, *,
    microbatches: int = UNSET, steps: int = UNSET, inputs: tuple[object, ...] | None = None,
    target: torch.Tensor | None = None, input_kwargs: Mapping[str, object] | None = None, events_dir: str | None = None,
    eval_data: Iterable[object] | None = None, resume: str | os.PathLike[str] | None = None, **options: object,
) -> Path:
    """Write a torchrun script that trains ``plan`` as ``pv.launch`` would (and its payload beside it).

    Takes the one launch configuration ``pv.launch`` takes (a ``pv.LaunchConfig``, or a schedule's name, third,
    and/or its fields as keywords, the same defaults), and everything is validated here, as ``pv.launch``
    validates, before a script exists. The script uses NCCL when every process has its own GPU (``LOCAL_RANK``),
    else gloo (CPU or a shared GPU). With ``dp`` replicas and ``tp`` shards the processes are laid out as
    ``pv.launch`` lays them out (``pv.Mesh``: pipeline ranks × replicas × shards, numbered pp-major then dp then
    tp, so a host's ``--nproc-per-node`` consecutive ranks hold a stage's shards and replicas).

    Example:
        >>> cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=100, loss_fn=pv.cross_entropy, dp=2)
        >>> pv.export_torchrun(plan, "train.py", cfg, inputs=(x,), target=y)

    ``eval_data``: held-out batches, as ``pv.launch`` takes them (shipped in the payload; every process evaluates
    its share every ``eval_every`` steps and after the last, and ``pv.watch(folder).eval_losses`` reads them).
    ``resume``: a folder ``run.save(folder)`` wrote after a training run: the script goes on from it, as
    ``pv.launch(..., resume=folder)`` does (its weights, every parameter's optimizer state, the scheduler, the step
    count), under this plan's layout. Each process reads its own share from the folder when it starts, so on
    several hosts the folder must be where every host sees it (shared storage, at the same absolute path).

    Returns:
        The script's path. Its payload is ``<script>.payload.pkl``; events go to ``<script stem>_events/``.

    Raises:
        LaunchError, ScheduleError, PlanError: what ``pv.launch`` would refuse, and ``devices`` other than
            ``"auto"`` (torchrun gives each process its ``LOCAL_RANK`` GPU).
    """
    import cloudpickle

    from pipeviz.errors import LaunchError
    from pipeviz.runtime.checks import validate_launch
    from pipeviz.runtime.payloads import spec_stages

    cfg = launch_config(config, microbatches=microbatches, steps=steps, **options)
    if cfg.devices != "auto":
        raise LaunchError(f"devices={cfg.devices!r} cannot be exported: under torchrun each process takes its "
                          "LOCAL_RANK GPU (or the CPU without GPUs). Fix: devices='auto' (the default).")
    checkpoint = None
    if resume is not None:  # the weights and the optimizer's state from the checkpoint, read by each process
        from pipeviz.runtime.checkpoint import read_resume
        from pipeviz.runtime.spec import default_optimizer

        resume = os.path.abspath(os.fspath(resume))
        checkpoint = read_resume(plan, resume, cfg, cfg.optimizer or default_optimizer)
    spec = validate_launch(plan, cfg, inputs=inputs, input_kwargs=None if input_kwargs is None else dict(input_kwargs),
                           target=target, eval_data=eval_data)
    script = Path(path)
    payload = script.with_suffix(".payload.pkl")
    events = events_dir or f"{script.stem}_events"
    stages, tied = spec_stages(plan, spec)
    sources = None
    if checkpoint is not None:
        from pipeviz.runtime.checks import check_weights
        from pipeviz.runtime.payloads import stage_sources

        spec.sources, spec.init_seed = check_weights(plan, resume, cfg.init_seed), cfg.init_seed
        spec.resume = checkpoint
        sources = stage_sources(plan, stages, spec)
    payload.write_bytes(cloudpickle.dumps({"spec": spec, "stages": stages, "tied": tied, "sources": sources}))
    from pipeviz.version import __version__

    mesh = spec.mesh
    layout = "".join(f" x {n} {what}" for n, what in ((mesh.dp, "replicas"), (mesh.cp, "sequence shares"),
                                                       (mesh.tp, "shards")) if n > 1)
    summary = (f"{type(plan.graph.model).__name__}, {plan.num_stages} stages on {spec.layout.num_ranks} ranks{layout}, "
               f"{spec.schedule}, {spec.microbatches} microbatches, {spec.steps} steps")
    script.write_text(_SCRIPT.format(version=__version__, summary=summary, ranks=mesh.world,
                                     name=script.name, events=events, payload=payload.name))
    script.chmod(0o755)
    return script
