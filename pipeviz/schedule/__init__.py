"""The run's description, before anything is priced or run.

Modules, bottom up: ``mesh`` (``Mesh``: pp x dp x cp x tp, process coordinates), ``timeline`` (``Event``,
``Timeline``: what a run or a simulation did), ``traits`` (the schedule registry ``info()``, ``Action``, orders and
their validator), ``hang`` (the hang report) and ``comm_order`` (a schedule's send/receive order played for
deadlock), ``recompute`` and ``tensor_parallel`` (what recomputation and tp change in a stage), ``training``
(the default loss, target and optimizer), ``config`` (``LaunchConfig``: the one configuration ``launch``,
``simulate``, the exports, the CLI and the Explorer share).
"""

from pipeviz.schedule.traits import ALL, Action, Kind, info, layout, orders

# pv.schedule.orders("1F1B", 2, 3) (Actions: pv.schedule.Action(0, pv.schedule.Kind.F, 0) prints "0F0"),
# pv.schedule.layout("ZBVZeroBubble", 8).stage_ranks: what the lessons read.
__all__ = ["ALL", "Action", "Kind", "info", "layout", "orders"]
