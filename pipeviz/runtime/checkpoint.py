"""Checkpoints a run can resume from, under any layout: the weights, the optimizer's state per parameter and its
hyperparameters, the learning-rate scheduler, the steps done and the batches consumed.

Saved by ``run.save(folder)`` beside the weights (HF's safetensors layout, by the model's own names):

- ``optimizer.safetensors``: every parameter's optimizer state (``"<name>::<key>"``: ``"l1.weight::exp_avg"``),
  whole tensors under the model's names (a tensor-parallel or FSDP2 shard's gathered);
- ``trainer_state.pt``: the optimizer's class and parameter groups' hyperparameters, the scheduler's
  ``state_dict``, the steps and batches done (``torch.save``: a scheduler's state is any picklable value);
- ``pipeviz_checkpoint.json``: the same facts for a person (and what ``resume=`` checks first).

Why safetensors by name and not torch's distributed checkpoint: the keys are the model's own, so any layout (pp 2
-> 3, dp 1 -> 2, tp, another schedule) finds its tensors by name, each process reading only its own
(``safe_open``), without a process group; the weights are the folder ``weights=`` and HF ``from_pretrained`` read.
DCP reshards too, but keys each tensor by the saving module's names (a pipeline stage's are not the model's) and
loads inside a process group.

Example:
    >>> run = pv.launch(plan, "1F1B", 4, 2, ..., optimizer=lambda ps: torch.optim.AdamW(ps, 1e-3))
    >>> run.wait(); run.save("ckpt")
    >>> more = pv.launch(plan2, "Interleaved1F1B", 4, 2, ..., resume="ckpt", dp=2)   # steps 3 and 4
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeviz.errors import LaunchError
from pipeviz.runtime.expert_shards import held_part

if TYPE_CHECKING:
    from pipeviz.plan.split import SplitPlan
    from pipeviz.schedule.config import LaunchConfig

__all__ = ["MANIFEST", "OPTIMIZER_FILE", "TRAINER_FILE", "Resume", "gathered_optimizer_state", "load_optimizer",
           "read_resume", "write_checkpoint"]

MANIFEST = "pipeviz_checkpoint.json"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_FILE = "trainer_state.pt"
SEP = "::"


@dataclass
class Resume:
    """What a resumed launch continues from (``pv.launch(..., resume=folder)``): sent to every process, which
    reads its own parameters' optimizer state from ``folder`` by name.

    Attributes:
        folder: the checkpoint folder.
        step: optimizer steps done before (the resumed run's first step is ``step``: dropout draws, the scheduler).
        batches: batches consumed (a ``data=`` stream skips them).
        groups: the optimizer's parameter groups' hyperparameters (``lr`` as the scheduler left it, ...).
        scheduler: the scheduler's ``state_dict`` (None: the run had none).
        names: canonical parameter name -> its key in ``optimizer.safetensors`` (the model's name).
    """

    folder: str
    step: int
    batches: int
    optimizer: str
    groups: list[dict[str, Any]] = field(default_factory=list)
    scheduler: dict[str, Any] | None = None
    names: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- on a rank
def gathered_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                             names: Mapping[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's optimizer state as whole tensors on the CPU, by canonical name. A tensor-parallel or FSDP2
    state (a DTensor) is gathered: every process of its mesh must call this, in the same order."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for t in params:
        state = optimizer.state.get(t)
        if not state or id(t) not in names:
            continue
        kept: dict[str, torch.Tensor] = {}
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor):
                full = getattr(value, "full_tensor", None)
                kept[key] = (full() if callable(full) else value).detach().cpu().clone()
            elif isinstance(value, int | float):
                kept[key] = torch.tensor(value, dtype=torch.float64)
        out[names[id(t)]] = kept
    return out


def load_optimizer(resume: Resume, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None, params: list[torch.nn.Parameter],
                   names: Mapping[int, str]) -> None:
    """Put the checkpoint's state into this rank's optimizer (its parameters' state, read by name, laid out as each
    parameter is: a tensor-parallel or FSDP2 shard takes its part) and scheduler, and the groups' hyperparameters
    (the learning rate as the scheduler left it)."""
    from safetensors import safe_open

    path = os.path.join(resume.folder, OPTIMIZER_FILE)
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        for t in params:
            canon = names.get(id(t))
            name = resume.names.get(canon or "")
            if name is None:
                continue
            state: dict[str, object] = {}
            for key in sorted(k for k in keys if k.startswith(name + SEP)):
                value = held_part(f.get_tensor(key), t)  # (expert parallelism: this process's experts alone)
                what = key[len(name) + len(SEP):]
                if value is None:
                    continue
                if value.dim() == 0 and what == "step":  # Adam's step count: a tensor on the CPU, as torch keeps it
                    state[what] = value.to(torch.float32).clone()
                    continue
                state[what] = _laid_out_as(value, t)
            if state:
                optimizer.state[t] = state
    for group, saved in zip(optimizer.param_groups, resume.groups, strict=False):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if scheduler is not None and resume.scheduler is not None:
        scheduler.load_state_dict(resume.scheduler)


def _laid_out_as(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole state tensor as ``param`` is: on its device and dtype, and a DTensor's part of it (each process cuts
    its own: no communication). Always a new tensor: two copies of a tied weight on one rank (ZBV's embedding and
    head) must not share the state the optimizer updates in place (shared, it took two updates a step)."""
    value = value.to(device=param.device, dtype=param.dtype if value.is_floating_point() else value.dtype,
                     copy=True)
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return value
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


# ------------------------------------------------------------------------------------------- launching process
def write_checkpoint(folder: str | os.PathLike[str], optim: Mapping[str, Mapping[str, torch.Tensor]],
                     trainer: Mapping[str, Any], names: Mapping[str, str]) -> list[str]:
    """Write ``optimizer.safetensors`` (``optim`` by the model's names: ``names`` maps canonical names to them),
    ``trainer_state.pt`` and the manifest into ``folder`` (the weights are written beside them by ``run.save``).
    Returns the files written."""
    from safetensors.torch import save_file

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    flat = {f"{names.get(canon, canon)}{SEP}{key}": t.contiguous()
            for canon, state in optim.items() for key, t in state.items()}
    files = [os.path.join(folder, OPTIMIZER_FILE), os.path.join(folder, TRAINER_FILE), os.path.join(folder, MANIFEST)]
    save_file(flat, files[0], metadata={"format": "pt"})
    torch.save(dict(trainer), files[1])
    manifest = {"format": "pipeviz checkpoint", "version": 1, "step": trainer["step"], "batches": trainer["batches"],
                "optimizer": trainer["optimizer"], "scheduler": trainer["scheduler"] is not None,
                "layout": trainer.get("layout", {}), "optimizer_state": sorted({k.split(SEP)[1] for k in flat})}
    Path(files[2]).write_text(json.dumps(manifest, indent=2))
    return files


def read_resume(plan: SplitPlan, folder: str | os.PathLike[str], config: LaunchConfig,
                optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> Resume:
    """The checkpoint in ``folder``, checked against the plan's model and the launch's ``optimizer`` (factory)
    before any process starts (the weights themselves are checked by ``weights=``'s checks: names and shapes).

    Raises:
        LaunchError: no checkpoint there, another model's, or another optimizer's state."""
    from pipeviz.capture.weights import lookup_tensor

    folder = os.fspath(folder)
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest):
        raise LaunchError(f"resume={folder!r} holds no pipeviz checkpoint ({MANIFEST} is missing). Fix: resume= a "
                          "folder run.save(folder) wrote after a training run.", setting="resume")
    if config.loss_fn is None:
        raise LaunchError("resume= continues training, but no loss_fn was given. Fix: pass the run's loss_fn, or "
                          "weights=folder to run forward only from its weights.", setting="resume")
    trainer = torch.load(os.path.join(folder, TRAINER_FILE), weights_only=False)
    built = optimizer([torch.nn.Parameter(torch.zeros(1))])
    if type(built).__name__ != trainer["optimizer"]:
        raise LaunchError(f"resume={folder!r} holds {trainer['optimizer']}'s state, but the launch's optimizer is "
                          f"{type(built).__name__}. Fix: the same optimizer as the saved run's, or weights=folder to "
                          "start a new optimizer from its weights.", setting="resume")
    if (trainer["scheduler"] is None) != (config.lr_scheduler is None):
        had = "a" if trainer["scheduler"] is not None else "no"
        raise LaunchError(f"resume={folder!r} was saved with {had} learning-rate scheduler, and this launch has "
                          f"{'none' if config.lr_scheduler is None else 'one'}. Fix: lr_scheduler= as the saved run "
                          "had it.", setting="resume")
    from safetensors import safe_open

    with safe_open(os.path.join(folder, OPTIMIZER_FILE), framework="pt") as f:
        saved = {k.split(SEP)[0] for k in f.keys()}
    cap = plan.graph.capture
    keys = set(cap.model.state_dict())
    names = {canon: next((n for n in cap.aliases.get(canon, (canon,)) if n in keys), canon)
             for canon in cap.param_numel if canon not in cap.buffers}
    unknown = sorted(saved - set(names.values()))
    if unknown:
        raise LaunchError(f"resume={folder!r} holds optimizer state for {unknown[0]!r}, which this model does not "
                          f"have ({len(unknown)} such): a checkpoint of another model. Fix: resume from this model's "
                          "run.", setting="resume")
    with safe_open(os.path.join(folder, OPTIMIZER_FILE), framework="pt") as f:
        shapes = {k.split(SEP)[0]: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                  if not k.endswith(SEP + "step")}
    for canon, name in names.items():
        shape, want = shapes.get(name), tuple(lookup_tensor(cap.model, canon).shape)
        if shape is not None and shape != want:
            raise LaunchError(f"resume={folder!r}: the optimizer state of {name!r} is {shape}, the model's tensor "
                              f"{want}: a checkpoint of another model. Fix: resume from this model's run.",
                              setting="resume")
    return Resume(folder, int(trainer["step"]), int(trainer["batches"]), trainer["optimizer"],
                  list(trainer["groups"]), trainer["scheduler"], {c: n for c, n in names.items() if n in saved})
