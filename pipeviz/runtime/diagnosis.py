"""A failed or stuck run in words, from its layout: which process (rank, coordinates, stages) a message came from,
where each pipeline rank was when the run stopped making progress (``pipeviz.schedule.hang``), a rank gloo killed for
a hand-off larger than its receive buffer, and NaN or inf found in a step.

Example:
    >>> diagnosis = Diagnosis(spec)
    >>> diagnosis.where(3)                    # 'rank 3 (pp1 dp1, stage 1)'
    >>> print(diagnosis.hang(run.events, idle=120.0))
"""

from __future__ import annotations

import re
from collections.abc import Container, Mapping, Sequence
from typing import TYPE_CHECKING

from pipeviz.schedule import traits as sched
from pipeviz.schedule.timeline import COMPUTE

if TYPE_CHECKING:
    from pipeviz.runtime.messages import Message
    from pipeviz.runtime.spec import LaunchSpec
    from pipeviz.schedule.hang import HangReport
    from pipeviz.schedule.timeline import Event

__all__ = ["Diagnosis"]


class Diagnosis:
    """What went wrong in one run, in words; reads only the run's spec and what it is handed."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.mesh = spec.mesh
        self.layout = spec.layout

    def who(self, msg: Message) -> str:
        """The sender in words: ``"rank 2"``, with its coordinates when the run has replicas or shards."""
        if self.mesh.world == self.mesh.pp:
            return f"rank {msg.rank}"
        return f"rank {msg.rank} ({' '.join(f'{d}{getattr(msg.coords, d)}' for d in self.mesh.dims)})"

    def where(self, r: int) -> str:
        """A process rank in words, with its coordinates (when the run has replicas or shards) and stages."""
        if not 0 <= r < self.mesh.world:
            return f"rank {r}"
        stages = self.layout.stages_of(self.mesh.pipeline_rank(r))
        said = [self.mesh.label(r)] if self.mesh.world > self.mesh.pp else []
        said += [f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}"] if stages else []
        return f"rank {r}" + (f" ({', '.join(said)})" if said else "")

    def hang(self, events: Sequence[Event], idle: float) -> HangReport:
        """Where each pipeline rank is stuck (``pipeviz.schedule.hang.diagnose``), from its schedule's order and the
        actions replica 0's first shard reported finished in the batch it was on."""
        from pipeviz.schedule.hang import diagnose

        cfg, lay = self.spec.config, self.layout
        m = self.spec.microbatches
        orders = cfg.actions() or sched.orders(lay.schedule, lay.num_stages, m, cfg.stages_per_rank)
        lead = self._lead_processes()
        mine = [e for e in events if e.kind in COMPUTE and e.rank in lead]
        step = max((e.step for e in mine), default=0)
        mine = [e for e in mine if e.step == step]
        batch = max((e.mb // m for e in mine), default=0)  # accumulation: the step's batches number on
        done = {(e.stage, e.kind, e.mb % m) for e in mine if e.mb // m == batch}
        return diagnose(orders, lay.stage_ranks, done, computing_for=idle)

    def _lead_processes(self) -> set[int]:
        """The processes of replica 0's first shard: one per pipeline rank."""
        mesh = self.mesh
        return {r for r in range(mesh.world) if mesh.coords(r).dp == mesh.coords(r).tp == mesh.coords(r).cp == 0}

    @staticmethod
    def hang_error(timeout: float, report: HangReport) -> str:
        """``run.error`` for a run stopped after ``timeout`` seconds without progress."""
        return (f"no progress for {timeout:g} s (step timeout); the run was stopped. Where each rank was (run.hang):"
                f"\n{report}\nFix: raise launch(timeout=...) for slow steps, or the cause above.")

    @staticmethod
    def nonfinite(found: Sequence[tuple[int, str]]) -> str:
        """``run.error`` for a run stopped at the first step with NaN or inf (``found``: ``(step, what)``)."""
        step = min(s for s, _ in found)
        first = [w for s, w in found if s == step]
        first.sort(key=lambda w: not w.startswith("the loss"))
        said = "; ".join(first[:4]) + (f"; and {len(first) - 4} more" if len(first) > 4 else "")
        return (f"NaN or inf in step {step}: {said}. The run was stopped before that step's optimizer update. Fix: a "
                "lower learning rate, gradient clipping, or inputs and targets without NaN/inf; "
                "launch(on_nonfinite='continue') to keep going.")

    def size_mismatch(self, exitcodes: Sequence[int | None], logs: Mapping[int, str | None], reported: Container[int],
                      events: Sequence[Event]) -> str | None:
        """A rank gloo killed for a message larger than its receive buffer, in words: which rank, receiving what
        from which rank (from its order and the actions finished), and the sizes. ``logs``: each killed rank's
        stderr tail; ``reported``: the ranks that reported their own failure (not killed by gloo).

        torch 2.13 + gloo measured: a hand-off larger than the receiving stage's buffer (built from the example's
        shapes) aborts the receiver (SIGABRT, "op.preamble.length <= op.nbytes. 40 vs 32") with no Python traceback;
        a smaller one is received silently into the front of the buffer (the forward computes on stale values;
        training then fails in the sender's backward with autograd's "Mismatch in shape")."""
        for rank, code in enumerate(exitcodes):
            if code is None or code >= 0 or rank in reported:
                continue
            log = logs.get(rank)
            found = re.search(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)", log) if log is not None else None
            if found is None:
                continue
            sent, room = int(found.group(1)), int(found.group(2))
            receiving = self._receiving(rank, events)
            return (f"Shape mismatch between stages: {self.where(rank)} was killed by gloo{receiving}: {sent} bytes "
                    f"arrived for a receive buffer of {room} bytes. The receiving stage's buffers are shaped by the "
                    "example batch; this microbatch's hand-off was larger (an output whose shape depends on the data, "
                    "or batches shaped unlike the example). Fix: make each stage's output shape depend only on the "
                    "batch's shape (pad to a fixed length), or launch with batches shaped like the example.")
        return None

    def _receiving(self, rank: int, events: Sequence[Event]) -> str:
        """What a killed rank was receiving, from which rank, as far as its finished actions tell."""
        try:
            state = self.hang(events, 0.0).ranks[self.mesh.pipeline_rank(rank)]
        except Exception:  # the diagnosis is a courtesy here: the sizes are the finding
            return ""
        if state.current is None:
            return ""
        s, kind, mb = sched.parse(state.current)  # the report's text (a RankState is what a message says)
        src = s - 1 if kind == "F" else s + 1
        if not 0 <= src < self.layout.num_stages:
            return ""
        what = "activations" if kind == "F" else "gradients"
        # a rank killed mid-step loses its last unsent events: this is the earliest it can have been
        return (f" receiving stage {src}'s {what} from rank {self.layout.stage_ranks[src]}, at {state.current} or "
                f"later (the first action it had not reported finished; it needs {src}{'F' if kind == 'F' else 'B'}"
                f"{mb})")
