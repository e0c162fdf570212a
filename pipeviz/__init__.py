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

from pipeviz.capture.export import TraceError
from pipeviz.capture.weights import materialize
from pipeviz.cost.model import Costs
from pipeviz.cost.options import CostOptions
from pipeviz.graph.manual import manual_plan
from pipeviz.graph.model import ModelGraph, trace

# pv.hardware and pv.profile are functions; their modules' names (kept from 0.2) are imported here first, so that
# a later `import pipeviz.hardware` does not replace the function on the package.
from pipeviz.hardware import HARDWARE, Hardware, HardwareError, hardware
from pipeviz.plan.errors import PlanError
from pipeviz.plan.megatron import megatron_layout
from pipeviz.plan.split import SplitPlan
from pipeviz.planner.balance import balance, compare
from pipeviz.planner.search import ClusterPlan, plan_cluster
from pipeviz.planner.synthesize import synthesize_schedule
from pipeviz.profile import Profile, profile
from pipeviz.runtime import LaunchConfig, LaunchError, Run, launch, train_reference
from pipeviz.runtime.export import export_torchrun, watch
from pipeviz.runtime.live import Live
from pipeviz.runtime.numerics import check_numerics
from pipeviz.runtime.torchtitan import export_torchtitan
from pipeviz.schedule.mesh import Mesh, MeshError
from pipeviz.schedule.timeline import Event, Timeline
from pipeviz.schedule.training import cross_entropy, sgd, warmup_cosine
from pipeviz.schedule.traits import ScheduleError
from pipeviz.sim.simulate import simulate
from pipeviz.sim.trace_import import import_trace
from pipeviz.sim.why import critical_path, idle_gaps
from pipeviz.version import __version__ as __version__

__all__ = [
    "HARDWARE",
    "ClusterPlan",
    "CostOptions",
    "Costs",
    "Event",
    "Hardware",
    "HardwareError",
    "LaunchConfig",
    "LaunchError",
    "Live",
    "Mesh",
    "MeshError",
    "ModelGraph",
    "PlanError",
    "Profile",
    "Run",
    "ScheduleError",
    "SplitPlan",
    "SplitPoint",
    "Timeline",
    "TraceError",
    "balance",
    "check_numerics",
    "compare",
    "critical_path",
    "cross_entropy",
    "export_torchrun",
    "export_torchtitan",
    "hardware",
    "idle_gaps",
    "import_trace",
    "launch",
    "manual_plan",
    "materialize",
    "megatron_layout",
    "plan_cluster",
    "profile",
    "sgd",
    "simulate",
    "synthesize_schedule",
    "trace",
    "train_reference",
    "warmup_cosine",
    "watch",
]

_VIEWS = ("Explorer", "TimelineView", "comparison_figure", "expert_tokens_figure", "graph_figure", "player_figure",
          "side_by_side_figure", "timeline_figure")


# Modules reached as attributes before 0.4 (pv.schedules, pv.timeline, pv.training; pv.costs from 0.2).
_MOVED = {"Layer": "pipeviz.capture.view", "NumericsCheck": "pipeviz.runtime.numerics",
          "SequenceStage": "pipeviz.plan.sequence", "StageInfo": "pipeviz.plan.preview",
          "estimate_costs": "pipeviz.sim.simulate",
          "Comparison": "pipeviz.sim.simulate",
          "BucketComparison": "pipeviz.planner.lengths",
          "BucketRow": "pipeviz.planner.lengths",
          "buckets": "pipeviz.planner.lengths",
          "padding_waste": "pipeviz.planner.lengths",
          "compare_buckets": "pipeviz.planner.lengths",
          "plan_cluster_lengths": "pipeviz.planner.lengths",
          "Watch": "pipeviz.runtime.export",
          "LayoutOption": "pipeviz.planner.cluster"}
_OLD_MODULES = ("schedules", "timeline", "training", "costs")


def __getattr__(name: str) -> object:
    """The views (``pv.Explorer``, ``pv.TimelineView``, ``pv.timeline_figure``, ...) load ipywidgets and
    plotly only when first used: ``import pipeviz`` stays free of them."""
    import importlib

    if name in _VIEWS:
        return getattr(importlib.import_module("pipeviz.widgets"), name)
    if name in _MOVED:  # names on pipeviz before 0.4, now in the module of their part
        import warnings

        warnings.warn(f"pv.{name} is deprecated since pipeviz 0.4: from {_MOVED[name]} import {name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    if name in _OLD_MODULES:  # pv.schedules.orders(...) as lessons before 0.4 wrote it: the module, with a warning
        return importlib.import_module(f"pipeviz.{name}")
    raise AttributeError(f"module 'pipeviz' has no attribute {name!r}")
