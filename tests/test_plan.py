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
    names = classic_graph.split_candidates
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


VALID = "Valid split points: layer0, layer1, layer2."


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (["layr0"], f"Unknown layer 'layr0'. Did you mean 'layer0'? {VALID}"),
        (["nothing_like_it"], f"Unknown layer 'nothing_like_it'. {VALID}"),
        (["layer0.lin"], "'layer0.lin' is inside layer 'layer0', not a layer at this granularity. "
                         "Fix: split at 'layer0', or go deeper first: graph = graph.expand('layer0'). " + VALID),
        (["output_proj"], "Cannot split at the END of 'output_proj': it is the last layer, so the last stage would "
                          "be empty. " + VALID),
        ({"layer0": pv.SplitPoint.BEGINNING}, "Cannot split at the BEGINNING of 'layer0': it is the first layer, "
                                              "so stage 0 would be empty. " + VALID),
        ({"layer0": "end", "layer1": "beginning"}, "Splits 'layer0' at END and 'layer1' at BEGINNING fall on the same "
                                                   "boundary (after 'layer0'), which would leave a stage empty. "
                                                   "Fix: keep only one of them."),
        ({"layer0": "middle"}, "Split point for 'layer0' is 'middle'; valid: SplitPoint.END, SplitPoint.BEGINNING, "
                               "'end', 'beginning'."),
    ],
)
def test_validation_messages(classic_graph: pv.ModelGraph, spec: object, message: str) -> None:
    with pytest.raises(pv.PlanError) as info:
        classic_graph.split(spec)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_container_name_message(tied_graph: pv.ModelGraph) -> None:
    with pytest.raises(pv.PlanError) as info:
        tied_graph.split(["blocks"])
    assert str(info.value).startswith("'blocks' is a container of layers (blocks.0 … blocks.1), not one layer. "
                                      "Fix: split at one of its layers, or graph = graph.collapse('blocks').")


def test_type_errors(classic_graph: pv.ModelGraph) -> None:
    with pytest.raises(TypeError, match=r"got the string 'layer0'. Fix: split\(\['layer0'\]\)"):
        classic_graph.split("layer0")
    with pytest.raises(TypeError, match="Layer names are strings, got 3"):
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
    assert g.split_candidates == ["a"]
    with pytest.raises(pv.PlanError, match="Layer 'b' runs 2 times in forward, so a split marker there would fire 2"):
        g.split(["b"])


def test_microbatches_must_divide_the_batch(classic_graph: pv.ModelGraph) -> None:
    with pytest.raises(pv.PlanError) as info:
        classic_graph.split(["layer0"]).pipe(microbatches=5)
    assert str(info.value) == ("microbatches=5 does not divide the batch of 32. Valid: 1, 2, 4, 8, 16, 32; "
                               "or change the batch size.")
