"""Sequence lengths that vary from batch to batch: the buckets that pad least, and what a number of buckets costs,
simulated (``compare_buckets``) or searched on a cluster (``plan_cluster_lengths``).

torch's pipeline has static shapes, so a run pads each batch to a bucket length (``pv.launch`` traces its stages
once per bucket: ``pipeviz.runtime.shapes``). One bucket pads every sequence to the longest and computes the
padding; more buckets pad less but trace (and, on a GPU, compile and warm up) once more each. A bucketed sampler
batches sequences of one bucket together (as HF's ``group_by_length`` and torchtitan's bucketing do): a bucket's
batches are padded to its length.

Example:
    >>> lengths = [int(n) for n in torch.randint(16, 129, (1000,))]
    >>> buckets(lengths, 3)                                 # (64, 96, 128): the bucket lengths that pad least
    >>> padding_waste(lengths, (128,)), padding_waste(lengths, (64, 96, 128))
    >>> for row in compare_buckets(plan, lengths, cfg, max_buckets=4).rows: print(row)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipeviz.capture.view import GraphView
    from pipeviz.cost.machine import Hardware
    from pipeviz.plan.split import SplitPlan
    from pipeviz.planner.cluster import ClusterPlan, LayoutOption
    from pipeviz.schedule.config import LaunchConfig

__all__ = ["BucketComparison", "BucketRow", "buckets", "compare_buckets", "padding_waste", "plan_cluster_lengths"]


def _checked(lengths: Sequence[int]) -> list[int]:
    out = [int(n) for n in lengths]
    if not out or min(out) < 1:
        raise ValueError(f"lengths must be a non-empty list of positive sequence lengths, got {list(lengths)[:5]}. "
                         "Fix: the token count of each sequence of the dataset (or a sample of it).")
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def buckets(lengths: Sequence[int], n: int, multiple: int = 1) -> tuple[int, ...]:
    """The ``n`` bucket lengths (ascending, the last the longest sequence) that pad ``lengths`` least: each
    sequence padded to the shortest bucket that holds it, each bucket a multiple of ``multiple`` (8 or 64 keeps
    GPU kernels on their fast sizes). Exact (dynamic programming over the distinct lengths); fewer when there are
    fewer distinct lengths."""
    seqs = _checked(lengths)
    if n < 1:
        raise ValueError(f"n must be at least 1 bucket, got {n}.")
    if multiple < 1:
        raise ValueError(f"multiple must be a positive int, got {multiple}.")
    sizes = sorted({_round_up(s, multiple) for s in seqs})
    counts = [sum(1 for s in seqs if _round_up(s, multiple) == u) for u in sizes]
    tokens = [sum(s for s in seqs if _round_up(s, multiple) == u) for u in sizes]
    k = min(n, len(sizes))

    def cost(i: int, j: int) -> int:  # sizes[i..j] padded to sizes[j]
        return sizes[j] * sum(counts[i:j + 1]) - sum(tokens[i:j + 1])

    # best[c][j]: least padding of sizes[0..j] in c buckets, the last ending at j
    best = [[math.inf] * len(sizes) for _ in range(k + 1)]
    cut: list[list[int]] = [[-1] * len(sizes) for _ in range(k + 1)]
    for j in range(len(sizes)):
        best[1][j] = cost(0, j)
    for c in range(2, k + 1):
        for j in range(c - 1, len(sizes)):
            for i in range(c - 2, j):
                total = best[c - 1][i] + cost(i + 1, j)
                if total < best[c][j]:
                    best[c][j], cut[c][j] = total, i
    out, j = [], len(sizes) - 1
    for c in range(k, 0, -1):
        out.append(sizes[j])
        j = cut[c][j]
    return tuple(reversed(out))


_choose = buckets  # (plan_cluster_lengths's argument of that name shadows it)


def padding_waste(lengths: Sequence[int], bucket_lengths: Sequence[int]) -> float:
    """The fraction of computed tokens that are padding when each sequence is padded to the shortest bucket of
    ``bucket_lengths`` that holds it."""
    seqs = _checked(lengths)
    padded = sum(_bucket_of(s, bucket_lengths) for s in seqs)
    return 1 - sum(seqs) / padded


def _bucket_of(length: int, bucket_lengths: Sequence[int]) -> int:
    fit = [b for b in sorted(bucket_lengths) if b >= length]
    if not fit:
        raise ValueError(f"a sequence of {length} tokens is longer than every bucket {tuple(bucket_lengths)}. Fix: a "
                         "last bucket at least the longest sequence (buckets chooses them).")
    return fit[0]


@dataclass(frozen=True)
class BucketRow:
    """One number of buckets: the bucket lengths, the padding, and the simulated cost.

    Attributes:
        buckets: how many; lengths: each bucket's length (ascending); padding: fraction of computed tokens that
            are padding; share: fraction of batches in each bucket.
        step_times: simulated seconds of one step (one batch) at each bucket's length; step_time: their mean over
            the batches (seconds per step); tokens_per_s: real (unpadded) tokens trained per second.
        traces: input shapes a run traces its stages for (one per bucket).
    """

    buckets: int
    lengths: tuple[int, ...]
    padding: float
    share: tuple[float, ...]
    step_times: tuple[float, ...]
    step_time: float
    tokens_per_s: float

    @property
    def traces(self) -> int:
        return self.buckets

    def __str__(self) -> str:
        return (f"{self.buckets} bucket{'s' * (self.buckets > 1)} {self.lengths}: {self.padding:.0%} padding, "
                f"{self.step_time * 1e3:.2f} ms a step, {self.tokens_per_s:,.0f} real tokens/s")


@dataclass(frozen=True)
class BucketComparison:
    """``compare_buckets``'s answer: a row per number of buckets; ``best`` the most real tokens per second."""

    rows: tuple[BucketRow, ...]
    rows_per_batch: int
    notes: tuple[str, ...] = field(default=())

    @property
    def best(self) -> BucketRow:
        return max(self.rows, key=lambda r: r.tokens_per_s)


def _at_length(x: object, length: int, seq: int) -> object:
    """``x`` with every dim after the batch of size ``seq`` (the traced sequence length) made ``length`` long:
    cut, or extended by repeating its values (ids stay valid ids; costs depend on shapes only)."""
    if not isinstance(x, torch.Tensor):
        return x
    for d in range(1, x.dim()):
        if x.shape[d] == seq:
            x = x.index_select(d, torch.arange(length) % seq)
    return x


def _plan_at(plan: SplitPlan, length: int, seq: int) -> SplitPlan:
    """The plan's model traced again with its example at ``length`` tokens, split at the same places."""
    from torch.utils import _pytree as pytree

    from pipeviz.graph.model import trace

    cap = plan.graph.capture
    args = pytree.tree_map(lambda t: _at_length(t, length, seq), tuple(cap.example_args))
    kwargs = pytree.tree_map(lambda t: _at_length(t, length, seq), dict(cap.example_kwargs or {}))
    graph = trace(cap.model, example_args=args, example_kwargs=kwargs or None)
    return graph.split(dict(plan.splits))


def _sequence_length(plan: SplitPlan) -> int:
    from torch.utils import _pytree as pytree

    cap = plan.graph.capture
    for t in pytree.tree_leaves((tuple(cap.example_args), dict(cap.example_kwargs or {}))):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[1])
    raise ValueError("the plan's example inputs have no sequence dimension (no tensor of 2 or more dims). "
                     "Fix: trace the model with a (batch, sequence) example.")


def compare_buckets(plan: SplitPlan, lengths: Sequence[int], config: LaunchConfig | str | None = None, *,
                    max_buckets: int = 4, multiple: int = 1, **simulate_options: object) -> BucketComparison:
    """Padding waste against the number of buckets, each simulated: for 1 to ``max_buckets`` buckets
    (``buckets``), the plan's model is traced at each bucket length (the example's sequence dim, dim 1, resized)
    and simulated with ``config`` (``pv.simulate``'s arguments; ``simulate_options`` such as
    ``hardware="h100"``). A bucketed sampler fills each batch from one bucket with as many sequences as the traced
    example holds, so a bucket's share of batches is its share of sequences.

    Returns:
        ``BucketComparison``: a ``BucketRow`` per number of buckets; ``best`` trains the most real tokens per
        second. More buckets trade padding for one more traced shape each (``row.traces``).
    """
    from pipeviz.capture.export import batch_size_of
    from pipeviz.sim.simulate import simulate

    seqs = _checked(lengths)
    seq = _sequence_length(plan)
    cap = plan.graph.capture
    rows_per_batch = batch_size_of(tuple(cap.example_args), dict(cap.example_kwargs or {})) or 1
    step_at: dict[int, float] = {}
    rows: list[BucketRow] = []
    for n in range(1, max_buckets + 1):
        lens = buckets(seqs, n, multiple)
        if rows and lens == rows[-1].lengths:
            break  # fewer distinct lengths than buckets
        for b in lens:
            if b not in step_at:
                at = plan if b == seq else _plan_at(plan, b, seq)
                step_at[b] = simulate(at, config, **simulate_options).step_time  # type: ignore[arg-type]
        per = [[s for s in seqs if _bucket_of(s, lens) == b] for b in lens]
        share = tuple(len(p) / len(seqs) for p in per)
        step = sum(sh * step_at[b] for sh, b in zip(share, lens, strict=True))
        tokens = rows_per_batch * sum(seqs) / len(seqs)  # real tokens in a mean batch
        rows.append(BucketRow(len(lens), lens, padding_waste(seqs, lens), share,
                              tuple(step_at[b] for b in lens), step, tokens / step))
    return BucketComparison(tuple(rows), rows_per_batch)


def plan_cluster_lengths(graph: GraphView, gpus: int, hardware: Hardware | str, *, global_batch: int,
                         lengths: Sequence[int] | Mapping[int, float], buckets: int | Sequence[int] = 3,
                         **options: object) -> ClusterPlan:
    """``pv.plan_cluster`` over a distribution of sequence lengths: the layouts ranked by their mean step over
    the buckets (each bucket's step simulated at its length, weighted by its share of sequences), each row's
    memory its longest bucket's (a layout must fit every bucket), its throughput in real tokens.

    Args:
        lengths: each sequence's length (a sample), or ``{bucket length: share of sequences}`` already bucketed.
        buckets: how many buckets (chosen by ``buckets``), or the bucket lengths.
        options: ``plan_cluster``'s other arguments (``memory_limit``, ``schedules``, ...).
    """
    import dataclasses

    from pipeviz.planner.search import plan_cluster

    if isinstance(lengths, Mapping):
        shares = {int(b): float(w) for b, w in lengths.items()}
        total = sum(shares.values())
        shares, real = {b: w / total for b, w in shares.items()}, {b: float(b) for b in shares}
    else:
        seqs = _checked(lengths)
        lens = _choose(seqs, buckets) if isinstance(buckets, int) else tuple(sorted(buckets))
        groups = {b: [s for s in seqs if _bucket_of(s, lens) == b] for b in lens}
        shares = {b: len(g) / len(seqs) for b, g in groups.items() if g}
        real = {b: sum(g) / len(g) for b, g in groups.items() if g}
    top = int(options.pop("top", 10))  # type: ignore[call-overload]
    # every layout of every bucket (top): a row is kept only where every bucket has it
    per: dict[int, ClusterPlan] = {}
    for b in shares:  # (options: plan_cluster's own keywords, checked there)
        per[b] = plan_cluster(graph, gpus, hardware, global_batch=global_batch, seq_len=b, top=10_000, **options)  # type: ignore[arg-type]

    def key(r: LayoutOption) -> tuple[object, ...]:
        return (r.pp, r.dp, r.tp, r.cp, r.schedule, r.stages_per_rank, r.microbatch_size, r.microbatches,
                r.recompute, r.dp_reduce, r.ep)

    longest = max(shares)
    by = {b: {key(r): r for r in p.rows} for b, p in per.items()}
    rows = []
    for k, r in by[longest].items():
        if not all(k in rows_b for rows_b in by.values()):
            continue
        step = sum(shares[b] * by[b][k].step_time for b in shares)
        tokens = global_batch * sum(shares[b] * real[b] for b in shares)
        rows.append(dataclasses.replace(r, step_time=step, tokens_per_s=tokens / step,
                                        peak_memory=max(by[b][k].peak_memory for b in shares)))
    rows.sort(key=lambda r: r.step_time)
    base = per[longest]
    note = ("Sequence lengths bucketed to " + ", ".join(f"{b} ({shares[b]:.0%})" for b in sorted(shares)) +
            ": each row's step is the buckets' mean, its memory the longest bucket's, its tokens the real ones.")
    return dataclasses.replace(base, rows=tuple(rows[:top]), notes=(*base.notes, note))
