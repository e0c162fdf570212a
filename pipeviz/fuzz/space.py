"""What the fuzzer draws: a ``Case`` (model, split, schedule or custom order, microbatches, steps, mesh, training
options), drawn from a seeded ``random.Random`` so a seed names the same cases everywhere.

The mesh dimensions are ``LaunchConfig``'s (``MESH_DIMS`` those it has): a dimension ``pv.launch`` gains (``cp``,
``ep``) is drawn once its field exists, and its degrees come from ``DEGREES`` (one line). The training options are
``OPTIONS``: each field's default first, then the values drawn instead of it.

Example:
    >>> rng = random.Random(0)
    >>> case = draw_case(rng, ["mlp", "tied"], candidates)
    >>> print(case.describe())
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig

__all__ = ["CUSTOM_ORDERS", "DEGREES", "MESH_DIMS", "OPTIONS", "Case", "config_fields", "custom_order", "draw_case"]

# Every mesh dimension the fuzzer knows and the degrees it draws (world size stays small: 2 cores); only those
# LaunchConfig has are drawn. Adding a dimension: one entry here.
DEGREES: dict[str, tuple[int, ...]] = {"dp": (1, 1, 2), "tp": (1, 1, 2), "cp": (1,) * 9 + (2,), "ep": (1,) * 9 + (2,)}
MESH_DIMS = tuple(d for d in DEGREES if d in {f.name for f in fields(LaunchConfig)})
MAX_WORLD = 4

# The training options: (default, *drawn instead). Values are plain (repr-able, for a repro script); the runner
# turns "optimizer" and "lr_scheduler" names into factories. "freeze" and "resume" are the fuzzer's own: the
# model's first parameters frozen, and the run resumed from a checkpoint another layout saved.
OPTIONS: dict[str, tuple[object, ...]] = {
    "accumulate": (1, 2),
    "clip_grad_norm": (None, 0.05),
    "loss_reduction": ("mean", "sum", "token_mean"),
    "mixed_precision": (None, "bf16", "fp16"),
    "recompute": ("none", "selective", "full"),
    "compile": (False, "aot_eager"),
    "dp_shard": (False, True),
    "dp_reduce": (None, "overlap", "zero1", "ddp", "after_flush"),
    "sequence_parallel": (False, True),
    "optimizer": ("sgd", "adamw"),
    "lr_scheduler": (None, "warmup_cosine"),
    "freeze": (False, True),
    "resume": (False, True),
}
# Options that only mean something with a mesh dimension: drawn without it rarely (its refusal is checked then).
NEEDS_DIM = {"dp_shard": "dp", "dp_reduce": "dp", "sequence_parallel": "tp"}
# Models drawn without mixed precision: the moe model (pipeviz.zoo.MoENet) adds its experts' half-precision outputs
# into a float32 sum, which its own forward cannot run under autocast (index_add_: "self (Float) and source (Half)
# must have the same scalar type"), split or not: a limit of that model, not yet refused before launch.
FULL_PRECISION = {"moe"}
# Custom orders (LaunchConfig.order) written out for one stage per rank: torch's schedules' orders are their own,
# these are not (GPipe's backwards in reverse; 1F1B's steady state).
CUSTOM_ORDERS = ("custom:gpipe-reversed", "custom:1f1b")


@dataclass(frozen=True)
class Case:
    """One composition. ``cuts``: split after each of these modules (``len(cuts) + 1`` stages); ``schedule``: a
    torch schedule's name or one of ``CUSTOM_ORDERS``; ``mesh`` and ``options``: the non-default ones only."""

    model: str
    cuts: tuple[str, ...]
    schedule: str
    microbatches: int
    steps: int = 1
    mesh: tuple[tuple[str, int], ...] = ()
    options: tuple[tuple[str, object], ...] = ()
    seed: int = 0

    @property
    def stages(self) -> int:
        return len(self.cuts) + 1

    @property
    def world(self) -> int:
        pp = self.stages // (2 if sched.info(self.torch_schedule).multi else 1)
        n = pp
        for name, d in self.mesh:
            n *= 1 if name == "ep" else d  # (ep adds no processes: carved out of dp x cp)
        return n

    @property
    def torch_schedule(self) -> str:
        """The schedule whose stage placement the run takes (a custom order's: GPipe's, one stage per rank, no
        microbatch rule of its own)."""
        return "GPipe" if self.schedule.startswith("custom:") else self.schedule

    def option(self, name: str) -> object:
        return dict(self.options).get(name, OPTIONS[name][0])

    def with_option(self, name: str, value: object) -> Case:
        opts = {**dict(self.options), name: value}
        return dataclasses.replace(self, options=tuple((k, v) for k, v in opts.items() if v != OPTIONS[k][0]))

    def with_dim(self, name: str, degree: int) -> Case:
        mesh = {**dict(self.mesh), name: degree}
        return dataclasses.replace(self, mesh=tuple((k, v) for k, v in mesh.items() if v != 1))

    def describe(self) -> str:
        """One line: every setting that is not its default."""
        parts = [f"model={self.model}", f"stages={self.stages} (after {', '.join(self.cuts)})",
                 f"schedule={self.schedule}", f"microbatches={self.microbatches}", f"steps={self.steps}"]
        parts += [f"{k}={v}" for k, v in (*self.mesh, *self.options)]
        return " ".join(parts)


def custom_order(kind: str, ranks: int, microbatches: int) -> list[list[str]]:
    """The per-rank order of a custom schedule (``CUSTOM_ORDERS``) for one stage per rank, in torch's notation."""
    out = []
    for r in range(ranks):
        fwd, bwd = [f"{r}F{m}" for m in range(microbatches)], [f"{r}B{m}" for m in range(microbatches)]
        if kind == "custom:gpipe-reversed":
            out.append(fwd + bwd[::-1])
            continue
        warm = min(ranks - 1 - r, microbatches)
        order = fwd[:warm]
        for i in range(microbatches - warm):
            order += [fwd[warm + i], bwd[i]]
        out.append(order + bwd[microbatches - warm:])
    return out


def _pick(rng: random.Random, values: Sequence[object], keep_default: float) -> object:
    return values[0] if rng.random() < keep_default else rng.choice(values[1:])


def draw_case(rng: random.Random, models: Sequence[str], candidates: Callable[[str], Sequence[str]],
              *, seed: int = 0) -> Case:
    """One composition drawn from ``rng``: ``candidates(model)`` lists the model's split points in order.

    Mostly ones that can run (world size at most ``MAX_WORLD``, microbatches the batch allows), with a share a
    launch must refuse (a microbatch count a schedule rejects, an ep that does not divide dp, a model without routed
    experts under ep)."""
    model = rng.choice(list(models))
    points = list(candidates(model))
    schedule = rng.choice([*sched.ALL, *sched.SINGLE, *CUSTOM_ORDERS])  # the two-stage ones a little more often
    multi = sched.info("GPipe" if schedule.startswith("custom:") else schedule).multi
    mesh, extra = {}, 1
    for d in MESH_DIMS:  # each degree drawn while two pipeline ranks still fit in MAX_WORLD
        degree = rng.choice(DEGREES[d])
        if d == "ep":  # no processes of its own (carved out of dp x cp): runs where it divides dp (and the model
            mesh[d] = degree  # has routed experts), refused naming ep elsewhere
            continue
        mesh[d] = degree if 2 * extra * degree <= MAX_WORLD else 1
        extra *= mesh[d]
    pp_max = max(1, MAX_WORLD // extra)
    pp = rng.choice([p for p in (2, 2, 3, 4) if p <= pp_max] or [2])
    stages = min(pp * (2 if multi else 1), len(points) + 1)
    for _ in range(20):  # mostly cuts that leave every stage a module (not a parent's end right after its child's)
        cuts = tuple(sorted(rng.sample(points, stages - 1), key=points.index))
        if not any(b and a.startswith(b + ".") for a, b in itertools.pairwise(cuts)):
            break
    per_replica = 8 // mesh.get("dp", 1)
    microbatches = rng.choice([m for m in (1, 2, 4, 8) if pp <= m <= per_replica] or [1, 2, 4, 8]) \
        if rng.random() < 0.9 else rng.choice((1, 2, 4, 8))  # mostly what the schedule and batch allow
    options = {name: _pick(rng, values, 0.75 if mesh.get(NEEDS_DIM.get(name, ""), 2) > 1 else 0.97)
               for name, values in OPTIONS.items()}
    if model in FULL_PRECISION:
        options["mixed_precision"] = None
    if options["mixed_precision"] is not None:
        # AdamW divides each gradient by its own magnitude, so a near-zero gradient's last-bit difference in bf16 (a
        # tp shard sums its partial products in another order than the unsplit model: exact in float32, not in bf16)
        # becomes a step of the learning rate's size; the oracle's tolerance is SGD's. (Seen on gpt2, tp=2, bf16:
        # wte 3.8e-3 apart under AdamW, matching under SGD and without tp.)
        options["optimizer"] = "sgd"
    case = Case(model, cuts, schedule, microbatches, rng.choice((1, 1, 2)), seed=seed)
    for name, degree in mesh.items():
        case = case.with_dim(name, degree)
    for name, value in options.items():
        case = case.with_option(name, value)
    return case


def config_fields(case: Case) -> Mapping[str, object]:
    """The ``LaunchConfig`` fields of ``case`` that are plain values (the runner adds the factories and the order)."""
    plain = {k: v for k, v in case.options if k in {f.name for f in fields(LaunchConfig)}
             and k not in ("optimizer", "lr_scheduler")}
    return {"schedule": case.torch_schedule, "microbatches": case.microbatches, "steps": case.steps,
            **dict(case.mesh), **plain}


