"""Forwards with ``torch.no_grad()`` / ``set_grad_enabled`` / ``autocast`` regions (``pipeviz.adapter.regions``):
traced with
their ops where they run, never split inside, and trained or run forward exactly like the unsplit model under
every schedule (three in ``make test``, the other four in ``make compat``)."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.adapter.regions import REGION_META, inline_regions
from pipeviz.plan.errors import PlanError
from tests.models import Regions
from tests.schedule_sets import SCHEDULES, train_exactly

FORWARD = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


def _model() -> tuple[Regions, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Regions(), torch.randn(8, 16), torch.randint(0, 4, (8,))


def _hops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]


def test_inlined_regions_compute_what_the_model_computes_and_restore_the_grad_mode() -> None:
    model, x, _ = _model()
    gm = torch.export.export(model, (x,)).module()
    assert {"wrap_with_set_grad_enabled", "wrap_with_autocast"} <= {h.rpartition(".")[2] for h in _hops(gm)}
    assert inline_regions(gm) == 5  # no_grad x3 (one decorated), autocast x2 (one nested); set_grad_enabled(True)
    assert _hops(gm) == []  # under grad mode is nothing for export to keep
    labels = {n.meta[REGION_META] for n in gm.graph.nodes if REGION_META in n.meta}
    assert any("torch.autocast('cpu', bfloat16) block in Regions.forward" in s for s in labels), labels
    assert any("torch.no_grad() block in Rotary.forward (rotary)" in s for s in labels), labels
    want = model(x)
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)
    with torch.no_grad():
        gm(x)
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")
    # No gradient flows through a no_grad region: the teacher gets none.
    gm(x).sum().backward()
    assert dict(gm.named_parameters())["teacher.weight"].grad is None
    assert dict(gm.named_parameters())["l1.weight"].grad is not None


def test_trace_counts_region_ops_where_they_run_and_offers_no_split_inside_one() -> None:
    model, x, _ = _model()
    graph = pv.trace(model, example_args=(x,))
    layers = {layer.name: layer for layer in graph.layers}
    assert layers["teacher"].params == 16 * 16 + 16 and layers["teacher"].flops > 0  # ops inside no_grad
    assert layers["l2"].params == 16 * 16 + 16 and layers["l2"].flops > 0  # ops inside autocast
    assert graph.split_candidates == ["l0", "rotary", "l1", "l3"]
    assert not graph.can_split_after("teacher") and not graph.can_split_after("l2")
    with pytest.raises(PlanError, match=r"END of 'teacher': it runs inside a torch.no_grad\(\) block in "
                                        r"Regions.forward.*Fix: split before or after the block"):
        graph.split(["teacher"])
    with pytest.raises(PlanError, match=r"BEGINNING of 'l2': it runs inside a torch.autocast\('cpu', bfloat16\)"):
        graph.split({"l2": pv.SplitPoint.BEGINNING})
    # Balance places splits only where they can be: teacher+l1 and l2+l3 stay together.
    assert [s.layers for s in pv.balance(graph, 5).stages] == [
        ("l0",), ("rotary",), ("teacher", "l1"), ("l2", "l3"), ("out",)]
    with pytest.raises(PlanError, match=r"a split can follow only 4 of them .*Valid: 1 to 5"):
        pv.balance(graph, 6)


def test_the_pipe_of_a_model_with_regions_computes_the_model_exactly() -> None:
    # torch's own pipeline() loses the regions' bodies ("references nonexistent attribute"); pipeviz inlines
    # them first. Exact equality: the autocast stage really runs in bfloat16, the rotary table in float32.
    model, x, _ = _model()
    plan = pv.trace(model, example_args=(x,)).split(["l0", "rotary", "l1"])
    pipe = plan.pipe(microbatches=1)
    assert pipe.num_stages == 4
    out = pipe(x)  # the stages in sequence, through torch's split graph
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x), rtol=0, atol=0)


def _train(schedules: tuple[str, ...]) -> None:
    model, x, y = _model()
    graph = pv.trace(model, example_args=(x,))
    plans = graph.split(["rotary"]), graph.split(["l0", "rotary", "l1"])
    for schedule in schedules:
        train_exactly(schedule, plans, inputs=(x,), target=y, loss_fn=pv.cross_entropy)


@pytest.mark.slow
@SCHEDULES
def test_a_model_with_regions_trains_like_the_unsplit_model(schedules: tuple[str, ...]) -> None:
    _train(schedules)


@pytest.mark.slow
@pytest.mark.parametrize("schedules", [FORWARD[:1], pytest.param(FORWARD[1:], marks=pytest.mark.compat)],
                         ids=["gpipe", "other-4"])
def test_a_model_with_regions_runs_forward_only_like_the_unsplit_model(schedules: tuple[str, ...]) -> None:
    model, x, _ = _model()
    graph = pv.trace(model, example_args=(x,))
    for schedule in schedules:
        plan = graph.split(["rotary"] if schedule in ("GPipe", "1F1B") else ["l0", "rotary", "l1"])
        run = pv.launch(plan, schedule, 4, steps=1, inputs=(x,))
        assert run.wait(120) == "done", f"{schedule}: {run.error}"
        torch.testing.assert_close(run.outputs[0], model(x).detach(), rtol=0, atol=1e-5)
        assert pv.check_numerics(run).ok


class _InferenceMode(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.inference_mode():
            z = h * 2
        return self.b(h) + z.clone()


class _Cond(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t - 1, (h,))
        return self.b(h)


def test_what_export_cannot_capture_is_said_at_trace() -> None:
    # torch.export drops an inference_mode block silently (the graph would train through it): refused, with the
    # line it is written on and the routes that work.
    with pytest.raises(pv.TraceError, match=r"(?s)enters torch.inference_mode\(\) \(at .*test_regions.py:\d+\).*"
                                            r"Fix: use torch.no_grad\(\) there.*pv.manual_plan"):
        pv.trace(_InferenceMode(), example_args=(torch.randn(4, 8),))


def test_an_op_torch_cannot_split_is_named_before_any_stage_is_built() -> None:
    x = torch.randn(4, 8)
    graph = pv.trace(_Cond(), example_args=(x,))
    assert any("torch.cond" in note for note in graph.notes)
    plan = graph.split(["a"])  # the preview still works: the plan is data
    with pytest.raises(PlanError, match=r"torch.cond \(in the model's forward, op 'cond'\) cannot be pipelined.*"
                                        r"Fix: compute both branches and pick with torch.where"):
        plan.pipe(2)
    with pytest.raises(pv.LaunchError, match=r"torch.cond .* cannot be pipelined"):
        pv.launch(plan, "1F1B", 2, steps=1, inputs=(x,))
