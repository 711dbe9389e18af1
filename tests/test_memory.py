"""Resident memory readings, the peak reset, and freed heap pages handed back to the OS."""
import platform

import pytest

from workbench.numerics.memory import release_freed_memory, reset_peak_rss, rss_mb


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_pages_between_live_blocks_are_returned():
    blocks = [bytearray(100_000) for _ in range(2000)]  # ~200 MB on the heap (below the mmap threshold)
    keep = blocks[::10]  # every tenth stays alive, so free() alone cannot shrink the heap
    del blocks
    before = rss_mb()
    assert release_freed_memory()
    after = rss_mb()
    assert before - after > 100, (before, after)
    assert len(keep) == 200


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/status")
def test_peak_is_reset_to_what_follows():
    big = bytearray(300_000_000)  # touched below, so resident
    big[::4096] = b"x" * len(big[::4096])
    del big
    release_freed_memory()
    assert rss_mb("VmHWM") - rss_mb("VmRSS") > 200
    if reset_peak_rss():  # some kernels refuse clear_refs; then there is nothing to check
        assert rss_mb("VmHWM") - rss_mb("VmRSS") < 50
