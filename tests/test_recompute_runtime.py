"""Activation recomputation at run time (``recompute=``, ``pipeviz.schedule.recompute``; the cost model's side is in
test_recompute.py): exact against the unsplit model (tied weights, a skip, BatchNorm's running statistics written
once, dropout drawn alike), the saved activations each rank measures equal to what ``pv.simulate(...,
recompute=...)`` predicts, and bad settings refused before any process starts. The schedules beyond 1F1B and ZBV,
replicas, shards, a mode per stage and HF Llama run in ``make compat``."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.costs import stage_costs
from pipeviz.runtime.stages import build_stages
from pipeviz.schedule.recompute import regions
from pipeviz.zoo import TinyTransformer
from tests.models import TiedSkipBN

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def _tied_skip_bn(schedule: str) -> tuple[pv.SplitPlan, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids, target = torch.randint(0, 16, (16, 4)), torch.randint(0, 16, (16, 4))
    graph = pv.trace(TiedSkipBN(), example_args=(ids,))
    single = schedule in ("GPipe", "1F1B")
    return graph.split(["bn"] if single else ["l1", "bn", "l2"]), ids, target


def _exact(schedule: str, recompute: str | list[str] = "full", **layout: object) -> pv.Run:
    plan, ids, target = _tied_skip_bn(schedule)
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.1), recompute=recompute, **layout)
    assert run.wait(240) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok and check.param_diff <= 1e-5 and check.loss_diff <= 1e-5, check
    return run


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_full_recomputation_trains_exactly(schedule: str) -> None:
    """Tied embedding and head on two stages, a skip and BatchNorm: its running statistics are written once (the
    recomputed forward writes copies; before that fix the running variance was 0.22 off), under one backward and
    under a split one (input grads, then weight grads)."""
    _exact(schedule)


@pytest.mark.compat
@pytest.mark.parametrize(("schedule", "layout"), [
    *[pytest.param(s, {}, marks=pytest.mark.coverage) for s in SCHEDULES if s not in ("1F1B", "ZBVZeroBubble")],
    ("1F1B", {"dp": 2}), ("1F1B", {"dp": 2, "dp_shard": True}),
    ("Interleaved1F1B", {"tp": 2, "tp_plan": {"l2": "colwise", "l3": "rowwise"}})])
def test_full_recomputation_trains_exactly_under_every_schedule_and_layout(schedule: str,
                                                                           layout: dict[str, object]) -> None:
    _exact(schedule, **layout)


@pytest.mark.compat
def test_a_mode_per_stage() -> None:
    _exact("Interleaved1F1B", ["full", "none", "selective", "full"])


def _peaks(run: pv.Run) -> list[int]:
    return [max(b for _, b in run.activation_memory[r]) for r in sorted(run.activation_memory)]


@pytest.mark.slow
def test_each_mode_keeps_what_the_simulator_predicts() -> None:
    """A transformer with its attention written out (scores, mask, softmax, dropout on): none > selective > full
    in every rank's measured peak of saved activations, each within 10 % of ``pv.simulate`` (measured here: within
    0.2 %), and every mode trains exactly (dropout draws the same mask when a layer runs again)."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=128, dim=32, heads=2, depth=4, seq=16, attention="explicit", dropout=0.1)
    ids, target = torch.randint(0, 128, (8, 16)), torch.randint(0, 128, (8, 16))
    plan = pv.balance(pv.trace(model, example_args=(ids,)), 2)
    peaks = {}
    for mode in ("none", "selective", "full"):
        run = pv.launch(plan, "1F1B", 4, steps=1, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                        optimizer=pv.sgd(lr=0.1), recompute=mode)
        assert run.wait(240) == "done", run.error
        check = pv.check_numerics(run)
        assert check.ok and check.param_diff <= 1e-5, (mode, check)
        peaks[mode] = _peaks(run)
        simulated = pv.simulate(plan, "1F1B", 4, recompute=mode).peak_activation_bytes
        for r, (got, want) in enumerate(zip(peaks[mode], simulated, strict=True)):
            assert abs(want / got - 1) <= 0.10, (mode, r, got, want)
    for r in range(2):
        assert peaks["none"][r] > peaks["selective"][r] > peaks["full"][r], peaks


def test_regions_follow_the_layers_and_the_attention() -> None:
    """Full: one region per layer of the stage; selective: one per explicit attention, none where the attention is
    fused (torch's ``scaled_dot_product_attention`` keeps no scores)."""
    torch.manual_seed(0)
    for attention, per_block in (("explicit", 1), ("fused", 0)):
        model = TinyTransformer(vocab=64, dim=16, heads=2, depth=4, seq=8, attention=attention)
        plan = pv.trace(model, example_args=(torch.randint(0, 64, (4, 8)),)).split(["blocks.2"])
        stages = build_stages(plan, microbatches=2)
        for runner, info in zip(stages.runners, plan.stages, strict=True):
            gm = runner.stage
            assert isinstance(gm, torch.fx.GraphModule)
            full = regions(gm, gm.node_modules, runner.layer_names, "full")
            assert len(full) == len(info.layers), (info.layers, len(full))
            blocks = sum(name.startswith("blocks.") for name in info.layers)
            assert len(regions(gm, gm.node_modules, runner.layer_names, "selective", runner.attention)) == \
                blocks * per_block


def test_settings_that_cannot_work_are_refused_before_any_process() -> None:
    plan, ids, target = _tied_skip_bn("1F1B")
    kw = {"inputs": (ids,), "target": target, "loss_fn": pv.cross_entropy}
    with pytest.raises(pv.LaunchError, match=r"recompute mode 'partial' is not one of 'none', 'selective', 'full'"):
        pv.launch(plan, "1F1B", 4, recompute="partial", **kw)
    with pytest.raises(pv.LaunchError, match=r"recompute= gives 3 modes for a plan of 2 stages. Fix: one mode per"):
        pv.launch(plan, "1F1B", 4, recompute=["full"] * 3, **kw)
    with pytest.raises(pv.LaunchError, match=r"recompute must be one of .* got 3"):
        pv.launch(plan, "1F1B", 4, recompute=3, **kw)  # type: ignore[arg-type]
    with pytest.raises(pv.LaunchError, match=r"with compile='aot_eager'.*Fix: compile=False"):
        pv.launch(plan, "1F1B", 4, recompute="full", compile="aot_eager", **kw)
    manual = pv.manual_plan(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), [["0"], ["1"]],
                            example_args=(torch.randn(8, 4),))
    with pytest.raises(pv.LaunchError, match=r"stages are your own modules \(pv.manual_plan\)"):
        pv.launch(manual, "1F1B", 4, inputs=(torch.randn(8, 4),), target=torch.randn(8, 4),
                  loss_fn=torch.nn.functional.mse_loss, recompute="full")


def test_the_simulator_prices_torchs_second_recomputation_under_a_split_backward() -> None:
    """torch's checkpoint recomputes once per backward call, and a zero-bubble schedule makes two (I, then W): the
    simulated I and W each pay the recomputed forward, a plain backward once."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, dim=16, heads=2, depth=4, seq=8)
    plan = pv.balance(pv.trace(model, example_args=(torch.randint(0, 64, (4, 8)),)), 4)
    plain = stage_costs(plan, 4)
    full = stage_costs(plan, 4, recompute="full")
    assert full.recompute_seconds and not plain.recompute_seconds
    for s in range(4):
        again = full.recompute_seconds[s]
        assert again == pytest.approx(plain.forward[s])
        assert full.duration(s, "B") == pytest.approx(plain.duration(s, "B") + again)
        assert full.duration(s, "I") + full.duration(s, "W") == pytest.approx(
            plain.duration(s, "I") + plain.duration(s, "W") + 2 * again)


@pytest.mark.compat
def test_selective_recomputation_on_hf_llama_with_eager_attention() -> None:
    """HF Llama at its defaults but the sizes, attention "eager" (its scores are activations): exact, and the
    scores' memory gone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="eager")
    ids, target = torch.randint(0, 128, (8, 32)), torch.randint(0, 128, (8, 32))
    plan = pv.balance(pv.trace(transformers.LlamaForCausalLM(cfg), example_args=(ids,)), 2)
    peaks = []
    for mode in ("none", "selective"):
        run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                        optimizer=pv.sgd(lr=0.1), recompute=mode)
        assert run.wait(240) == "done", run.error
        check = pv.check_numerics(run)
        assert check.ok and check.param_diff <= 1e-5, check
        peaks.append(_peaks(run))
    assert all(s < n for n, s in zip(*peaks, strict=True)), peaks
