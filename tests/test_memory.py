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


def test_drop_file_pages_hands_back_a_file_mapped_tensors_pages_and_never_heap_memory(tmp_path):
    """A weight read straight from its safetensors file keeps its pages resident while the file is mapped; dropped,
    they leave the process (read from the file again if touched: the values are unchanged). Heap tensors: 0."""
    import sys

    import torch
    from safetensors.torch import load_file, save_file

    from workbench.numerics.memory import drop_file_pages, rss_mb
    if not sys.platform.startswith("linux"):
        pytest.skip("file mappings are read from /proc/self/maps")
    w = torch.randn(4096, 2048)  # 32 MiB
    save_file({"w": w, "b": torch.ones(3)}, tmp_path / "m.safetensors")
    mapped = load_file(tmp_path / "m.safetensors")["w"]
    assert torch.equal(mapped, w)  # every page touched
    before = rss_mb()
    dropped = drop_file_pages(mapped)  # safetensors maps the file: its tensors are views of that mapping
    assert dropped >= 31 * 2**20 and rss_mb() < before - 24
    assert torch.equal(mapped, w)  # the file gives the same values back
    heap = torch.randn(4096, 2048)
    assert drop_file_pages(heap) == 0 and drop_file_pages(heap[:, :5]) == 0
