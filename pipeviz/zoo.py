"""Example models for demos, tutorials and tests.

All models are small, deterministic given a seed, and need no downloads.

Example:
    >>> from pipeviz.zoo import MyNetwork
    >>> model = MyNetwork(512, [512, 1024, 256])   # layer0, layer1, layer2, output_proj
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from pipeviz.graph.model import ModelGraph

__all__ = ["CONFIGS", "MoENet", "MyNetwork", "MyNetworkBlock", "RoutedMoE", "SkipNet", "TiedNet", "TinyTransformer",
           "TransformerBlock", "bert", "from_config", "gpt2", "llama", "mixtral", "planning_graph", "repeat_layers"]


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


class ExplicitAttention(nn.Module):
    """Causal self-attention written out (scores, scaling, mask, softmax, dropout, values), as GPT-2's and HF's
    "eager" attention are: the scores are activations that selective recomputation drops (a fused
    ``scaled_dot_product_attention`` keeps none)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.drop(scores.masked_fill(causal, float("-inf")).softmax(-1))
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, d))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + MLP block (``attention="explicit"``: ``ExplicitAttention``, else torch's
    ``nn.MultiheadAttention``, which runs a fused attention)."""

    def __init__(self, dim: int, heads: int, attention: str = "fused", dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn: nn.Module = (ExplicitAttention(dim, heads, dropout) if attention == "explicit"
                                else nn.MultiheadAttention(dim, heads, batch_first=True))
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        if isinstance(self.attn, nn.MultiheadAttention):
            x = x + self.attn(h, h, h, need_weights=False)[0]
        else:
            x = x + self.attn(h)
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A small decoder-style transformer: ``embed``, ``blocks.0..N``, ``norm``, ``head``. ``attention="explicit"``
    writes the attention out (``ExplicitAttention``, with ``dropout`` on its probabilities)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, depth: int = 4, seq: int = 16,
                 attention: str = "fused", dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, attention, dropout) for _ in range(depth))
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
# Mixture of experts (routed experts: the planner searches ep for these):
# - Mixtral 8x7B: mistralai/Mixtral-8x7B-v0.1's config.json (Jiang et al. 2024, "Mixtral of Experts", table 1:
#   8 experts, top 2); trained here at 4,096 tokens, the sequence of Megatron-Core's and NeMo's Mixtral recipes.
# - DeepSeek-V3: deepseek-ai/DeepSeek-V3's config.json and DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"
#   (arXiv 2412.19437), sec. 4.2: 61 layers, the first 3 dense, then 1 shared + 256 routed experts of 2,048,
#   top 8 (of 8 groups, 4 chosen), MLA (q rank 1,536, kv rank 512); pre-trained at 4,096 tokens (so no YaRN
#   scaling, which came with the later context extension). Its multi-token-prediction module is not in
#   transformers' model: not planned (about 2 % of the step).
# - Qwen3-30B-A3B: Qwen/Qwen3-30B-A3B's config.json: 48 layers, 128 experts of 768, top 8, no shared expert.
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
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                                     rope_theta=1e6, sliding_window=None), 4096),
    "deepseek-v3": ("deepseek_v3", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
                                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                                        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                        norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512,
                                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                        vocab_size=129280, max_position_embeddings=4096), 4096),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6), 4096),
}

# transformers' (config, causal-LM) classes of each family of CONFIGS
_FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
             "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
             "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
             "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def from_config(name_or_path: str) -> tuple[nn.Module, int]:
    """A well-known model (``CONFIGS``: ``"llama-3-8b"``, ``"llama-3-70b"``, ``"llama-3.1-405b"``,
    ``"gpt3-175b"``, and the mixtures of experts ``"mixtral-8x7b"``, ``"deepseek-v3"``, ``"qwen3-30b-a3b"``) or any
    HF ``config.json`` built on the meta device (no memory, no weights), with its training sequence length (for a
    config file: its ``max_position_embeddings`` / ``n_positions``, at most 8192).

    Example:
        >>> model, seq = zoo.from_config("llama-3-70b")
        >>> graph = pv.trace(model, example_args=(torch.zeros(1, seq, dtype=torch.long),))

    Raises:
        ValueError: neither a known name nor an existing file (the message lists the names).
    """
    import os

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    key = name_or_path.strip().lower()
    if key in CONFIGS:
        family, fields, seq = CONFIGS[key]
        config_cls, model_cls = (getattr(transformers, n) for n in _FAMILIES[family])
        if family == "gpt2":
            fields = {**fields, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        with torch.device("meta"):
            return model_cls(config_cls(**fields)), seq
    if not os.path.exists(name_or_path):
        raise ValueError(f"Unknown model {name_or_path!r}; valid: {', '.join(CONFIGS)}, or the path of an HF "
                         "config.json. Fix: --model llama-3-8b, or --config path/to/config.json.")
    cfg = AutoConfig.from_pretrained(name_or_path)
    seq = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg), min(int(seq), 8192)


def repeat_layers(graph: ModelGraph, container: str, total: int) -> ModelGraph:
    """``graph`` (a model traced with a few identical blocks ``container.0``, ``container.1``, ...) with its last
    block repeated until there are ``total``: the graph a trace of the full-depth model gives, for planning.

    Tracing costs per op, so a 126-block model takes minutes even on the meta device; its blocks are identical,
    so two traced blocks say what every block costs. Each copy gets the last block's ops (FLOPs, bytes, module
    names and parameters renamed ``container.i``), reads the previous block's output where the last block read
    its predecessor's, and everything the blocks share (masks, rotary tables) as the traced ones do; the ops
    after the blocks read the last copy. Checked equal, layer by layer, to tracing the full depth
    (``tests/test_planner.py``). The result is for previews, balancing, simulation and planning: ``graph.model``
    is still the shallow model, so building its ``Pipe`` is refused.

    Example:
        >>> small = pv.trace(llama_with_2_layers, example_args=(ids,))
        >>> graph = repeat_layers(small, "model.layers", 126)

    Raises:
        ValueError: fewer than two traced blocks, blocks that differ, or ``total`` below the traced count.
    """
    from pipeviz.graph.model import ModelGraph

    cap = graph.capture
    ops = cap.ops

    def prefix(i: int) -> str:
        return f"{container}.{i}"

    def inside(name: str, i: int) -> bool:
        return name == prefix(i) or name.startswith(prefix(i) + ".")

    spans: list[list[int]] = []
    while True:
        idx = [op.index for op in ops if any(inside(s_, len(spans)) for s_ in op.stack)]
        if not idx:
            break
        spans.append(idx)
    k = len(spans)
    if k < 2 or total < k:
        raise ValueError(f"repeat_layers needs at least two traced blocks under {container!r} and total >= them; "
                         f"found {k}, total={total}. Fix: trace the model with 2 blocks, then repeat_layers(graph, "
                         f"{container!r}, {max(total, 2)}).")
    prev, last = spans[-2], spans[-1]
    a0, a, b = prev[0], last[0], last[-1]
    n = b - a + 1
    if (last != list(range(a, b + 1)) or prev != list(range(a0, a0 + n))
            or [ops[i].target for i in prev] != [ops[i].target for i in last]):
        raise ValueError(f"The blocks under {container!r} are not identical runs of ops; trace the full depth instead.")

    def rename(name: str, i: int) -> str:
        return prefix(i) + name[len(prefix(k - 1)):] if inside(name, k - 1) else name

    new_ops = list(ops[:b + 1])
    for i in range(k, total):
        base = len(new_ops)
        for t in range(n):
            op = ops[a + t]
            def moved(j: int, base: int = base) -> int:
                return base + (j - a) if a <= j <= b else base - n + (j - a0) if a0 <= j < a0 + n else j

            new_ops.append(dataclasses.replace(
                op, index=base + t, name=f"{op.name}__{i}", stack=tuple(rename(s_, i) for s_ in op.stack),
                inputs=tuple(moved(j) for j in op.inputs), params=tuple(rename(p, i) for p in op.params),
                resaved=tuple((moved(f), slot, nb) for f, slot, nb in op.resaved)))
    shift, last_base = (total - k) * n, len(new_ops) - n

    def shifted(j: int) -> int:
        return last_base + (j - a) if a <= j <= b else j + shift if j > b else j

    for op in ops[b + 1:]:
        new_ops.append(dataclasses.replace(op, index=op.index + shift, inputs=tuple(shifted(j) for j in op.inputs),
                                           resaved=tuple((shifted(f), slot, nb) for f, slot, nb in op.resaved)))

    def copies(names: Iterable[str]) -> list[str]:
        return [rename(x, i) for x in names if inside(x, k - 1) for i in range(k, total)]

    modules = dict(cap.modules)
    for fqn, (kind, children) in cap.modules.items():
        if inside(fqn, k - 1):
            for i in range(k, total):
                modules[rename(fqn, i)] = (kind, tuple(rename(c, i) for c in children))
    if container in modules:
        kind, children = modules[container]
        modules[container] = (kind, (*children, *(prefix(i) for i in range(k, total))))
    numel, nbytes, aliases = dict(cap.param_numel), dict(cap.param_bytes), dict(cap.aliases)
    for name in [x for x in cap.param_numel if inside(x, k - 1)]:
        for i in range(k, total):
            numel[rename(name, i)], nbytes[rename(name, i)] = cap.param_numel[name], cap.param_bytes[name]
            aliases[rename(name, i)] = tuple(rename(x, i) for x in cap.aliases.get(name, (name,)))
    note = (f"Planned from a trace of {k} blocks of {container!r}, the last repeated to {total} "
            "(pipeviz.zoo.repeat_layers): the graph's model is the shallow one.")
    big = dataclasses.replace(
        cap, ops=new_ops, modules=modules, param_numel=numel, param_bytes=nbytes, aliases=aliases,
        buffers=cap.buffers | set(copies(cap.buffers)), mutated=cap.mutated | set(copies(cap.mutated)),
        elementwise=cap.elementwise | set(copies(cap.elementwise)), frozen=cap.frozen | set(copies(cap.frozen)),
        notes=[*cap.notes, note],
        unsupported=[*cap.unsupported, note + " Fix: trace the full model to build its Pipe or launch it."])
    return ModelGraph(big)


def planning_graph(name_or_path: str, seq_len: int | None = None, blocks: int | None = 2) -> tuple[ModelGraph, int]:
    """A well-known model or an HF config (``from_config``) traced for planning on the meta device at
    ``seq_len`` tokens (default: the model's), and that length. With ``blocks`` (default 2) only that many
    decoder blocks (after the config's leading dense ones, DeepSeek's ``first_k_dense_replace``) are traced and
    the last is repeated to the config's depth (``repeat_layers``): minutes become seconds for a 70B or 405B
    model. ``blocks=None``, or a config whose blocks differ (``layer_types``), traces
    the full depth.

    Example:
        >>> graph, seq = planning_graph("llama-3.1-405b")
        >>> pv.plan_cluster(graph, 1024, "h100", global_batch=1024)
    """
    from pipeviz.graph.model import trace  # not the package root: a core module importing it closes a cycle

    model, default_seq = from_config(name_or_path)
    seq = seq_len or default_seq
    ids = torch.zeros(1, seq, dtype=torch.long)
    cfg = getattr(model, "config", None)
    depth = getattr(cfg, "num_hidden_layers", None)
    found = [(name, len(m)) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    if blocks is not None:  # blocks that differ from the rest come first (DeepSeek's dense ones): traced too
        blocks += int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    if blocks is None or cfg is None or not depth or depth <= blocks or len(found) != 1 \
            or getattr(cfg, "layer_types", None) or getattr(cfg, "mlp_only_layers", None):
        return trace(model, example_args=(ids,)), seq
    shallow_cfg = type(cfg).from_dict({**cfg.to_dict(), "num_hidden_layers": blocks})
    with torch.device("meta"):
        shallow = type(model)(shallow_cfg)
    return repeat_layers(trace(shallow, example_args=(ids,)), found[0][0], depth), seq
