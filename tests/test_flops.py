"""FLOPs of what torch's counter does not know by itself: the CPU kernel of scaled-dot-product attention."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _total(graph: pv.ModelGraph) -> int:
    return sum(op.flops for op in graph.capture.ops)


def test_attention_counts_the_same_flops_traced_on_the_cpu_and_on_meta() -> None:
    x = torch.randn(2, 16, 32)
    cpu = _total(pv.trace(Attention(), example_args=(x,)))
    with torch.device("meta"):
        model = Attention()
    meta = _total(pv.trace(model, example_args=(x,)))
    linear = 2 * 2 * 16 * 32 * 96
    attention = 4 * 2 * 4 * 16 * 16 * 8  # QK^T and PV: 2 matmuls of 2 FLOPs per multiply-add
    assert cpu == meta == linear + attention, (cpu, meta)


def test_hf_llama_attention_is_counted_on_the_cpu() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 96, (2, 32))
    torch.manual_seed(0)
    cpu = pv.trace(transformers.LlamaForCausalLM(cfg), example_args=(ids,))
    with torch.device("meta"):
        meta = pv.trace(transformers.LlamaForCausalLM(cfg), example_args=(ids,))
    assert [layer.flops for layer in cpu.layers] == [layer.flops for layer in meta.layers]
    sdpa = [op.flops for op in cpu.capture.ops if "scaled_dot_product" in op.target]
    assert len(sdpa) == 2 and all(f == 4 * 2 * 4 * 32 * 32 * 16 for f in sdpa), sdpa  # heads of 16 dims
