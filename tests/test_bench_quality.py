import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quality.py"
quality = runpy.run_path(str(BENCH))

# the summary llama-perplexity --kl-divergence printed for the demo model's Q4_K_M (trimmed)
KL_OUTPUT = """
====== Perplexity statistics ======
Mean PPL(Q)                   :  59.080338 ±   1.582189
Mean PPL(base)                :  59.109920 ±   1.584074
====== KL divergence statistics ======
Mean    KLD:   0.002728 ±   0.000020
Maximum KLD:   0.041533
====== Token probability statistics ======
Same top p: 95.604 ± 0.191 %
"""


def test_parses_llama_perplexity_summaries():
    got = quality["parse_kl"](KL_OUTPUT)
    assert got["kl"] == 0.002728 and got["kl_se"] == 0.00002
    assert got["perplexity"] == pytest.approx(59.080338) and got["same_top"] == pytest.approx(0.95604)
    assert quality["parse_perplexity"]("... Final estimate: PPL = 59.1100 +/- 1.58408") == 59.11
    with pytest.raises(ValueError, match="no KL summary nor the last chunk's row"):
        quality["parse_kl"]("Mean PPL(Q) : 1 ± 2")


def test_a_lost_summary_is_read_from_the_last_chunks_row():
    """llama.cpp's logger can lose the summary at exit; the table's last row holds the same running means."""
    table = """kl_divergence: computing over 2 chunks, n_ctx=256, batch_size=2048, n_seq=8
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      56.0410 ±    1.5545       0.00032 ±    0.00037       0.00072 ±    0.00001     0.477 ±  0.008 %    97.732 ±  0.144 %
   2      58.8083 ±    1.5849       0.00027 ±    0.00036       0.00071 ±    0.00002     0.471 ±  0.008 %    97.673 ±  0.141 %
"""
    got = quality["parse_kl"](table)
    assert got["kl"] == 0.00071 and got["kl_se"] == 0.00002 and got["from_table"]
    assert got["perplexity"] == 58.8083 and got["same_top"] == pytest.approx(0.97673)
    with pytest.raises(ValueError, match="last chunk's row"):  # the last chunk's row lost too: run it again
        quality["parse_kl"](table.rsplit("   2 ", 1)[0])


def test_gguf_bits_count_every_tensor():
    class T:
        def __init__(self, n_bytes, n_elements):
            self.n_bytes, self.n_elements = n_bytes, n_elements

    class Reader:
        tensors = [T(1024, 256), T(18432, 32768)]  # an f32 norm and a Q4_K matrix (4.5 bits)
    assert quality["gguf_bits_per_weight"](Reader()) == pytest.approx(8 * 19456 / 33024)


def test_incomplete_llama_cpp_tree_is_named(tmp_path):
    with pytest.raises(SystemExit, match="not found in .*llama-quantize / llama-perplexity"):
        quality["LlamaCpp"].find(str(tmp_path))


def test_without_llama_cpp_the_bench_plans_each_size_and_says_so(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setattr(sys, "argv", ["quality.py", "--model", str(tiny_model_dir), "--sizes", "5.0,9.0",
                                      "--configs", "32s", "--ctx", "64", "--sweep-tokens", "256", "--threads", "1",
                                      "--samples", "8", "--seq-len", "64"])
    runpy.run_path(str(BENCH), run_name="__main__")
    out = capsys.readouterr().out
    assert "llama.cpp: not found" in out and "(llama.cpp absent)" in out
    rows = [ln for ln in out.splitlines() if "(llama.cpp absent)" in ln]
    assert len(rows) == 2
    assert "g32 sym" in rows[1]  # 9 bits/weight always fits; each plan's size is within its budget
    for ln in rows:
        if "g32 sym" in ln:
            size, bits = float(ln.split()[0]), float(ln.split("sym")[1].split()[0])
            assert bits <= size
