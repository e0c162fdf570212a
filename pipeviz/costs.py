"""The names ``pipeviz.costs`` held before 0.3; the cost model lives in ``pipeviz.cost`` (its modules: ``options``,
``model``, ``comm``, ``memory``, ``machine``, ...). Kept so that imports written against 0.2 work unchanged.

Example:
    >>> from pipeviz.costs import CostOptions, stage_costs, memory_per_rank     # as before
"""

from pipeviz.cost.comm import (
    DDP_BUCKET_BYTES,
    all_reduce_time,
    attention_kv_bytes,
    backend_link,
    cp_collectives,
    ddp_buckets,
    tp_all_reduces,
    tp_collectives,
)
from pipeviz.cost.machine import FLOPS_PER_S, LINKS
from pipeviz.cost.memory import (
    in_flight,
    memory_per_rank,
    peak_activations,
    plan_stage_memory,
    stage_bytes,
    stage_info_memory,
    static_memory,
)
from pipeviz.cost.model import (
    BACKWARD_PER_FORWARD,
    Costs,
    layer_activation_bytes,
    layer_times,
    measured_here,
    parallel_costs,
    stage_costs,
    time_source,
)
from pipeviz.cost.options import OPTIMIZER_STATES, RECOMPUTE, CostOptions

# 0.2's names for what 0.3 calls by one meaning each (SplitPlan.stage_memory is a plan's memory per stage;
# CostOptions.link and Hardware.link a link across a span of devices).
link = backend_link
stage_memory = stage_bytes

__all__ = ["BACKWARD_PER_FORWARD", "DDP_BUCKET_BYTES", "FLOPS_PER_S", "LINKS", "OPTIMIZER_STATES", "RECOMPUTE",
           "CostOptions", "Costs", "all_reduce_time", "attention_kv_bytes", "cp_collectives", "ddp_buckets",
           "in_flight", "layer_activation_bytes", "layer_times", "link", "measured_here", "memory_per_rank",
           "parallel_costs", "peak_activations", "plan_stage_memory", "stage_costs", "stage_info_memory",
           "stage_memory", "static_memory", "time_source", "tp_all_reduces", "tp_collectives"]
