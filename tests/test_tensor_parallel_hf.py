"""Tensor parallelism on the models people use: HF Llama (grouped KV heads, rotary table), Mistral, BERT, GPT-2
(``Conv1D``, its fused q/k/v cut by heads) and Qwen2-MoE, sharded the way Megatron shards them (q / k / v
column-wise by heads, the attention's output row-wise, the MLP column then row, the vocabulary), exact against
the unsplit model. Their traced stage code runs on DTensors: the export's metadata asserts, plain tensors made
inside the graph, the CPU attention kernel and transformers' expert op are handled in
``pipeviz.adapter.dtensor_graph``. Three rows in ``make test``, the rest (another schedule, a multi-stage one,
dp = 2 on 8 processes) in ``make compat``."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import torch

import pipeviz as pv
from pipeviz.cost.sharding import launch_collectives
from pipeviz.schedule.tensor_parallel import check_tp_plan, default_tp_plan, sharded_modules

transformers = pytest.importorskip("transformers")

_SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 64}


def _model(kind: str, layers: int = 2) -> Any:
    """A tiny model at its library's defaults but the sizes, dropout off where the config has it (these tests
    compare computation and count collectives; dropout under tensor parallelism, exact too, is
    ``tests/test_dropout.py``'s)."""
    torch.manual_seed(0)
    small = _SMALL | {"num_hidden_layers": layers}
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, num_key_value_heads=2))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**small, num_key_value_heads=2,
                                                                          sliding_window=8))
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            **small, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if kind == "qwen2moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **small, num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=4, num_experts_per_tok=2))
    raise ValueError(kind)


def _blocks(graph: pv.ModelGraph) -> list[str]:
    return [n for n in graph.layer_names if re.search(r"\.(layers|layer|h)\.\d+$", n)]


def _train(kind: str, schedule: str = "1F1B", layers: int = 2, dp: int = 1, sequence_parallel: bool = False,
           ) -> pv.Run:
    model = _model(kind, layers)
    ids = torch.randint(0, 128, (8, 16))
    graph = pv.trace(model, example_args=(ids,))
    blocks = _blocks(graph)
    plan = graph.split(blocks[:1] if schedule in ("GPipe", "1F1B") else blocks[:-1])
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), tp=2, dp=dp, sequence_parallel=sequence_parallel)
    assert run.wait(240) == "done", f"{kind} {schedule}: {run.error}"
    check = pv.check_numerics(run)
    assert check.ok and check.loss_diff <= 1e-5 and check.param_diff <= 1e-5, f"{kind} {schedule}: {check}"
    assert check.note == "", check.note  # no random op drawn: nothing left to chance in the comparison
    return run


def _collectives_match_the_model(run: pv.Run, kind: str, sequence_parallel: bool = False) -> None:
    """The run issues the collectives the cost model charges (``launch_collectives``: per microbatch, Megatron's
    all-reduces, or sequence parallelism's reduce-scatters and all-gathers, the vocabulary's and the parallel
    loss's), counted from its own timed TP events per process and step. Left to DTensor's op-by-op choices
    Llama's stages issued 17-26 per microbatch, not 4."""
    plan = run.plan
    model = launch_collectives(plan, sharded_modules(plan, None, 2), sequence_parallel)
    per_stage = [len(cs) for cs in model]
    assert all(c > 0 for c in per_stage), per_stage
    # Not modelled, a few KB each: a later stage all-reduces the gradient of each floating-point tensor it
    # receives besides the hidden states where it meets the sharded heads (Llama's rotary cos and sin: 2 a
    # microbatch; BERT's float mask under transformers 4.57: 1); under sequence parallelism each replicated weight
    # that saw split tokens (the norms') has its gradient all-reduced once a step.
    seen = Counter((e.rank, e.step) for e in run.events if e.kind == "TP")
    for rank in range(4):
        stage = run.mesh.coords(rank).pp
        norms = {("llama", 0): 2, ("llama", 1): 2, ("bert", 0): 8, ("bert", 1): 8, ("gpt2", 0): 5,
                 ("gpt2", 1): 4}.get((kind, stage), 0)
        received = [seen[(rank, step)] - 4 * per_stage[stage] - norms * sequence_parallel for step in range(2)]
        allowed = (0,) if stage == 0 or kind == "gpt2" else (0, 4, 8)  # 4 microbatches x 0, 1 or 2 tensors
        assert received[0] == received[1] in allowed, (rank, seen, per_stage)
    # pv.simulate prices the same collectives, each a TP action of its pipeline rank (pipeviz.sim.tensor_parallel):
    # as many per process and step as the run issued, less the unmodelled ones above
    here = pv.simulate(plan, run.spec.config, cores=2)
    priced = Counter(e.rank for e in here.events if e.kind == "TP")
    lay = run.layout
    assert {r: priced[r] for r in lay.ranks} == {r: 4 * sum(per_stage[s] for s in lay.stages_of(r)) for r in lay.ranks}


def test_the_default_layout_is_megatrons() -> None:
    """HF's own plan where the config ships one (Llama: q / k / v and gate / up column-wise, o and down row-wise),
    by name where it does not (BERT; GPT-2's MLP, whose fused c_attn stays replicated), Linear pairs otherwise."""
    llama = _model("llama")
    stages = [(f"model.layers.{i}",) for i in range(2)]
    plan = default_tp_plan(llama, stages)
    assert {n.rsplit(".", 1)[-1]: s for n, s in plan.items()} == {
        "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
        "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    assert len(plan) == 14
    bert = default_tp_plan(_model("bert"), [("bert.encoder.layer.0",)])
    assert bert == {f"bert.encoder.layer.0.{k}": v for k, v in {
        "attention.self.query": "colwise", "attention.self.key": "colwise", "attention.self.value": "colwise",
        "attention.output.dense": "rowwise", "intermediate.dense": "colwise", "output.dense": "rowwise"}.items()}
    gpt2 = _model("gpt2")
    gpt2_plan = default_tp_plan(gpt2, [("transformer.h.0",)])
    assert gpt2_plan == {"transformer.h.0.attn.c_attn": "colwise", "transformer.h.0.attn.c_proj": "rowwise",
                         "transformer.h.0.mlp.c_fc": "colwise", "transformer.h.0.mlp.c_proj": "rowwise"}
    # Conv1D stores its weight [in, out]: column-wise shards its dim 1; the fused [q | k | v] by heads, each of
    # its three parts cut alike (Megatron's fused QKV)
    assert check_tp_plan(gpt2, gpt2_plan, 2) == {
        "transformer.h.0.attn.c_attn.weight": "fused1", "transformer.h.0.attn.c_attn.bias": "fused0",
        "transformer.h.0.attn.c_proj.weight": "shard0", "transformer.h.0.attn.c_proj.bias": "replicate",
        "transformer.h.0.mlp.c_fc.weight": "shard1", "transformer.h.0.mlp.c_fc.bias": "shard0",
        "transformer.h.0.mlp.c_proj.weight": "shard0", "transformer.h.0.mlp.c_proj.bias": "replicate"}
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_attn' has 192 output features, which tp=5 "
                                         r"shards cannot share equally in each of its 3 parts"):
        check_tp_plan(gpt2, {"transformer.h.0.attn.c_attn": "colwise"}, 5)


def test_heads_that_tp_does_not_divide_are_refused_before_any_process() -> None:
    """4 query heads and 2 key/value heads: tp=4 divides every projection's features (64, 32) but not the
    key/value heads, so a shard would hold half a head; refused with the numbers and the fix."""
    model = _model("llama")
    ids = torch.randint(0, 128, (8, 16))
    plan = pv.trace(model, example_args=(ids,)).split(["model.layers.0"])
    with pytest.raises(pv.LaunchError, match=re.escape(
            "tp=4 does not divide the model's 2 key/value heads ('model.layers.0.self_attn.k_proj' is sharded "
            "column-wise: each shard must hold whole heads). Valid tp: 1, 2. Fix: one of those, or leave the "
            "attention's projections out of tp_plan (replicated).")):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, tp=4)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "schedule"), [("llama", "1F1B"), ("bert", "GPipe"), ("gpt2", "1F1B")])
def test_hf_models_train_exactly_under_tensor_parallelism(kind: str, schedule: str) -> None:
    run = _train(kind, schedule)
    assert run.mesh == pv.Mesh(pp=2, tp=2)
    _collectives_match_the_model(run, kind)


@pytest.mark.slow
# GPT-2's sequence parallelism (its fused q/k/v, Conv1D's flattened tokens) in `make test`; Llama's and BERT's (4-12 s
# each on 2 cores) in `make compat`, which CI runs too; tp on both stays in `make test` above.
@pytest.mark.parametrize("kind", [pytest.param("llama", marks=pytest.mark.compat),
                                  pytest.param("bert", marks=pytest.mark.compat), "gpt2"])
def test_sequence_parallelism_trains_exactly_and_issues_what_the_model_charges(kind: str) -> None:
    """Norms, dropout and the residual stream split by token between the sharded regions (Korthikanti et al.
    2022): exact, with reduce-scatters and all-gathers where the all-reduces were, as ``launch_collectives``
    counts them. GPT-2 too: its fused c_attn sharded by heads, its Conv1D's flattened tokens gathered before."""
    run = _train(kind, "1F1B", sequence_parallel=True)
    _collectives_match_the_model(run, kind, sequence_parallel=True)


def test_sequence_parallelism_is_refused_where_it_cannot_split_the_tokens() -> None:
    """An attention projection left whole would see its shard's tokens only; tp=1 has nothing to split."""
    model = _model("gpt2")
    ids = torch.randint(0, 128, (8, 16))
    plan = pv.trace(model, example_args=(ids,)).split(["transformer.h.0"])
    mlp = {f"transformer.h.{i}.mlp.{n}": s for i in range(2) for n, s in (("c_fc", "colwise"), ("c_proj", "rowwise"))}
    with pytest.raises(pv.LaunchError, match=re.escape(
            "sequence_parallel=True: 'transformer.h.0.attn.c_attn' is not sharded (tp_plan leaves it replicated), "
            "so it would see only its shard's tokens. Fix: sequence_parallel=False")):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, tp=2,
                  tp_plan=mlp, sequence_parallel=True)
    with pytest.raises(pv.LaunchError, match="sequence_parallel=True with tp=1"):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy,
                  sequence_parallel=True)


def test_the_vocabulary_is_sharded_and_the_loss_takes_each_shards_logits() -> None:
    """The embedding's rows and the LM head's columns cut by token id where tp divides the vocabulary (tied
    alike: GPT-2's), whole where it does not; a shard's summary says which tokens it holds."""
    from pipeviz.schedule.tensor_parallel import shard_summary, vocab_modules

    gpt2 = _model("gpt2")
    stages = [("transformer.wte", "transformer.h.0"), ("transformer.h.1", "lm_head")]
    assert vocab_modules(gpt2, stages, 2) == {"transformer.wte": "rowwise", "lm_head": "colwise"}
    assert vocab_modules(gpt2, stages, 3) == {}  # 128 tokens do not split three ways
    placements = check_tp_plan(gpt2, vocab_modules(gpt2, stages, 2), 2)
    assert placements["transformer.wte.weight"] == placements["lm_head.weight"] == "shard0"
    plan = default_tp_plan(gpt2, stages, 2)
    assert "tokens 64t-64t+63 of 128" in " ".join(shard_summary(gpt2, plan, 2))
    assert "the embedding, the LM head, norms (tp=3 does not divide the vocabulary of 128)" in " ".join(
        shard_summary(gpt2, default_tp_plan(gpt2, stages, 3), 3))


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes
@pytest.mark.parametrize(("kind", "schedule", "layers"), [
    # with the three rows above: every model under GPipe, 1F1B and a multi-stage schedule (4 stages on 2 ranks)
    ("llama", "GPipe", 2), ("llama", "Interleaved1F1B", 4),
    ("mistral", "GPipe", 2), ("mistral", "1F1B", 2), ("mistral", "ZBVZeroBubble", 4),
    ("bert", "1F1B", 2), ("bert", "LoopedBFS", 4),
    ("gpt2", "GPipe", 2), ("gpt2", "Interleaved1F1B", 4),
    ("qwen2moe", "GPipe", 2), ("qwen2moe", "1F1B", 2), ("qwen2moe", "Interleaved1F1B", 4)])
def test_more_hf_models_and_schedules_under_tensor_parallelism(kind: str, schedule: str, layers: int) -> None:
    _train(kind, schedule, layers)


@pytest.mark.slow
@pytest.mark.compat
def test_llama_with_data_and_tensor_parallelism_on_8_processes() -> None:
    run = _train("llama", "1F1B", dp=2)
    assert run.mesh == pv.Mesh(pp=2, dp=2, tp=2)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "sequence_parallel"), [("gpt2", False), ("llama", False), ("llama", True)])
def test_a_shards_memory_is_what_the_memory_model_says(kind: str, sequence_parallel: bool) -> None:
    """Per process at tp = 2, measured (parameters, gradients and Adam's states; the peak of saved activations)
    against pv.simulate's memory model, which counts what the layout cuts (sharded weights, the activations
    between a column-wise and a row-wise projection) and what it leaves whole (embeddings, norms, the LM head,
    the residual stream): a uniform 1/tp put Llama's first stage 15 % (parameters) and 27 % (activations) under."""
    model = _model(kind)
    ids = torch.randint(0, 128, (8, 16))
    graph = pv.trace(model, example_args=(ids,))
    plan = graph.split(_blocks(graph)[:1])
    run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, tp=2,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3), sequence_parallel=sequence_parallel)
    assert run.wait(240) == "done", run.error
    sim = pv.simulate(plan, "1F1B", 4, tp=2, optimizer_states=2, sequence_parallel=sequence_parallel)
    # Llama's last stage is left out: its activations are 12 % over the model at tp = 1 already (what it
    # receives from the rotary table), a gap of the memory model that tensor parallelism does not change
    stages = (0, 1) if kind == "gpt2" else (0,)
    for rank in range(4):
        stage = run.mesh.coords(rank).pp
        if stage not in stages:
            continue
        static = run.memory[rank][-1][1] - run.activation_memory[rank][-1][1]
        activations = max(b for _, b in run.activation_memory[rank])
        model_act = sim.meta["peak_activation_bytes"][stage]
        model_static = sim.memory_bytes[stage] - model_act
        assert model_static == pytest.approx(static, rel=0.01), (rank, model_static, static)
        assert model_act == pytest.approx(activations, rel=0.10), (rank, model_act, activations)


def test_the_explorer_shows_what_each_shard_holds() -> None:
    """tp = 2 on Llama in the Explorer: the mesh says which heads, which slice of the MLP and what stays whole;
    the memory column is the simulated peak of one shard, which the layout's cut sets (not a uniform half)."""
    pytest.importorskip("ipywidgets")
    from pipeviz.plan.preview import human_bytes

    model = _model("llama")
    ids = torch.randint(0, 128, (8, 16))
    ex = pv.Explorer(model, example_args=(ids,))
    ex.plan = ["model.layers.0"]
    ex.tp.value = 2
    assert ex.refusal is None, ex.refusal
    mesh = ex.mesh_view.value
    assert "attention: shard t holds heads 2t-2t+1 of 4 (key/value heads t of 2)" in mesh
    assert "MLP: 64 of 128 hidden units per shard" in mesh and "tokens 64t-64t+63 of 128" in mesh
    assert ex.sim is not None
    for peak in ex.sim.meta["memory_bytes"]:
        assert human_bytes(peak) in ex.preview.value
    halves = pv.simulate(ex.plan, "1F1B", ex.microbatches.value).memory_bytes
    assert all(m > h / 2 for m, h in zip(ex.sim.meta["memory_bytes"], halves, strict=True))  # norms stay whole
    # Sequence parallelism: a switch beside tp, what Launch runs and what the simulation costs (less memory)
    whole = ex.sim.meta["memory_bytes"]
    ex.sequence_parallel.value = True
    assert ex.refusal is None and ex.launch_config().sequence_parallel
    assert "sequence parallel: between the sharded regions" in ex.mesh_view.value
    assert ex.sim is not None and ex.sim.meta["memory_bytes"][0] < whole[0]
    ex.tp.value = 1  # nothing to split over: the switch is off and Launch runs without it
    assert ex.sequence_parallel.disabled and not ex.launch_config().sequence_parallel and ex.refusal is None


@pytest.mark.slow
def test_the_layout_the_planner_prices_is_the_one_launch_runs() -> None:
    """``Collectives(tp_layout="megatron")`` (``pv.plan_cluster``'s rows): every block's attention and MLP and the
    vocabulary sharded, 2 all-reduces per block each way, a uniform 1/tp. pp 3 x tp 2 on GPT-2 (6 processes):
    launch's default layout shards exactly those modules (the fused c_attn by heads, the vocabulary), a block's
    stage issues the all-reduces Megatron's count charges, and each shard's memory is within 12 % of the uniform
    1/tp (norms, biases and the position table stay whole: the launch layout, within 1 %, is the finer price)."""
    from pipeviz.cost.comm import tp_all_reduces
    from pipeviz.sim.collectives import Collectives

    model = _model("gpt2", 4)
    ids = torch.randint(0, 128, (8, 16))
    graph = pv.trace(model, example_args=(ids,))
    plan = graph.split(_blocks(graph)[:2])
    sharded = sharded_modules(plan, None, 2)
    assert {n.split(".", 3)[-1] for n in sharded if ".h." in n} == {"attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                    "mlp.c_proj"}
    assert len(sharded) == 4 * 4 + 2 and sharded["transformer.wte"] == "rowwise" and sharded["lm_head"] == "colwise"
    run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, tp=2,
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    assert run.wait(300) == "done", run.error
    # (Adam divides by the gradients' size: rounding in a near-zero gradient moves a weight 1e-4; the losses agree)
    assert pv.check_numerics(run).loss_diff <= 1e-6
    layers = {layer.name: layer for layer in graph.layers}
    priced = [sum(2 * tp_all_reduces(layers[n]) for n in s.layers) * 4 for s in plan.stages]  # fwd + bwd, 4 mbs
    seen = Counter((e.rank, e.step) for e in run.events if e.kind == "TP")
    middle = [r for r in range(run.mesh.world) if run.mesh.coords(r).pp == 1]
    assert priced[1] == 16 and all(seen[(r, s)] == priced[1] for r in middle for s in range(2)), (priced, seen)
    sim = pv.simulate(plan, "1F1B", 4, tp=2, optimizer_states=2, collectives=Collectives(tp_layout="megatron"))
    for rank in range(run.mesh.world):
        stage = run.mesh.coords(rank).pp
        measured = run.memory[rank][-1][1] - run.activation_memory[rank][-1][1] + max(
            b for _, b in run.activation_memory[rank])
        assert sim.memory_bytes[stage] == pytest.approx(measured, rel=0.12), (rank, sim.memory_bytes, measured)
