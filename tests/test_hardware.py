"""pv.Hardware: presets, lookup and errors; the roofline per op; the one cost model on named hardware."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import nn

import pipeviz as pv
from pipeviz.costs import CostOptions, layer_times, stage_costs
from pipeviz.hardware import HARDWARE, matmul_efficiency, op_time


class Scale(nn.Module):
    """An elementwise layer: no FLOPs counted, only bytes read and written."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class MatmulThenScale(nn.Module):
    def __init__(self, d: int = 2048) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)
        self.scale = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.lin(x))


def test_presets_and_lookup() -> None:
    assert list(HARDWARE) == ["a100-80gb", "h100-sxm", "h200", "b200", "cpu"]
    assert pv.hardware("H100") is pv.hardware("h100-sxm") is HARDWARE["h100"]
    assert pv.hardware(" A100 ").name == "a100-80gb"
    h100 = pv.hardware("h100")
    assert h100.peak("bfloat16") == 989.5e12 and h100.peak("bf16") == 989.5e12 and h100.peak("fp8") == 1979e12
    assert pv.hardware("a100").peak("bfloat16") == 312e12 and pv.hardware("b200").peak("bfloat16") == 2.25e15
    assert pv.hardware("h200").memory_bytes == 141 * 10**9 and pv.hardware("h200").memory_bandwidth == 4.8e12
    assert h100.rate("bfloat16") == pytest.approx(989.5e12 * h100.efficiency)
    assert 0.5 <= h100.efficiency <= 0.6
    slower = h100.with_efficiency(0.3)
    assert slower == dataclasses.replace(h100, efficiency=0.3) and slower != h100 and hash(slower) == hash(
        dataclasses.replace(h100, efficiency=0.3))
    assert pv.hardware(slower) is slower
    # Links: a group within a node uses NVLink, beyond one the network; both at collective_efficiency.
    assert h100.link(8) == (450e9 * h100.collective_efficiency, 5e-6)
    assert h100.link(9) == (50e9 * h100.collective_efficiency, 1e-5)


def test_cpu_is_measured() -> None:
    cpu = pv.hardware("CPU")
    assert cpu is pv.hardware("cpu")  # measured once, cached
    assert cpu.flops["float32"] > 1e8 and cpu.memory_bandwidth > 1e8 and cpu.efficiency == 1.0
    assert cpu.dtype() in ("float32", "bfloat16")


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(pv.HardwareError) as info:
        pv.hardware("v100")
    assert "Unknown hardware 'v100'; valid: a100-80gb, h100-sxm, h200, b200, cpu" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(pv.HardwareError, match="has no peak for dtype 'int4'; valid: float32, tf32"):
        pv.hardware("a100").peak("int4")
    with pytest.raises(pv.HardwareError, match="efficiency must be in"):
        pv.hardware("h100").with_efficiency(1.5)
    with pytest.raises(TypeError):
        pv.hardware(3)  # type: ignore[arg-type]
    with pytest.raises(pv.HardwareError, match="Unknown hardware 'tpu'"):
        pv.simulate(None, "1F1B", 4, costs=pv.Costs.uniform(2), num_stages=2, hardware="tpu")


def test_roofline_per_op() -> None:
    h100 = pv.hardware("h100")
    assert h100.roofline == "additive" and pv.hardware("cpu").roofline == "kernels"
    # A 8192^3 matmul: 1.1 TFLOP, 400 MB. The GPU presets add its math and its memory traffic; the plain
    # roofline takes the slower of the two: compute-bound. An elementwise add of 1 GB: memory-bound in both.
    big, nbytes = 2 * 8192**3, 3 * 8192**2 * 2
    rate, bw = h100.rate("bfloat16"), h100.memory_bandwidth
    assert op_time(big, nbytes, h100, "bfloat16") == pytest.approx(big / rate + nbytes / bw)
    plain = dataclasses.replace(h100, roofline="max")
    assert op_time(big, nbytes, plain, "bfloat16") == pytest.approx(big / rate)
    assert op_time(2**28, 3 * 2**30, plain) == pytest.approx(3 * 2**30 / bw)
    assert op_time(0, 3 * 2**30, h100) == pytest.approx(3 * 2**30 / bw)
    with pytest.raises(pv.HardwareError, match="Unknown roofline='min'; valid: additive, max, kernels"):
        dataclasses.replace(h100, roofline="min")


def test_matmul_efficiency_rises_with_size_toward_the_constant() -> None:
    for name in ("a100", "h100"):
        hw = pv.hardware(name)
        square = [matmul_efficiency(d, d, d, hw) for d in (128, 256, 512, 1024, 2048, 4096, 8192, 16384)]
        assert all(a < b for a, b in itertools.pairwise(square))  # monotone in size
        assert 0 < square[0] < 0.5 * hw.efficiency and square[-1] < hw.efficiency
        assert square[-1] > 0.95 * hw.efficiency  # a large matmul is nearly at the ceiling
        assert matmul_efficiency(8192, 8192, 8192, hw.with_efficiency(0.3)) < 0.3
    h100 = pv.hardware("h100")
    # Megatron-LM's H100 weak scaling: the 1.7B model's QKV matmul (4096 tokens, hidden 2048, tp 1) is less
    # efficient than the 462B model's (hidden 18432, tp 8), whose arithmetic intensity is twice as high.
    assert matmul_efficiency(4096, 2048, 6144, h100) < matmul_efficiency(4096, 18432, 6912, h100)
    # The plain roofline: every compute-bound matmul at the constant.
    assert matmul_efficiency(4096, 2048, 6144, dataclasses.replace(h100, roofline="max")) == pytest.approx(
        h100.efficiency)


def test_a_group_over_nodes_uses_a_nic_per_member_in_each_node() -> None:
    a100 = pv.hardware("a100")  # NVLink 300 GB/s per direction, 25 GB/s InfiniBand per GPU, 8 per node
    eff = a100.collective_efficiency
    assert a100.link(8) == (300e9 * eff, 5e-6)  # within a node: NVLink, rails do not matter
    assert a100.link(8, rails=8) == a100.link(8)
    assert a100.link(32) == (25e9 * eff, 1e-5)  # one member per node: one NIC
    assert a100.link(32, rails=4)[0] == pytest.approx(100e9 * eff)
    assert a100.link(32, rails=8)[0] == pytest.approx(200e9 * eff)
    assert a100.link(32, rails=64)[0] == pytest.approx(200e9 * eff)  # no more rails than devices in a node
    h100 = pv.hardware("h100")  # 8 x 50 GB/s = 400 GB/s of NICs, NVLink 450: the NICs bound it
    assert h100.link(48, rails=8)[0] == pytest.approx(400e9 * h100.collective_efficiency)


class Chain(nn.Module):
    """Three element-wise ops in a row: a fused kernel reads the input once and writes the result once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2.0 + 1.0)


class ChainModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.chain = Chain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chain(x)


def test_fused_element_wise_chains_move_their_tensor_once() -> None:
    x = torch.randn(1024, 1024)
    graph = pv.trace(ChainModel(), example_args=(x,))
    h100 = pv.hardware("h100")
    eager, _, _ = layer_times(graph, 1, options=CostOptions(hardware=h100, dtype="float32"))
    fused, _, _ = layer_times(graph, 1, options=CostOptions(hardware=dataclasses.replace(h100, fused=True),
                                                            dtype="float32"))
    pass_ = x.numel() * 4 / h100.memory_bandwidth
    # Three ops, each reading and writing the tensor (the model's input x is no op's output: its read is not
    # counted): 5 passes; fused, the two intermediates are neither written nor read back: the result's write.
    assert eager[0] == pytest.approx(5 * pass_)
    assert fused[0] == pytest.approx(1 * pass_)
    # A matmul's output is written whatever follows it: fusing changes only the element-wise layer.
    graph = pv.trace(MatmulThenScale(), example_args=(torch.randn(1024, 2048),))
    one, _, _ = layer_times(graph, 1, options=CostOptions(hardware=h100, dtype="float32"))
    two, _, _ = layer_times(graph, 1, options=CostOptions(hardware=dataclasses.replace(h100, fused=True),
                                                          dtype="float32"))
    assert two == pytest.approx(one)


def test_layer_times_on_hardware_are_a_roofline() -> None:
    x = torch.randn(1024, 2048)
    graph = pv.trace(MatmulThenScale(), example_args=(x,))
    h100 = dataclasses.replace(pv.hardware("h100"), roofline="max")  # the plain roofline, term by term
    opts = CostOptions(hardware=h100, dtype="float32")
    fwd, bwd, source = layer_times(graph, 1, options=opts)
    assert source == "roofline" and bwd == [2 * f for f in fwd]
    lin, scale = graph.layer("lin"), graph.layer("scale")
    assert fwd[0] == pytest.approx(lin.flops / h100.rate("float32"))  # 8.6 GFLOP: compute-bound
    assert scale.flops == 0
    assert fwd[1] == pytest.approx(2 * x.numel() * 4 / h100.memory_bandwidth)  # reads and writes 8 MiB
    # Half the efficiency: the matmul takes twice as long, the elementwise layer is unchanged.
    half, _, _ = layer_times(graph, 1, options=CostOptions(hardware=h100.with_efficiency(h100.efficiency / 2),
                                                           dtype="float32"))
    assert half[0] == pytest.approx(2 * fwd[0]) and half[1] == pytest.approx(fwd[1])
    # bfloat16: 2 bytes per activation instead of 4, and the bfloat16 peak.
    bf, _, _ = layer_times(graph, 1, options=CostOptions(hardware=h100, dtype="bfloat16"))
    assert bf[1] == pytest.approx(fwd[1] / 2) and bf[0] == pytest.approx(lin.flops / h100.rate("bfloat16"))
    # A profile wins over any estimate for the kind of device it was measured on: a GPU's for a GPU preset, a
    # CPU's for "cpu"; a CPU measurement says nothing of an H100.
    prof = pv.Profile("cuda:0", 1, {"lin": 0.5, "scale": 0.25}, {"lin": 1.0, "scale": 0.5}, 0.0, 0.0, 0.0, 0.0)
    measured, _, src = layer_times(graph.with_profile(prof), 1, options=opts)
    assert src == "measured" and measured == [0.5, 0.25]
    on_cpu = dataclasses.replace(prof, device="cpu")
    assert layer_times(graph.with_profile(on_cpu), 1, options=opts)[2] == "roofline"
    assert layer_times(graph.with_profile(on_cpu), 1, options=CostOptions(hardware="cpu"))[2] == "measured"
    assert layer_times(graph.with_profile(on_cpu), 1)[2] == "measured"


def test_simulate_plumbs_hardware_everywhere(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer1"])
    a100 = pv.simulate(plan, "1F1B", 4, hardware="a100")
    h100 = pv.simulate(plan, "1F1B", 4, hardware="H100")
    assert h100.step_time < a100.step_time and h100.meta["hardware"] == "h100-sxm"
    assert h100.meta["dtype"] == "bfloat16" and h100.meta["costs"] == "roofline"
    # Keywords and an options object are the same thing, in simulate, stage_costs, memory and balance.
    opts = pv.CostOptions(hardware="h100", dtype="bfloat16", recompute="full")
    assert pv.simulate(plan, "1F1B", 4, options=opts).events == pv.simulate(
        plan, "1F1B", 4, hardware="h100", dtype="bfloat16", recompute="full").events
    assert stage_costs(plan, 4, options=opts) == stage_costs(plan, 4, hardware="h100", recompute="full")
    assert pv.balance(classic_graph, 2, hardware="h100") == pv.balance(classic_graph, 2, options=CostOptions("h100"))
    # Without hardware nothing changes: FLOPs at the device's rate, the backend's link.
    assert stage_costs(plan, 4).source == "flops"


def test_hand_offs_use_the_link_the_two_ranks_share(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer1"])
    hw = pv.hardware("h100")
    costs = stage_costs(plan, 1, hardware=hw)

    def gap(tl: pv.Timeline) -> float:
        f0 = next(e for e in tl.events if e.kind == "F" and e.stage == 0 and e.mb == 0)
        f1 = next(e for e in tl.events if e.kind == "F" and e.stage == 1 and e.mb == 0)
        return f1.start - f0.end

    nbytes = costs.send_bytes[0]
    # One pipeline on two GPUs of one node: NVLink.
    assert gap(pv.simulate(plan, "GPipe", 1, hardware=hw)) == pytest.approx(nbytes / hw.link(2)[0] + hw.link(2)[1])
    # With 8 shards per stage the next pipeline rank is 8 process ranks on: another node, InfiniBand (the
    # sharded microbatch's bytes are the whole microbatch's: every shard sends the full activation).
    far = pv.simulate(plan, "GPipe", 1, hardware=hw, tp=8)
    assert gap(far) == pytest.approx(nbytes / hw.link(9)[0] + hw.link(9)[1])


def test_the_preview_in_the_cost_models_settings(classic_graph: pv.ModelGraph) -> None:
    plan = classic_graph.split(["layer0", "layer1"])
    assert plan.stage_memory() == [s.memory_bytes for s in plan.stages]  # the preview's figure
    bf16 = plan.stage_memory(hardware="h100", dtype="bfloat16")  # activations in 2 bytes instead of 4
    assert all(b < m for b, m in zip(bf16, plan.stage_memory(), strict=True))
    # One microbatch in flight: full recomputation keeps each layer's input and rebuilds one layer at a time,
    # never more than keeping everything plus that rebuilt layer (a layer whose input is larger than what it saves,
    # layer2's 1024 wide input here, gains nothing from it).
    opts = CostOptions(hardware="h100", recompute="full")
    full = plan.stage_memory(options=opts)
    rebuilt = stage_costs(plan, 1, options=opts).recompute_bytes
    assert all(f <= b + r for f, b, r in zip(full, bf16, rebuilt, strict=True))
    assert plan.table(hardware="h100") != plan.table() and plan.table() == str(plan)


def test_views_hold_no_memory_on_a_hardware() -> None:
    pytest.importorskip("transformers")
    from pipeviz import zoo
    from pipeviz.costs import layer_activation_bytes

    graph = pv.trace(zoo.llama(num_hidden_layers=2), example_args=(torch.randint(0, 512, (2, 32)),))
    traced = layer_activation_bytes(graph, CostOptions(dtype="float32"))
    on_h100 = layer_activation_bytes(graph, CostOptions(hardware="h100", dtype="float32"))
    block = graph.layer_names.index("model.layers.0")
    # What autograd saves: a reshape, transpose or expand of a saved tensor is that tensor, on any hardware; every
    # op's output (views included) is far more.
    assert on_h100 == traced
    assert traced[block] < graph.layers[block].activation_bytes


def test_fused_attention_is_costed() -> None:
    pytest.importorskip("transformers")
    from pipeviz import zoo
    from pipeviz.hardware import op_table

    seq = 64
    graph = pv.trace(zoo.llama(num_hidden_layers=2), example_args=(torch.randint(0, 512, (2, seq)),))
    table = op_table(graph.capture)
    sdpa = [op for op in graph.capture.ops if "scaled_dot_product_attention" in op.target]
    for op in sdpa:  # QK^T and PV over every key: 4 FLOPs per query element per key (the capture counts them)
        assert op.flops == table.flops[op.index] == 4 * (op.out_bytes / 4) * seq
    block = graph.layer_names.index("model.layers.0")
    with_attention, _, _ = layer_times(graph, 1, options=CostOptions(hardware="h100", dtype="float32"))
    assert with_attention[block] > graph.layers[block].flops / pv.hardware("h100").rate("float32")
