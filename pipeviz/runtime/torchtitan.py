"""Export a plan and its launch configuration as a torchtitan job-config fragment (TOML).

torchtitan takes the split as data: ``[parallelism] module_fqns_per_model_part``, one list of module names per model
part (stage), with the schedule (torch's name, or a CSV of per-rank actions for a custom order), the microbatch size
and the data / tensor / context parallel degrees beside it. torchtitan 0.2 reads the file itself
(``--job.config_file``, merged over its defaults); 0.3 builds its configuration in Python, and the same fields set
there (``dataclasses.replace(config.parallelism, **fragment["parallelism"])``) or as ``--parallelism.<field>``
flags.

Example:
    >>> cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=8, stages_per_rank=2, dp=4)
    >>> pv.export_torchtitan(plan, cfg, "pp.toml")
    $ ./run_train.sh --job.config_file pp.toml        # torchtitan 0.2 (or merge it into your job's TOML)
"""

from __future__ import annotations

import bisect
import csv
import json
import os
from collections.abc import Mapping
from pathlib import Path

from pipeviz.capture.units import ROOT
from pipeviz.plan.errors import PlanError
from pipeviz.plan.pipe import check_batch_split
from pipeviz.plan.split import SplitPlan
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig, launch_config
from pipeviz.sim.engine import check_order
from pipeviz.version import __version__

__all__ = ["export_torchtitan", "module_fqns"]


def module_fqns(plan: SplitPlan, rename: Mapping[str, str] | None = None) -> list[list[str]]:
    """Per stage, the model's own module names torchtitan's ``module_fqns_per_model_part`` takes: every module the
    stage runs whole, outermost first, in execution order; a ``ModuleList`` / ``ModuleDict`` is named by its items
    (``layers.0``, ``layers.1``: torchtitan keeps or drops a list's items one by one). ``rename`` maps name prefixes
    (whole dotted parts) to the names of the model torchtitan builds, e.g. ``{"model.embed_tokens":
    "tok_embeddings", "model.layers": "layers", "model.norm": "norm", "model.rotary_emb": "rotary_emb"}`` for
    torchtitan's Hugging Face backend.

    Example:
        >>> module_fqns(graph.split(["layers.1"]))          # a torchtitan-style model
        [['tok_embeddings', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'output']]

    Raises:
        PlanError: a split inside a list's item (a transformer block): torchtitan places whole items.
    """
    tree = plan.graph._tree
    positions = plan.positions
    parts: list[list[str]] = [[] for _ in range(plan.num_stages)]

    def stage(op: int) -> int:
        return bisect.bisect_left(positions, op)

    def walk(name: str) -> None:
        unit = tree.units[name]
        lo, hi = stage(unit.first), stage(unit.last)
        if name != ROOT and unit.called and lo == hi:
            if unit.fqn not in parts[lo]:  # a module called twice in one stage (fqn@0, fqn@1) is named once
                parts[lo].append(unit.fqn)
            return
        parent = tree.units[unit.parent] if name != ROOT else None
        if lo != hi and parent is not None and not parent.called:
            raise PlanError(f"Stages {lo} and {hi} share {unit.fqn!r}, an item of {parent.fqn!r}: torchtitan's "
                            "module_fqns_per_model_part keeps or drops a list's items whole. Fix: split between "
                            f"the items of {parent.fqn!r}, at the END of {unit.fqn!r} or before it.")
        for child in unit.children:
            walk(child)

    walk(ROOT)
    if rename:
        parts = [[_renamed(n, rename) for n in part] for part in parts]
    return parts


def _renamed(name: str, rename: Mapping[str, str]) -> str:
    hits = [k for k in rename if name == k or name.startswith(k + ".")]
    if not hits:
        return name
    key = max(hits, key=len)
    new = rename[key] + name[len(key):]
    return new.lstrip(".")


def export_torchtitan(plan: SplitPlan, config: LaunchConfig | str, path: str | os.PathLike[str], *,
                      microbatch_size: int | None = None, rename: Mapping[str, str] | None = None) -> Path:
    """Write ``plan`` under ``config`` as a torchtitan TOML fragment: ``[parallelism]`` (the pipeline degree, the
    stages as ``module_fqns_per_model_part``, the schedule, the microbatch size, the dp / tp / cp degrees) and
    ``[training] local_batch_size`` (microbatch size x microbatches, so torchtitan cuts as many microbatches).

    Example:
        >>> cfg = pv.LaunchConfig(schedule="1F1B", microbatches=8, dp=2, tp=2)
        >>> pv.export_torchtitan(plan, cfg, "pp.toml")                    # then: --job.config_file pp.toml
        >>> pv.export_torchtitan(plan, cfg.replace(order=my_order), "pp.toml")  # + pp.schedule.csv beside it

    Args:
        plan: the split; its stages become ``module_fqns_per_model_part`` (``module_fqns``: the model's own names).
        config: a ``pv.LaunchConfig`` (or a schedule's name). Its schedule is torch's name, which torchtitan takes
            as it is; with ``order`` (a custom schedule) the actions are written one row per pipeline rank to
            ``<path stem>.schedule.csv`` beside the TOML, torch's ``_load_csv`` format, and its absolute path is
            ``pipeline_parallel_schedule_csv`` (the schedule still places the stages: loop, or V for ZBV/DualPipeV).
            ``dp`` replicas are ``data_parallel_replicate_degree`` (DDP), or ``data_parallel_shard_degree`` with
            ``dp_shard`` (FSDP2, as pipeviz runs it) or ``dp_reduce="zero1"`` (torchtitan's nearest: FSDP2, which
            shards the parameters too); ``tp`` and ``cp`` keep their names' degrees.
        path: the TOML file to write.
        microbatch_size: samples per microbatch (per replica); default: the traced batch / (dp x microbatches), the
            batch ``pv.launch`` would split the same way. Give it for a plan traced at another batch (a planner
            row's ``row.microbatch_size``).
        rename: module-name prefixes mapped to the names torchtitan's model has (``module_fqns``).

    Returns:
        The TOML's path.

    Raises:
        ScheduleError: a layout or microbatch count the schedule refuses, or a custom order that cannot run (an
            action missing or doubled, on the wrong rank, or a deadlock: ``pipeviz.sim.engine.check_order``).
        PlanError: a split torchtitan cannot place (inside a block), or a batch the microbatches do not divide.
    """
    cfg = launch_config(config)
    lay = cfg.layout(plan.num_stages)
    sched.check_microbatches(lay.schedule, plan.num_stages, cfg.microbatches, cfg.stages_per_rank)
    order = cfg.actions()
    if order is not None:  # as pv.simulate and pv.launch check it: complete, on the right ranks, no deadlock
        check_order(order, lay, cfg.microbatches)
    size = microbatch_size if microbatch_size is not None else _microbatch_size(plan, cfg)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise PlanError(f"microbatch_size must be a positive int, got {size!r}.")
    parts = module_fqns(plan, rename)
    shard = cfg.dp_shard or cfg.dp_reduce == "zero1"
    target = Path(path)
    lines = [f"# {line}" if line else "#" for line in _header(plan, cfg, lay.num_ranks, parts, shard)]
    lines += ["", "[parallelism]", f"pipeline_parallel_degree = {lay.num_ranks}",
              f"pipeline_parallel_schedule = {_str(lay.schedule)}"]
    if order is not None:
        table = target.with_name(f"{target.stem}.schedule.csv")
        with open(table, "w", newline="") as f:
            csv.writer(f).writerows([str(a) for a in row] for row in order)  # torch's CSV: its text
        lines.append(f"pipeline_parallel_schedule_csv = {_str(str(table.resolve()))}")
    lines += [f"pipeline_parallel_microbatch_size = {size}", "module_fqns_per_model_part = ["]
    lines += [f"    [{', '.join(_str(n) for n in part)}]," for part in parts]
    lines += ["]",
              f"data_parallel_replicate_degree = {1 if shard else cfg.dp}",
              f"data_parallel_shard_degree = {cfg.dp if shard else 1}",  # torchtitan's default, -1, takes what is left
              f"tensor_parallel_degree = {cfg.tp}",
              f"context_parallel_degree = {cfg.cp}",
              # (torchtitan's dp2ep: the experts sharded over ep of the dp-shard x cp ranks)
              *([f"expert_parallel_degree = {cfg.ep}"] if cfg.ep > 1 else []),
              "", "[training]", f"local_batch_size = {size * cfg.microbatches}"]
    if cfg.accumulate > 1:  # torchtitan accumulates global / (local x dp) batches per step
        lines.append(f"global_batch_size = {size * cfg.microbatches * cfg.dp * cfg.accumulate}")
    target.write_text("\n".join(lines) + "\n")
    return target


def _microbatch_size(plan: SplitPlan, cfg: LaunchConfig) -> int:
    batch = plan.graph.batch_size
    if batch is None:
        raise PlanError("The plan's traced inputs have no batch dimension to cut into microbatches. Fix: "
                        "microbatch_size=<samples per microbatch>.")
    if batch % cfg.dp:
        raise PlanError(f"dp={cfg.dp} replicas cannot share the traced batch of {batch} equally. Fix: a dp dividing "
                        f"{batch}, or microbatch_size=<samples per microbatch>.")
    check_batch_split(batch // cfg.dp, cfg.microbatches)
    return batch // cfg.dp // cfg.microbatches


def _header(plan: SplitPlan, cfg: LaunchConfig, ranks: int, parts: list[list[str]], shard: bool) -> list[str]:
    model = type(plan.graph.model).__name__
    out = [f"torchtitan job-config fragment written by pipeviz {__version__}: {model}, {plan.num_stages} stages on "
           f"{ranks} pipeline ranks, {cfg.schedule}{' with a custom order' if cfg.order else ''}, "
           f"{cfg.microbatches} microbatches.",
           "torchtitan 0.2: --job.config_file this.toml (or merge it into your job's TOML). torchtitan 0.3: set the",
           "same fields on your Trainer.Config: config.parallelism = dataclasses.replace(config.parallelism,",
           "**tomllib.load(f)['parallelism']), and config.training.local_batch_size."]
    nested = sorted({n.split(".")[0] for part in parts for n in part if "." in n and not n.split(".")[1].isdigit()})
    if nested:
        out += ["", f"Names nested under {', '.join(nested)}: torchtitan's pipeline_module_split keeps top-level "
                "modules and the items of top-level", "ModuleLists; for a model torchtitan wraps under other names, "
                "export with rename={prefix: its name}."]
    if shard and not cfg.dp_shard:
        out += ["", "dp_reduce='zero1' (sharded optimizer state): torchtitan's nearest is FSDP2, which shards the "
                "parameters too."]
    if cfg.tp > 1 and not cfg.sequence_parallel:
        out += ["", "sequence_parallel=False: torchtitan 0.3's parallelism.enable_sequence_parallel = false (0.2 "
                "always shards the sequence under TP)."]
    return out


def _str(text: str) -> str:
    # A TOML basic string: JSON's escapes are TOML's (\\, \", \n, \uXXXX).
    return json.dumps(text)
