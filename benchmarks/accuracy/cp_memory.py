"""Peak activation memory per process under context parallelism: simulated (``pv.simulate(..., cp=2)``: 1/cp of
each stage's activations) vs measured (the peak of ``run.activation_memory[rank]``: the bytes autograd holds saved
for backward), and the measured cp=2 peak against the cp=1 run's (goal: 1/cp within 10 %).

    PYTHONPATH=. python benchmarks/accuracy/cp_memory.py [--seq 256]
"""

from __future__ import annotations

import argparse
import warnings

import torch

import pipeviz as pv
from pipeviz.zoo import gpt2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = gpt2(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=a.seq)
        ids = torch.randint(0, 256, (8, a.seq))
        plan = pv.trace(model, example_args=(ids,)).split(["transformer.h.2"])
    peaks: dict[int, list[int]] = {}
    print(f"{'cp':>3}{'rank':>6}{'simulated':>12}{'measured':>12}{'error':>8}")
    for cp in (1, 2):
        run = pv.launch(plan, "GPipe", 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, cp=cp)
        assert run.wait(900) == "done", run.error
        sim = pv.simulate(plan, "GPipe", 4, cp=cp).meta["peak_activation_bytes"]
        peaks[cp] = [max(b for _, b in run.activation_memory[r]) for r in sorted(run.activation_memory)]
        for r, got in enumerate(peaks[cp]):
            want = sim[run.mesh.coords(r).pp]
            print(f"{cp:>3}{r:>6}{want / 2**20:>11.2f}M{got / 2**20:>11.2f}M{want / got - 1:>8.1%}")
    for r, got in enumerate(peaks[2]):
        whole = peaks[1][pv.Mesh(pp=2, cp=2).coords(r).pp]
        print(f"cp=2 rank {r}: {got / whole:.3f} of the cp=1 stage's measured peak (1/cp = 0.5)")


if __name__ == "__main__":
    main()
