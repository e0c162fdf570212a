"""Example models for demos, tutorials and tests.

All models are small, deterministic given a seed, and need no downloads.

Example:
    >>> from pipeviz.zoo import MyNetwork
    >>> model = MyNetwork(512, [512, 1024, 256])   # layer0, layer1, layer2, output_proj
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CONFIGS", "MoENet", "MyNetwork", "MyNetworkBlock", "RoutedMoE", "SkipNet", "TiedNet", "TinyTransformer",
           "TransformerBlock", "bert", "from_config", "gpt2", "llama", "mixtral"]


class MyNetworkBlock(nn.Module):
    """One Linear followed by a ReLU: the block of the classic PiPPy walkthrough."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class MyNetwork(nn.Module):
    """The classic PiPPy example: blocks ``layer0 .. layerN`` then ``output_proj`` (10 classes).

    Args:
        in_dim: input features.
        layer_dims: output width of each block; one block per entry.
        num_classes: width of ``output_proj``.
    """

    def __init__(self, in_dim: int = 512, layer_dims: list[int] | None = None, num_classes: int = 10) -> None:
        super().__init__()
        layer_dims = list(layer_dims or [512, 1024, 256])
        prev = in_dim
        for i, dim in enumerate(layer_dims):
            setattr(self, f"layer{i}", MyNetworkBlock(prev, dim))
            prev = dim
        self.num_layers = len(layer_dims)
        self.output_proj = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.num_layers):
            x = getattr(self, f"layer{i}")(x)
        return self.output_proj(x)


class SkipNet(nn.Module):
    """Linear blocks with a long skip connection: ``layer0``'s output is added after ``layer2``.

    Split it after ``layer0`` and ``layer1`` and the skip crosses two stage boundaries.
    """

    def __init__(self, dim: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.layer0 = MyNetworkBlock(dim, dim)
        self.layer1 = MyNetworkBlock(dim, dim)
        self.layer2 = MyNetworkBlock(dim, dim)
        self.output_proj = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.layer0(x)
        b = self.layer2(self.layer1(a))
        return self.output_proj(a + b)


class TiedNet(nn.Module):
    """A tiny language model whose output head shares its weight with the embedding.

    ``embed.weight`` and ``head.weight`` are the same ``Parameter`` (as in GPT-2).
    """

    def __init__(self, vocab: int = 32, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MyNetworkBlock(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + MLP block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A small decoder-style transformer: ``embed``, ``blocks.0..N``, ``norm``, ``head``."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, depth: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt2(
    n_layer: int = 2, n_embd: int = 32, n_head: int = 2, vocab_size: int = 128, n_positions: int = 64, **kw: Any
) -> nn.Module:
    """HF ``GPT2LMHeadModel`` from a small config with random weights (``transformers`` required).

    ``gpt2(12, 768, 12, 50257, 1024)`` is GPT-2 small.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw,
    )
    return GPT2LMHeadModel(cfg)


def bert(
    num_hidden_layers: int = 2, hidden_size: int = 32, num_attention_heads: int = 2, vocab_size: int = 128, **kw: Any
) -> nn.Module:
    """HF ``BertModel`` from a small config with random weights (``transformers`` required)."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        num_hidden_layers=num_hidden_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        intermediate_size=4 * hidden_size, vocab_size=vocab_size, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw,
    )
    return BertModel(cfg)


def llama(
    num_hidden_layers: int = 4, hidden_size: int = 128, num_attention_heads: int = 4, num_key_value_heads: int = 2,
    vocab_size: int = 512, **kw: Any
) -> nn.Module:
    """HF ``LlamaForCausalLM`` from a small config with random weights: RoPE, grouped-query attention,
    RMSNorm (``transformers`` required). Build it under ``torch.device("meta")`` to allocate nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=num_hidden_layers, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                      vocab_size=vocab_size, **kw)
    return LlamaForCausalLM(cfg)


def mixtral(num_hidden_layers: int = 4, hidden_size: int = 64, vocab_size: int = 512, **kw: Any) -> nn.Module:
    """HF ``MixtralForCausalLM`` from a small config: 4 experts, top-2 routing (``transformers`` required)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                        intermediate_size=2 * hidden_size, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, vocab_size=vocab_size, **kw)
    return MixtralForCausalLM(cfg)


class _Expert(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.gelu(self.w1(x)))


class RoutedMoE(nn.Module):
    """A mixture-of-experts layer, the seed's example: a learned router picks the top-k experts per token;
    each expert runs only on the tokens routed to it (data-dependent shapes, which torch.export captures).

    ``skip_empty=True`` skips the experts no token was routed to: a branch on values, which torch.export
    cannot capture (``pv.trace`` says so); such a model goes through ``pv.manual_plan``."""

    def __init__(self, d: int = 64, experts: int = 4, k: int = 2, skip_empty: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(_Expert(d, 2 * d) for _ in range(experts))
        self.k, self.skip_empty = k, skip_empty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm(x).reshape(-1, d)
        weights, idx = self.router(h).softmax(-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tokens, slot = torch.where(idx == e)
            if self.skip_empty and tokens.numel() == 0:
                continue
            out = out.index_add(0, tokens, expert(h[tokens]) * weights[tokens, slot].unsqueeze(-1))
        return x + out.reshape(b, t, d)


class MoENet(nn.Module):
    """Token embedding, ``layers`` mixture-of-experts blocks, a vocabulary head."""

    def __init__(self, vocab: int = 512, d: int = 64, layers: int = 6, experts: int = 4,
                 skip_empty: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(RoutedMoE(d, experts, skip_empty=skip_empty) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# Published configurations of well-known models (HF config fields), for planning on the meta device: no weights.
# Llama 3 / 3.1: Meta's model cards and params.json (Grattafiori et al. 2024, "The Llama 3 Herd of Models",
# table 3); GPT-3 175B: Brown et al. 2020, table 2.1 (96 layers, d_model 12288, 96 heads, context 2048).
CONFIGS: dict[str, tuple[str, dict[str, Any], int]] = {
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192, rope_theta=500000.0), 8192),
    "llama-3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=8192, rope_theta=500000.0), 8192),
    "llama-3.1-405b": ("llama", dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                     num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                                     max_position_embeddings=131072, rope_theta=500000.0), 8192),
    "gpt3-175b": ("gpt2", dict(n_embd=12288, n_layer=96, n_head=96, vocab_size=50257, n_positions=2048), 2048),
}


def from_config(name_or_path: str) -> tuple[nn.Module, int]:
    """A well-known model (``CONFIGS``: ``"llama-3-8b"``, ``"llama-3-70b"``, ``"llama-3.1-405b"``,
    ``"gpt3-175b"``) or any HF ``config.json`` built on the meta device (no memory, no weights), with its
    training sequence length (for a config file: its ``max_position_embeddings`` / ``n_positions``, at most 8192).

    Example:
        >>> model, seq = zoo.from_config("llama-3-70b")
        >>> graph = pv.trace(model, example_args=(torch.zeros(1, seq, dtype=torch.long),))

    Raises:
        ValueError: neither a known name nor an existing file (the message lists the names).
    """
    import os

    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    key = name_or_path.strip().lower()
    if key in CONFIGS:
        family, fields, seq = CONFIGS[key]
        with torch.device("meta"):
            if family == "llama":
                return LlamaForCausalLM(LlamaConfig(**fields)), seq
            return GPT2LMHeadModel(GPT2Config(**fields, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), seq
    if not os.path.exists(name_or_path):
        raise ValueError(f"Unknown model {name_or_path!r}; valid: {', '.join(CONFIGS)}, or the path of an HF "
                         "config.json. Fix: --model llama-3-8b, or --config path/to/config.json.")
    cfg = AutoConfig.from_pretrained(name_or_path)
    seq = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg), min(int(seq), 8192)
