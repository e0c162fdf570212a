"""What ``compile=`` does to a pipelined step, measured side by side in one run: the same plan eager and compiled
(inductor), under 1F1B (whole backwards) and ZBVZeroBubble (backwards split into input-grad ``I`` and weight-grad
``W`` passes). Prints each action kind's median seconds (steps 3 on: after compilation), the step time, and the
ratios compiled / eager. Measured on the 2-core CPU machine (width 512, 6 steps): 1F1B x0.72 a step (F x0.80,
B x0.67); ZBVZeroBubble x2.29 (F x1.99, I x1.89, W x1.86), every compiled action slower there, not explained yet
((I + W) / F stays 2.3-2.4 both ways, so the split backward is not computed twice).

    python benchmarks/speed/compiled_stages.py [--width 512] [--steps 6] [--backend inductor]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pipeviz as pv
from pipeviz.zoo import MyNetwork


def _run(schedule: str, compile_: bool | str, width: int, steps: int) -> tuple[dict[str, float], float, float]:
    torch.manual_seed(0)
    model, x = MyNetwork(width, [width] * 6), torch.randn(64, width)
    graph = pv.trace(model, example_args=(x,))
    cuts = graph.layer_names[1:-1:2] if schedule == "ZBVZeroBubble" else graph.layer_names[3:4]
    plan = graph.split(list(cuts)[:3] if schedule == "ZBVZeroBubble" else list(cuts))
    t0 = time.time()
    run = pv.launch(plan, schedule, 4, steps=steps, inputs=(x,), target=torch.randint(0, 10, (64,)),
                    loss_fn=pv.cross_entropy, compile=compile_)
    assert run.wait(900) == "done", run.error
    wall = time.time() - t0
    later = [e for e in run.events if e.step >= 2]  # after compilation and warm-up
    kinds = {k: statistics.median(e.duration for e in later if e.kind == k)
             for k in ("F", "B", "I", "W") if any(e.kind == k for e in later)}
    return kinds, run.timeline().step_time, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--backend", default="inductor")
    a = ap.parse_args()
    for schedule in ("1F1B", "ZBVZeroBubble"):
        eager, e_step, e_wall = _run(schedule, False, a.width, a.steps)
        comp, c_step, c_wall = _run(schedule, a.backend, a.width, a.steps)
        print(f"{schedule}: step eager {e_step * 1e3:.1f} ms, compiled {c_step * 1e3:.1f} ms "
              f"(x{c_step / e_step:.2f}); whole run {e_wall:.1f} s vs {c_wall:.1f} s (compilation included)")
        for k in eager:
            print(f"  {k}: eager {eager[k] * 1e3:.2f} ms, compiled {comp[k] * 1e3:.2f} ms (x{comp[k] / eager[k]:.2f})")
        if "I" in eager:
            for label, d in (("eager", eager), ("compiled", comp)):
                print(f"  (I + W) / F, {label}: {(d['I'] + d['W']) / d['F']:.2f}")


if __name__ == "__main__":
    main()
