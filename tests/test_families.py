"""The seed's model families train pipelined under every schedule, equal to the unsplit model (1e-5):
HF LLaMA (RoPE, GQA, RMSNorm), HF Mixtral (4 experts, top-2 routing), and a plain-torch MoE whose experts
run only on the tokens routed to them; the same MoE with a branch torch.export cannot capture goes through
the manual route, and the trace error says why.

``make test`` trains each family under three schedules that take the three runtime paths (one stage per rank;
several stages per rank with the backward split into input and weight gradients; the V shape); the other four
run in the compatibility step (``make compat``, the ``compat`` marker), so CI covers all seven."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipeviz as pv
from tests.compat import lm_loss, sgd
from tests.foreign import routed_moe_net
from tests.schedule_sets import SCHEDULES

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow



def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2))


def mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2))


def train_under(schedules: tuple[str, ...], model: torch.nn.Module, ids: torch.Tensor, vocab: int) -> None:
    target = torch.randint(0, vocab, ids.shape, generator=torch.Generator().manual_seed(2))
    graph = pv.trace(model, example_args=(ids,))
    ref_losses, ref_state = pv.train_reference(model, (ids,), target, loss_fn=lm_loss, optimizer=sgd, microbatches=4,
                                               steps=2,
                                               fixups=graph.capture.fixups)
    two, four = pv.balance(graph, 2, by="params"), pv.balance(graph, 4, by="params")
    for schedule in schedules:
        run = pv.launch(two if schedule in ("GPipe", "1F1B") else four, schedule, 4, steps=2, inputs=(ids,),
                        target=target, loss_fn=lm_loss, optimizer=sgd)
        assert run.wait(120) == "done", f"{schedule}: {run.error}"
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
        got = run.state_dict()
        for name, want in ref_state.items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-5, msg=f"{schedule}: {name}")


@SCHEDULES
def test_llama_every_schedule(schedules: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    train_under(schedules, llama(), torch.randint(0, 96, (8, 8)), 96)


@pytest.mark.compat  # make compat and the version grid (16 s: make test stays within 10 minutes); make test trains
@SCHEDULES            # a routed MoE in tests/test_foreign.py and Llama here
def test_mixtral_every_schedule(schedules: tuple[str, ...]) -> None:
    # transformers 4.57's Mixtral loops over the experts the router hit: traced through pipeviz.adapter.hf_moe
    torch.manual_seed(0)
    train_under(schedules, mixtral(), torch.randint(0, 96, (8, 8)), 96)


@pytest.mark.compat  # make compat (CI); make test trains a routed MoE in tests/test_foreign.py
@SCHEDULES
def test_routed_moe_every_schedule(schedules: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    model = routed_moe_net()
    graph = pv.trace(model, example_args=(torch.randint(0, 32, (8, 6)),))
    assert graph.layer_names == ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")  # MoE blocks whole
    train_under(schedules, model, torch.randint(0, 32, (8, 6)), 32)


def test_moe_with_a_value_branch_goes_the_manual_route() -> None:
    torch.manual_seed(0)
    model, ids = routed_moe_net(skip_empty=True), torch.randint(0, 32, (8, 6))
    with pytest.raises(pv.TraceError, match=r"(?s)data-dependent control flow.*manual_plan") as info:
        pv.trace(model, example_args=(ids,))
    assert "GuardOnDataDependent" in str(info.value)  # torch's own words, first line
    stages = [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]
    plan = pv.manual_plan(model, stages, example_args=(ids,))
    ref = pv.train_reference(model, (ids,), ids, loss_fn=lm_loss, optimizer=sgd, microbatches=4, steps=2)
    for schedule in ("GPipe", "1F1B"):
        run = pv.launch(plan, schedule, 4, steps=2, inputs=(ids,), target=ids, loss_fn=lm_loss, optimizer=sgd)
        assert run.wait(120) == "done", f"{schedule}: {run.error}"
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref[0]), rtol=0, atol=1e-5)
        for name, want in ref[1].items():
            torch.testing.assert_close(run.state_dict()[name], want, rtol=0, atol=1e-5, msg=name)
