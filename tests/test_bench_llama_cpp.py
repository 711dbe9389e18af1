"""bench/llama_cpp.py: where llama.cpp is found, and what its absence says."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

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


def write_log_probs(path: Path, tokens, logits, n_ctx: int) -> None:
    """A --kl-divergence-base file as llama-perplexity writes it (step and lowest log-probability, 16-bit codes)."""
    import numpy as np
    n_chunk, n_vocab = len(tokens) // n_ctx, logits.shape[1]
    with open(path, "wb") as f:
        f.write(b"_logits_" + np.array([n_ctx, n_vocab, n_chunk], dtype=np.int32).tobytes())
        f.write(np.asarray(tokens, dtype=np.int32).tobytes())
        for row in logits:
            top, low = row.max(), max(row.min(), row.max() - 16)
            lse = np.log(np.exp(row - top).sum())
            step = (top - low) / 65535
            codes = np.where(row > low, np.rint((row - low) / step), 0).astype(np.uint16)
            f.write(np.array([step, low - top - lse], dtype=np.float32).tobytes())
            f.write(np.pad(codes, (0, n_vocab % 2)).tobytes())


def test_per_token_kl_from_two_log_probability_files(tmp_path):
    import numpy as np
    rng = np.random.default_rng(0)
    n_ctx, n_chunk, n_vocab = 16, 3, 51
    positions = n_chunk * (n_ctx - 1 - n_ctx // 2)
    tokens = rng.integers(0, n_vocab, n_ctx * n_chunk)
    p = rng.normal(0, 3, (positions, n_vocab)).astype(np.float32)
    q = p + rng.normal(0, 0.5, p.shape).astype(np.float32)
    write_log_probs(tmp_path / "p.kld", tokens, p, n_ctx)
    write_log_probs(tmp_path / "q.kld", tokens, q, n_ctx)
    got = llama_cpp.token_kl(tmp_path / "p.kld", tmp_path / "q.kld", block=4)
    lp = p - np.log(np.exp(p).sum(1, keepdims=True))
    lq = q - np.log(np.exp(q).sum(1, keepdims=True))
    exact = (np.exp(lp) * (lp - lq)).sum(1)
    assert got.shape == (positions,) and np.allclose(got, exact, atol=2e-3) and exact.mean() > 0.05
    assert np.allclose(llama_cpp.token_kl(tmp_path / "p.kld", tmp_path / "p.kld"), 0, atol=1e-6)
    d, se = llama_cpp.paired_difference(got, exact)
    assert abs(d) < 1e-3 and se < 1e-3
    write_log_probs(tmp_path / "other.kld", tokens[::-1], q, n_ctx)  # another text
    with pytest.raises(ValueError, match="same tokens"):
        llama_cpp.token_kl(tmp_path / "p.kld", tmp_path / "other.kld")
    (tmp_path / "cut.kld").write_bytes((tmp_path / "q.kld").read_bytes()[:-10])
    with pytest.raises(ValueError, match="partly written"):
        llama_cpp.token_kl(tmp_path / "p.kld", tmp_path / "cut.kld")
    (tmp_path / "x.kld").write_bytes(b"not a file of llama.cpp's")
    with pytest.raises(ValueError, match="not a llama-perplexity"):
        llama_cpp.read_log_probs(tmp_path / "x.kld")


def test_a_paired_difference_is_tighter_than_independent_errors():
    import numpy as np
    rng = np.random.default_rng(1)
    shared = rng.exponential(0.1, 2000)  # both models err most on the same tokens
    a, b = shared * 1.05, shared + rng.normal(0, 0.002, 2000)
    d, se = llama_cpp.paired_difference(a, b)
    unpaired = np.hypot(a.std(ddof=1), b.std(ddof=1)) / np.sqrt(2000)
    assert d == pytest.approx((a - b).mean()) and se < unpaired / 4 and abs(d) > 3 * se
    with pytest.raises(ValueError, match="two tokens"):
        llama_cpp.paired_difference([1.0], [0.5])
