"""What a finished run hands back (``pv.Run``'s part that reads results): the trained tensors under the original
model's names (``state_dict``, checked equal across replicas), a safetensors save, and a forward-only run's
outputs joined back into the model's output structure.

Example:
    >>> run.wait(); model.load_state_dict(run.state_dict()); run.save("trained/")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from pipeviz.plan.split import SplitPlan
    from pipeviz.runtime.reducer import Reducer
    from pipeviz.runtime.spec import LaunchSpec
    from pipeviz.schedule.mesh import Mesh

__all__ = ["RunResults"]


class RunResults:
    """The results half of ``pv.Run`` (a mixin: ``Run`` holds the state it reads)."""

    plan: SplitPlan
    spec: LaunchSpec
    mesh: Mesh
    status: str
    outputs: list[Any]
    _reducer: Reducer
    _replica_outputs: dict[int, dict[int, Sequence[object]]]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Trained parameters and buffers gathered from all stages, keyed by the original model's names
        (every alias of a tied tensor, so ``model.load_state_dict(run.state_dict())`` works). With replicas
        (``dp > 1``) these are replica 0's, after checking that every replica holds the same parameters (their
        buffers, such as running statistics, are each replica's own, as under DDP without buffer broadcast).

        Raises:
            RuntimeError: the run has not finished, or two replicas' parameters differ (naming the tensor)."""
        if self.status != "done":
            raise RuntimeError(f"state_dict() needs a finished run; status is {self.status!r}. Fix: run.wait().")
        self._check_replicas()
        aliases = self.plan.graph.capture.aliases
        keys = set(self.plan.graph.model.state_dict())
        out: dict[str, torch.Tensor] = {}
        for canon, value in self._trained().items():
            for name in aliases.get(canon, (canon,)):
                if name in keys:
                    out[name] = value
        return out

    def _check_replicas(self) -> None:
        if not self._reducer.replica_files:
            return
        mine = self._trained()
        params = set(self.plan.graph.capture.param_numel) - self.plan.graph.capture.buffers
        for replica, files in sorted(self._reducer.replica_files.items()):
            for path in files:
                for name, value in torch.load(path, mmap=True, weights_only=True).items():
                    if name in params and not torch.equal(value, mine[name]):
                        diff = float((value.double() - mine[name].double()).abs().max())
                        raise RuntimeError(f"Replica {replica}'s {name!r} differs from replica 0's by {diff:.1e}: "
                                           "the replicas did not take the same updates. Please report.")

    def _trained(self) -> dict[str, torch.Tensor]:
        out = dict(self._reducer.state)
        for path in sorted(self._reducer.state_files):  # memory-mapped: pages are read when used
            out.update(torch.load(path, mmap=True, weights_only=True))
        return out

    def save(self, path: str | os.PathLike[str]) -> list[str]:
        """Write the trained parameters and persistent buffers as safetensors under the original names
        (each tied tensor once, as HF saves it): a path ending in ``.safetensors`` gets one file; any other
        path a folder with one shard per rank and ``model.safetensors.index.json`` (HF ``save_pretrained``'s
        layout, which ``weights=`` and ``from_pretrained`` read; no process holds the whole model while it
        is written; an HF model's ``config.json`` and ``generation_config.json`` too). After a training run the
        folder is a checkpoint ``pv.launch(..., resume=folder)`` continues from, under any layout: every
        parameter's optimizer state by the model's names (``optimizer.safetensors``), the optimizer's groups and
        the scheduler's state, the steps and batches done (``trainer_state.pt``, ``pipeviz_checkpoint.json``:
        ``pipeviz.runtime.checkpoint``). Returns the files written."""
        from pipeviz.capture.weights import save_state

        if self.status != "done":
            raise RuntimeError(f"save() needs a finished run; status is {self.status!r}. Fix: run.wait().")
        aliases = self.plan.graph.capture.aliases
        keys = set(self.plan.graph.model.state_dict())

        def named(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = {}
            for canon, value in part.items():
                name = next((n for n in aliases.get(canon, (canon,)) if n in keys), None)
                if name is not None:  # a non-persistent buffer (inv_freq) is not saved, as in the model's
                    out[name] = value
            return out

        if os.fspath(path).endswith(".safetensors"):
            return save_state([named(self._trained())], path)
        files = sorted(self._reducer.state_files)
        parts = ([named(torch.load(f, mmap=True, weights_only=True)) for f in files] if files
                 else [named(self._trained())])
        written = save_state(parts, path)
        if self._reducer.trainer:  # a training run: the checkpoint's other half
            from pipeviz.runtime.checkpoint import write_checkpoint

            names = {canon: next((n for n in aliases.get(canon, (canon,)) if n in keys), canon)
                     for canon in self._reducer.optim}
            written += write_checkpoint(path, self._reducer.optim, self._trainer_state(), names)
        model = self.plan.graph.model
        for attr in ("config", "generation_config"):  # an HF model: from_pretrained(path) reads the folder as is
            saver = getattr(getattr(model, attr, None), "save_pretrained", None)
            if callable(saver):
                saver(os.fspath(path))
                written.append(os.path.join(os.fspath(path), f"{attr}.json"))
        return written

    def _trainer_state(self) -> dict[str, Any]:
        """What a resumed run needs beside the tensors: the optimizer's class and groups, the scheduler's state, the
        steps and batches done (a resumed run's own added to its checkpoint's), and the layout, for a person."""
        spec = self.spec
        before = spec.resume
        steps = len(self._reducer.losses)
        return {**self._reducer.trainer,
                "step": (before.step if before is not None else 0) + steps,
                "batches": (before.batches if before is not None else 0) + steps * spec.config.accumulate,
                "layout": {"schedule": spec.schedule, "stages": spec.layout.num_stages, "pp": spec.mesh.pp,
                           "dp": spec.mesh.dp, "tp": spec.mesh.tp, "microbatches": spec.microbatches,
                           "accumulate": spec.config.accumulate}}

    def _output(self, step: int, replica: int, leaves: Sequence[object]) -> None:
        """A forward-only step's output from one replica's last stage; the step's output is the replicas'
        outputs joined along the batch dim, replica 0's share first."""
        parts = self._replica_outputs.setdefault(step, {})
        parts[replica] = leaves
        if len(parts) < self.mesh.dp:
            return
        del self._replica_outputs[step]
        joined = [torch.cat(cast("tuple[torch.Tensor, ...]", ls))
                  if isinstance(ls[0], torch.Tensor) and ls[0].dim() else ls[0]
                  for ls in zip(*(parts[r] for r in range(self.mesh.dp)), strict=True)]
        self.outputs.append(self._structured(joined))

    def _structured(self, leaves: list[object]) -> object:
        """A forward-only step's output leaves back in the model's output structure (an HF ModelOutput, a
        tuple, a tensor), on the CPU."""
        from torch.utils import _pytree as pytree

        spec = self.plan.graph.capture.out_spec
        if spec is not None and spec.num_leaves == len(leaves):
            return pytree.tree_unflatten(leaves, spec)
        return leaves[0] if len(leaves) == 1 else tuple(leaves)
