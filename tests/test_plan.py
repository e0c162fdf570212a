"""SplitPlan: stages preview, validation, toggles, JSON."""

from __future__ import annotations

import pytest

import pipeviz as pv


def test_classic_three_stages(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer0", "layer1"])
    assert plan.num_stages == 3
    assert [s.layers for s in plan.stages] == [("layer0",), ("layer1",), ("layer2", "output_proj")]
    assert [s.params for s in plan.stages] == [262_656, 525_312, 262_400 + 2_570]
    assert [s.send_bytes for s in plan.stages] == [32 * 512 * 4, 32 * 1024 * 4, 0]
    assert [s.recv_bytes for s in plan.stages] == [0, 32 * 512 * 4, 32 * 1024 * 4]
    assert plan.stages[0].inputs == ("x",) and plan.stages[1].inputs == ()
    assert sum(s.flops for s in plan.stages) == classic_graph.total_flops


def test_beginning_and_end_are_the_same_boundary(classic_graph: pv.ModelGraph) -> None:
    a = classic_graph.split(["layer1"])
    b = classic_graph.split({"layer2": pv.SplitPoint.BEGINNING})
    c = classic_graph.split({"layer1": "end"})
    assert [s.layers for s in a.stages] == [s.layers for s in b.stages] == [s.layers for s in c.stages]


def test_skip_value_counted_in_send_bytes(skip_graph: pv.ModelGraph) -> None:
    plan = skip_graph.split(["layer0", "layer1"])
    act = 8 * 16 * 4
    # Stage 1 forwards its own output and relays layer0's output, which output_proj needs.
    assert [s.send_bytes for s in plan.stages] == [act, 2 * act, 0]


def test_tied_weights_flagged_per_stage(tied_graph: pv.ModelGraph) -> None:
    plan = tied_graph.split(["blocks.0"])
    assert plan.stages[0].shared_params == ("embed.weight",) == plan.stages[1].shared_params
    assert sum(s.params for s in plan.stages) == tied_graph.total_params  # counted once overall
    assert plan.stages[1].param_bytes > plan.stages[1].params * 4  # but stage 1 holds its own copy


def test_hundred_toggles(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split([])
    names = ["layer0", "layer1", "layer2"]
    expected: set[str] = set()
    for i in range(100):
        name = names[(i * 7) % len(names)]
        plan = plan.toggle(name)
        expected ^= {name}
        assert plan.num_stages == len(expected) + 1
        assert {n for n, _ in plan.splits} == expected
        assert sum(len(s.layers) for s in plan.stages) == 4


def test_toggle_removes_a_beginning_split_on_the_same_boundary(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split({"layer2": pv.SplitPoint.BEGINNING})
    assert plan.toggle("layer1").num_stages == 1


def test_plans_are_immutable(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer0"])
    plan.toggle("layer1")
    assert plan.num_stages == 2
    with pytest.raises(AttributeError):
        plan.splits = ()  # type: ignore[misc]


def test_json_round_trip(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split({"layer0": pv.SplitPoint.END, "layer2": pv.SplitPoint.BEGINNING})
    again = pv.SplitPlan.from_json(plan.to_json(), classic_graph)
    assert again == plan and again.stages == plan.stages


def test_from_stages(classic_graph: pv.ModelGraph) -> None:
    plan = pv.SplitPlan.from_stages(classic_graph, [["layer0", "layer1"], ["layer2", "output_proj"]])
    assert plan == classic_graph.split(["layer1"])
    with pytest.raises(pv.PlanError, match="must list every layer once, in execution order"):
        pv.SplitPlan.from_stages(classic_graph, [["layer1", "layer0"], ["layer2", "output_proj"]])


VALID = "Valid split points: layer0, layer1, layer2 (and the modules inside them: graph.split_candidates)."


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (["layr0"], f"Unknown module 'layr0'. Did you mean 'layer0'? {VALID}"),
        (["nothing_like_it"], f"Unknown module 'nothing_like_it'. {VALID}"),
        (["output_proj"], "Cannot split at the END of 'output_proj': no module runs after it, so the last stage "
                          "would be empty. " + VALID),
        ({"layer0": pv.SplitPoint.BEGINNING}, "Cannot split at the BEGINNING of 'layer0': no module runs before it, "
                                              "so stage 0 would be empty. " + VALID),
        ({"layer0": "end", "layer1": "beginning"}, "Splits 'layer0' at END and 'layer1' at BEGINNING fall on the same "
                                                   "boundary, which would leave a stage empty. "
                                                   "Fix: keep only one of them."),
        (["layer0.lin", "layer0"], "Stage 1 would hold no module, only the ops between modules (positions 0.5..1.5). "
                                   "Fix: drop one of the two split points around it."),
        ({"layer0": "middle"}, "Split point for 'layer0' is 'middle'; valid: SplitPoint.END, SplitPoint.BEGINNING, "
                               "'end', 'beginning'."),
    ],
)
def test_validation_messages(classic_graph: pv.ModelGraph, spec: object, message: str) -> None:
    with pytest.raises(pv.PlanError) as info:
        classic_graph.split(spec)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_any_module_name_splits_whatever_the_view(classic_graph: pv.ModelGraph, tied_graph: pv.ModelGraph) -> None:
    # A container (the ModuleList `blocks`) splits at its end, as its last block would.
    assert tied_graph.split(["blocks"]).stages == tied_graph.split(["blocks.1"]).stages
    # A module inside a layer: the plan's graph opens that layer, so stages stay runs of whole layers.
    plan = classic_graph.split(["layer0.lin"])
    assert plan.graph.layer_names == ("layer0.lin", "layer1", "layer2", "output_proj")
    assert [s.layers for s in plan.stages] == [("layer0.lin",), ("layer1", "layer2", "output_proj")]
    assert plan.stages[0].send_bytes == 32 * 512 * 4  # the pre-activation: the ReLU runs in stage 1, as in torch
    assert plan.pipe(2).num_stages == 2
    assert plan.onto(classic_graph).num_stages == 1  # that split falls inside a layer of the coarser view


def test_type_errors(classic_graph: pv.ModelGraph) -> None:
    with pytest.raises(TypeError, match=r"got the string 'layer0'. Fix: split\(\['layer0'\]\)"):
        classic_graph.split("layer0")
    with pytest.raises(TypeError, match="Module names are strings, got 3"):
        classic_graph.split([3])  # type: ignore[list-item]


def test_reused_module_is_not_a_split_point() -> None:
    import torch

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.c = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(self.b(self.a(x))))

    g = pv.trace(Twice(), example_args=(torch.randn(2, 4),))
    assert g.layer_names == ("a", "b@0", "b@1", "c")  # one layer per call
    assert g.split_candidates == ["a", "b@0", "b@1"] and g.layer("b@1").calls == 2
    with pytest.raises(pv.PlanError, match=r"Module 'b' runs 2 times in forward, so a split there is ambiguous. "
                                           r"Fix: name one call: b@0, b@1."):
        g.split(["b"])
    plan = g.split(["b@0"])  # between the two calls: b's weights live in both stages
    assert [s.layers for s in plan.stages] == [("a", "b@0"), ("b@1", "c")]
    assert plan.stages[0].shared_params == ("b.bias", "b.weight") == plan.stages[1].shared_params
    pipe = plan.pipe(2)
    assert pipe.num_stages == 2
    x = torch.randn(1, 4)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x)[0], g.model(x))


def test_microbatches_must_divide_the_batch(classic_graph: pv.ModelGraph) -> None:
    with pytest.raises(pv.PlanError) as info:
        classic_graph.split(["layer0"]).pipe(microbatches=5)
    assert str(info.value) == ("microbatches=5 does not divide the batch of 32. Valid: 1, 2, 4, 8, 16, 32; "
                               "or change the batch size.")
