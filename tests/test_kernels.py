"""hardware="cpu" times each traced op on this machine (``pipeviz.kernels``): what the trace records for a replay,
how the microbatch scales it, and the fallbacks. Speed itself is judged in benchmarks/accuracy/simulator_accuracy.py."""

from __future__ import annotations

import torch
from torch import nn

import pipeviz as pv
from pipeviz.cost.replay import MAX_FLOPS, TensorSpec, op_seconds, scaled_shape
from pipeviz.costs import CostOptions, layer_times
from pipeviz.zoo import TinyTransformer


def _ops(graph: pv.ModelGraph, target: str) -> list:
    return [op for op in graph.capture.ops if op.target == target]


def test_the_trace_records_each_ops_arguments_as_shapes() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    graph = pv.trace(model, example_args=(torch.randn(16, 32),))
    first = _ops(graph, "aten.linear.default")[0]
    args, kwargs = first.spec
    x, weight, bias = args
    # The batch: scaled with it; no gradient (training never computes the input's, so the first Linear's backward
    # is its weight's alone)
    assert x == TensorSpec((16, 32), torch.float32, activation=True, grad=False)
    assert weight == TensorSpec((64, 32), torch.float32, activation=False, grad=True)  # a parameter: as traced
    assert bias.shape == (64,) and not bias.activation and kwargs == ()
    assert hash(first)  # an Op stays hashable
    relu = _ops(graph, "aten.relu.default")[0]
    assert relu.spec[0][0].shape == (16, 64) and relu.spec[0][0].activation
    assert relu.spec[0][0].grad  # computed from a parameter: its gradient flows back


def test_what_is_not_computed_from_the_batch_keeps_its_shape() -> None:
    """A position table (an embedding of arange) is the same for any microbatch: only what reads the batch is
    scaled; integer inputs train no gradient."""
    model = TinyTransformer(vocab=64, dim=32, heads=2, depth=1, seq=16)
    graph = pv.trace(model, example_args=(torch.randint(0, 64, (8, 16)),))
    embeddings = _ops(graph, "aten.embedding.default")
    tokens = [t for op in embeddings for t in op.spec[0] if isinstance(t, TensorSpec) and not t.dtype.is_floating_point]
    assert any(t.activation and t.shape[0] == 8 and not t.grad for t in tokens)  # the token ids: the batch
    table = [t for op in embeddings for t in op.spec[0] if isinstance(t, TensorSpec) and t.dtype.is_floating_point]
    assert table and all(not t.activation and t.grad for t in table)  # the embedding weights
    # x + pos[:seq]: the token embeddings are the batch's, the sliced position table is not (not scaled)
    add = _ops(graph, "aten.add.Tensor")[0]
    tokens_emb, pos = add.spec[0]
    assert (tokens_emb.shape, tokens_emb.activation) == ((8, 16, 32), True) and (pos.shape, pos.activation) == (
        (16, 32), False)
    assert scaled_shape(tokens_emb, 0.25, 8) == (2, 16, 32) and scaled_shape(pos, 0.25, 8) == (16, 32)
    # nn.MultiheadAttention (batch_first=False) works on (seq, batch, dim): the batch's dim is scaled, not dim 0
    qkv = _ops(graph, "aten.linear.default")[0]
    assert qkv.spec[0][0].shape == (16, 8, 32) and scaled_shape(qkv.spec[0][0], 0.25, 8) == (16, 2, 32)
    assert scaled_shape(TensorSpec((64, 32), torch.float32, True, True), 0.5, 8) == (32, 32)  # (batch x seq, dim)


def test_ops_replay_forward_and_backward_and_too_big_ones_fall_back() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    graph = pv.trace(model, example_args=(torch.randn(32, 64),))
    linear = _ops(graph, "aten.linear.default")[0]
    times = op_seconds(linear, 0.25)
    assert times is not None and times[0] > 0 and times[1] > 0
    assert op_seconds(linear, MAX_FLOPS / linear.flops * 2) is None  # more work than a replay may take
    threads = torch.get_num_threads()
    op_seconds(_ops(graph, "aten.gelu.default")[0], 0.5)
    assert torch.get_num_threads() == threads  # the replay's one thread is given back


def test_the_cpu_preset_costs_layers_by_their_replayed_ops() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    graph = pv.trace(model, example_args=(torch.randn(32, 64),))
    fwd, bwd, source = layer_times(graph, 4, options=CostOptions(hardware="cpu"))
    assert source == "roofline" and all(f > 0 for f in fwd) and all(b > 0 for b in bwd)
    # GELU has no FLOPs: the plain roofline gives it its bytes' time; replayed, its backward is its own measure,
    # not twice the forward by rule.
    assert bwd != [2 * f for f in fwd]
    plan = pv.balance(graph, 2, hardware="cpu")
    assert pv.simulate(plan, "1F1B", 4, hardware="cpu").step_time > 0


def test_the_cpu_preset_pays_the_measured_gap_between_actions() -> None:
    from pipeviz.profile import CPU_ACTION_OVERHEAD

    assert pv.hardware("cpu").action_overhead == CPU_ACTION_OVERHEAD and pv.hardware("h100").action_overhead == 0
    graph = pv.trace(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), example_args=(torch.randn(8, 16),))
    plan = graph.split(["0"])
    from pipeviz.costs import stage_costs

    assert stage_costs(plan, 2, options=CostOptions(hardware="cpu")).overhead == CPU_ACTION_OVERHEAD


def test_a_size_the_data_decides_is_not_replayed() -> None:
    """MoE routing (a nonzero over the router's choice) gives later ops sizes that only the data fixes: those ops
    carry no replay spec (hardware="cpu" estimates them); the trace itself is unaffected."""
    from pipeviz import zoo

    model = zoo.MoENet(layers=2)
    graph = pv.trace(model, example_args=(torch.randint(0, 64, (4, 16)),))
    assert any(op.spec is None for op in graph.capture.ops)
    assert any(op.spec is not None for op in graph.capture.ops)
    assert all(f > 0 for f in layer_times(graph, 2, options=CostOptions(hardware="cpu"))[0][1:])


def test_the_replay_times_what_training_runs() -> None:
    """A parameter's gradient is accumulated into .grad (counted: a parameter-free op of the same output costs
    nothing for it); the last stage pays the loss (a log-softmax over the output), the others do not;
    forget_kernel_times() makes the next estimate measure again."""
    from pipeviz.cost import replay as kernels
    from pipeviz.costs import stage_costs

    assert kernels._accumulate((256, 256), torch.float32) > 0
    fwd, bwd = kernels.loss_seconds([((64, 1000), torch.float32), ((64,), torch.int64)], 0.5)
    assert fwd > 0 and bwd > 0
    assert kernels.loss_seconds([((64,), torch.int64)], 1.0) == (0.0, 0.0)  # an integer output: no loss over it
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 512))
    graph = pv.trace(model, example_args=(torch.randn(32, 64),))
    plan = graph.split(["1"])
    opts = CostOptions(hardware="cpu")
    layer_f, _, _ = layer_times(graph, 2, options=opts)
    costs = stage_costs(plan, 2, options=opts)
    first = plan.stages[0].layers
    pos = {n: i for i, n in enumerate(graph.layer_names)}
    assert costs.forward[0] == sum(layer_f[pos[n]] for n in first)  # no loss before the last stage
    assert costs.forward[1] > sum(layer_f[pos[n]] for n in plan.stages[1].layers)  # the loss on the last
    assert kernels._measure.cache_info().currsize > 0
    from pipeviz.hardware import forget_kernel_times

    forget_kernel_times()
    assert kernels._measure.cache_info().currsize == 0 and kernels._accumulate.cache_info().currsize == 0


def test_a_transposed_activation_is_replayed_transposed() -> None:
    """The trace keeps a non-row-major activation's layout (``TensorSpec.order``): ``.contiguous()`` of a transposed
    tensor copies in the run, and so in the replay."""
    from pipeviz.cost import replay as kernels

    class T(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.transpose(0, 1).contiguous())

    graph = pv.trace(T(), example_args=(torch.randn(32, 16, 64),))
    cont = _ops(graph, "aten.contiguous.default")[0]
    (arg,), _ = cont.spec
    assert arg.shape == (16, 32, 64) and arg.order == (1, 0, 2)  # dim 1 outermost in memory: a transposed view
    x = kernels._random((16, 8, 64), torch.float32, False, arg.order)
    assert x.shape == (16, 8, 64) and not x.is_contiguous() and x.transpose(0, 1).is_contiguous()
    assert _ops(graph, "aten.linear.default")[0].spec[0][0].order is None  # contiguous: no layout recorded


class _CausalAttention(nn.Module):
    """Attention whose causal mask is built from positions alone and expanded to the batch, as HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, heads, seq, dim)
        batch, _, seq, _ = x.shape
        pos = torch.arange(seq)
        mask = (pos[:, None] >= pos[None, :]).expand(batch, 1, seq, seq)
        q = self.proj(x)
        return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_a_mask_expanded_to_the_batch_is_scaled_with_it() -> None:
    """The mask is no activation (no batch data in it) but has the batch's dim: replayed at a quarter of the batch
    it must shrink with the queries, or the op does not run and falls back to the roofline."""
    graph = pv.trace(_CausalAttention(), example_args=(torch.randn(8, 2, 64, 32),))
    (sdpa,) = _ops(graph, "aten.scaled_dot_product_attention.default")
    mask = sdpa.spec[0][3]
    assert mask.shape == (8, 1, 64, 64) and not mask.activation and not mask.grad
    quarter, whole = op_seconds(sdpa, 0.25, batch=8), op_seconds(sdpa, 1.0, batch=8)
    assert quarter is not None and whole is not None
    assert quarter[0] > 0 and quarter[1] > 0
