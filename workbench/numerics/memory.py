"""Process memory: read resident memory and its peak, and hand freed heap pages back to the OS.

Quantization allocates and frees many mid-sized tensors; glibc keeps freed pages mapped, so a
process's resident memory climbs well above what is alive at once. Long steps call
:func:`release_freed_memory` between stages; benchmarks and profiles call it before reading a
baseline, then :func:`reset_peak_rss` so the peak read afterwards is their own (Linux).
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["release_freed_memory", "rss_mb", "reset_peak_rss", "settled_rss_mb"]

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


def rss_mb(field: str = "VmRSS") -> float | None:
    """Resident memory (``VmRSS``) or its peak (``VmHWM``) in MiB from /proc; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so the next peak read is what follows; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def settled_rss_mb() -> float | None:
    """Resident memory once garbage is collected and free heap pages are handed back, so a peak read
    later counts what a step needs, not what an earlier step left cached in the allocator."""
    import gc
    gc.collect()
    release_freed_memory()
    return rss_mb("VmRSS")
