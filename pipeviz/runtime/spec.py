"""What a launch runs: the ``LaunchSpec`` that ``pipeviz.runtime.checks.validate_launch`` returns, and the defaults
a launch fills in (the optimizer, the mixed-precision dtypes). Shared by ``pv.launch``, ``pv.export_torchrun`` and
each rank's payload (``pipeviz.runtime.payloads``).

Example:
    >>> spec = validate_launch(plan, LaunchConfig(schedule="1F1B", microbatches=4), inputs=(x,), target=y)
    >>> spec.mesh.world, spec.layout.stage_ranks, spec.training
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig
from pipeviz.schedule.mesh import Mesh

__all__ = ["MIXED_PRECISION", "FedBatch", "LaunchSpec", "default_optimizer"]

# One batch's (args, kwargs, target), as checked against the first batch.
FedBatch = tuple[tuple[object, ...], dict[str, object], object]

# mixed_precision=: the dtype each setting computes in (autocast)
MIXED_PRECISION = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@dataclass
class LaunchSpec:
    """A validated launch: what ``launch`` and ``export_torchrun`` run."""

    schedule: str
    layout: sched.Layout
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: torch.Tensor | None  # None: a forward-only run
    loss_fn: Callable[..., torch.Tensor] | None  # None: a forward-only run
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None
    microbatches: int = 1
    steps: int | None = 1  # None: until data= runs out
    data: Any = None  # an iterator over the batches after the first (whose args/kwargs/target are above)
    sources: dict[str, Any] | None = None  # weights= or a meta model: where each tensor comes from on its rank
    init_seed: int = 0
    dp: int = 1  # data-parallel replicas of the pipeline, each on 1/dp of every batch
    dp_shard: bool = False  # replicas shard their stages' parameters (FSDP2) instead of replicating them (DDP)
    tp: int = 1  # tensor-parallel shards of every stage
    cp: int = 1  # context-parallel shares of every sequence (pipeviz.adapter.context_graph)
    ep: int = 1  # expert-parallel shares of every MoE block's routed experts (pipeviz.adapter.expert_graph)
    tp_placements: dict[str, str] = field(default_factory=dict)  # canonical parameter name -> "shard0"/"shard1"
    config: LaunchConfig = field(default_factory=LaunchConfig)  # the options it was validated from
    eval_batches: list[FedBatch] = field(default_factory=list)  # eval_data=: held-out batches, checked
    resume: Any = None  # runtime.checkpoint.Resume (resume=): the checkpoint the run continues from

    @property
    def training(self) -> bool:
        return self.loss_fn is not None

    @property
    def mesh(self) -> Mesh:
        """The layout of the run's processes: ``layout.num_ranks`` pipeline ranks × ``dp`` replicas × ``tp``
        shards × ``cp`` shares of every sequence; ``ep`` (no processes of its own) shards the experts over dp."""
        return Mesh(pp=self.layout.num_ranks, dp=self.dp, tp=self.tp, cp=self.cp, ep=self.ep)


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of a launch without ``optimizer=``: SGD with learning rate 0.1 (``pv.sgd(lr=0.1)``)."""
    return torch.optim.SGD(params, lr=0.1)
