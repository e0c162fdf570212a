"""The compatibility matrix: HF architectures from small configs (random weights, nothing downloaded), each
traced, split at its natural blocks and trained pipelined, against the unsplit model.

Configs keep each model's own defaults (tied embeddings where the config ties them, its buffers, rotary
embeddings, ALBERT's one shared layer) and shrink only the sizes. Dropout is set to 0: random masks drawn in
other processes can never match the unsplit model's.

``tests/test_compat.py`` runs every row; ``python -m tests.compat`` prints the table in docs/compatibility.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeviz.schedule.training import cross_entropy

SIZE = {"vocab_size": 96}
MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


lm_loss = cross_entropy  # the one language-model loss: pv.cross_entropy over the last dim


@dataclass
class Row:
    """One architecture: how to build it and what it takes."""

    name: str
    family: str
    build: Callable[[], Any]
    kind: str = "lm"  # lm: token ids in, logits per token; cls: classes per example; s2s: encoder-decoder
    note: str = ""


def _decoder(cls: str, cfg: str, **kw: Any) -> Callable[[], Any]:
    def build() -> Any:
        import transformers

        config = getattr(transformers, cfg)(**SIZE, **kw)
        return getattr(transformers, cls)(config)

    return build


_DEC = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
ROWS: list[Row] = [
    Row("GPT-2", "decoder", _decoder("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=4, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    Row("GPT-Neo", "decoder", _decoder("GPTNeoForCausalLM", "GPTNeoConfig", hidden_size=32, num_layers=4, num_heads=4,
                                       attention_types=[[["global", "local"], 2]], embed_dropout=0.0,
                                       resid_dropout=0.0, attention_dropout=0.0)),
    Row("GPT-J", "decoder", _decoder("GPTJForCausalLM", "GPTJConfig", n_embd=32, n_layer=4, n_head=4, rotary_dim=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    Row("OPT", "decoder", _decoder("OPTForCausalLM", "OPTConfig", hidden_size=32, ffn_dim=64, num_hidden_layers=4,
                                   num_attention_heads=4, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)),
    Row("BLOOM", "decoder", _decoder("BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=4, n_head=4,
                                     hidden_dropout=0.0, attention_dropout=0.0)),
    Row("Falcon", "decoder", _decoder("FalconForCausalLM", "FalconConfig", hidden_size=32, num_hidden_layers=4,
                                      num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)),
    Row("Llama", "decoder", _decoder("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **_DEC)),
    Row("Mistral", "decoder", _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, **_DEC)),
    Row("Qwen2", "decoder", _decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, **_DEC)),
    Row("Gemma", "decoder", _decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=2, head_dim=8, **_DEC)),
    Row("Phi", "decoder", _decoder("PhiForCausalLM", "PhiConfig", resid_pdrop=0.0, embd_pdrop=0.0,
                                   attention_dropout=0.0, **_DEC)),
    Row("GPT-NeoX", "decoder", _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_dropout=0.0,
                                        attention_dropout=0.0, **_DEC)),
    Row("Qwen2-MoE", "decoder", _decoder("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, **_DEC)),
    Row("Mixtral", "decoder", _decoder("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2,
                                       num_local_experts=4, num_experts_per_tok=2, **_DEC)),
    Row("BERT", "encoder", _decoder("BertForMaskedLM", "BertConfig", hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=4, num_attention_heads=4, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)),
    Row("RoBERTa", "encoder", _decoder("RobertaForMaskedLM", "RobertaConfig", hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=4, num_attention_heads=4, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)),
    Row("DistilBERT", "encoder", _decoder("DistilBertForMaskedLM", "DistilBertConfig", dim=32, hidden_dim=64,
                                          n_layers=4, n_heads=4, dropout=0.0, attention_dropout=0.0)),
    Row("ALBERT", "encoder", _decoder("AlbertForMaskedLM", "AlbertConfig", embedding_size=16, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      classifier_dropout_prob=0.0)),
    Row("ELECTRA", "encoder", _decoder("ElectraForMaskedLM", "ElectraConfig", embedding_size=16, hidden_size=32,
                                       intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    Row("T5", "encoder-decoder", _decoder("T5ForConditionalGeneration", "T5Config", d_model=32, d_kv=8, d_ff=64,
                                          num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                          decoder_start_token_id=0, pad_token_id=0), kind="s2s"),
    Row("BART", "encoder-decoder", _decoder("BartForConditionalGeneration", "BartConfig", d_model=32,
                                            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                            max_position_embeddings=64), kind="s2s"),
    # transformers 4.x draws a LayerDrop number before every layer, even at probability 0 (pipeviz.adapter.hf_layerdrop)
    Row("mBART", "encoder-decoder", _decoder("MBartForConditionalGeneration", "MBartConfig", d_model=32,
                                             encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                             max_position_embeddings=64), kind="s2s"),
    Row("ViT", "vision", lambda: _vit(), kind="cls"),
]


def _vit() -> Any:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, image_size=16,
                    patch_size=4, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg)


def inputs(row: Row, batch: int = 8, seq: int = 8) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
    """One full batch (args, kwargs, target) for the row's model, seeded."""
    gen = torch.Generator().manual_seed(1)
    vocab = SIZE["vocab_size"]
    if row.kind == "cls":
        return (torch.randn(batch, 3, 16, 16, generator=gen),), {}, torch.randint(0, 5, (batch,), generator=gen)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    if row.kind == "s2s":
        dec = torch.randint(1, vocab, (batch, seq - 2), generator=gen)
        return (ids,), {"decoder_input_ids": dec}, target[:, : seq - 2]
    return (ids,), {}, target


@dataclass
class Result:
    """What one row measured: per schedule, the largest loss and state differences (or the error)."""

    name: str
    layers: int = 0
    params: int = 0
    stages: list[list[str]] = field(default_factory=list)
    diffs: dict[str, tuple[float, float]] = field(default_factory=dict)  # schedule -> (loss, state)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    multi: str = ""

    @property
    def ok(self) -> bool:
        return not self.errors and all(max(d) <= TOL for d in self.diffs.values())


TOL = 1e-5


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def multi_for(row: Row) -> str:
    """The multi-stage schedule a row is checked with: the five take turns down the table."""
    return MULTI[ROWS.index(row) % len(MULTI)]


def check(row: Row, multi: str, steps: int = 2, microbatches: int = 4) -> Result:
    """Trace, split into 3 stages (4 for the multi-stage schedule), train under GPipe, 1F1B and ``multi``,
    and compare losses, parameters and buffers with the unsplit model trained the same way."""
    import pipeviz as pv

    t0 = time.time()
    torch.manual_seed(0)
    model = row.build()
    args, kwargs, target = inputs(row)
    res = Result(row.name, multi=multi)
    graph = pv.trace(model, example_args=args, example_kwargs=kwargs)
    res.layers, res.params = len(graph.layers), graph.total_params
    ref = pv.train_reference(model, args, target, loss_fn=lm_loss, optimizer=sgd, microbatches=microbatches,
                             steps=steps, input_kwargs=kwargs,
                             fixups=graph.capture.fixups)
    for schedule in ("GPipe", "1F1B", multi):
        stages = 4 if schedule in MULTI else 3
        try:
            plan = pv.balance(graph, stages, by="params")
            if schedule == "1F1B":
                res.stages = [list(s.layers) for s in plan.stages]
            run = pv.launch(plan, schedule, microbatches, steps=steps, inputs=args, input_kwargs=kwargs or None,
                            target=target, loss_fn=lm_loss, optimizer=sgd)
            if run.wait(300) != "done":
                res.errors[schedule] = (run.error or run.status).strip().splitlines()[-1][:300]
                continue
            res.diffs[schedule] = compare(run, ref)
        except Exception as exc:  # recorded in the table: what torch or pipeviz raised
            res.errors[schedule] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    res.seconds = time.time() - t0
    return res


def compare(run: Any, ref: tuple[list[float], dict[str, torch.Tensor]]) -> tuple[float, float]:
    losses, state = ref
    got = run.state_dict()
    missing = set(state) - set(got)
    if missing:
        raise AssertionError(f"run.state_dict() lacks {sorted(missing)[:5]}")
    d_loss = max(abs(a - b) for a, b in zip(run.losses, losses, strict=True))
    d_state = max((float((got[k].double() - v.double()).abs().max()) for k, v in state.items() if v.numel()),
                  default=0.0)
    return d_loss, d_state


def table(results: list[Result]) -> str:
    """The markdown table of docs/compatibility.md."""
    head = ("| model | family | layers | params | stages (1F1B) | GPipe | 1F1B | multi-stage | time |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    fam = {r.name: r.family for r in ROWS}
    for r in results:
        cells = []
        for s in ("GPipe", "1F1B", r.multi):
            if s in r.errors:
                cells.append(f"✗ {s}: {r.errors[s]}")
            else:
                d = max(r.diffs.get(s, (float('nan'),) * 2))
                cells.append(("✓ " if d <= TOL else "✗ ") + (f"{s} " if s in MULTI else "") + f"{d:.0e}")
        cuts = " \\| ".join(f"{st[0]}…{st[-1]}" if len(st) > 1 else st[0] for st in r.stages)
        lines.append(f"| {r.name} | {fam[r.name]} | {r.layers} | {r.params:,} | {cuts} | " + " | ".join(cells)
                     + f" | {r.seconds:.0f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    wanted = sys.argv[1:]
    out = []
    for row in ROWS:
        if wanted and row.name not in wanted:
            continue
        r = check(row, multi_for(row))
        out.append(r)
        print(row.name, "ok" if r.ok else "FAIL", r.diffs, r.errors, f"{r.seconds:.1f}s", flush=True)
    print(table(out))
