"""Launch -> first event for GPT-2 tiny and GPT-2 small (random weights), 3 stages on 3 processes, 1F1B: the first
launch of a session (it starts the fork server the ranks come from) and the next ones, with and without what makes a
launch fast, side by side in one run.

- after: torch's Pipe traced once per plan and input shape (``pipeviz.runtime.payloads.launch_stages``), the model's
  values written once into a file each rank maps copy-on-write (``pipeviz.runtime.ship``), the ranks joining the
  process group while the launching process builds their payloads;
- before: the same code with ``pipeviz.runtime.payloads.SHIP_VALUES = False``: every launch traces the Pipe again and
  pickles each stage's values into its rank's payload, as pv.launch did until 2026-12-02 (the ranks still start
  while the payloads are built).

Each (model, mode) runs in a fresh process, so each has a first launch. The first launch's extra cost is the fork
server's start: it imports torch, torch.distributed and pipeviz's worker (measured alone, in a fresh interpreter).
Goal: from the second launch of a session on, tiny < 1 s and small < 2 s.

    python benchmarks/speed/launch_latency.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

MODELS = {"tiny": ("GPT-2 tiny (4 x 128, vocab 512)", dict(n_layer=4, n_embd=128, n_head=4, vocab_size=512)),
          "small": ("GPT-2 small (12 x 768, vocab 50257, 124 M)", dict(n_layer=12, n_embd=768, n_head=12,
                                                                       vocab_size=50257, n_positions=1024))}


def child(model_key: str, mode: str, repeats: int) -> None:
    import warnings

    import torch

    import pipeviz as pv
    from pipeviz.runtime import payloads
    from pipeviz.zoo import gpt2

    warnings.filterwarnings("ignore")
    payloads.SHIP_VALUES = mode == "after"
    _, cfg = MODELS[model_key]
    torch.manual_seed(0)
    model = gpt2(**cfg)
    ids = torch.randint(0, cfg["vocab_size"], (8, 32))
    plan = pv.balance(pv.trace(model, example_args=(ids,)), 3)
    out = []
    for _ in range(repeats):
        run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy)
        assert run.wait(600) == "done", run.error
        out.append((run.first_event_at or float("nan")) - run.started_at)
    print(json.dumps(out))


def import_seconds() -> list[tuple[str, float]]:
    """What the fork server imports, timed one after another in a fresh interpreter."""
    code = ("import time, json; t = time.perf_counter(); out = []\n"
            "for m in ('torch', 'torch.distributed.pipelining', 'pipeviz.runtime.worker'):\n"
            "    __import__(m); now = time.perf_counter(); out.append((m, now - t)); t = now\n"
            "print(json.dumps(out))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [tuple(x) for x in json.loads(res.stdout)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.repeats)
    print("launch -> first event, seconds (3 stages on 3 processes, 1F1B, batch 8 x 32)")
    print(f"{'model':<44} {'mode':<7} {'first':>6}   next")
    results = {}
    for key, (name, _) in MODELS.items():
        for mode in ("before", "after"):
            t = time.time()
            res = subprocess.run([sys.executable, __file__, "--child", key, mode, "--repeats", str(a.repeats)],
                                 capture_output=True, text=True)
            if res.returncode:
                print(f"{name:<44} {mode:<7} failed:\n{res.stderr[-2000:]}")
                continue
            firsts = json.loads(res.stdout.strip().splitlines()[-1])
            results[key, mode] = firsts
            print(f"{name:<44} {mode:<7} {firsts[0]:>6.2f}   {', '.join(f'{x:.2f}' for x in firsts[1:])}"
                  f"   ({time.time() - t:.0f} s in all)", flush=True)
    for key, (name, _) in MODELS.items():
        if (key, "before") in results and (key, "after") in results:
            b, f = results[key, "before"][1:], results[key, "after"][1:]
            if b and f:
                print(f"{name}: next launches {min(b) / max(f):.1f}-{max(b) / min(f):.1f}x faster")
    print("the first launch's extra: the fork server imports " + ", ".join(
        f"{m} {s:.2f} s" for m, s in import_seconds()) + " (a fresh interpreter, alone)")
    goals = {"tiny": 1.0, "small": 2.0}
    for key, limit in goals.items():
        nxt = results.get((key, "after"), [0, float("inf")])[1:]
        print(f"goal {key} < {limit:g} s from the second launch on: {'met' if nxt and max(nxt) < limit else 'NOT met'}"
              f" (max {max(nxt) if nxt else float('nan'):.2f} s)")


if __name__ == "__main__":
    main()
