"""Shared fixtures: small models and their example inputs."""

from __future__ import annotations

import warnings

import pytest
import torch

import pipeviz as pv
from pipeviz.zoo import MyNetwork, SkipNet, TiedNet

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture
def classic() -> tuple[MyNetwork, torch.Tensor]:
    torch.manual_seed(0)
    return MyNetwork(512, [512, 1024, 256]), torch.randn(32, 512)


@pytest.fixture
def classic_graph(classic: tuple[MyNetwork, torch.Tensor]) -> pv.ModelGraph:
    model, x = classic
    return pv.trace(model, example_args=(x,))


@pytest.fixture
def skip_graph() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(SkipNet(16), example_args=(torch.randn(8, 16),))


@pytest.fixture
def tied_graph() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(TiedNet(32, 16, 2), example_args=(torch.randint(0, 32, (4, 8)),))
