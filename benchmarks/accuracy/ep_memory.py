"""Parameter, gradient and optimizer bytes per process under expert parallelism: measured (``pv.launch(..., dp=2,
ep=1 | 2)`` with AdamW; the memory meter's count after a step: ``run.memory`` less ``run.activation_memory``) vs
``pv.simulate``'s (each pipeline rank's ``memory_bytes`` less its ``peak_activation_bytes``: weights, gradients, two
Adam states and buffers, 1/ep of the routed experts), on ``pipeviz.zoo.MoENet`` (``nn.ModuleList`` experts) and a
tiny HF Qwen2-MoE (transformers 5.x's fused 3-D experts and a shared expert). Goal: ep=2 holds exactly its stage's
tensors less half the routed experts' (the simulator's price).

    PYTHONPATH=. python benchmarks/accuracy/ep_memory.py [--models moenet,qwen2-moe]

Measured 2026-12-06 (2 cores shared with other work, load average 11-14; pp 2 x dp 2, 1F1B, 4 microbatches, 2 steps,
float32), bytes per process of replica 0 (replica 1's the same sizes):

    model        stage   ep=1 measured   ep=2 measured  ep=2 simulated  ep2/ep1
    moenet           0         148,480          79,872          79,872    0.538
    moenet           1         148,992          80,384          80,384    0.540
    qwen2-moe        0         746,496         549,888         549,904    0.737
    qwen2-moe        1         747,008         550,400         550,400    0.737

Equal to the byte but for Qwen2-MoE's stage 0, whose rotary embedding's ``inv_freq`` (4 floats, 16 bytes) the
simulator counts as a buffer and the meter, which counts parameters, gradients and optimizer state, does not.
Qwen2-MoE keeps 0.74 (its attention and shared expert stay whole), MoENet 0.54 (experts are most of its blocks).
"""

from __future__ import annotations

import argparse
import warnings

import torch

import pipeviz as pv
from pipeviz.cost.memory import static_memory
from pipeviz.zoo import MoENet


def _model(name: str) -> tuple[torch.nn.Module, int, str]:
    torch.manual_seed(0)
    if name == "moenet":
        return MoENet(vocab=32, d=16, layers=4), 32, "blocks"
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64)
    return transformers.Qwen2MoeForCausalLM(config), 96, "model.layers"


def measure(name: str) -> list[tuple[int, int, int, int]]:
    """(stage, ep=1 measured, ep=2 measured, ep=2 simulated) bytes per process of replica 0."""
    model, vocab, blocks = _model(name)
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (8, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = pv.trace(model, example_args=(ids[:2],)).split([f"{blocks}.1"])
    measured: dict[int, list[int]] = {}
    simulated: list[int] = []
    for ep in (1, 2):
        run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy,
                        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), dp=2, ep=ep)
        assert run.wait(600) == "done", run.error
        for r in sorted(run.memory):
            if run.mesh.coords(r).dp == 0:
                held = max(m - a for (_, m), (_, a) in zip(run.memory[r], run.activation_memory[r], strict=True))
                measured.setdefault(run.mesh.coords(r).pp, []).append(held)
        if ep == 2:
            tl = pv.simulate(plan, "1F1B", 4, dp=2, ep=2)
            simulated = [static_memory(tl.meta["stage_costs"], [s]) for s in range(plan.num_stages)]
    return [(s, m[0], m[1], simulated[s]) for s, m in sorted(measured.items())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="moenet,qwen2-moe")
    a = ap.parse_args()
    print(f"{'model':<12}{'stage':>6}{'ep=1 measured':>16}{'ep=2 measured':>16}{'ep=2 simulated':>16}{'ep2/ep1':>9}")
    for name in a.models.split(","):
        for stage, one, two, sim in measure(name):
            print(f"{name:<12}{stage:>6}{one:>16,}{two:>16,}{sim:>16,}{two / one:>9.3f}")


if __name__ == "__main__":
    main()
