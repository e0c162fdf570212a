"""The names ``pipeviz.hardware`` held before 0.3; the machine table lives in ``pipeviz.cost.machine`` and the
roofline of a capture in ``pipeviz.cost.roofline``. Kept so that imports written against 0.2 work unchanged.

Example:
    >>> from pipeviz.hardware import HARDWARE, Hardware, hardware       # as before
"""

from pipeviz.cost.machine import (
    DTYPE_BYTES,
    DTYPES,
    HARDWARE,
    ROOFLINES,
    Hardware,
    HardwareError,
    dtype_name,
    hardware,
    measure_cpu,
)
from pipeviz.cost.roofline import (
    OpTable,
    forget_kernel_times,
    layer_roofline,
    loss_kernel_times,
    matmul_efficiency,
    op_table,
    op_time,
)

__all__ = ["DTYPES", "DTYPE_BYTES", "HARDWARE", "ROOFLINES", "Hardware", "HardwareError", "OpTable", "dtype_name",
           "forget_kernel_times", "hardware", "layer_roofline", "loss_kernel_times", "matmul_efficiency", "measure_cpu",
           "op_table", "op_time"]
