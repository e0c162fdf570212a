"""pv.plan_cluster searches expert parallelism for mixture-of-experts models (issue 45, point 4): ep among the divisors
of the routed experts' count that divide dp x cp, its all-to-alls priced on the link the group spans, 1/ep of the
experts' weights, gradients and optimizer state per rank; a bad ep refused naming it and the valid ones. Also the
routed experts' FLOPs of transformers 5's fused experts (a grouped matmul torch's counter skips), and the MoE configs
of ``pipeviz.zoo.CONFIGS`` built on the meta device."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

import pipeviz as pv
from pipeviz import zoo
from pipeviz.planner import search as planner
from pipeviz.planner.experts import ep_degrees, expert_counts

H, FF, E, K, SEQ, LAYERS = 64, 128, 8, 2, 64, 4


@pytest.fixture(scope="module")
def mixtral() -> pv.ModelGraph:
    """A small Mixtral (transformers 5's fused experts) on the meta device."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, num_local_experts=E, num_experts_per_tok=K)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    return pv.trace(model, example_args=(torch.zeros(1, SEQ, dtype=torch.long),))


def test_fused_experts_count_their_routed_flops(mixtral: pv.ModelGraph) -> None:
    """Each token's top-k rows through gate_up (H -> 2 FF) and down (FF -> H): 2 x rows x K x N per grouped matmul."""
    routed = sum(op.flops for op in mixtral.capture.ops if any(s.endswith(".mlp.experts") for s in op.stack))
    rows = SEQ * K
    assert routed == LAYERS * (2 * rows * H * 2 * FF + 2 * rows * FF * H)


def test_experts_counted_listed_and_fused(mixtral: pv.ModelGraph) -> None:
    assert set(expert_counts(mixtral).values()) == {E} and len(expert_counts(mixtral)) == LAYERS
    assert ep_degrees(mixtral, None) == [1, 2, 4, 8]
    torch.manual_seed(0)
    listed = pv.trace(zoo.MoENet(vocab=32, d=16, layers=2, experts=4), example_args=(torch.randint(0, 32, (2, 8)),))
    assert expert_counts(listed) == {"blocks.0.experts": 4, "blocks.1.experts": 4}
    dense = pv.trace(zoo.TinyTransformer(vocab=32, dim=16, heads=2, depth=2, seq=8),
                     example_args=(torch.randint(0, 32, (2, 8)),))
    assert expert_counts(dense) == {} and ep_degrees(dense, None) == [1]


def test_bad_ep_refused_naming_it_and_the_valid_ones(mixtral: pv.ModelGraph) -> None:
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 8 routed experts.*Valid ep: 1, 2, 4, 8"):
        pv.plan_cluster(mixtral, 8, "h100", global_batch=8, ep=[3])
    with pytest.raises(ValueError, match=r"ep=0 is not a positive int"):
        pv.plan_cluster(mixtral, 8, "h100", global_batch=8, ep=[0])
    dense = pv.trace(zoo.TinyTransformer(vocab=32, dim=16, heads=2, depth=2, seq=8),
                     example_args=(torch.randint(0, 32, (2, 8)),))
    with pytest.raises(ValueError, match=r"ep=2: the model has no routed experts"):
        pv.plan_cluster(dense, 8, "h100", global_batch=8, ep=[2])


def _one_layout(graph: pv.ModelGraph, hw: pv.Hardware, ep: int) -> pv.LayoutOption:
    cp = pv.plan_cluster(graph, 8, hw, global_batch=16, tp=[1], cp=[1], schedules=["1F1B"], recompute="none",
                         microbatch_sizes=[1], dp_reduce="ddp", ep=[ep], top=100)
    return next(r for r in cp.rows if (r.pp, r.dp) == (2, 4))


def test_ep_rows_priced_as_simulated(mixtral: pv.ModelGraph) -> None:
    """ep is searched by default; a row's step and memory are pv.simulate's of its config, whose A2A actions are
    there; the all-to-alls grow as the ep link slows; a rank holds 1/ep of the experts' weights."""
    plan = pv.plan_cluster(mixtral, 8, "h100", global_batch=16, tp=[1], cp=[1], top=1000)
    assert {r.ep for r in plan.rows} >= {1, 2, 4}
    row = next(r for r in plan.rows if r.ep > 1)
    assert f"ep{row.ep}" in row.label() and "ep" in plan.cells(len(plan.rows))[0]
    tl = pv.simulate(row.plan, row.config, options=row.options, collectives=row.collectives)
    assert tl.step_time == pytest.approx(row.step_time, rel=1e-9) or row.extrapolated
    assert any(e.kind == "A2A" for e in tl.events)

    h100 = pv.hardware("h100")
    slow = dataclasses.replace(h100, intra_node=(h100.intra_node[0] / 1000, h100.intra_node[1]))
    fast2, slow2 = _one_layout(mixtral, h100, 2), _one_layout(mixtral, slow, 2)
    assert slow2.step_time > fast2.step_time
    a2a = [sum(e.duration for e in pv.simulate(r.plan, r.config, options=r.options, collectives=r.collectives).events
               if e.kind == "A2A") for r in (fast2, slow2)]
    assert a2a[1] > 2 * a2a[0] > 0  # (a small model: latency is much of each all-to-all)
    extra = []  # what ep 2 adds to one device's collectives per microbatch, on each link: the all-to-alls
    for hw in (h100, slow):
        search, _ = planner._ask(mixtral, 8, hw, 16, None, None, None, "none", "bfloat16", [1], [1], None, (2,), 2,
                                 None, "ddp", None)
        extra.append(sum(search.device_costs(2, 1, "none", 1, 1, 2).collective or ())
                     - sum(search.device_costs(2, 1, "none", 1, 1, 1).collective or ()))
    assert extra[1] > 2 * extra[0] > 0

    search, _ = planner._ask(mixtral, 8, "h100", 16, None, None, None, "none", "bfloat16", [1], [1], None, (2,),
                                 2, None, "ddp", None)
    expert_bytes = sum(b for p, b in mixtral.capture.param_bytes.items() if ".experts." in p)
    whole = sum(search.device_costs(2, 1, "none", 1, 1, 1).param_bytes)
    for e in (2, 4, 8):
        halved = sum(search.device_costs(2, 1, "none", 1, 1, e).param_bytes)
        assert halved == pytest.approx(whole - expert_bytes * (1 - 1 / e), abs=8)
    assert fast2.peak_memory < _one_layout(mixtral, h100, 1).peak_memory


def test_the_bounds_stay_below_what_they_bound_with_ep(mixtral: pv.ModelGraph) -> None:
    """The pruned search stays exact with ep: every simulated row's step and memory at or above its bounds."""
    search, space = planner._ask(mixtral, 8, "h100", 16, None, None, None, ("none", "full"), "bfloat16", [1, 2],
                                 [1], None, (2,), 2, None, None, None)
    candidates, _, _ = planner._candidates(search, space)
    assert {o.ep for _, o in candidates} == {1, 2, 4, 8}
    rows, _ = planner._rank(search, space, candidates, 1000, 40_000)
    bounds = {(o.pp, o.dp, o.tp, o.schedule, o.v, o.b, o.m, o.mode, o.reduce, o.ep): (b, o) for b, o in candidates}
    checked = 0
    for r in rows:
        bound, o = bounds[(r.pp, r.dp, r.tp, r.schedule, r.stages_per_rank, r.microbatch_size, r.microbatches,
                           r.recompute, r.dp_reduce, r.ep)]
        assert bound <= r.step_time
        assert search.memory_bound(o.tp, o.cp, o.pp, o.schedule, o.v, o.b, o.mode, o.ep) <= r.peak_memory * (1 + 1e-12)
        checked += r.ep > 1
    assert checked > 10


@pytest.mark.parametrize(("name", "params", "experts"), [("mixtral-8x7b", 46.7e9, 8), ("qwen3-30b-a3b", 30.5e9, 128),
                                                         ("deepseek-v3", 671.0e9, 256)])
def test_moe_configs_build_on_meta(name: str, params: float, experts: int) -> None:
    """The published sizes: Mixtral 8x7B 46.7B, Qwen3-30B-A3B 30.5B, DeepSeek-V3 671B (without its MTP module)."""
    model, seq = zoo.from_config(name)
    assert seq == 4096
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=2e-3)
    fused = [m for n, m in model.named_modules() if n.endswith(".mlp.experts")]
    assert fused and all(m.num_experts == experts for m in fused)


def test_deepseeks_keys_are_not_relayed_to_the_head() -> None:
    """DeepSeek-V3's attention builds its keys by ``copy_`` into a fresh tensor: an in-place op's result is no model
    output, so a hand-off carries the hidden states (and the rotary tables), not every earlier layer's keys."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                           first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                           num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=128)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    graph = pv.trace(model, example_args=(torch.zeros(1, SEQ, dtype=torch.long),))
    assert expert_counts(graph) and set(expert_counts(graph).values()) == {8}
    sends = [s.send_bytes for s in graph.split(["model.layers.1", "model.layers.2"]).stages[:-1]]
    hidden = SEQ * 64 * 4
    keys = SEQ * 4 * (16 + 8) * 4  # one layer's keys: relayed, each boundary would carry one more layer's
    assert max(sends) < 2 * hidden and sends[1] - sends[0] < keys / 4, sends


def test_cli_plan_ep(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``pipeviz plan --ep``: the rows' ep column; a bad ep refused with the planner's message, exit 2."""
    from transformers import MixtralConfig

    from pipeviz.cli import main

    cfg = MixtralConfig(hidden_size=H, intermediate_size=FF, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, num_local_experts=E, num_experts_per_tok=K,
                        max_position_embeddings=SEQ, architectures=["MixtralForCausalLM"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    args = ["plan", "--config", str(path), "--gpus", "8", "--global-batch", "16", "--top", "3", "--no-synthesize"]
    assert main([*args, "--ep", "3"]) == 2
    assert "pipeviz: ep=3 does not divide the 8 routed experts" in capsys.readouterr().err
    assert main([*args, "--ep", "4", "--export", "megatron"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    assert header.split()[:6] == ["#", "pp", "dp", "tp", "ep", "schedule"]
    assert "--expert-model-parallel-size 4" in out and " ep4 " in out
    toml = tmp_path / "tt.toml"
    assert main([*args, "--ep", "4", "--export", "torchtitan", "--export-path", str(toml)]) == 0
    assert "expert_parallel_degree = 4" in toml.read_text()


def test_tp_and_ep_cut_the_experts_once(mixtral: pv.ModelGraph) -> None:
    """With tp the experts a process holds are already 1/tp of them: ep takes 1/ep of those, never more."""
    search, _ = planner._ask(mixtral, 8, "h100", 16, None, None, None, "none", "bfloat16", [1, 2], [1], None, (2,),
                             2, None, "ddp", None)
    expert_bytes = sum(b for p, b in mixtral.capture.param_bytes.items() if ".experts." in p)
    whole = sum(search.device_costs(2, 1, "none", 1, 1, 1).param_bytes)
    for e in (2, 8):
        assert sum(search.device_costs(2, 1, "none", 2, 1, e).param_bytes) == pytest.approx(
            (whole - expert_bytes * (1 - 1 / e)) / 2, abs=8)
