"""bench/llama_cpp.py: where llama.cpp is found, and what its absence says."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import llama_cpp  # noqa: E402  (bench/llama_cpp.py)

BINARIES = ("llama-bench", "llama-quantize")


def test_location_and_absence(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    assert llama_cpp.find_bin(None, BINARIES)[0] is None
    assert "not given" in llama_cpp.find_bin(None, BINARIES)[1]
    assert "not found in" in llama_cpp.find_bin(str(tmp_path), BINARIES)[1]
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in BINARIES:
        (bin_dir / name).write_text("")
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))
    assert llama_cpp.find_bin(None, BINARIES) == (bin_dir, "")
    assert llama_cpp.find_bin(str(bin_dir), BINARIES) == (bin_dir, "")  # the bin folder itself is fine too
    assert "llama-perplexity" in llama_cpp.find_bin(None, ("llama-perplexity",))[1]
    assert llama_cpp.source_root(bin_dir) is None  # no source tree above it
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    (tmp_path / "gguf-py").mkdir()
    assert llama_cpp.source_root(bin_dir) == tmp_path
