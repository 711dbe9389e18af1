"""bench/scale.py's pure helpers: step/shape parsing, error lines, targets."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "scale.py"
_spec = importlib.util.spec_from_file_location("bench_scale", _PATH)
scale = importlib.util.module_from_spec(_spec)
sys.modules["bench_scale"] = scale
_spec.loader.exec_module(scale)


def test_parse_steps_keeps_pipeline_order_and_expands_aliases():
    assert scale.parse_steps(None) == list(scale.STEPS)
    assert scale.parse_steps("convert,load,quantize") == ["info", "quantize-rtn", "quantize-awq", "quantize-gptq",
                                                          "convert"]
    assert scale.parse_steps("gptq") == ["quantize-gptq"]
    with pytest.raises(ValueError, match="unknown step"):
        scale.parse_steps("info,bogus")


def test_parse_shapes():
    assert scale.parse_shapes(None) == ["qwen2.5-0.5b"]
    assert scale.parse_shapes("qwen3-4b, qwen2.5-0.5b") == ["qwen3-4b", "qwen2.5-0.5b"]
    assert scale.parse_shapes("x", all_shapes=True) == list(scale.SCALE_SHAPES)
    with pytest.raises(ValueError, match="unknown shape"):
        scale.parse_shapes("qwen9")


def test_last_error_line_prefers_the_error_over_later_noise():
    assert scale.last_error_line("progress 10%\rprogress 100%\nworkbench plan: error: no plan fits\n") == \
        "workbench plan: error: no plan fits"
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nRuntimeError: bad alloc\n'
    assert scale.last_error_line("", tb) == "RuntimeError: bad alloc"
    assert scale.last_error_line("", "") == ""


def test_targets():
    t = scale.TARGETS["qwen2.5-0.5b"]["quantize-rtn"]
    assert scale.format_target(t) == "< 3 min, < 4 GB"
    assert scale.format_target(scale.TARGETS["qwen3-4b"]["convert"]) == "completes, < 20 GB"
    ok = {"status": "ok", "seconds": 100.0, "peak_mb": 3000.0}
    assert scale.target_met(ok, t) is True
    assert scale.target_met({**ok, "peak_mb": 4.5 * 1024}, t) is False
    assert scale.target_met({**ok, "seconds": 200.0}, t) is False
    assert scale.target_met({**ok, "status": "FAILED (exit 2): x"}, t) is False
    assert scale.target_met(ok, None) is None


def test_combined_row_sums_seconds_and_takes_the_larger_peak():
    rows = [{"step": "sensitivity", "status": "ok", "seconds": 10.0, "peak_mb": 900.0},
            {"step": "plan", "status": "ok", "seconds": 5.0, "peak_mb": 1200.0}]
    row = scale.combined_row(rows, ("sensitivity", "plan"), "sensitivity+plan")
    assert (row["status"], row["seconds"], row["peak_mb"]) == ("ok", 15.0, 1200.0)
    assert scale.combined_row(rows[:1], ("sensitivity", "plan"), "x") is None
