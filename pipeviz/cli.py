"""``pipeviz`` command line: ``pipeviz demo`` is the headless main job.

    pipeviz demo [--model classic|transformer|gpt2] [--stages 3]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

import torch

import pipeviz as pv
from pipeviz import zoo


def _model(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    if name == "classic":
        return zoo.MyNetwork(512, [512, 1024, 256]), (torch.randn(32, 512),)
    if name == "transformer":
        return zoo.TinyTransformer(depth=4), (torch.randint(0, 64, (8, 16)),)
    if name == "gpt2":
        return zoo.gpt2(n_layer=4), (torch.randint(0, 128, (8, 16)),)
    raise SystemExit(f"Unknown model {name!r}; valid: classic, transformer, gpt2.")


def demo(args: argparse.Namespace) -> int:
    """Trace a model, split it into ``--stages`` stages, print the stage table and check the Pipe."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    model, inputs = _model(args.model)
    graph = pv.trace(model, example_args=inputs)
    print(f"{graph!r}")
    for layer in graph.layers:
        print(f"  {layer.index:2d} {layer.name:<24} {layer.kind:<16} params={layer.params:>10,} "
              f"flops={layer.flops:>12,} out={layer.out_bytes:>9,} B")
    if args.model == "classic" and args.stages == 3:
        plan = graph.split(["layer0", "layer1"])  # the classic PiPPy walkthrough
    else:
        cands = graph.split_candidates
        if not 1 <= args.stages <= len(cands) + 1:
            raise SystemExit(f"--stages must be between 1 and {len(cands) + 1} for this model, got {args.stages}.")
        step = len(graph.layers) / args.stages
        plan = graph.split([cands[round(step * (i + 1)) - 1] for i in range(args.stages - 1)])
    print(f"\n{plan!r}\n{plan.table()}\n")
    pipe = plan.pipe(microbatches=2)
    (x, *rest), _ = plan.microbatch_inputs(2)
    with torch.no_grad():
        got = pipe(x, *rest)
        want = model(x, *rest)
    got = got[0] if isinstance(got, tuple) else got
    want = want.logits if hasattr(want, "logits") else want
    ok = torch.allclose(got, want, atol=1e-5)
    print(f"torch Pipe built: {pipe.num_stages} stages; stages run in sequence {'match' if ok else 'DIFFER FROM'} "
          "the unsplit model.")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pipeviz", description="See, split, simulate and run pipeline parallelism.")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="headless main job: trace, split, preview, check")
    d.add_argument("--model", default="classic", choices=["classic", "transformer", "gpt2"])
    d.add_argument("--stages", type=int, default=3)
    d.set_defaults(func=demo)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
