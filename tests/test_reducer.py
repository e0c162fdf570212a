"""One reducer of a run's messages (pipeviz.runtime.reducer) for pv.launch's Run and pv.watch's Watch: every kind
of message is handled, and both name a failure the same way, root cause first."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

import pipeviz as pv
from pipeviz.runtime.messages import (
    Done,
    EvalLoss,
    Events,
    ExpertTokens,
    Failed,
    GradNorm,
    LearningRate,
    Loss,
    Memory,
    Message,
    NonFinite,
    OptimState,
    Output,
    Phase,
    State,
    StepEnd,
)
from pipeviz.runtime.reducer import Reducer
from pipeviz.schedule.mesh import Coords
from pipeviz.schedule.timeline import Event


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _one_of_each(rank: int = 1) -> list[Message]:
    c = Coords(rank)
    return [Phase(rank, c, "stage 1 ready"), Events(rank, c, [Event(rank, 1, "F", 0, 0.1, 0.2)]),
            Memory(rank, c, [(0.1, 100, 40)]), Loss(rank, c, 0, 2.5), Output(rank, c, 0, _saved([torch.ones(2)])),
            StepEnd(rank, c, 0, 0.3), NonFinite(rank, c, 0, ["the loss is nan"]), GradNorm(rank, c, 0, 1.5),
            LearningRate(rank, c, 0, 0.05), EvalLoss(rank, c, 0, 2.75),
            ExpertTokens(rank, c, 0, 1, 2, "blocks.1.experts", [3, 0, 5, 4]),
            OptimState(rank, c, _saved({"tensors": {"w": {"exp_avg": torch.ones(1)}}, "optimizer": "AdamW"})),
            State(rank, c, _saved({"w": torch.zeros(1)})), Done(rank, c)]


def test_every_kind_of_message_changes_what_the_reducer_holds() -> None:
    sent = _one_of_each()
    assert {type(m).__name__ for m in sent} | {"Failed"} == set(Message.kinds)  # a new kind must be added here
    r = Reducer(world=2)
    ups = [r.apply(m) for m in sent]
    assert ups[0].phase == "stage 1 ready" and ups[1].events == r.events == [Event(1, 1, "F", 0, 0.1, 0.2)]
    assert r.memory == {1: [(0.1, 100)]} and r.activation_memory == {1: [(0.1, 40)]} and r.losses == [2.5]
    step, replica, leaves = ups[4].output  # type: ignore[misc]
    assert (step, replica) == (0, 0) and torch.equal(leaves[0], torch.ones(2))
    assert r.step_ends == {0: 0.3} and r.step == 0 and ups[5].step is None  # rank 0 has not finished step 0
    assert r.nonfinite == [(0, "the loss is nan")] and set(r.state) == {"w"} and r.done == {1}
    assert r.grad_norms == [1.5] and r.learning_rates == [0.05] and r.eval_losses == [(0, 2.75)]
    assert set(r.optim) == {"w"} and torch.equal(r.optim["w"]["exp_avg"], torch.ones(1))
    assert r.trainer == {"optimizer": "AdamW"}
    assert [tuple(x) for x in r.expert_tokens] == [(0, 1, "blocks.1.experts", 2, 0, (3, 0, 5, 4))]
    r.apply(StepEnd(0, Coords(0), 0, 0.4))
    assert r.step == 1 and r.step_ends == {0: 0.4}
    r.apply(Failed(0, Coords(0), "ValueError: boom", "Traceback ...\nValueError: boom"))
    assert r.errors == {0: ("ValueError: boom", "Traceback ...\nValueError: boom", "")}


def test_the_root_cause_is_named_first() -> None:
    r = Reducer(world=3)
    r.apply(Failed(0, Coords(0), "RuntimeError: Connection closed by peer", "..."))
    r.apply(Failed(2, Coords(2), "ValueError: boom", "Traceback\nValueError: boom"))
    text = r.failure(lambda rank: f"rank {rank} (stage {rank})", exit_codes=[1, -9, 1])
    assert text.startswith("rank 1 (stage 1) died (killed by signal SIGKILL) without a Python traceback.")
    assert text.endswith("As a consequence, rank 2 (stage 2), rank 0 (stage 0) failed too (their peers went away).")


def test_watch_reads_every_kind_as_a_run_does(tmp_path: Path) -> None:
    # What an exported run's processes write: rank 0 the layout, each rank its messages as JSON lines.
    (tmp_path / "layout.json").write_text(json.dumps({"world": 2, "mesh": {"pp": 2, "dp": 1, "tp": 1, "cp": 1},
                                                      "stages": 2, "microbatches": 1, "schedule": "GPipe",
                                                      "steps": 1}))
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.jsonl", "w") as f:
            for m in _one_of_each(rank)[:-1]:
                if isinstance(m, State):  # an exported rank writes its tensors beside the lines
                    (tmp_path / f"state_rank{rank}.pt").write_bytes(m.data)  # type: ignore[arg-type]
                    m = State(m.rank, m.coords, f"state_rank{rank}.pt")
                f.write(json.dumps(m.to_json()) + "\n")
            if rank == 1:
                f.write(json.dumps(Failed(1, Coords(1), "ValueError: boom", "Traceback\nValueError: boom").to_json())
                        + "\n")
    w = pv.watch(tmp_path, poll=0.05, timeout=30)
    assert w.wait(30) == "failed"
    assert w.error is not None and w.error.startswith("rank 1 failed in step 1: ValueError: boom"), w.error
    assert w.mesh == pv.Mesh(pp=2) and w.step == 1 and w.losses == [2.5, 2.5]
    assert any(text == "rank 0: stage 1 ready" for _, text in w.phases) and w.phases[-1][1] == "failed"
    assert w.nonfinite == [(0, "the loss is nan")] * 2 and set(w.outputs[0]) == {0} and w.grad_norms == [1.5, 1.5]
    assert w.learning_rates == [0.05, 0.05] and w.eval_losses == [(0, 2.75)] * 2
    assert sorted(Path(p).name for p in w.state_files) == ["state_rank0.pt", "state_rank1.pt"]
    assert w.activation_memory == {0: [(0.1, 40)], 1: [(0.1, 40)]}
    tl = w.timeline()
    assert tl.mesh == pv.Mesh(pp=2) and tl.schedule == "GPipe" and tl.num_stages == 2 and len(tl.events) == 2
