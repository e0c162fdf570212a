"""Memory measured on real runs (``run.memory``, ``run.activation_memory``; ``pipeviz.runtime.memory``): the
tensors autograd saves for backward, counted from the forward that saves them until they are released, plus
parameters, gradients and optimizer state — per process, sampled as every action starts and ends."""

from __future__ import annotations

import pytest
import torch

import pipeviz as pv
from pipeviz.zoo import MyNetwork

pytestmark = pytest.mark.slow

WIDTH, MB_ROWS, MICROBATCHES = 64, 4, 8


def _peaks(run: pv.Run) -> dict[int, int]:
    return {r: max(b for _, b in samples) for r, samples in run.activation_memory.items()}


def test_saved_activations_follow_the_schedule_and_static_bytes_are_counted() -> None:
    # MyNetwork's blocks are Linear + ReLU: per microbatch a block keeps its input (for the weight gradient) and
    # its ReLU output; consecutive blocks share one tensor. Stage 0 = layer0 + layer1 keeps x, relu0, relu1: 3
    # tensors of MB_ROWS x WIDTH floats per microbatch in flight.
    torch.manual_seed(0)
    model = MyNetwork(WIDTH, [WIDTH, WIDTH, WIDTH])
    x, y = torch.randn(MB_ROWS * MICROBATCHES, WIDTH), torch.randint(0, 10, (MB_ROWS * MICROBATCHES,))
    plan = pv.trace(model, example_args=(x,)).split(["layer1"])
    per_mb = 3 * MB_ROWS * WIDTH * 4
    peaks = {}
    for schedule in ("GPipe", "1F1B"):
        run = pv.launch(plan, schedule, MICROBATCHES, steps=2, inputs=(x,), target=y, loss_fn=pv.cross_entropy,
                        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
        assert run.wait(120) == "done", run.error
        peaks[schedule] = _peaks(run)
        samples = run.activation_memory[0]
        assert samples[-1][1] == 0  # every saved tensor released by the end of the step
        assert [t for t, _ in samples] == sorted(t for t, _ in samples)
        params = sum(p.numel() * 4 for n, p in model.named_parameters() if n.split(".")[0] in ("layer0", "layer1"))
        # at the end of step 1: weights, their gradients and Adam's two moments (the run uses Adam)
        assert run.memory[0][-1][1] == 4 * params, (run.memory[0][-1], params)
        tl = run.timeline()
        assert tl.meta["activation_memory"][0] == samples
        # the timeline draws a memory track under each rank, with the simulator's peak beside it
        fig = pv.timeline_figure(tl, overlay=pv.simulate(plan, schedule, MICROBATCHES))
        kinds = [t.meta[1] for t in fig.data if t.meta and t.meta[0] == "memory"]
        assert kinds.count("MEM") == 2 and kinds.count("MEMSIM") == 2
    assert peaks["GPipe"][0] == MICROBATCHES * per_mb  # GPipe: every microbatch's forward before any backward
    assert peaks["1F1B"][0] == 2 * per_mb  # 1F1B: rank 0 of 2 keeps 2 microbatches in flight
    assert peaks["1F1B"][1] < peaks["GPipe"][1]  # the last rank: one microbatch at a time under 1F1B
