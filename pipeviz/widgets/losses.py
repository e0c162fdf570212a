"""Default loss and target for ``pv.Explorer``'s Launch button.

This module imports only torch: a launched run pickles ``cross_entropy_last_dim`` by reference, so the
stage processes import it, and they must never load a view library (ipywidgets, plotly, anywidget).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pipeviz.graph import ModelGraph


def cross_entropy_last_dim(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy treating the output's last dim as classes (``(batch, classes)`` for a classifier,
    ``(batch, seq, vocab)`` for a language model)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


def random_classes(output: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Integer targets in ``[0, output.shape[-1])`` shaped like ``output`` without its last dim (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(1, output.shape[-1]), tuple(output.shape[:-1]), generator=gen)


def default_target(graph: ModelGraph, seed: int = 0) -> torch.Tensor:
    """``random_classes`` for the model's output on the example batch (one forward of a fresh copy).

    Raises:
        ValueError: the model has several outputs, so no single target fits; pass ``target=`` and ``loss_fn=``.
    """
    from pipeviz.runtime.reference import model_output

    model = graph.capture.fresh_copy()  # a copy: a forward in train mode would update BatchNorm statistics
    with torch.no_grad():
        out = model_output(model(*graph.example_args, **graph.example_kwargs))
    if not isinstance(out, torch.Tensor):
        raise ValueError("The model has several outputs, so Explorer cannot guess a target. "
                         "Fix: pv.Explorer(..., target=y, loss_fn=fn).")
    return random_classes(out, seed)
