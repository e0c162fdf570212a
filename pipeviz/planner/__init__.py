"""Choosing a layout: ``balance`` (``balance``, ``compare``), ``search`` (``plan_cluster`` over a cluster),
``cluster`` (its options and rows), ``lengths`` (buckets for sequences of many lengths) and ``synthesize`` (the
fastest order for a memory limit, over ``list_schedule``).

``from pipeviz.planner import plan_cluster`` (the module's path before 0.4) keeps working.
"""

from pipeviz.planner.search import ClusterPlan, LayoutOption, plan_cluster

__all__ = ["ClusterPlan", "LayoutOption", "plan_cluster"]
