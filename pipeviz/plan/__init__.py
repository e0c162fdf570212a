"""The split plan as a value: ``SplitPlan`` (stages as lists of module names, immutable, JSON), its preview, the
real ``torch.distributed.pipelining`` Pipe it builds (``split``), the split markers (``marks``) and a manual
plan's stages (``sequence``). A plan never prices itself: ``pipeviz.cost`` answers for it.

``from pipeviz.plan import SplitPlan`` (the module's path before 0.4) keeps working.
"""

from pipeviz.plan.split import PlanError, SplitPlan, StageInfo, check_batch_split

__all__ = ["PlanError", "SplitPlan", "StageInfo", "check_batch_split"]
