"""Process memory: hand freed heap pages back to the operating system.

Quantization allocates and frees many mid-sized tensors; glibc keeps freed pages mapped, so a
process's resident memory climbs well above what is alive at once. Long steps call
:func:`release_freed_memory` between stages; benchmarks call it before reading a baseline.
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["release_freed_memory"]

_trim = None


def release_freed_memory() -> bool:
    """``malloc_trim(0)`` where the C library has it (glibc); False, doing nothing, elsewhere."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if not _trim:
        return False
    _trim(0)
    return True
