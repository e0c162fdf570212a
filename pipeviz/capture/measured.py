"""``Profile``: a measurement of each layer's forward and backward time (what ``pv.profile`` returns), the first of
the cost model's time sources (``pipeviz.cost.model.time_source``). A value: attach it to a view of the graph
(``graph.with_profile(prof)``).

Example:
    >>> prof = pv.profile(graph, microbatches=4)
    >>> prof.forward["layer1"], prof.backward["layer1"], prof.peak_memory
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeviz.cost.calibration import constant

__all__ = ["CPU_ACTION_OVERHEAD", "Profile"]


# Fixed cost of one schedule action in a run on CPU: the gap between one action's end and the next on the
# same rank when the next one's input is already there (pipeviz.cost.calibration: "cpu_action_overhead").
CPU_ACTION_OVERHEAD = constant("cpu_action_overhead")


@dataclass
class Profile:
    """Measured seconds per microbatch for each layer; ``glue_*`` is time between layers (ops outside any
    layer); ``loss_forward``/``loss_backward`` the loss and its gradient down to the model's output (the
    last stage runs them); ``overhead`` the fixed cost per pipeline action assumed by the simulator."""

    device: str
    microbatches: int
    forward: dict[str, float]
    backward: dict[str, float]
    glue_forward: float
    glue_backward: float
    total_forward: float
    total_backward: float
    loss_forward: float = 0.0
    loss_backward: float = 0.0
    overhead: float = CPU_ACTION_OVERHEAD
    peak_memory: int | None = None
    samples: dict[str, Any] = field(default_factory=dict)
