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
