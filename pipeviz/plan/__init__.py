"""The split plan as a value: ``SplitPlan`` (stages as lists of module names, immutable, JSON; ``split``), its
preview (``StageInfo`` per stage, read from the graph: ``preview``), the real ``torch.distributed.pipelining`` Pipe
it builds (``pipe``), the split markers (``marks``), a manual plan's stages (``sequence``) and ``PlanError``
(``errors``). A plan never prices itself: ``pipeviz.cost`` answers for it.

``from pipeviz.plan import SplitPlan`` (the module's path before 0.4) keeps working.
"""

from pipeviz.plan.errors import PlanError
from pipeviz.plan.pipe import check_batch_split
from pipeviz.plan.preview import StageInfo
from pipeviz.plan.split import SplitPlan

__all__ = ["PlanError", "SplitPlan", "StageInfo", "check_batch_split"]
