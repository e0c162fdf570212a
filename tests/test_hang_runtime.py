"""Planted run-time failures between stages, named (``pipeviz.runtime.run``): a hand-off larger than the receiving
stage's buffer, which gloo answers by aborting the receiver (measured on torch 2.13 CPU)."""

from __future__ import annotations

import time

import pytest
import torch

import pipeviz as pv
from tests.hang_models import trimming_model


@pytest.mark.slow
def test_a_hand_off_larger_than_the_receive_buffer_is_named_with_ranks_action_and_sizes() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 6, 8), torch.randint(0, 4, (8,))
    x[0:2, 4:] = 0  # microbatch 0 (the one the stages' buffers are shaped by) is padded: its hand-off is 4 long
    plan = pv.manual_plan(trimming_model(), [["0", "1"], ["2", "3", "4"]], example_args=(x,))
    run = pv.launch(plan, "GPipe", 4, steps=1, inputs=(x,), target=y, loss_fn=pv.cross_entropy, timeout=20)
    start = time.time()
    assert run.wait(120) == "failed"
    assert time.time() - start < 20  # a failure, named at once: no hang, no timeout
    err = run.error or ""
    assert err.startswith("Shape mismatch between stages: rank 1 (stage 1) was killed by gloo receiving stage 0's "
                          "activations from rank 0, at 1F"), err
    assert "bytes arrived for a receive buffer of 256 bytes" in err  # 2 x 4 x 8 floats: microbatch 0's hand-off
