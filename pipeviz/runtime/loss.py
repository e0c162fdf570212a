"""How a step's loss is reduced over its tokens (``LaunchConfig.loss_reduction``), a leaf module: the worker's
steps, the unsplit reference and the launch checks read it, and it imports nothing of pipeviz.

Example:
    >>> summed_cross_entropy(logits, target) / valid_tokens      # what "token_mean" adds up over microbatches
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "LOSS_REDUCTIONS", "summed_cross_entropy"]

LOSS_REDUCTIONS = {
    "mean": "the loss_fn's own mean in each microbatch, averaged over the microbatches (torch's schedules' way)",
    "sum": "the sum over every token of the step's batch",
    "token_mean": "the sum over every valid token (target not ignore_index) divided by the count of valid tokens "
                  "in the whole step's batch, over every microbatch and replica (torchtitan's and Megatron's)",
}
IGNORE_INDEX = -100  # torch's cross_entropy default: a target position that counts for nothing


def summed_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``pv.cross_entropy`` summed over the tokens instead of averaged (positions whose target is -100 count for
    nothing): the piece ``loss_reduction="sum"`` and ``"token_mean"`` add up and divide."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1), reduction="sum")
