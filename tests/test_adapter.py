"""pipeviz.adapter: every touch of torch internals, checked against the installed torch.

A torch whose internals changed fails here, with the name of the piece that moved, before any worker runs.
"""

from __future__ import annotations

import pickle

import cloudpickle
import pytest
import torch
from torch import nn

import pipeviz as pv
from pipeviz import adapter
from tests.foreign import BNNet


def test_the_internals_pipeviz_relies_on_are_there() -> None:
    from torch.distributed.pipelining import _backward, schedules, stage

    assert callable(schedules._wait_batch_p2p), "torch moved schedules._wait_batch_p2p (timed_waits)"
    assert callable(stage.stage_backward_input) and callable(stage.stage_backward_weight), \
        "torch moved stage.stage_backward_input/_weight (exact_split_backward)"
    for name in ("_get_grad_fn_or_grad_acc", "construct_reverse_graph", "reverse_closure"):
        assert callable(getattr(_backward, name)), f"torch moved _backward.{name} (exact_split_backward)"
    from torch._library.custom_ops import OPDEFS  # custom ops named in pickled stages

    assert hasattr(OPDEFS, "get"), "torch moved torch._library.custom_ops.OPDEFS (custom ops in stages)"


def test_flat_stage_computes_what_torch_stage_computes_and_survives_pickling() -> None:
    torch.manual_seed(0)
    model, x = BNNet(), torch.randn(8, 16)
    plan = pv.trace(model, example_args=(x,)).split(["bn0"])
    pipe = plan.pipe(2)
    aliases = {a: c for c, group in plan.graph.capture.aliases.items() for a in group}
    original = pipe.get_stage_module(0)
    flat = adapter.flatten_stage(original, aliases)
    assert isinstance(flat, adapter.FlatStage)
    assert {n for n, _ in flat.named_parameters()} == {"fc0.weight", "fc0.bias", "bn0.weight", "bn0.bias"}
    again = pickle.loads(cloudpickle.dumps(flat))
    torch.testing.assert_close(again(x[:4]), original(x[:4]))
    # The in-place counter update survives pickling (fx's own pickling drops unused in-place results).
    before = int(again.bn0.num_batches_tracked)
    again(x[:4])
    assert int(again.bn0.num_batches_tracked) == before + 1
    graph = adapter.split_graph(pipe)
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["submod_pp_0", "submod_pp_1"]


def test_stage_modules_run_generated_code_not_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's stage submodules run node by node through torch.fx.Interpreter; plan.stage_modules() gives the same
    modules running their generated code, with the same results bit for bit."""
    from torch import fx

    interpreted = []
    run = fx.Interpreter.run
    monkeypatch.setattr(fx.Interpreter, "run", lambda self, *a, **k: interpreted.append(1) or run(self, *a, **k))
    torch.manual_seed(0)
    model, x = BNNet(), torch.randn(8, 16)
    plan = pv.trace(model, example_args=(x,)).split(["bn0"])
    torchs, ours = plan.pipe(2).get_stage_module(0), plan.stage_modules(2)[0]
    ours.load_state_dict(torchs.state_dict())
    expected = torchs(x[:4])
    assert interpreted, "torch's stage module no longer runs through fx.Interpreter: compiled_submodules is moot"
    interpreted.clear()
    assert torch.equal(ours(x[:4]), expected) and not interpreted


def test_canonical_names_drop_call_suffixes() -> None:
    aliases = {"head.weight": "embed.weight", "shared.0.weight": "shared.0.weight"}
    assert adapter.canonical_name("shared@1.0@1.weight", aliases) == "shared.0.weight"
    assert adapter.canonical_name("head.weight", aliases) == "embed.weight"


def test_fake_tensors_give_shapes_without_computing() -> None:
    lin = nn.Linear(4, 3)
    weight = lin.weight.detach().clone()
    with adapter.fake_tensors() as fake:
        (x,) = fake((torch.randn(5, 4),))
        out = lin(x)
    assert out.shape == (5, 3) and torch.equal(lin.weight, weight)


def test_timed_waits_is_restored() -> None:
    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p
    with adapter.timed_waits(lambda a, b: None):
        assert schedules._wait_batch_p2p is not original
    assert schedules._wait_batch_p2p is original


class Bypass(nn.Module):
    """A stage whose position table never meets the input's path, and a bias that also leaves directly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pos = nn.Embedding(6, 4)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.pos(torch.arange(6))
        b = self.bias * 2
        return self.lin(x) + b, p, b


@pytest.mark.parametrize("fixed", [False, True])
def test_exact_split_backward_gives_every_weight_its_gradient(fixed: bool) -> None:
    from torch.distributed.pipelining import stage as torch_stage

    torch.manual_seed(0)
    mod = Bypass()
    x = torch.randn(6, 4, requires_grad=True)
    grads = [torch.randn(6, 4), torch.randn(6, 4), torch.randn(4)]
    full = torch.autograd.grad(mod(x), list(mod.parameters()), grads)

    def split() -> dict[str, torch.Tensor | None]:
        mod.zero_grad(set_to_none=True)
        outs = list(mod(x))
        _, groups = torch_stage.stage_backward_input(outs, grads, [x], mod.parameters())
        torch_stage.stage_backward_weight(mod.parameters(), groups)
        return {n: p.grad for n, p in mod.named_parameters()}

    want = dict(zip([n for n, _ in mod.named_parameters()], full, strict=True))

    if fixed:
        with adapter.exact_split_backward():
            got = split()
        for name, g in got.items():
            torch.testing.assert_close(g, want[name], msg=name)
    else:  # torch 2.13 alone: the position table gets no gradient (if this passes, torch fixed it)
        got = split()
        assert got["pos.weight"] is None


def test_the_timed_stage_overrides_match_this_torchs_pipeline_stage() -> None:
    adapter.check_stage_methods()  # the overridden methods take the parameters the overrides pass on
    assert set(adapter.OVERRIDDEN) == {"forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
                                       "perform_reduce_grad"}


_TIMED_STAGE = """
import contextlib, sys, tempfile, torch, torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules
from pipeviz.adapter import timed_stage_class

dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
seen = []

@contextlib.contextmanager
def span(stage, kind, mb):
    seen.append(f"{stage}{kind}{mb}")
    yield

Stage = timed_stage_class(span)
torch.manual_seed(0)
a, b, x, y = nn.Linear(4, 4), nn.Linear(4, 2), torch.randn(4, 4), torch.randn(4, 2)
train = sys.argv[1] != "forward"
grad = dict(requires_grad=train)
stages = [Stage(a, 0, 2, torch.device("cpu"), input_args=(torch.empty(2, 4),),
                output_args=(torch.empty(2, 4, **grad),)),
          Stage(b, 1, 2, torch.device("cpu"), input_args=(torch.empty(2, 4, **grad),),
                output_args=(torch.empty(2, 2, **grad),))]
if train:
    cls = schedules.get_schedule_class(sys.argv[1])
    schedule = cls(stages, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    losses = []
    schedule.step(x, target=y, losses=losses)
    ref = [nn.functional.mse_loss(b(a(x[i:i + 2])), y[i:i + 2]).item() for i in (0, 2)]
    assert [l.item() for l in losses] == ref, (losses, ref)
else:  # forward only: one stage of both layers (torch cannot run two adjacent stages of one rank without a backward)
    whole = Stage(nn.Sequential(a, b), 0, 1, torch.device("cpu"), input_args=(torch.empty(2, 4),),
                  output_args=(torch.empty(2, 2),))
    with torch.no_grad():  # the reference at the microbatches' shapes: the same kernels, so exactly equal anywhere
        # (one batch of 4 rows may take another BLAS kernel than two of 2, which differs in the last bits on some CPUs)
        want = torch.cat([b(a(x[i:i + 2])) for i in (0, 2)])
        assert torch.equal(schedules.ScheduleGPipe(whole, n_microbatches=2).step(x), want)
print(" ".join(seen))
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("schedule", "kinds"), [("Interleaved1F1B", {"F", "B"}), ("ZBVZeroBubble", {"F", "I", "W"}),
                                                 ("forward", {"F"})])
def test_the_timed_stage_times_every_action_torchs_schedules_run(schedule: str, kinds: set[str]) -> None:
    # Two stages of a real schedule on one rank (a 1-process gloo group): every action the schedule runs is
    # timed once, with its stage and microbatch, and the losses are the unsplit model's.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TIMED_STAGE, schedule], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    actions = out.stdout.split()
    assert {a[1] for a in actions} == kinds and len(actions) == len(set(actions))
    stages = 1 if schedule == "forward" else 2
    assert len(actions) == stages * 2 * len(kinds)  # every (stage, microbatch) once per kind
