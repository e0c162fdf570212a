"""A rank's gradients between a step's backward and its optimizer update: the replicas' reduction switched on for the
step's last batch only, tensor-parallel gradients laid out as their parameters, tied copies summed, replicas averaged
after the step, NaN and inf found, and the global norm clipped; and a DTensor's local or whole tensor.

Example:
    >>> settle_grads(params); sync_tied(local, payload.tied, groups)
    >>> norm = clip_global_norm(payload, params, names, max_norm=1.0)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeviz.runtime.clock import Clock
from pipeviz.runtime.payloads import RankPayload

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining import PipelineStage

__all__ = ["average_replicas", "averaged_after_step", "clip_global_norm", "full_tensor", "local_tensor", "nonfinite",
           "settle_grads", "sync_replicas", "sync_tied"]


def sync_replicas(stages: list[PipelineStage], sync: bool) -> None:
    """Whether the replicas' gradients are reduced in this schedule step's last backward (DDP's all-reduce,
    FSDP2's reduce-scatter): only in a step's last accumulated batch, so each reduction carries the sum of the
    step's batches, as DDP's ``no_sync`` accumulation does (``adapter.stage``'s ``sync_replicas`` flag)."""
    for st in stages:
        st.sync_replicas = sync  # type: ignore[attr-defined]


def nonfinite(loss: float, params: list[torch.nn.Parameter], names: dict[int, str], p: RankPayload,
               step: int) -> list[str]:
    """What is NaN or inf on this rank after a step's backward: the loss, and each gradient (by name)."""
    import math

    stages = ", ".join(str(s.index) for s in p.stages)
    found = []
    if not math.isfinite(loss):
        found.append(f"the loss is {loss} (step {step}, rank {p.rank}, stage {stages})")
    grads = [local_tensor(t.grad) for t in params if t.grad is not None]
    if grads and not bool(torch.isfinite(torch.stack([g.detach().float().sum() for g in grads])).all()):
        for t in params:
            if t.grad is not None and not bool(torch.isfinite(local_tensor(t.grad)).all()):
                kind = "nan" if bool(torch.isnan(local_tensor(t.grad)).any()) else "inf"
                found.append(f"the gradient of {names.get(id(t), '?')!r} holds {kind} (step {step}, rank {p.rank}, "
                             f"stage {stages})")
    return found


def averaged_after_step(p: RankPayload) -> bool:
    """Whether replicas average their gradients in one all-reduce after the step (``average_replicas``):
    ``dp_reduce="after_flush"`` (the default under tensor parallelism: DDP does not take DTensor parameters)."""
    return not p.dp_shard and p.dp_reduce == "after_flush"


def average_replicas(params: list[torch.nn.Parameter], group: ProcessGroup | None, replicas: int, clock: Clock,
                     rank: int, step: int) -> None:
    """Average this rank's gradients across its replicas in one all-reduce (timed as a ``DP`` action): for
    the schedules whose split backward DDP's reducer cannot follow (see ``pipeviz.runtime.rank_stages``). Under
    expert parallelism the routed experts this process holds are summed over the processes holding the same experts
    instead, and divided by every replica too (their owner's gradient holds its whole ep group's tokens)."""
    import torch.distributed as dist

    from pipeviz.runtime.expert_shards import expert_params, replicas_group

    rest, experts = expert_params(params)  # expert parallelism: the experts summed over those holding them
    parts = [(rest, group), (experts, replicas_group(experts))]
    for held, over in parts if experts else parts[:1]:
        grads = [local_tensor(t.grad) for t in held if t.grad is not None]
        if not grads:
            continue
        with clock.span(rank, -1, "DP", -1, step), torch.no_grad():
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=over)
            flat /= replicas
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(reduced)


def clip_global_norm(p: RankPayload, params: list[torch.nn.Parameter], names: dict[int, str],
                     max_norm: float) -> float:
    """Clip every gradient of the run by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does on the
    unsplit model (``max_norm / (norm + 1e-6)``, at most 1); returns the norm before clipping, the same on every
    process. Each parameter is counted once over the whole run: a shared (tied) one on the lowest pipeline rank
    holding a copy, a replicated tensor-parallel one on shard 0, a replica's on replica 0 (DDP left them equal;
    FSDP2's shards each count theirs), a sharded one on every shard (its local part)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    me = p.mesh.coords(p.rank) if p.mesh is not None else None
    total = torch.zeros((), dtype=torch.float64)
    counted: set[str] = set()
    for t in params:
        g = t.grad
        if g is None:
            continue
        canon = names.get(id(t), "")
        if canon in p.tied:
            if canon in counted or (me is not None and min(p.tied[canon]) != me.pp) or (
                    me is None and min(p.tied[canon]) != p.rank):
                continue
            counted.add(canon)
        over_dp = not p.dp_shard and p.dp_reduce != "zero1"  # replicas hold equal gradients, unless sharded
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            if any(pl.is_replicate() and mesh.get_local_rank(i) != 0 for i, pl in enumerate(g.placements)):
                continue
        shard = getattr(t, "expert_shard", None)  # expert parallelism: a routed expert, on its first holder
        if over_dp and me is not None and me.dp >= (shard.share.ep if shard is not None else 1):
            continue
        total += local_tensor(g).detach().double().pow(2).sum().cpu()
    dist.all_reduce(total)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for t in params:
                if t.grad is not None:
                    local_tensor(t.grad).mul_(coef)
    return norm


def settle_grads(params: list[torch.nn.Parameter]) -> None:
    """Each tensor-parallel gradient laid out as its parameter is, once, before anything reads it. Under sequence
    parallelism a replicated weight that saw only this shard's tokens (a norm's) has partial sums for a gradient:
    all-reduced here once, as Megatron-LM does its sequence-parallel norms' (left to the optimizer, DTensor would
    all-reduce it in every op that reads it). Any other gradient whose layout DTensor chose differently from its
    parameter's is laid out as the parameter here, so a tied copy on another stage, sharded alike, sums with it
    shard by shard (a row-sharded embedding's gradient came out whole before ``vocab_parallel_embedding``: GPT-2's
    tied sync then mismatched sizes in gloo)."""
    from torch.distributed.tensor import DTensor

    for t in params:
        g = t.grad
        if isinstance(g, DTensor) and isinstance(t, DTensor) and tuple(g.placements) != tuple(t.placements):
            t.grad = g.redistribute(placements=t.placements)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor as the whole tensor (a vocabulary-parallel loss: replicated), else the tensor itself."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a tensor-parallel gradient), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def sync_tied(local: dict[str, list[torch.Tensor]], tied: dict[str, list[int]],
               groups: dict[str, ProcessGroup | None]) -> None:
    """Sum the gradients of every copy of a shared parameter (on this rank, then across the ranks holding
    one), then give each copy the sum (as DeepSpeed does for tied weights): copies stay identical and take
    one update, like the unsplit model's one tensor."""
    import torch.distributed as dist

    for canon in sorted(tied):
        copies = local.get(canon, [])
        if not copies or not any(c.requires_grad for c in copies):
            # frozen (the same on every rank holding a copy): no zero gradient, or AdamW's weight decay would move it
            # (found by pipeviz fuzz: GPT-2 with its tied embedding frozen)
            continue
        for c in copies:
            if c.grad is None:
                c.grad = torch.zeros_like(c)
        # A tensor-parallel copy's local part (tied: replicated); every copy has a gradient by now.
        grads = [local_tensor(c.grad) for c in copies if c.grad is not None]
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if groups.get(canon) is not None:
            dist.all_reduce(total, group=groups[canon])
        with torch.no_grad():
            for g in grads:
                g.copy_(total)
