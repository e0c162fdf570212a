"""Big models: a meta-device model traces, previews, balances and simulates without memory; launched, each
rank initialises (or reads from a safetensors checkpoint) only its own stage, and the run trains exactly like
the whole model given the same values; run.save writes checkpoints weights= and HF read; bad checkpoints are
refused before any process starts, naming the tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipeviz as pv
from tests.compat import lm_loss, sgd

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def config(**kw: Any) -> Any:
    base = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    return transformers.LlamaConfig(**{**base, **kw})


def meta_llama(**kw: Any) -> Any:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config(**kw))


IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))


def test_a_meta_model_is_explored_without_memory() -> None:
    model = meta_llama(num_hidden_layers=8)
    graph = pv.trace(model, example_args=(IDS,))
    assert all(t.is_meta for t in model.parameters())  # nothing was allocated, the user's model untouched
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert graph.layers[2].flops > 0
    for by in ("flops", "params"):
        plan = pv.balance(graph, 4, by=by)
        assert plan.num_stages == 4 and pv.simulate(plan, "1F1B", 4).step_time > 0
        assert all(s.memory_bytes > 0 for s in plan.stages)
    # the default target is sized by the traced output (a forward of a meta model cannot run: HF's mask calls
    # .item()), so the Explorer opens on it and checks its settings as Launch would
    from pipeviz.schedule.training import default_target

    assert default_target(graph).shape == IDS.shape
    pytest.importorskip("ipywidgets")
    ex = pv.Explorer(graph, splits=pv.balance(graph, 2))
    assert ex.refusal is None and ex.sim is not None, ex.refusal


def launch(plan: pv.SplitPlan, schedule: str = "1F1B", **kw: Any) -> pv.Run:
    run = pv.launch(plan, schedule, 4, steps=2, inputs=(IDS,), target=IDS, loss_fn=lm_loss, optimizer=sgd, **kw)
    assert run.wait(120) == "done", run.error
    return run


@pytest.mark.slow
@pytest.mark.compat  # make compat (CI); make test keeps the checkpoint / meta test below
def test_meta_model_initialised_on_its_ranks_trains_exactly_and_repeats(tmp_path: Path) -> None:
    model = meta_llama()
    plan = pv.balance(pv.trace(model, example_args=(IDS,)), 2)
    run = launch(plan)
    check = pv.check_numerics(run)  # against pv.materialize(model, seed=0) trained the same way
    assert check.ok and check.tensors == 39, check
    again, other = launch(plan), launch(plan, init_seed=1)
    assert again.losses == run.losses and other.losses != run.losses
    whole = pv.materialize(model, seed=0)
    assert not any(t.isnan().any() for t in whole.state_dict().values() if t.is_floating_point())
    torch.testing.assert_close(whole.model.rotary_emb.inv_freq,  # a non-persistent buffer, from HF's initialiser
                               transformers.LlamaForCausalLM(config()).model.rotary_emb.inv_freq)
    # run.save -> a sharded checkpoint (one shard per rank, HF's index), which weights= and HF both read, and the
    # optimizer's side of it, which resume= reads (pipeviz.runtime.checkpoint)
    files = run.save(tmp_path / "trained")
    assert sorted(os.path.basename(f) for f in files) == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "optimizer.safetensors",
        "pipeviz_checkpoint.json", "trainer_state.pt"]
    index = json.loads((tmp_path / "trained" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(whole.state_dict())  # persistent tensors, original names
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "trained")
    for name, value in run.state_dict().items():
        if name in index["weight_map"]:
            torch.testing.assert_close(hf.state_dict()[name], value, rtol=0, atol=0)
    resumed = launch(plan, "GPipe", weights=tmp_path / "trained")
    assert pv.check_numerics(resumed).ok
    assert resumed.losses[0] < run.losses[0]  # it starts from the trained weights


@pytest.mark.slow
def test_a_checkpoint_starts_a_real_or_meta_model_and_ranks_get_no_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config())
    real.save_pretrained(tmp_path / "hf")  # one model.safetensors + config.json
    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(config())  # different values: the run must use the checkpoint's
    plan = pv.balance(pv.trace(other, example_args=(IDS,)), 2)
    run = launch(plan, weights=tmp_path / "hf")
    assert pv.check_numerics(run).ok
    ref_losses, _ = pv.train_reference(real, (IDS,), IDS, loss_fn=lm_loss, optimizer=sgd, microbatches=4, steps=2)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    # one .safetensors file, on a meta model
    single = run.save(tmp_path / "one.safetensors")
    meta_plan = pv.balance(pv.trace(meta_llama(), example_args=(IDS,)), 2)
    assert pv.check_numerics(launch(meta_plan, "GPipe", weights=single[0])).ok
    # what each rank is sent: its own stage, with no model values (every parameter a meta tensor)
    from pipeviz.runtime.checks import check_weights, validate_launch
    from pipeviz.runtime.payloads import rank_payloads
    from pipeviz.runtime.ship import load_payload

    spec = validate_launch(plan, pv.LaunchConfig(microbatches=4, loss_fn=lm_loss), inputs=(IDS,), target=IDS)
    spec.sources = check_weights(plan, tmp_path / "hf", 0)
    payloads, shipment, _ = rank_payloads(plan, spec, ["cpu", "cpu"], [None, None], "gloo", 0, 0.0, 60.0, 1, None)
    params = set(dict(plan.graph.model.named_parameters()))
    assert shipment.path is None and not params & set(shipment.inline), shipment  # no value is shipped
    for data in payloads:
        (stage,) = load_payload(data).stages
        assert all(p.is_meta for p in stage.runner.parameters())


def test_bad_checkpoints_and_uninitialisable_meta_tensors_are_named_before_any_process(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config())
    real.save_pretrained(tmp_path / "hf")
    plan = pv.balance(pv.trace(meta_llama(), example_args=(IDS,)), 2)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "partial.safetensors")
    with pytest.raises(pv.LaunchError, match=r"lacks 1 tensor\(s\) the stages need: "
                                             r"model\.layers\.3\.mlp\.down_proj\.weight \(stage 1\)"):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(IDS,), target=IDS, loss_fn=lm_loss,
                  weights=tmp_path / "partial.safetensors")
    wide = transformers.LlamaForCausalLM(config(intermediate_size=48))
    save_file(wide.state_dict(), tmp_path / "wide.safetensors")
    with pytest.raises(pv.LaunchError, match=r"do not match the traced model's shapes: model\.layers\.0\.mlp\."
                                             r"down_proj\.weight: \(32, 48\) in the checkpoint, \(32, 64\)"):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(IDS,), target=IDS, loss_fn=lm_loss,
                  weights=tmp_path / "wide.safetensors")
    with pytest.raises(pv.LaunchError, match="does not exist"):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(IDS,), target=IDS, loss_fn=lm_loss, weights=tmp_path / "nowhere")

    class Scaled(nn.Module):  # a raw parameter set in __init__, no reset_parameters: on meta it has no value
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), Scaled(), nn.Linear(16, 4))
    plan = pv.trace(model, example_args=(torch.randn(8, 16),)).split(["0"])
    with pytest.raises(pv.LaunchError, match=r"1 tensor\(s\) are on the meta device .*1\.scale \(Scaled '1', "
                                             r"stage 1\).*Fix: weights=PATH"):
        pv.launch(plan, "1F1B", 4, steps=1, inputs=(torch.randn(8, 16),), target=torch.zeros(8, dtype=torch.long),
                  loss_fn=pv.cross_entropy)


def test_the_fork_server_preloads_only_the_models_transformers_modules() -> None:
    from pipeviz.runtime.procs import preload_modules
    from tests.foreign import BNNet

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    assert preload_modules(llama) == ["transformers.activations", "transformers.models.llama.modeling_llama"]
    assert preload_modules(BNNet()) == []  # a user's own module (tests.foreign) never runs in the server
    assert preload_modules(None) == []
