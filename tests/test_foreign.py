"""Models written the way other people write them train exactly like the unsplit model.

Each case (``tests/foreign.py``) is traced, split where a user would split it, simulated, and trained two
steps under GPipe, 1F1B and a multi-stage schedule; losses, parameters and buffers must match the unsplit
model trained the same way (1e-5, float32).
"""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from tests.foreign import CASES, BNNet, Reused, case

MULTI = {"mlp_chain": "Interleaved1F1B", "seq_blocks": "LoopedBFS", "reused": "InterleavedZeroBubble",
         "batchnorm": "ZBVZeroBubble", "kwargs": "DualPipeV", "two_outputs": "Interleaved1F1B",
         "aliased": "LoopedBFS", "resnet": "ZBVZeroBubble", "moe": "InterleavedZeroBubble"}


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_same_training(run: pv.Run, ref: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    assert run.wait(120) == "done", run.error
    losses, state = ref
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=0, atol=1e-5)
    got = run.state_dict()
    assert set(got) == set(state)  # parameters and buffers, every original name
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5, msg=f"{k} differs from the unsplit model")


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_trains_like_the_unsplit_model(name: str) -> None:
    model, args, kwargs, target, loss_fn, splits = case(name)
    graph = pv.trace(model, example_args=args, example_kwargs=kwargs)
    ref = pv.train_reference(model, args, target, loss_fn=loss_fn, optimizer=sgd, microbatches=4, steps=2,
                             input_kwargs=kwargs)
    plan = graph.split(splits)  # the names a user would write, whatever the view shows
    assert pv.simulate(plan, "1F1B", 4).step_time > 0
    # 4 stages for the multi-stage schedule (2 per rank); the ReLU "1" of the chain makes a stage of its own.
    four = graph.split(["0", "1", "2"]) if name == "mlp_chain" else pv.balance(graph, 4)
    for schedule, p in (("GPipe", plan), ("1F1B", plan), (MULTI[name], four)):
        run = pv.launch(p, schedule, 4, steps=2, inputs=args, input_kwargs=kwargs or None, target=target,
                        loss_fn=loss_fn, optimizer=sgd)
        assert_same_training(run, ref)


def test_blocks_and_layers_are_whole_and_activations_are_glue() -> None:
    for name, layers in [
        ("seq_blocks", ("layer0", "layer1", "layer2", "layer3", "output_proj")),  # Sequential(Linear, ReLU) kept
        ("moe", ("embed", "moe0", "moe1", "moe2", "head")),  # a MoE layer (norm, router, experts) kept whole
        ("mlp_chain", ("0", "2", "4")),  # the ReLUs of an nn.Sequential chain are glue, not layers
        ("resnet", ("conv1", "bn1", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "avgpool", "fc")),
    ]:
        model, args, kwargs, *_ = case(name)
        graph = pv.trace(model, example_args=args, example_kwargs=kwargs)
        assert graph.layer_names == layers
    # The glue is still a split point: after the ReLU "1", it runs in stage 0.
    model, args, *_ = case("mlp_chain")
    graph = pv.trace(model, example_args=args)
    assert graph.split(["1"]).stages[0].send_bytes == graph.split(["0"]).stages[0].send_bytes
    assert graph.split(["1"]).stages[1].flops == graph.split(["0"]).stages[1].flops


def test_parameters_are_counted_without_buffers() -> None:
    model = BNNet()
    graph = pv.trace(model, example_args=(torch.randn(8, 16),))
    n_params = sum(p.numel() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert graph.total_params == n_params and graph.total_buffer_bytes == buffer_bytes
    plan = graph.split(["bn0"])
    assert sum(s.params for s in plan.stages) == n_params
    assert sum(s.buffer_bytes for s in plan.stages) == buffer_bytes
    assert plan.stages[0].buffer_bytes == 16 * 4 * 2 + 8  # bn0: running mean and var, num_batches_tracked
    assert graph.layer("bn0").params == 32 and graph.layer("bn0").buffer_bytes == 16 * 4 * 2 + 8


def test_a_module_called_in_two_stages_is_shared_like_a_tied_weight() -> None:
    graph = pv.trace(Reused(), example_args=(torch.randn(8, 16),))
    assert graph.layer_names == ("shared@0", "l1", "l2", "shared@1", "head")
    plan = graph.split(["l1"])
    assert plan.stages[0].shared_params == ("shared.0.bias", "shared.0.weight") == plan.stages[1].shared_params
    assert graph.split(["shared@0"]).num_stages == 2  # one call can be split after


def test_a_buffer_updated_in_two_stages_is_refused() -> None:
    class TwiceBN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(8)
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.norm(self.a(self.norm(x))))

    graph = pv.trace(TwiceBN(), example_args=(torch.randn(8, 8),))
    assert graph.split(["norm@1"]).num_stages == 2  # both updates in stage 0: fine
    with pytest.raises(pv.PlanError, match=r"Buffer 'norm.running_mean' is updated during forward and "
                                           r"used in stages \[0, 1\]"):
        graph.split(["norm@0"])
