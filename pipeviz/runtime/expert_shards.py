"""Expert parallelism's memory: each process holds only its own routed experts (``LaunchConfig.ep``), as torchtitan
and Megatron-LM lay them out: share ``r`` of an expert-parallel group keeps experts ``[r·E/ep, (r+1)·E/ep)`` of every
MoE block, their weights, gradients and optimizer state; the router and shared experts stay whole on every process.

- **Held.** ``shard_experts`` cuts a stage's routed experts down to this process's share once its stage is built: an
  ``nn.ModuleList`` expert it does not own (``<block>.experts.<e>``) keeps an empty placeholder (no element, no
  gradient: the optimizer never steps it), transformers 5.x's fused experts (3-D ``gate_up_proj`` / ``down_proj``)
  keep their rows ``[r·E/ep, (r+1)·E/ep)`` of dim 0. Each kept or emptied parameter carries an ``ExpertShard``
  (``expert_shard`` attribute): what it is of the whole, and the groups that reduce and gather it.
- **Reduced.** An expert's gradient on its owner holds every group member's tokens; the processes that hold the same
  experts (the same share of every expert-parallel group: ``dp / ep`` of them) sum theirs and divide by the dp
  replicas, which gives the unsplit model's gradient (``expert_params`` splits a stage's parameters for that).
- **Made whole.** What reads a stage's full parameters (the run's final state, ``check_numerics``, checkpoints) gets
  every expert: ``whole_experts`` gathers the shares over the expert-parallel group; ``held_part`` cuts a whole
  tensor (a checkpoint's optimizer state) to this process's share when it resumes.

Example:
    >>> shard_experts(runner.stage, st.params, blocks, share=Share(ep=2, rank=0, group=ep_group, replicas=rg))
    >>> state = whole_experts(rank_state(payload), params)      # every process of the group calls it
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import fx
    from torch.distributed import ProcessGroup

    from pipeviz.adapter.expert_graph import Block

__all__ = ["ExpertShard", "Share", "expert_params", "held_part", "held_text", "replicas_group", "shard_experts",
           "whole_experts"]


@dataclass(frozen=True)
class Share:
    """This process's place in expert parallelism: share ``rank`` of ``ep``, its expert-parallel ``group`` (the
    ``ep`` processes that split the experts) and ``replicas``, the ``dp / ep`` processes holding the same experts
    (a group of one where dp = ep)."""

    ep: int
    rank: int
    group: ProcessGroup | None = None
    replicas: ProcessGroup | None = None

    def owned(self, experts: int) -> range:
        per = experts // self.ep
        return range(self.rank * per, (self.rank + 1) * per)


@dataclass(frozen=True)
class ExpertShard:
    """What a routed expert's parameter on this process is of the whole one (``canon``, its model name, of
    ``shape``): with ``fused`` the rows ``owned`` of dim 0 (transformers 5.x's experts); else expert ``expert``'s
    whole tensor, held only by its owner (an empty placeholder elsewhere)."""

    canon: str
    experts: int
    expert: int
    fused: bool
    shape: tuple[int, ...]
    share: Share

    @property
    def owned(self) -> range:
        return self.share.owned(self.experts)

    @property
    def held(self) -> bool:
        """Whether this process holds any of the tensor's elements."""
        return self.fused or self.expert in self.owned


def shard_experts(stage: fx.GraphModule, params: Mapping[str, str], blocks: list[Block], share: Share) -> int:
    """Cut ``stage``'s routed experts (``blocks``, from ``find_blocks``) to this process's share, in place; returns
    the elements dropped. ``params``: canonical name -> the stage's name (``RankStage.params``). A parameter cut
    before (a stage of another input shape bound to the same tensors) is left as it is."""
    inner_to_canon = {inner: canon for canon, inner in params.items()}
    dropped = 0
    for b in blocks:
        if b.fused:
            targets = [(t, -1) for t in b.weights]
        else:
            targets = [(str(a.target), e) for e, reads in enumerate(b.inputs) for a in reads if a.op == "get_attr"]
        for target, e in targets:
            whole = _get(stage, target)
            if not isinstance(whole, torch.nn.Parameter) or hasattr(whole, "expert_shard"):
                continue
            shard = ExpertShard(inner_to_canon.get(target, target), b.count, e, b.fused, tuple(whole.shape), share)
            if b.fused:
                part = whole.detach()[shard.owned.start:shard.owned.stop].clone()
            elif shard.held:
                part = whole.detach()
            else:
                part = whole.detach().new_empty(0)
            kept = torch.nn.Parameter(part, requires_grad=whole.requires_grad and shard.held)
            kept.expert_shard = shard  # type: ignore[attr-defined]
            kept.expert_count = b.count  # type: ignore[attr-defined]  # (find_blocks reads a fused block's count)
            dropped += whole.numel() - part.numel()
            _set(stage, target, kept)
    return dropped


def expert_params(params: Iterable[torch.nn.Parameter]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the parameters reduced over every replica, the routed experts' this process holds)."""
    rest, experts = [], []
    for t in params:
        shard = getattr(t, "expert_shard", None)
        if shard is None:
            rest.append(t)
        elif shard.held:
            experts.append(t)
    return rest, experts


def replicas_group(params: Iterable[torch.nn.Parameter]) -> ProcessGroup | None:
    """The process group the experts among ``params`` are reduced over (the processes holding the same experts)."""
    for t in params:
        shard = getattr(t, "expert_shard", None)
        if shard is not None:
            return shard.share.replicas
    return None


def held_text(params: Iterable[torch.nn.Parameter]) -> str:
    """What a process holds of its stages' routed experts, for its "ready" line ("" without expert parallelism)."""
    shards = [(t, s) for t in params if (s := getattr(t, "expert_shard", None)) is not None]
    if not shards:
        return ""
    share = shards[0][1].share
    owned = shards[0][1].owned
    whole = sum(math.prod(s.shape) for _, s in shards)
    return (f" (experts {owned.start}-{owned.stop - 1} of every block's {shards[0][1].experts}, share {share.rank} "
            f"of ep={share.ep}: {sum(t.numel() for t, _ in shards):,} of {whole:,} routed-expert elements held)")


def held_part(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
    """A whole tensor laid out as ``param`` holds it: a fused expert's rows of this share, nothing (None) for an
    expert this process does not hold, else ``value`` itself."""
    shard: ExpertShard | None = getattr(param, "expert_shard", None)
    if shard is None:
        return value
    if not shard.held:
        return None
    return value[shard.owned.start:shard.owned.stop] if shard.fused and value.dim() else value


def whole_experts(parts: dict[str, Any], params: Iterable[torch.nn.Parameter]) -> dict[str, Any]:
    """``parts`` (canonical name -> a tensor, or a dict of tensors: an optimizer's state) with every routed expert
    among ``params`` made whole from the shares of its expert-parallel group: a fused tensor's rows concatenated in
    share order, an ``nn.ModuleList`` expert's from its owner. Every process of the group calls it, in one order
    (an ``all_gather_object``); the rest of ``parts`` is returned as it is."""
    import torch.distributed as dist

    shards = {s.canon: s for t in params if (s := getattr(t, "expert_shard", None)) is not None}
    if not shards:
        return parts
    share = next(iter(shards.values())).share
    mine = {c: _cpu(parts[c]) for c in sorted(shards) if c in parts and shards[c].held}
    gathered: list[Any] = [None] * share.ep
    dist.all_gather_object(gathered, mine, group=share.group)
    out = dict(parts)
    for canon, shard in shards.items():
        if canon not in parts and not any(canon in g for g in gathered):
            continue  # (a tensor this stage does not report; an optimizer state nobody has yet)
        if shard.fused:
            pieces = [g[canon] for g in gathered if canon in g]
            if len(pieces) == share.ep:
                out[canon] = _cat(pieces)
        else:
            owner = shard.expert // (shard.experts // share.ep)
            if canon in gathered[owner]:
                out[canon] = gathered[owner][canon]
    return out


def _cpu(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _cat(pieces: list[Any]) -> Any:
    """Shares' rows (or each optimizer state's, a 0-d step count taken once) concatenated along dim 0."""
    if isinstance(pieces[0], dict):
        return {k: _cat([p[k] for p in pieces]) for k in pieces[0]}
    if isinstance(pieces[0], torch.Tensor) and pieces[0].dim() > 0:
        return torch.cat(pieces)
    return pieces[0]


def _get(mod: torch.nn.Module, target: str) -> Any:
    value: Any = mod
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _set(mod: torch.nn.Module, target: str, value: torch.nn.Parameter) -> None:
    parent, _, name = target.rpartition(".")
    owner = _get(mod, parent) if parent else mod
    setattr(owner, name, value)
