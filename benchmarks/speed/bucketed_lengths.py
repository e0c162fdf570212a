"""What batches of several sequence lengths cost a run (``pipeviz.runtime.shapes``), side by side in one run: a tiny
HF Llama (4 x 256, vocab 1024), 2 stages, 1F1B, 4 microbatches of 2 sequences, trained on 12 batches

- fixed: every batch padded to 128 tokens (one shape);
- bucketed: the same sequences in buckets of 32, 64 and 128 tokens, in turn (three shapes).

Printed: each new shape's trace in the launching process and its stage build on rank 0 (the run's phases), the
steady step time per bucket length, and the whole run's wall time for each; the ratio says what bucketing saved
once its traces are paid. Goal: a new shape costs under 1 s here, and the bucketed run's steps at 32 tokens are
faster than the padded run's.

    python benchmarks/speed/bucketed_lengths.py
"""

from __future__ import annotations

import re
import statistics
import time

import torch

import pipeviz as pv
from pipeviz import zoo

ROWS, M = 8, 4


def batches(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 1024, (ROWS, s), generator=g), torch.randint(0, 1024, (ROWS, s), generator=g))
            for s in lengths]


def run(plan: pv.SplitPlan, lengths: list[int]) -> tuple[float, pv.Run]:
    t = time.perf_counter()
    r = pv.launch(plan, "1F1B", M, steps=None, data=iter(batches(lengths)), loss_fn=pv.cross_entropy,
                  optimizer=pv.sgd(lr=0.01))
    assert r.wait(600) == "done", r.error
    return time.perf_counter() - t, r


def main() -> None:
    torch.manual_seed(0)
    model = zoo.llama(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=1024)
    plan = pv.balance(pv.trace(model, example_args=(torch.randint(0, 1024, (ROWS, 128)),)), 2, by="params")
    run(plan, [128])  # warm: the fork server and the first shape's trace
    bucketed = [32, 64, 128] * 4
    fixed_s, fixed = run(plan, [128] * len(bucketed))
    mixed_s, mixed = run(plan, bucketed)
    for _, text in mixed.phases:
        if "input shape" in text:
            print(" ", text)
    traced = [float(x) for x in re.findall(r"traced for it in ([\d.]+) s", " ".join(t for _, t in mixed.phases))]
    # step_walltimes[i] is step i + 1's (from the previous step's end); a shape's first step includes its build
    by_len: dict[int, list[float]] = {}
    for i, s in enumerate(mixed.step_walltimes, start=1):
        if i >= 3:  # every shape met once by then
            by_len.setdefault(bucketed[i], []).append(s)
    print(f"padded to 128: steady step {statistics.median(fixed.step_walltimes[2:]) * 1e3:.1f} ms, "
          f"run {fixed_s:.2f} s")
    for length, times in sorted(by_len.items()):
        print(f"bucket {length:>3}: steady step {statistics.median(times) * 1e3:.1f} ms")
    print(f"bucketed: run {mixed_s:.2f} s; new shapes traced in {', '.join(f'{x:.2f}' for x in traced)} s; "
          f"run time bucketed / padded = {mixed_s / fixed_s:.2f}")


if __name__ == "__main__":
    main()
