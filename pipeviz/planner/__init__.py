"""Choosing a layout: ``balance`` (``balance``, ``compare``), ``search`` (``plan_cluster`` over a cluster),
``cluster`` (its options and rows) and ``lengths`` (buckets for sequences of many lengths).

``from pipeviz.planner import plan_cluster`` (the module's path before 0.4) keeps working.
"""

from pipeviz.planner.search import ClusterPlan, LayoutOption, plan_cluster

__all__ = ["ClusterPlan", "LayoutOption", "plan_cluster"]
