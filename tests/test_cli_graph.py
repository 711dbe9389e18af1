"""`workbench export`, `inspect` and `convert` from the command line: JSON fields and one-line errors."""
from __future__ import annotations

import json

import pytest

from workbench.cli import main
from workbench.plan import QuantPlan


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_export_json_reports_parity(tiny_model_dir, tmp_path, capsys):
    assert main(["export", str(tiny_model_dir), "--out", str(tmp_path), "--steps", "8", "--json"]) == 0
    out = _json(capsys)
    assert out["max_abs_diff"] < 1e-4 and out["greedy_match_steps"] == 8
    assert {f["path"].rsplit("/", 1)[-1] for f in out["files"]} == {"prefill.onnx", "decode.onnx"}
    assert all(f["bytes"] > 0 for f in out["files"]) and out["seconds"] > 0
    assert out["weight_names"]["lm_head"] == "lm_head.weight.T"


def test_export_rejects_a_malformed_static_spec(tiny_model_dir, tmp_path, capsys):
    assert main(["export", str(tiny_model_dir), "--out", str(tmp_path), "--static", "128"]) == 2
    assert "--static must be SEQ,PAST" in capsys.readouterr().err


def test_inspect_static_export_for_qnn_and_a_bad_file(tiny_model_dir, tmp_path, capsys):
    assert main(["export", str(tiny_model_dir), "--out", str(tmp_path), "--static", "16,32", "--no-check"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "decode.onnx"), "--target", "qnn", "--json"]) == 0
    report = _json(capsys)
    assert report["ok"] and report["static"] and report["inventory"][0]["count"] > 0
    assert main(["inspect", str(tmp_path / "decode.onnx"), "--target", "rknn"]) == 1  # Neg is not supported
    assert "Neg" in capsys.readouterr().out
    bad = tmp_path / "notes.onnx"
    bad.write_text("not a model")
    assert main(["inspect", str(bad), "--target", "qnn"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("workbench inspect: error:") and "notes.onnx" in err


def test_convert_int4_json_has_the_agreement_fields(tiny_model_dir, tmp_path, capsys):
    assert main(["convert", str(tiny_model_dir), "--bits", "4", "--target", "ort-int4", "--out", str(tmp_path),
                 "--max-tokens", "300", "--ctx", "128", "--json"]) == 0
    out = _json(capsys)
    for key in ("files", "kl_divergence", "top1_agreement", "top1_agreement_vs_simulation", "simulation"):
        assert out[key] is not None, key
    assert out["top1_agreement_vs_simulation"] >= 0.95
    assert any(f["path"].endswith("prefill.onnx") for f in out["files"])


def test_convert_with_a_plan_for_another_model_fails_clearly(tiny_model_dir, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    QuantPlan.uniform("int4").with_override("model.layers.30.mlp.up_proj", "fp16").save(plan)
    assert main(["convert", str(tiny_model_dir), "--plan", str(plan), "--target", "ort-int4",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "model.layers.30.mlp.up_proj" in err and "matches no layer" in err


@pytest.mark.parametrize("argv, message", [
    (["convert", "demo", "--target", "ort-int4", "--out", "x"], "give a plan (--plan PLAN.json) or --bits"),
])
def test_convert_needs_a_plan_for_a_float_model(argv, message, tmp_path, capsys):
    argv = [a if a != "x" else str(tmp_path / "x") for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
