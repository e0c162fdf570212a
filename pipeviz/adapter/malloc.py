"""Keep large CPU buffers in the heap (glibc), so training steps reuse memory instead of re-faulting it.

By default glibc serves allocations of 128 KiB and more with fresh ``mmap`` pages and returns them on
free, so every backward pass page-faults its gradient buffers again, and a layer's backward time doubles at
random (docs/torch-fixes.md, "What pipeviz fixes"). pipeviz's worker processes (and ``pv.profile``, which must time what
the workers will do) raise the mmap and trim thresholds once; memory freed by tensors then stays in the
process for reuse. No effect off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_heap"]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_done = False


def keep_heap(threshold: int = 1 << 30) -> bool:
    """Apply the setting once per process; returns whether glibc accepted it."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok
