"""The names ``pipeviz.kernels`` held before 0.3; the CPU replay of traced ops lives in ``pipeviz.cost.replay``.
Kept so that imports written against 0.2 work unchanged."""

from pipeviz.cost.replay import MAX_BYTES, MAX_FLOPS, TensorSpec, loss_seconds, op_seconds, replayable, scaled_shape

__all__ = ["MAX_BYTES", "MAX_FLOPS", "TensorSpec", "loss_seconds", "op_seconds", "replayable", "scaled_shape"]
