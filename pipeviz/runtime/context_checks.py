"""The check before spawn of context parallelism's stages (``LaunchConfig.cp``): each stage run once on one share's
tokens, an op a share of the sequence cannot run exactly refused naming cp.

Example:
    >>> context_stages(plan, spec)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pipeviz.errors import LaunchError

if TYPE_CHECKING:
    from pipeviz.plan.split import SplitPlan
    from pipeviz.runtime.spec import LaunchSpec

__all__ = ["context_stages"]


def context_stages(plan: SplitPlan, spec: LaunchSpec) -> None:
    """Each stage run once on one share's tokens (fake tensors; the launch's stages, cached for it): an op a share
    cannot run exactly is refused here, before any process starts."""
    from pipeviz.adapter.context_graph import ContextError
    from pipeviz.runtime.payloads import launch_stages
    from pipeviz.runtime.stages import StepError

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # (it logs the op's traceback at ERROR before raising; the refusal says it)
    try:
        launch_stages(plan, spec)
    except (ContextError, StepError) as exc:
        if not isinstance(exc, ContextError) and not isinstance(exc.__cause__, ContextError):
            raise
        raise LaunchError(f"cp={spec.cp}: {exc}. Context parallelism runs attention as "
                          "scaled_dot_product_attention (HF attn_implementation='sdpa') on each share's tokens. "
                          "Fix: cp=1, or a model whose attention is fused.", setting="cp") from exc
    finally:
        fake_log.setLevel(level)
