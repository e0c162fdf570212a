"""The memory rule's formula, at the bottom of the import graph (plain numbers in, bytes out): a stage holds its
weights, their gradients and the optimizer's state per parameter, its buffers, and its live activations. Everything
that prices memory (``pipeviz.cost.memory``, a ``StageInfo``'s figure) calls it.

Example:
    >>> stage_bytes(param_bytes=4_000, buffer_bytes=0, activation_bytes_in_flight=1_000)   # Adam: 2 states
    17000
"""

from __future__ import annotations

__all__ = ["OPTIMIZER_STATES", "stage_bytes"]

OPTIMIZER_STATES = 2  # tensors of optimizer state per parameter by default: Adam's two moments


def stage_bytes(param_bytes: int, buffer_bytes: int, activation_bytes_in_flight: float,
                 optimizer_states: int = OPTIMIZER_STATES, frozen_bytes: int = 0) -> int:
    """One stage's bytes: weights, gradients and optimizer state per trainable parameter (``frozen_bytes`` of the
    ``param_bytes`` do not train: weights alone), buffers, live activations."""
    return round(param_bytes * (2 + optimizer_states) - frozen_bytes * (1 + optimizer_states) + buffer_bytes
                 + activation_bytes_in_flight)
