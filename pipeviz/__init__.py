"""pipeviz: see, split, simulate and run pipeline parallelism in PyTorch.

Example:
    >>> import torch, pipeviz as pv
    >>> from pipeviz.zoo import MyNetwork
    >>> graph = pv.trace(MyNetwork(512, [512, 1024, 256]), example_args=(torch.randn(32, 512),))
    >>> plan = graph.split(["layer0", "layer1"])
    >>> print(plan)            # per-stage layers, params, FLOPs, bytes sent, memory
    >>> pipe = plan.pipe(microbatches=4)

The core (this package minus ``pipeviz.widgets``) imports neither ipywidgets nor plotly; the view names
below (``pv.Explorer``, ``pv.TimelineView``, the figure functions) load them on first use.
"""

from torch.distributed.pipelining import SplitPoint

from pipeviz.balance import balance, compare
from pipeviz.capture import TraceError
from pipeviz.cost.model import Costs
from pipeviz.cost.options import CostOptions
from pipeviz.export import Watch, export_torchrun, watch
from pipeviz.graph import Layer, ModelGraph, trace

# pv.hardware and pv.profile are functions; their modules' names (kept from 0.2) are imported here first, so that
# a later `import pipeviz.hardware` does not replace the function on the package.
from pipeviz.hardware import HARDWARE, Hardware, HardwareError, hardware
from pipeviz.lengths import BucketComparison, BucketRow, buckets, compare_buckets, padding_waste, plan_cluster_lengths
from pipeviz.live import Live
from pipeviz.manual import SequenceStage, manual_plan
from pipeviz.mesh import Mesh, MeshError
from pipeviz.numerics import NumericsCheck, check_numerics
from pipeviz.plan import PlanError, SplitPlan, StageInfo
from pipeviz.planner import ClusterPlan, LayoutOption, plan_cluster
from pipeviz.profile import Profile, profile
from pipeviz.runtime import LaunchConfig, LaunchError, Run, launch, train_reference
from pipeviz.schedules import ScheduleError
from pipeviz.simulate import Comparison, estimate_costs, simulate
from pipeviz.timeline import Event, Timeline
from pipeviz.trace_import import import_trace
from pipeviz.training import cross_entropy, sgd, warmup_cosine
from pipeviz.version import __version__ as __version__
from pipeviz.weights import materialize
from pipeviz.why import critical_path, idle_gaps

__all__ = [
    "HARDWARE",
    "BucketComparison",
    "BucketRow",
    "ClusterPlan",
    "Comparison",
    "CostOptions",
    "Costs",
    "Event",
    "Hardware",
    "HardwareError",
    "LaunchConfig",
    "LaunchError",
    "Layer",
    "LayoutOption",
    "Live",
    "Mesh",
    "MeshError",
    "ModelGraph",
    "NumericsCheck",
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
    "buckets",
    "check_numerics",
    "compare",
    "compare_buckets",
    "critical_path",
    "cross_entropy",
    "estimate_costs",
    "export_torchrun",
    "hardware",
    "idle_gaps",
    "import_trace",
    "launch",
    "manual_plan",
    "materialize",
    "padding_waste",
    "plan_cluster",
    "plan_cluster_lengths",
    "profile",
    "sgd",
    "simulate",
    "trace",
    "train_reference",
    "warmup_cosine",
    "watch",
]

_VIEWS = ("Explorer", "TimelineView", "comparison_figure", "graph_figure", "player_figure", "side_by_side_figure",
          "timeline_figure")


def __getattr__(name: str) -> object:
    """The views (``pv.Explorer``, ``pv.TimelineView``, ``pv.timeline_figure``, ...) load ipywidgets and
    plotly only when first used: ``import pipeviz`` stays free of them."""
    if name in _VIEWS:
        import importlib

        return getattr(importlib.import_module("pipeviz.widgets"), name)
    raise AttributeError(f"module 'pipeviz' has no attribute {name!r}")
