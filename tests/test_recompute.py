"""Activation recomputation (none / selective / full) in the one cost and memory model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pipeviz as pv
from pipeviz import zoo
from pipeviz.costs import CostOptions, layer_activation_bytes, memory_per_rank, stage_costs


@pytest.fixture(scope="module")
def eager_gpt2() -> pv.ModelGraph:
    """GPT-2 with eager attention: its scores and softmax are stored activations (what selective drops)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = zoo.gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=128, attn_implementation="eager")
    return pv.trace(model, example_args=(torch.randint(0, 128, (4, 64)),))


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_full_recompute_keeps_inputs_only_and_pays_the_forward_again(classic_graph: pv.ModelGraph,
                                                                      schedule: str) -> None:
    plan, m = classic_graph.split(["layer0", "layer1"]), 4
    none = pv.simulate(plan, schedule, m, hardware="h100")
    full = pv.simulate(plan, schedule, m, hardware="h100", recompute="full")
    assert max(full.memory_bytes) < max(none.memory_bytes)
    assert full.step_time > none.step_time
    c_none = stage_costs(plan, m, hardware="h100")
    c_full = stage_costs(plan, m, hardware="h100", recompute="full")
    # Every backward is the plain backward plus the forward run again; forwards are unchanged.
    assert c_full.forward == c_none.forward
    assert c_full.backward == pytest.approx([b + f for b, f in zip(c_none.backward, c_none.forward, strict=True)])
    # Kept per in-flight microbatch: each layer's input (layer1 widens 512 -> 1024: its input is half its output),
    # and on the last stage what the loss saves (the log-softmax of the logits).
    layers = {layer.name: layer for layer in classic_graph.layers}
    s = CostOptions(hardware="h100").byte_scale(plan.graph)
    loss = classic_graph.layer("output_proj").out_bytes
    for stage, kept in zip(plan.stages, c_full.activation_bytes, strict=True):
        expected = sum(layers[n].in_bytes for n in stage.layers) + (loss if "output_proj" in stage.layers else 0)
        assert kept == pytest.approx(expected * s / m, abs=1)
    # The backward rebuilds one layer at a time: that transient is in the peak.
    assert all(b > 0 for b in c_full.recompute_bytes)
    without = dataclasses.replace(c_full, recompute_bytes=())
    assert memory_per_rank(plan, schedule, m, costs=c_full)[0] == (memory_per_rank(plan, schedule, m, costs=without)[0]
                                                                   + c_full.recompute_bytes[0])


def test_selective_drops_attention_scores_at_a_modest_cost(eager_gpt2: pv.ModelGraph) -> None:
    graph = eager_gpt2
    none = layer_activation_bytes(graph, CostOptions(recompute="none"))
    selective = layer_activation_bytes(graph, CostOptions(recompute="selective"))
    full = layer_activation_bytes(graph, CostOptions(recompute="full"))
    blocks = [i for i, layer in enumerate(graph.layers) if layer.kind == "GPT2Block"]
    assert blocks
    for i in blocks:
        assert full[i] < selective[i] < none[i]
    plan = pv.balance(graph, 2)
    runs = {mode: pv.simulate(plan, "1F1B", 4, hardware="h100", recompute=mode) for mode in ("none", "selective",
                                                                                             "full")}
    assert max(runs["full"].memory_bytes) < max(runs["selective"].memory_bytes) < max(runs["none"].memory_bytes)
    assert runs["none"].step_time < runs["selective"].step_time < runs["full"].step_time
    # Modest: the score ops are a small part of the forward, so selective costs far less than full.
    assert runs["selective"].step_time - runs["none"].step_time < (runs["full"].step_time - runs["none"].step_time) / 2


def test_fused_attention_has_nothing_to_drop() -> None:
    pytest.importorskip("transformers")
    graph = pv.trace(zoo.llama(num_hidden_layers=2), example_args=(torch.randint(0, 512, (2, 32)),))  # SDPA
    assert layer_activation_bytes(graph, CostOptions(recompute="selective")) == layer_activation_bytes(graph)


def test_recompute_lets_a_tight_memory_limit_fit(classic_graph: pv.ModelGraph) -> None:
    m = 8
    plan = pv.balance(classic_graph, 2, schedule="GPipe", microbatches=m)
    full_peak = max(pv.simulate(plan, "GPipe", m, recompute="full").memory_bytes)
    none_peak = max(pv.simulate(plan, "GPipe", m).memory_bytes)
    assert full_peak < none_peak
    # Without recomputation no split fits a limit just above the full-recompute peak.
    with pytest.raises(pv.PlanError):
        pv.balance(classic_graph, 2, memory_limit=min(none_peak - 1, (full_peak + none_peak) // 2), schedule="GPipe",
                   microbatches=m)
    fitted = pv.balance(classic_graph, 2, memory_limit=full_peak * 1.01, schedule="GPipe", microbatches=m,
                        recompute="full")
    assert max(pv.simulate(fitted, "GPipe", m, recompute="full").memory_bytes) <= full_peak * 1.01 + \
        max(stage_costs(fitted, m, recompute="full").recompute_bytes)


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="Unknown recompute='some'; valid: none, selective, full"):
        CostOptions(recompute="some")
