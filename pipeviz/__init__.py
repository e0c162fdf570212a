"""pipeviz: see, split, simulate and run pipeline parallelism in PyTorch.

Example:
    >>> import torch, pipeviz as pv
    >>> from pipeviz.zoo import MyNetwork
    >>> graph = pv.trace(MyNetwork(512, [512, 1024, 256]), example_args=(torch.randn(32, 512),))
    >>> plan = graph.split(["layer0", "layer1"])
    >>> print(plan)            # per-stage layers, params, FLOPs, bytes sent, memory
    >>> pipe = plan.pipe(microbatches=4)

The core (this package minus ``pipeviz.widgets``) imports neither ipywidgets nor plotly.
"""

from torch.distributed.pipelining import SplitPoint

from pipeviz.balance import balance
from pipeviz.capture import TraceError
from pipeviz.export import Watch, export_torchrun, watch
from pipeviz.graph import Layer, ModelGraph, trace
from pipeviz.manual import SequenceStage, manual_plan
from pipeviz.plan import PlanError, SplitPlan, StageInfo
from pipeviz.profile import Profile, profile
from pipeviz.runtime import LaunchError, Run, launch, train_reference
from pipeviz.schedules import ScheduleError
from pipeviz.simulate import Comparison, Costs, compare, estimate_costs, simulate
from pipeviz.timeline import Event, Timeline

__version__ = "0.1.0"

__all__ = [
    "Comparison",
    "Costs",
    "Event",
    "LaunchError",
    "Layer",
    "ModelGraph",
    "PlanError",
    "Profile",
    "Run",
    "ScheduleError",
    "SequenceStage",
    "SplitPlan",
    "SplitPoint",
    "StageInfo",
    "Timeline",
    "TraceError",
    "Watch",
    "balance",
    "compare",
    "estimate_costs",
    "export_torchrun",
    "launch",
    "manual_plan",
    "profile",
    "simulate",
    "trace",
    "train_reference",
    "watch",
]


def __getattr__(name: str) -> object:
    """``pv.Explorer`` and ``pv.TimelineView`` load ipywidgets and plotly only when first used."""
    if name in ("Explorer", "TimelineView"):
        from pipeviz import widgets

        return getattr(widgets, name)
    raise AttributeError(f"module 'pipeviz' has no attribute {name!r}")
