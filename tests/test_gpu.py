"""On CUDA devices (marked ``gpu``; skipped without one): stages sharing one GPU over host memory, NCCL across
GPUs when there are two or more, each run checked against the unsplit model trained on the GPU
(``pv.check_numerics``). ``benchmarks/gpu_check.py`` runs this file and prints the step times."""

from __future__ import annotations

import statistics
import warnings

import pytest
import torch

import pipeviz as pv
from pipeviz.zoo import TinyTransformer

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

TOLERANCE = 1e-4  # float32 on a GPU (TF32 off): kernels differ between the split and the unsplit model's shapes


@pytest.fixture(scope="module")
def case() -> tuple[torch.nn.Module, pv.ModelGraph, torch.Tensor, torch.Tensor]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = TinyTransformer(vocab=512, dim=256, heads=4, depth=8, seq=64)
    ids, target = torch.randint(0, 512, (32, 64)), torch.randint(0, 512, (32, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, pv.trace(model, example_args=(ids,)), ids, target


def _check(plan: pv.SplitPlan, schedule: str, devices: list[str] | str, ids: torch.Tensor,
           target: torch.Tensor) -> pv.Run:
    run = pv.launch(plan, schedule, 8, steps=8, inputs=(ids,), target=target, loss_fn=pv.cross_entropy,
                    optimizer=pv.sgd(lr=0.05), devices=devices, timeout=300)
    assert run.wait(600) == "done", run.error
    check = pv.check_numerics(run, tolerance=TOLERANCE, device="cuda:0")
    tl = run.timeline()
    print(f"{schedule:<14} devices={run.devices} {check} step(wall)={statistics.median(run.step_walltimes) * 1e3:.1f} "
          f"ms step(compute)={tl.step_time * 1e3:.1f} ms bubble={tl.bubble_fraction:.0%}")
    assert check.ok, check
    return run


@pytest.mark.parametrize(("schedule", "devices"), [("1F1B", ["cuda:0"] * 4), ("GPipe", ["cuda:0"] * 4),
                                                   ("ZBVZeroBubble", ["cuda:0"] * 2)])
def test_stages_sharing_one_gpu_train_like_the_unsplit_model(case: tuple, schedule: str, devices: list[str]) -> None:
    _, graph, ids, target = case
    run = _check(graph.split(["blocks.1", "blocks.3", "blocks.5"]), schedule, devices, ids, target)
    assert all(d.startswith("cuda") for d in run.devices)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(("splits", "schedule"), [(["blocks.3"], "1F1B"),
                                                  (["blocks.1", "blocks.3", "blocks.5"], "Interleaved1F1B")])
def test_nccl_across_gpus_trains_like_the_unsplit_model(case: tuple, splits: list[str], schedule: str) -> None:
    _, graph, ids, target = case
    _check(graph.split(splits), schedule, "auto", ids, target)
