"""Process memory: read resident memory and its peak, and hand freed heap pages back to the OS.

Quantization allocates and frees many mid-sized tensors; glibc keeps freed pages mapped, so a
process's resident memory climbs well above what is alive at once. Long steps call
:func:`release_freed_memory` between stages; benchmarks and profiles call it before reading a
baseline, then :func:`reset_peak_rss` so the peak read afterwards is their own (Linux).
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["release_freed_memory", "rss_mb", "reset_peak_rss", "settled_rss_mb", "drop_file_pages"]

MADV_DONTNEED = 4  # Linux: the pages leave this process; a file mapping's are read from the file again if touched

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


def _file_mapping(address: int) -> tuple[int, int] | None:
    """The (start, end) of the file-backed mapping in /proc/self/maps holding ``address``; None when it is not one."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                start, end = (int(x, 16) for x in parts[0].split("-"))
                if start <= address < end:
                    path = parts[5].strip() if len(parts) > 5 else ""
                    return (start, end) if path.startswith("/") else None
    except (OSError, ValueError):
        return None
    return None


def drop_file_pages(tensor) -> int:
    """Hand back the resident pages of a tensor that lives in a file mapping (a safetensors checkpoint loaded
    without a copy), for a caller that no longer reads it: releasing the tensor alone leaves them resident, since
    the file stays mapped while any other tensor of it lives. Only whole pages inside the tensor are dropped; heap
    memory is never touched. Returns the bytes dropped (0 where there is nothing to drop, or off Linux)."""
    import mmap
    start = tensor.data_ptr()
    size = tensor.untyped_storage().nbytes() if tensor.is_contiguous() else 0
    if not size or tensor.device.type != "cpu":
        return 0
    span = _file_mapping(start)
    if span is None or start + size > span[1]:
        return 0
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + size) // page * page
    if hi <= lo:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return hi - lo
