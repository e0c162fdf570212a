"""ZeRO-1 across the replicas (``LaunchConfig.dp_reduce="zero1"``): each stage's gradients reduce-scattered as soon
as they are final, the optimizer's state sharded, the updated parameters all-gathered after the step.

What Megatron-Core's distributed optimizer and ZeRO stage 1 do: every replica keeps the whole parameters for its
forwards and backwards, but owns 1/dp of each parameter (its rows, ``torch.chunk`` of dim 0, as a DTensor
``Shard(0)`` over the data-parallel mesh) and only that part's optimizer state. When a stage's last backward of the
step returns (``stage.grads_final``), each of its gradients is reduce-scattered asynchronously
(``dist.reduce_scatter_tensor(..., async_op=True)``: half an all-reduce's traffic), while the rank goes on with its
other stages; before the optimizer the step waits for them (``wait``) and each shard holds the replicas' average of
its rows. The optimizer (the run's own factory, built on the shards: elementwise optimizers such as SGD, Adam and
AdamW update a shard exactly as they would the whole) steps on the shards, and ``gather`` all-gathers the updated
shards into the whole parameters (``DTensor.full_tensor``). A 0-dimensional parameter is all-reduced and kept whole.

The shards are DTensors, so what already reads FSDP2's and tensor parallelism's shards reads these: clipping by the
global norm counts each shard once, ``run.save`` gathers the optimizer's state whole by name, ``resume=`` cuts each
replica's part from it, and the memory meter counts the sharded state (1/dp of it per process).

Example:
    >>> zero = ZeroOne(params, names, dp_mesh, on_done=record)
    >>> optimizer = factory(zero.shards)      # the state is 1/dp per replica
    >>> zero.launch(0); ...; zero.wait()      # stage 0's reduce-scatters, waited for before the step
    >>> optimizer.step(); zero.gather()       # the whole parameters updated on every replica
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["ZeroOne"]


@dataclass
class _Pending:
    work: dist.Work
    out: torch.Tensor
    param: nn.Parameter
    whole: bool  # a 0-dim parameter: all-reduced
    stage: int
    start: float
    timed: bool  # its completion is recorded by its future


class ZeroOne:
    """One process's ZeRO-1 state: the shards of its parameters (``shards``, what the optimizer steps), the
    asynchronous reduce-scatters of each stage's gradients and the all-gather after the step (see the module)."""

    def __init__(self, params: Sequence[nn.Parameter], names: Mapping[int, str], mesh: DeviceMesh,
                 on_done: Callable[[int, float, float], None] | None = None) -> None:
        self.mesh, self.on_done = mesh, on_done
        self.group = mesh.get_group()
        self.dp = mesh.size()
        self.me = mesh.get_local_rank()
        self.trained = [t for t in params if t.requires_grad]
        self.shard_of: dict[int, nn.Parameter] = {}
        for t in self.trained:
            placement = Replicate() if t.dim() == 0 else Shard(0)
            shard = distribute_tensor(t.detach().clone(), mesh, [placement], src_data_rank=None)
            self.shard_of[id(t)] = nn.Parameter(shard)
        self.shards = [self.shard_of[id(t)] for t in self.trained]
        self.names = {id(self.shard_of[i]): name for i, name in names.items() if i in self.shard_of}
        self.stage_params: dict[int, list[nn.Parameter]] = {}
        self.pending: list[_Pending] = []
        self.launched: set[int] = set()

    def add_stage(self, stage: int, params: Sequence[nn.Parameter]) -> None:
        """The parameters of ``stage`` (reduce-scattered when the stage's gradients are final)."""
        self.stage_params[stage] = [t for t in params if id(t) in self.shard_of]

    def tied(self, local: Mapping[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """``local`` (a shared parameter's copies on this rank) as their shards: the copies' gradients are summed
        shard by shard (every copy is cut alike)."""
        return {name: [self.shard_of[id(t)] for t in copies if id(t) in self.shard_of] for name, copies in
                local.items()}

    def launch(self, stage: int) -> None:
        """Start reduce-scattering ``stage``'s gradients (its last backward of the step has run)."""
        if stage in self.launched:
            return
        self.launched.add(stage)
        for t in self.stage_params.get(stage, ()):
            g = t.grad
            if g is None:
                g = torch.zeros_like(t)  # a parameter the batch did not reach: every replica sends its rows
            start = time.time()
            if t.dim() == 0:
                out = g.detach().clone()
                work = dist.all_reduce(out, group=self.group, async_op=True)
                whole = True
            else:
                rows = math.ceil(t.shape[0] / self.dp)
                flat = g.detach().reshape(t.shape[0], -1)
                padded = torch.zeros(rows * self.dp, flat.shape[1], dtype=g.dtype, device=g.device)
                padded[:t.shape[0]] = flat
                out = torch.empty(rows, flat.shape[1], dtype=g.dtype, device=g.device)
                work = dist.reduce_scatter_tensor(out, padded, group=self.group, async_op=True)
                whole = False
            assert work is not None
            timed = False
            if self.on_done is not None:
                try:  # completion, as it happens (gloo's reduce-scatter has no future: then at the step's wait)
                    work.get_future().then(lambda _f, s=stage, at=start, done=self.on_done: done(s, at, time.time()))
                    timed = True
                except RuntimeError:
                    pass
            self.pending.append(_Pending(work, out, t, whole, stage, start, timed))

    def wait(self) -> None:
        """Wait for every launched reduce-scatter; each shard's gradient is then the replicas' average of its rows
        (the whole gradients are dropped: the shards carry them from here)."""
        for stage in self.stage_params:  # a stage torch never told of its last backward: now
            self.launch(stage)
        with torch.no_grad():
            for p in self.pending:
                p.work.wait()
                if not p.timed and self.on_done is not None:
                    self.on_done(p.stage, p.start, time.time())  # (an upper bound: it may have finished before)
                shard = self._dtensor(self.shard_of[id(p.param)])
                local = shard.to_local()
                if p.whole:
                    grad = (p.out / self.dp).to(local.dtype)
                else:
                    rows = local.shape[0]
                    grad = (p.out[:rows] / self.dp).reshape(local.shape).to(local.dtype)
                self.shard_of[id(p.param)].grad = DTensor.from_local(grad, self.mesh, shard.placements,
                                                                     run_check=False, shape=shard.shape,
                                                                     stride=shard.stride())
                p.param.grad = None
        self.pending.clear()
        self.launched.clear()

    def gather(self) -> None:
        """After the optimizer step: every whole parameter set from its updated shards (one all-gather each)."""
        with torch.no_grad():
            for t in self.trained:
                t.copy_(self._dtensor(self.shard_of[id(t)]).full_tensor())

    @staticmethod
    def _dtensor(shard: nn.Parameter) -> DTensor:
        assert isinstance(shard, DTensor)  # (an nn.Parameter around a DTensor is one)
        return shard

    def zero_grad(self) -> None:
        """The whole parameters' gradients dropped (the optimizer drops the shards')."""
        for t in self.trained:
            t.grad = None
