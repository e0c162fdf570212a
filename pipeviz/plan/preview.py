"""A plan's preview: what each stage runs, holds, computes, saves and sends, read from the graph's ``GraphIndex``
without tracing again.

``Preview`` is the per-stage arithmetic over a set of cut positions (``SplitPlan.positions``): which stage runs
each op, and from that every stage's ``StageInfo``. ``SplitPlan.stages`` and its other preview properties answer
from the ``Preview`` the plan holds; ``stage_table`` renders it as text.

Example:
    >>> preview = Preview(graph.index, graph.capture.frozen, (3.5,))     # one cut, between ops 3 and 4
    >>> [s.flops for s in preview.stages(graph.layer_names)]
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from pipeviz.capture.view import GraphIndex
from pipeviz.cost.rule import stage_bytes

__all__ = ["Preview", "StageInfo", "human_bytes", "stage_table"]


@dataclass(frozen=True)
class StageInfo:
    """Preview of one pipeline stage, computed from the graph (no tracing).

    Attributes:
        index: stage number.
        layers: layer names in execution order.
        params: parameter elements the stage owns (buffers excluded; a tensor shared with an earlier stage
            counts there).
        flops: forward FLOPs for the example batch.
        send_bytes: bytes this stage sends to the next one per example batch: every activation
            produced here or earlier that a later stage reads (skip connections included).
        recv_bytes: bytes arriving from earlier stages.
        inputs: model inputs (placeholder names) this stage reads.
        shared_params: parameters this stage holds a copy of that other stages hold too (tied or reused).
        param_bytes: bytes of every parameter the stage holds (shared copies included).
        frozen_bytes: the part of ``param_bytes`` that does not train (``requires_grad=False``): no gradient, no
            optimizer state.
        activation_bytes: bytes autograd saves for the stage's backward, for the example batch: what a
            pipelined run keeps alive from each forward to its backward (``Op.saved_bytes`` over the stage's
            ops, a tensor received from an earlier stage counted here too, and on the last stage what the loss
            saves, one output-sized tensor). ``pipeviz.runtime.memory`` measures the same thing on a run.
        buffer_bytes: bytes of the buffers the stage holds (running statistics, ``inv_freq``, ...).
        memory_bytes: the stage's training footprint on a rank of its own (``pipeviz.costs``): parameters,
            gradients and Adam's two states, buffers, and every microbatch's activations in flight (GPipe, the
            most any schedule keeps). ``pv.simulate(...).memory_bytes`` gives it per rank for a schedule.
    """

    index: int
    layers: tuple[str, ...]
    params: int
    flops: int
    send_bytes: int
    recv_bytes: int
    inputs: tuple[str, ...]
    shared_params: tuple[str, ...]
    param_bytes: int
    activation_bytes: int
    buffer_bytes: int = 0
    frozen_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        # on a rank of its own with every microbatch in flight (GPipe, the most any schedule keeps)
        return stage_bytes(self.param_bytes, self.buffer_bytes, self.activation_bytes,
                           frozen_bytes=self.frozen_bytes)


@dataclass(frozen=True, eq=False)
class Preview:
    """The per-stage figures of a plan's cut positions over a graph's index: which stage runs each op, and what
    each stage holds, computes, saves and sends. Immutable; each figure is computed once.

    Attributes:
        index: the graph's ``GraphIndex`` (of the view the plan was refined onto).
        frozen: canonical names of the parameters that do not train (``Capture.frozen``).
        positions: the cuts (``k + 0.5``: between ops ``k`` and ``k + 1``), in order.
    """

    index: GraphIndex
    frozen: frozenset[str]
    positions: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.positions) + 1

    def stage_of_op(self, op: int) -> int:
        """The stage that runs op ``op``."""
        return bisect.bisect_left(self.positions, op)

    @cached_property
    def cuts(self) -> list[int]:
        """Each stage's first op, then the op count: stage ``s`` runs ops ``cuts[s]`` to ``cuts[s + 1] - 1``."""
        return [0, *(int(p + 0.5) for p in self.positions), self.index.num_ops]

    @cached_property
    def received_saved_bytes(self) -> list[int]:
        """Per stage, bytes it saves for backward of tensors it received from an earlier stage that the sender
        saves too (an MLP block's ReLU output: saved by the ReLU and by the next Linear). In the unsplit model
        that is one tensor; in a pipelined run it is two (the receiver saves its own copy), so it counts once
        in each stage that saves it (part of ``StageInfo.activation_bytes``)."""
        stage = self.stage_of_op
        out = [0] * self.num_stages
        again: set[tuple[int, int, int]] = set()
        for op, first, slot, nbytes in self.index.resaved:
            s = stage(op)
            if stage(first) != s and (s, first, slot) not in again:
                again.add((s, first, slot))
                out[s] += nbytes
        return out

    @cached_property
    def input_grad_freed_bytes(self) -> list[int]:
        """Per stage, the saved bytes (``StageInfo.activation_bytes``' units) its input-grad pass frees under a
        zero-bubble schedule: what the ops after the stage's last op using a parameter saved (a stage without
        parameters: all of it). torch's ``stage_backward_input`` keeps the graph below the weight ops for the
        weight-grad pass and detaches the stage's outputs, which frees only the part above them."""
        idx, cuts, stage = self.index, self.cuts, self.stage_of_op
        last = [cuts[s] - 1 for s in range(self.num_stages)]  # before the stage's first op: no parameter
        for uses in idx.param_uses.values():
            for u in uses:
                last[stage(u)] = max(last[stage(u)], u)
        prefix = idx.saved_prefix or idx.act_prefix
        freed = [prefix[cuts[s + 1]] - prefix[last[s] + 1] for s in range(self.num_stages)]
        op, loss = idx.loss_saved
        if loss and op <= last[stage(op)]:  # the loss runs after the output op, whatever weights that op reads
            freed[stage(op)] += loss
        # torch's PipelineStage.backward_one_chunk skips the input-grad pass on the first stage (no stage before it
        # needs the gradient) and runs that stage's whole backward in its weight-grad pass: its I frees nothing
        # (measured: benchmarks/accuracy/synthesized_runs.py, an order with 0I0 ... 0W0 kept 2/3 of stage 0's
        # activations more than the rule said until W)
        freed[0] = 0
        return freed

    def _per_stage(self, prefix: Sequence[int]) -> list[int]:
        return [prefix[self.cuts[s + 1]] - prefix[self.cuts[s]] for s in range(self.num_stages)]

    def _holders(self, uses_of: Mapping[str, tuple[int, ...]]) -> list[set[str]]:
        """Per stage, the names (canonical tensors, model inputs) some op of the stage reads."""
        held: list[set[str]] = [set() for _ in range(self.num_stages)]
        for name, uses in uses_of.items():
            for s in {self.stage_of_op(u) for u in uses}:
                held[s].add(name)
        return held

    def stage_tensors(self) -> list[frozenset[str]]:
        """Canonical names of the parameters and buffers each stage holds (a shared one in every holder)."""
        params, buffers = self._holders(self.index.param_uses), self._holders(self.index.buffer_uses)
        return [frozenset(p | b) for p, b in zip(params, buffers, strict=True)]

    @cached_property
    def stages(self) -> list[StageInfo]:
        """Per-stage preview (layers, params, FLOPs, bytes sent and saved), computed from the index."""
        idx, n, stage = self.index, self.num_stages, self.stage_of_op
        layers: list[list[str]] = [[] for _ in range(n)]
        for name, first in zip(idx.layer_names, idx.layer_first, strict=True):
            layers[stage(first)].append(name)
        act = self._per_stage(idx.saved_prefix or idx.act_prefix)
        act = [a + r for a, r in zip(act, self.received_saved_bytes, strict=True)]
        send, recv = [0] * n, [0] * n
        for src, end, nbytes in idx.values:
            for s in range(stage(src), stage(end)):  # relayed through every stage in between
                send[s] += nbytes
                recv[s + 1] += nbytes
        owned = [0] * n
        for p, uses in idx.param_uses.items():
            owned[min(stage(u) for u in uses)] += idx.numel.get(p, 0)
        held, bufs = self._holders(idx.param_uses), self._holders(idx.buffer_uses)
        # model inputs in the index's order, each in every stage reading it
        inputs = [[x for x in idx.input_uses if x in read] for read in self._holders(idx.input_uses)]
        flops = self._per_stage(idx.flops_prefix)
        return [
            StageInfo(
                index=s, layers=tuple(layers[s]), params=owned[s], flops=flops[s], send_bytes=send[s],
                recv_bytes=recv[s], inputs=tuple(inputs[s]),
                shared_params=tuple(sorted(p for p in held[s] if any(p in held[t] for t in range(n) if t != s))),
                param_bytes=sum(idx.nbytes.get(p, 0) for p in held[s]), activation_bytes=act[s],
                buffer_bytes=sum(idx.nbytes.get(b, 0) for b in bufs[s]),
                frozen_bytes=sum(idx.nbytes.get(p, 0) for p in held[s] if p in self.frozen),
            )
            for s in range(n)
        ]


def stage_table(stages: Sequence[StageInfo], memory: Sequence[int]) -> str:
    """The stage preview as a plain-text table, with ``memory`` bytes per stage (``SplitPlan.table``)."""
    rows = [("stage", "layers", "params", "GFLOPs", "sends", "memory")]
    for s, mem in zip(stages, memory, strict=True):
        names = ", ".join(s.layers) if len(s.layers) <= 4 else f"{s.layers[0]} … {s.layers[-1]} ({len(s.layers)})"
        rows.append((str(s.index), names, f"{s.params:,}", f"{s.flops / 1e9:.3f}", human_bytes(s.send_bytes),
                     human_bytes(mem)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def human_bytes(n: float) -> str:
    """Bytes in IEC units: ``65536`` -> ``"64.0 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
