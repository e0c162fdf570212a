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
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EVAL_SEED", "CountDraws", "RunDraws", "StageSeeds", "draws_random", "seed_device", "stage_seed"]

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
