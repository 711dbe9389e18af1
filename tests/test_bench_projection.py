import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "projection.py"


def test_bench_prints_every_published_case_and_the_impossible_ones(capsys):
    runpy.run_path(str(BENCH), run_name="__main__")
    out = capsys.readouterr().out
    for case in ("Qwen2.5-1.5B INT8 (QNN)", "Qwen3-1.5B FP16 (TensorRT)", "Qwen3-1.5B INT8 (TensorRT)",
                 "Qwen3-1.5B INT8 (RKNN)", "Qwen2.5-1.5B w4 + some w8 (AI Hub)"):
        assert case in out
    assert "IMPOSSIBLE  Qwen3-1.5B INT8 (RKNN) on RK3588, decode" in out
    assert "IMPOSSIBLE  'a 7B model in 9.3 MB of peak memory'" in out and "> the claimed 0.0093 GB" in out
    assert "efficiency hexagon-htp" in out and "error up to" in out


def test_bench_prints_the_vendor_fits_the_three_model_ones_and_the_reference_chipsets(capsys):
    runpy.run_path(str(BENCH), run_name="__main__")
    out = capsys.readouterr().out
    four, three = out.split("three models (the fewest fitted)")[:2]
    assert "Samsung Galaxy S26       genie" in four and "snapdragon-8-elite-gen-5" in four
    assert "llama.cpp-npu" in three.split("class hexagon-htp")[0] and "RK3576" in three
    assert "= snapdragon-x-elite" in four  # the IQ-X7181 is AI Hub's X Elite, not a board of its own
    marked = [ln for ln in four.splitlines() if "%*" in ln]  # a group past its goal is marked
    assert any("Snapdragon X Elite CRD   genie" in ln for ln in marked)
    for rt in ("genie", "qairt", "llama.cpp-npu", "llama.cpp-gpu", "llama.cpp-cpu"):
        assert f"class hexagon-htp {rt} " in out


def test_bench_residuals_hold_the_decode_errors_against_each_feature(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["projection.py", "--residuals"])
    runpy.run_path(str(BENCH), run_name="__main__")
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    head = next(line for line in lines if "as fitted" in line)  # the decode table's header, after its title
    rows = lines[lines.index(head) + 1:]
    for column in ("as fitted", "+ parts", "+ layers", "lm_head apart", "rate / family"):
        assert column in head
    s25 = next(r for r in rows if r.startswith("Samsung Galaxy S25       genie"))
    assert "llama +" in s25 and "qwen3 -" in s25  # Llama decodes slower than the line through both families
    assert not any(r.startswith("Dragonwing Q-8750") for r in rows)  # a reference-chipset copy is not studied twice
