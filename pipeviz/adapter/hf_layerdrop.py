"""transformers' LayerDrop checks, decided while a model is traced.

Encoder-decoder and speech models in transformers 4.x (BART, mBART, Marian, Pegasus, M2M100, Whisper, wav2vec2 and
~40 more) draw ``torch.rand([])`` before every layer in training mode and skip the layer when the draw is below
``self.layerdrop``, even when that probability is 0 (HF's default): a branch on a tensor's value, which
``torch.export`` cannot capture ("Could not guard on data-dependent expression"), so ``pv.trace`` refused them.
transformers 5.x checks ``self.layerdrop > 0.0`` first and exports as is.

A draw from [0, 1) is never below 0: inside ``decided_layerdrop()`` a ``torch.rand([])`` called from transformers'
modelling code is a ``LayerDropDraw`` whose comparison with a probability of 0 is ``False`` without any tensor, so
the trace records no branch and no random op, exactly what the model computes. A probability above 0 skips layers at
random in every step, which no pipelined run can reproduce against the unsplit model: it is refused, naming the
fix. ``pv.trace`` and ``plan.pipe()`` enter the block around ``torch.export`` / torch's ``pipeline()``; the user's
model runs as it is everywhere else.

Example:
    >>> with decided_layerdrop():
    ...     ep = torch.export.export(mbart_copy, (ids,), {"decoder_input_ids": dec})
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LayerDropDraw", "LayerDropError", "decided_layerdrop"]


class LayerDropError(ValueError):
    """A model drops layers at random while training (LayerDrop > 0): a pipelined run cannot match it."""


class LayerDropDraw:
    """``torch.rand([])`` in a LayerDrop check: a uniform draw from [0, 1), compared with a drop probability."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _decide(self, p: object, op: str) -> bool:
        if isinstance(p, int | float) and not isinstance(p, bool):
            # The draw lies in [0, 1): against a probability outside (0, 1) every comparison has one answer.
            certain = {"<": (p <= 0, p >= 1), "<=": (p < 0, p >= 1), ">": (p >= 1, p < 0), ">=": (p >= 1, p <= 0)}
            never, always = certain[op]
            if never or always:
                return always
        raise LayerDropError(
            f"{self.where} drops each layer with probability {p!r} while training (LayerDrop): every step would "
            "skip other layers at random, which a pipelined run cannot reproduce. Fix: set the config's layerdrop "
            "to 0 (encoder_layerdrop=0.0, decoder_layerdrop=0.0 or layerdrop=0.0, HF's defaults), or trace the "
            "model in eval mode to run it forward only.")

    def __lt__(self, p: object) -> bool:
        return self._decide(p, "<")

    def __le__(self, p: object) -> bool:
        return self._decide(p, "<=")

    def __gt__(self, p: object) -> bool:
        return self._decide(p, ">")

    def __ge__(self, p: object) -> bool:
        return self._decide(p, ">=")


@contextlib.contextmanager
def decided_layerdrop() -> Iterator[None]:
    """Inside the block, ``torch.rand([])`` called from transformers' modelling code returns a ``LayerDropDraw``
    (see the module's docstring); every other call, and every call outside, is torch's own."""
    original = torch.rand

    def rand(*args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == 1 and isinstance(args[0], list | tuple) and len(args[0]) == 0:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("transformers.models."):
                return LayerDropDraw(f"{module.rsplit('.', 1)[-1]}:{caller.f_lineno}")
        return original(*args, **kwargs)

    torch.rand = rand
    try:
        yield
    finally:
        torch.rand = original
