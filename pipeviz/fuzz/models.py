"""The fuzzer's models: small ones that build in milliseconds, each with its batch, targets and loss.

Every model is built from a seed, so a case names a model by a string and rebuilds it identically in a repro
script. The zoo's small models cover skip connections (``skip``), tied weights (``tied``), batch statistics
(``batchnorm``) and attention (``transformer``); ``gpt2`` and ``llama`` are HF families built from tiny configs with
random weights (they need ``transformers``). A user's model: ``"path/to/file.py"`` (a file defining
``fuzz_model()`` returning ``(model, inputs, target)``) or ``"package.module:function"`` (the same function).

Example:
    >>> m = build_model("tied", seed=0)
    >>> m.model, m.inputs, m.target, m.loss_fn
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pipeviz import zoo
from pipeviz.schedule.training import cross_entropy

__all__ = ["BUILTIN", "HF_MODELS", "BatchNormNet", "FuzzModel", "build_model", "builtin_models"]

BATCH = 8  # rows per step: divisible by every microbatch count drawn (1, 2, 4, 8) times dp (1, 2)


@dataclass
class FuzzModel:
    """A model with what a run trains it on. ``size``: an order for shrinking (smaller is simpler)."""

    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss_fn: Callable[..., torch.Tensor]
    size: int


class BatchNormNet(nn.Module):
    """Linear blocks with BatchNorm between them: running statistics are buffers a run must keep exactly."""

    def __init__(self, d: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.layer0 = nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.ReLU())
        self.layer1 = nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.output_proj = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_proj(self.layer2(self.layer1(self.layer0(x))))


def _classifier(model: nn.Module, d: int, classes: int) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    return model, (torch.randn(BATCH, d),), torch.randint(0, classes, (BATCH,))


def _lm(model: nn.Module, vocab: int, seq: int) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    return model, (torch.randint(0, vocab, (BATCH, seq)),), torch.randint(0, vocab, (BATCH, seq))


# name -> (size, builder): builders run after torch.manual_seed(seed)
BUILTIN: dict[str, tuple[int, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]]]] = {
    "mlp": (0, lambda: _classifier(zoo.MyNetwork(8, [8, 8, 8, 8], 4), 8, 4)),
    "skip": (1, lambda: _classifier(zoo.SkipNet(8, 4), 8, 4)),
    "batchnorm": (2, lambda: _classifier(BatchNormNet(8, 4), 8, 4)),
    "tied": (3, lambda: _lm(zoo.TiedNet(16, 8, 4), 16, 4)),
    "transformer": (4, lambda: _lm(zoo.TinyTransformer(16, 8, 2, 4, 4), 16, 4)),
    "gpt2": (5, lambda: _lm(zoo.gpt2(n_layer=4, n_embd=8, n_head=2, vocab_size=16, n_positions=8), 16, 4)),
    "llama": (6, lambda: _lm(zoo.llama(num_hidden_layers=4, hidden_size=16, num_attention_heads=2,
                                       num_key_value_heads=2, vocab_size=16), 16, 4)),
    "moe": (7, lambda: _lm(zoo.MoENet(vocab=16, d=8, layers=4, experts=4), 16, 4)),  # routed experts: ep runs
}
HF_MODELS = ("gpt2", "llama")


def builtin_models() -> list[str]:
    """The built-in models this environment can build (the HF ones need ``transformers``)."""
    hf = importlib.util.find_spec("transformers") is not None
    return [n for n in BUILTIN if hf or n not in HF_MODELS]


def _user(name: str) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]]:
    """``fuzz_model`` from a file, or ``module:function``."""
    if os.path.exists(name):
        spec = importlib.util.spec_from_file_location("pipeviz_fuzz_user_model", name)
        if spec is None or spec.loader is None:
            raise ValueError(f"Cannot import {name!r} as Python. Fix: a .py file defining fuzz_model().")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, "fuzz_model", None)
        where = f"{name} has no fuzz_model()"
    elif ":" in name:
        mod, _, attr = name.partition(":")
        fn = getattr(importlib.import_module(mod), attr, None)
        where = f"{mod} has no {attr}"
    else:
        raise ValueError(f"Unknown model {name!r}; valid: {', '.join(BUILTIN)}, a .py file defining fuzz_model(), or "
                         "'package.module:function'. Fix: --model tied, or --model my_model.py.")
    if not callable(fn):
        raise ValueError(f"{where}. Fix: define fuzz_model() returning (model, inputs, target), inputs a tuple of "
                         f"tensors whose first dimension is the batch ({BATCH} rows keeps every microbatch count "
                         "possible).")
    return fn


def build_model(name: str, seed: int = 0) -> FuzzModel:
    """The model ``name`` (``BUILTIN``, a file or ``module:function``) with its batch, built from ``seed``.

    Raises:
        ValueError: an unknown name or a user model that cannot be imported (named, with the fix).
    """
    size, builder = BUILTIN.get(name, (len(BUILTIN), None))
    make = builder if builder is not None else _user(name)
    torch.manual_seed(seed)
    model, inputs, target = make()
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return FuzzModel(name, model, tuple(inputs), target, cross_entropy, size)
