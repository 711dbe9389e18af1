"""release_freed_memory hands freed heap pages in the middle of the heap back to the OS."""
import platform

import pytest

from workbench.memory import release_freed_memory


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_pages_between_live_blocks_are_returned():
    blocks = [bytearray(100_000) for _ in range(2000)]  # ~200 MB on the heap (below the mmap threshold)
    keep = blocks[::10]  # every tenth stays alive, so free() alone cannot shrink the heap
    del blocks
    before = _rss_mb()
    assert release_freed_memory()
    after = _rss_mb()
    assert before - after > 100, (before, after)
    assert len(keep) == 200
