"""GPU check: stages sharing one GPU (over host memory), and NCCL across GPUs when there are two or more.

Run once on a GPU machine; it trains pipelined runs on the GPU, checks losses and parameters against the
unsplit model trained on the same GPU, and prints step times.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import TinyTransformer


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def check(name: str, plan: pv.SplitPlan, schedule: str, devices: list[str] | str, ids: torch.Tensor,
          target: torch.Tensor, model: torch.nn.Module, steps: int = 8) -> bool:
    opt = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    t = time.time()
    run = pv.launch(plan, schedule=schedule, microbatches=8, steps=steps, inputs=(ids,), target=target,
                    loss_fn=lm_loss, optimizer=opt, devices=devices, timeout=300)
    status = run.wait(600)
    if status != "done":
        print(f"{name}: {status}\n{run.error}")
        return False
    ref_losses, ref_state = pv.train_reference(model, (ids,), target, loss_fn=lm_loss, optimizer=opt, microbatches=8,
                                               steps=steps, device="cuda:0")
    state = run.state_dict()
    dl = max(abs(a - b) for a, b in zip(run.losses, ref_losses, strict=True))
    dp = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    tl = run.timeline()
    ok = dl < 1e-4 and dp < 1e-4
    print(f"{name:<44} {schedule:<14} devices={run.devices} backend-loss-diff={dl:.2e} param-diff={dp:.2e} "
          f"step(wall)={statistics.median(run.step_walltimes) * 1e3:.1f} ms step(compute)={tl.step_time * 1e3:.1f} ms "
          f"bubble={tl.bubble_fraction:.0%} total={time.time() - t:.1f}s {'OK' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        print("No CUDA device: nothing to check here.")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    torch.manual_seed(0)
    model = TinyTransformer(vocab=512, dim=256, heads=4, depth=8, seq=64)
    ids, target = torch.randint(0, 512, (32, 64)), torch.randint(0, 512, (32, 64))
    graph = pv.trace(model, example_args=(ids,))
    four = graph.split(["blocks.1", "blocks.3", "blocks.5"])
    results = [
        check("4 stages sharing cuda:0 (host-memory transport)", four, "1F1B", ["cuda:0"] * 4, ids, target, model),
        check("4 stages sharing cuda:0 (host-memory transport)", four, "GPipe", ["cuda:0"] * 4, ids, target, model),
        check("4 stages, 2 ranks on cuda:0 (V schedule)", four, "ZBVZeroBubble", ["cuda:0"] * 2, ids, target, model),
    ]
    if torch.cuda.device_count() >= 2:
        two = graph.split(["blocks.3"])
        results.append(check("2 stages on 2 GPUs (NCCL)", two, "1F1B", "auto", ids, target, model))
        results.append(check("4 stages on 2 GPUs (NCCL)", four, "Interleaved1F1B", "auto", ids, target, model))
    print("ALL OK" if all(results) else "SOME CHECKS FAILED")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
