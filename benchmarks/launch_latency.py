"""Launch -> first event, and the launch's phases, for GPT-2 tiny and GPT-2 small (random weights), 3 stages on
3 processes: the first launch of a session (it starts the fork server the ranks come from) and the next ones.
Goal: under 5 s for GPT-2 tiny on an otherwise idle 2-core machine.

    python benchmarks/launch_latency.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import pipeviz as pv
from pipeviz.zoo import gpt2

MODELS = {"GPT-2 tiny (4 x 128, vocab 512)": dict(n_layer=4, n_embd=128, n_head=4, vocab_size=512),
          "GPT-2 small (12 x 768, vocab 50257)": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                                     n_positions=1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    for name, cfg in MODELS.items():
        torch.manual_seed(0)
        model = gpt2(**cfg)
        ids = torch.randint(0, cfg["vocab_size"], (8, 32))
        t = time.time()
        plan = pv.balance(pv.trace(model, example_args=(ids,)), 3)
        print(f"{name}: traced and balanced in {time.time() - t:.1f} s")
        for i in range(a.repeats):
            run = pv.launch(plan, "1F1B", 4, 2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy)
            assert run.wait(600) == "done", run.error
            first = (run.first_event_at or float("nan")) - run.started_at
            phases = ", ".join(f"{text} {at:.1f} s" for at, text in run.phases if not text.startswith("step"))
            print(f"  launch {i + 1}: first event after {first:.2f} s   ({phases})")


if __name__ == "__main__":
    main()
