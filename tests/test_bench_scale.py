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


def test_prune_and_distill_are_steps_and_distill_trains_prunes_output(tmp_path):
    assert scale.parse_steps("distill,prune,info") == ["info", "prune", "distill"]
    assert scale.NEEDS["distill"] == "prune"
    assert scale.format_target(scale.TARGETS["qwen2.5-0.5b"]["prune"]) == "< 5 min, < 6 GB"
    assert scale.format_target(scale.TARGETS["qwen2.5-0.5b"]["distill"]) == "< 10 min, < 8 GB"
    model, shape_dir = tmp_path / "model", tmp_path / "shape"
    prune, _ = scale.step_command("prune", model, shape_dir, None, {})
    assert prune[:2] == ["prune", str(model)] and prune[prune.index("--out") + 1] == str(shape_dir / "pruned")
    assert prune[prune.index("--heads") + 1] == "0.25" and prune[prune.index("--mlp") + 1] == "0.2"
    distill, note = scale.step_command("distill", model, shape_dir, None, {})
    assert distill[:2] == ["distill", str(shape_dir / "pruned")]
    assert distill[distill.index("--teacher") + 1] == str(model)
    assert distill[distill.index("--mode") + 1] == "lora" and distill[distill.index("--steps") + 1] == "8"
    assert "8 steps" in note and {"pruned", "distilled"} <= set(scale.OUTPUTS)


def test_every_step_command_is_one_the_workbench_cli_accepts(tmp_path):
    """The bench's argv parse with the CLI's own parser (a renamed option fails here, not after an hour's run)."""
    from workbench.cli import build_parser
    parser = build_parser()
    for step in scale.STEPS:
        argv, _ = scale.step_command(step, tmp_path / "model", tmp_path / "shape",
                                     type("Args", (), {"plan_bits": 6.0})(), {})
        parser.parse_args(argv)  # exits (SystemExit) on an unknown option
