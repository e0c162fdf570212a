"""Simulated vs measured step time: GPipe, 1F1B and Interleaved1F1B on two models, on CPU.

For each case: ``pv.profile`` calibrates the graph at the run's microbatch size, ``pv.simulate`` predicts
the step, ``pv.launch`` measures it (median compute span of the steps after warm-up, from the events).
Prints the error per case; goal <= 10 %.

    python benchmarks/simulator_accuracy.py [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork, TinyTransformer


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def cases() -> list[tuple[str, torch.nn.Module, torch.Tensor, torch.Tensor, object]]:
    torch.manual_seed(0)
    mlp = MyNetwork(1024, [2048, 1024, 2048, 1024, 512])
    tr = TinyTransformer(vocab=1024, dim=256, heads=4, depth=4, seq=64)
    return [
        ("MLP 1024-2048 x5", mlp, torch.randn(64, 1024), torch.randint(0, 10, (64,)), F.cross_entropy),
        ("transformer d256 x4", tr, torch.randint(0, 1024, (16, 64)), torch.randint(0, 1024, (16, 64)), lm_loss),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    m = a.microbatches
    errors = []
    print(f"{'model':<22}{'schedule':<17}{'stages/ranks':>13}{'simulated':>12}{'measured':>11}{'error':>8}")
    for name, model, x, y, loss in cases():
        graph = pv.trace(model, example_args=(x,))
        prof = pv.profile(graph, microbatches=m, repeats=15, threads=max(1, (os.cpu_count() or 1) // 2))  # 2 ranks
        graph = graph.with_profile(prof)
        for schedule, stages, spr in (("GPipe", 2, None), ("1F1B", 2, None), ("Interleaved1F1B", 4, 2)):
            plan = pv.balance(graph, stages, by="time")
            sim = pv.simulate(plan, schedule, m, stages_per_rank=spr)
            run = pv.launch(plan, schedule=schedule, microbatches=m, steps=a.steps, inputs=(x,), target=y,
                            loss_fn=loss, stages_per_rank=spr, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
            assert run.wait(600) == "done", run.error
            measured = run.timeline().step_time
            err = sim.step_time / measured - 1
            errors.append(abs(err))
            print(f"{name:<22}{schedule:<17}{f'{stages}/{sim.num_ranks}':>13}{sim.step_time * 1e3:>10.2f}ms"
                  f"{measured * 1e3:>9.2f}ms{err:>+8.1%}")
    print(f"max |error| {max(errors):.1%}, mean {sum(errors) / len(errors):.1%}   (goal <= 10 %)")


if __name__ == "__main__":
    main()
