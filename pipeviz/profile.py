"""The names ``pipeviz.profile`` held before 0.3 (``pv.profile``, ``Profile``); they live in
``pipeviz.runtime.profiler``
and ``pipeviz.capture.measured``. Kept so that imports written against 0.2 work unchanged."""

from pipeviz.capture.measured import CPU_ACTION_OVERHEAD, Profile
from pipeviz.runtime.profiler import profile

__all__ = ["CPU_ACTION_OVERHEAD", "Profile", "profile"]
