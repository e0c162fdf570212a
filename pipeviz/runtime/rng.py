"""Random draws (dropout, ``torch.rand``) made alike in a pipelined run and in the unsplit model it is checked
against, so ``pv.check_numerics`` is exact with dropout on, as a user trains.

A pipelined run draws each stage's random numbers in another process, in the schedule's order, so by default
its dropout masks differ from the unsplit model's and the check could only say "differs". Instead every rank
seeds its device's generator before each stage forward, from (seed, step, microbatch, stage)
(``stage_seed``), and the reference run seeds its generator the same way just before the first random op of
each stage: it counts the random ops of the whole forward (``StageSeeds``, a ``TorchDispatchMode`` over the ops
torch tags ``nondeterministic_seeded``) against each stage's count, taken when the stages were built
(``CountDraws``). Within a stage both then draw the same numbers: the same ops, the same shapes, the same
generator state.

Sharded tensors (tensor parallelism's heads and token splits; context parallelism's sequence shares) draw as the
unsplit model does: the whole tensor's mask from the same generator state, each shard keeping its part
(``drawn_part``, given the full shape and the shard's slice; ``register_sharded_draws`` makes every random op on
a DTensor do so). Every shard of a stage is seeded alike, so the generators stay in step after the draw too. What
it costs: each shard draws the whole tensor's numbers (Megatron draws only its part, from a seed of its own, and
so cannot check against the unsplit model).

Example:
    >>> with CountDraws() as c:
    ...     stage(x)
    >>> c.count                     # random ops in one forward of the stage
    >>> with StageSeeds(seed=0, step=0, microbatch=3, draws=[2, 0, 4]) as s:
    ...     model(x_mb)             # reseeds before random op 0 (stage 0) and op 2 (stage 2)
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EVAL_SEED", "CountDraws", "RunDraws", "StageSeeds", "drawn_part", "draws_random", "register_sharded_draws",
           "seed_device", "shard_slice", "stage_seed"]

SEEDED = torch.Tag.nondeterministic_seeded


def draws_random(func: torch._ops.OpOverload, args: Sequence[object] = (),
                 kwargs: Mapping[str, object] | None = None) -> bool:
    """Whether an op draws from a random generator (torch tags it ``nondeterministic_seeded``). Given the call's
    ``args``, an attention or dropout kernel whose dropout probability is 0 (or whose ``train`` is off) draws
    nothing, although tagged: HF Llama's attention calls the CPU flash kernel with ``dropout_p=0.0`` in training."""
    if SEEDED not in getattr(func, "tags", ()):
        return False
    schema = getattr(func, "_schema", None)
    if schema is None or not (args or kwargs):
        return True
    kwargs = kwargs or {}
    dropout = "dropout" in schema.name
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p" or (dropout and arg.name in ("p", "train")):
            value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
            if value is False or (arg.name != "train" and isinstance(value, int | float) and value == 0):
                return False
    return True


EVAL_SEED = 7919  # an evaluation's stage forwards seed from seed + EVAL_SEED: draws apart from training's


def stage_seed(seed: int, step: int, microbatch: int, stage: int) -> int:
    """The generator seed for one stage's forward of one microbatch in one step (the same on a rank and in the
    reference; ``microbatch`` counts across data-parallel replicas)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{microbatch}:{stage}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed_device(device: torch.device | str, seed: int) -> None:
    """Seed only the generator ops on ``device`` draw from (``torch.manual_seed`` would seed every GPU too)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def _device_of(args: object, kwargs: Mapping[str, object]) -> torch.device:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
        if isinstance(leaf, torch.device):
            return leaf
    return torch.device("cpu")  # a factory op without a device argument: torch.rand(3)


class CountDraws(TorchDispatchMode):
    """Count the random ops that run inside (under fake tensors too: nothing is drawn there)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # (torch leaves it untyped)
        self.count = 0

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Sequence[type],
                           args: tuple[object, ...] = (), kwargs: Mapping[str, object] | None = None) -> object:
        if draws_random(func, args, kwargs):
            self.count += 1
        return func(*args, **(kwargs or {}))


class StageSeeds(TorchDispatchMode):
    """Inside, a whole-model forward of one microbatch reseeds its generator before the first random op of each
    stage, as the rank holding the stage does before its forward. ``draws``: random ops per stage (from
    ``CountDraws`` on the stages); ``count`` afterwards: the ops seen, which must equal ``sum(draws)`` for the
    draws to line up (``aligned``)."""

    def __init__(self, seed: int, step: int, microbatch: int, draws: Sequence[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # (torch leaves it untyped)
        self.count = 0
        self.draws = tuple(draws)
        self._seed_at: dict[int, int] = {}  # random op number in the forward -> the seed before it
        first = 0
        for stage, n in enumerate(self.draws):
            if n:
                self._seed_at[first] = stage_seed(seed, step, microbatch, stage)
            first += n

    @property
    def aligned(self) -> bool:
        return self.count == sum(self.draws)

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Sequence[type],
                           args: tuple[object, ...] = (), kwargs: Mapping[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        if draws_random(func, args, kwargs):
            reseed = self._seed_at.get(self.count)
            if reseed is not None:
                seed_device(_device_of(args, kwargs), reseed)
            self.count += 1
        return func(*args, **kwargs)


class RunDraws:
    """A run's random draws, for its reference: ``forward(step, microbatch)`` wraps one whole-model forward
    (``StageSeeds``); ``aligned`` stays True while every forward met exactly the stages' random ops, and
    ``seen`` is the most random ops one forward met (0: the model drew nothing, e.g. in eval mode).

    Example:
        >>> draws = RunDraws(seed=0, per_stage=[2, 0, 4])
        >>> with draws.forward(step=0, microbatch=1):
        ...     model(x_mb)
    """

    def __init__(self, seed: int, per_stage: Sequence[int]) -> None:
        self.seed, self.per_stage = seed, tuple(per_stage)
        self.aligned = True
        self.seen = 0

    def shifted(self, by: int) -> RunDraws:
        """The same draws from ``seed + by`` (an evaluation's forwards, ``EVAL_SEED``)."""
        return RunDraws(self.seed + by, self.per_stage)

    @contextlib.contextmanager
    def forward(self, step: int, microbatch: int) -> Iterator[None]:
        with StageSeeds(self.seed, step, microbatch, self.per_stage) as mode:
            yield
        self.aligned = self.aligned and mode.aligned
        self.seen = max(self.seen, mode.count)


def drawn_part(full_shape: Sequence[int], part: Sequence[slice], draw: Callable[[torch.Tensor], object],
               like: torch.Tensor) -> torch.Tensor:
    """This shard's ``part`` (one slice per dim, e.g. ``shard_slice``'s) of what ``draw`` fills a whole tensor of
    ``full_shape`` with (``like``'s dtype and device), drawn from the generator's current state: the numbers the
    unsplit model draws for the whole tensor, cut to the shard. A sequence shard (context parallelism) passes its
    tokens' slice of the sequence dim (a zig-zag share: call it once per contiguous chunk, in order, on the same
    state, or cut the whole draw into its chunks).

    Example:
        >>> mask = drawn_part((8, 4, 16, 16), (slice(None), slice(2, 4)), lambda t: t.bernoulli_(0.9), heads_part)
    """
    whole = torch.empty(tuple(full_shape), dtype=like.dtype, device=like.device)
    draw(whole)
    return whole[tuple(part)]


def shard_slice(value: Any) -> tuple[slice, ...] | None:
    """The slice of the whole tensor a DTensor's local part is (one per dim), or None where its placements are
    not plain shards and replicas (a partial sum, a strided cut)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = value.device_mesh, value.placements
    if not all(type(p) in (Shard, Replicate) for p in placements):
        return None
    part = [slice(None)] * value.ndim
    sizes = list(value.shape)
    starts = [0] * value.ndim
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            dim = p.dim % value.ndim
            n, rank = mesh.size(axis), mesh.get_local_rank(axis)
            size = sizes[dim]
            chunk = -(-size // n)  # torch.chunk's sizes: the last shards may be shorter
            lo = min(rank * chunk, size)
            starts[dim] += lo
            sizes[dim] = max(0, min(chunk, size - lo))
    for dim in range(value.ndim):
        if sizes[dim] != value.shape[dim]:
            part[dim] = slice(starts[dim], starts[dim] + sizes[dim])
    return tuple(part)


# random ops that fill their first argument in place: on a sharded DTensor, filled with its part of a whole draw
_FILLS = ("bernoulli_.float", "uniform_.default", "normal_.default", "exponential_.default",
          "geometric_.default", "log_normal_.default", "cauchy_.default", "random_.default")


def _fill(op: torch._ops.OpOverload, args: tuple[object, ...], kwargs: Mapping[str, object] | None) -> object:
    """An in-place random op on a DTensor: its local part filled with this shard's part of the whole draw."""
    value = args[0]
    part = shard_slice(value)
    local = value.to_local()  # type: ignore[attr-defined]
    if part is None:
        raise NotImplementedError(f"{op} on a DTensor laid out as {value.placements}: pipeviz draws a "  # type: ignore[attr-defined]
                                  "shard's part of the whole tensor for plain shards and replicas only")
    local.copy_(drawn_part(value.shape, part, lambda t: op(t, *args[1:], **(kwargs or {})), local))  # type: ignore[attr-defined]
    return value


def _native_dropout(op: torch._ops.OpOverload, args: tuple[object, ...],
                    kwargs: Mapping[str, object] | None) -> object:
    """``native_dropout`` (the fused dropout of CUDA, and of a CPU tensor whose input needs it) on a DTensor: the
    whole tensor's mask drawn by the op itself, this shard's part kept, and its output computed from it."""
    from torch.distributed.tensor import DTensor

    value, *rest = args
    assert isinstance(value, DTensor)
    part = shard_slice(value)
    if part is None:
        raise NotImplementedError(f"{op} on a DTensor laid out as {value.placements}: pipeviz draws a shard's "
                                  "part of the whole tensor for plain shards and replicas only")
    local = value.to_local()
    train = rest[1] if len(rest) > 1 else (kwargs or {}).get("train")
    p = float(rest[0]) if rest else float((kwargs or {})["p"])  # type: ignore[arg-type]
    if train is False:
        out, mask = op(local, p, train)
    else:
        whole_mask: list[torch.Tensor] = []
        drawn_part(value.shape, [slice(None)] * value.ndim, lambda t: whole_mask.append(op(t, p, train)[1]), local)
        mask = whole_mask[0][part]
        out = local * mask * (1.0 / (1.0 - p) if p < 1 else 0.0)
    mesh, placements = value.device_mesh, value.placements
    return (DTensor.from_local(out, mesh, placements, run_check=False),
            DTensor.from_local(mask, mesh, placements, run_check=False))


_SHARDED_DRAWS: list[bool] = []


def register_sharded_draws() -> None:
    """From now on, in this process, a random op on a DTensor (dropout's ``bernoulli_`` on CPU, ``native_dropout``,
    ``uniform_``, ...) draws the whole tensor's numbers and keeps the DTensor's part (``drawn_part``), so a
    sharded stage draws what the unsplit model draws. Through DTensor's handler table (private: where a torch
    release drops it, nothing is registered and the shards draw their own masks, which ``pv.check_numerics``
    then reports as a difference). Registered once per process."""
    if _SHARDED_DRAWS:
        return
    from torch.distributed.tensor import DTensor

    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if not isinstance(handlers, dict):
        return
    aten = torch.ops.aten
    for name in _FILLS:
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet), overload)
        handlers.setdefault(op, _fill)
    handlers.setdefault(aten.native_dropout.default, _native_dropout)
    _SHARDED_DRAWS.append(True)
