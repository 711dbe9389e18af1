"""`workbench export`, `inspect` and `convert` from the command line: JSON fields and one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.quantize.plan import QuantPlan


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_export_json_reports_parity(tiny_model_dir, tmp_path, capsys):
    assert main(["export", str(tiny_model_dir), "--out", str(tmp_path), "--steps", "8", "--json"]) == 0
    out = _json(capsys)
    assert out["max_abs_diff"] < 1e-4 and out["greedy_match_steps"] == 8
    assert {f["path"].rsplit("/", 1)[-1] for f in out["files"]} == {"prefill.onnx", "decode.onnx"}
    assert all(f["bytes"] > 0 for f in out["files"]) and out["seconds"] > 0
    assert out["weight_names"]["lm_head"] == "lm_head.weight.T"


def test_export_of_a_model_whose_config_does_not_match_its_weights(tiny_model_dir, tmp_path, capsys):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 8}))
    out = tmp_path / "onnx"
    assert main(["export", str(model), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "do not match the model its config.json describes" in err
    assert str(model) in err and not out.exists()


def test_export_failing_midway_leaves_nothing_in_out(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import workbench.onnx.export as graph

    def broken(paths):
        assert all(p.is_file() for p in paths)  # the graphs were written (staged) before the failure
        raise RuntimeError("check failed")
    import workbench.files.workspace as workspace
    monkeypatch.setattr(graph, "check_graphs", broken)
    monkeypatch.setattr(workspace, "DEFAULT_WORKSPACE", tmp_path / "ws")  # where a bug's log goes
    out = tmp_path / "onnx"
    out.mkdir()
    assert main(["export", str(tiny_model_dir), "--out", str(out), "--steps", "2"]) == 2
    assert "internal error (RuntimeError: check failed)" in capsys.readouterr().err
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "ws"]


def test_export_of_a_model_with_layers_the_graph_does_not_know(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import dataclasses

    import workbench.cli.export as export_cmd
    real = export_cmd.export_onnx

    def with_an_unknown_layer(lm, *args, **kwargs):
        lm.layers.append(dataclasses.replace(lm.layers[0], name="model.adapter.proj"))
        return real(lm, *args, **kwargs)
    monkeypatch.setattr(export_cmd, "export_onnx", with_an_unknown_layer)
    out = tmp_path / "onnx"
    assert main(["export", str(tiny_model_dir), "--out", str(out), "--no-check", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("workbench export: error: the graphs hold no weight for model.adapter.proj")
    assert len(err.strip().splitlines()) == 1 and not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_export_refuses_an_out_holding_other_files(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["export", str(tiny_model_dir), "--out", str(tmp_path), "--steps", "2"]) == 2
    assert f"--out '{tmp_path}' is not empty and has no workbench manifest.json" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    out = tmp_path / "onnx"
    for _ in range(2):  # an earlier export is replaced
        assert main(["export", str(tiny_model_dir), "--out", str(out), "--no-check", "--json"]) == 0
        assert {f["path"] for f in _json(capsys)["files"]} == {str(out / "prefill.onnx"), str(out / "decode.onnx")}
    assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "manifest.json", "prefill.onnx",
                                                     "weight_names.json"]


def test_export_rejects_a_malformed_static_spec(tiny_model_dir, tmp_path, capsys):
    assert main(["export", str(tiny_model_dir), "--out", str(tmp_path), "--static", "128"]) == 2
    assert "--static must be SEQ,PAST" in capsys.readouterr().err


def test_inspect_static_export_for_qnn_and_a_bad_file(tiny_model_dir, tmp_path, capsys):
    assert main(["export", str(tiny_model_dir), "--out", str(tmp_path), "--static", "16,32", "--no-check"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "decode.onnx"), "--target", "qnn", "--json"]) == 0
    report = _json(capsys)
    assert report["ok"] and report["static"] and report["inventory"][0]["count"] > 0
    assert main(["inspect", str(tmp_path / "decode.onnx"), "--target", "rknn"]) == 0  # the toolkit takes Neg
    assert "Mul(x, -1)" not in capsys.readouterr().out  # Neg is listed in the inventory, not flagged
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


def test_conversion_json_names_the_final_directory_not_the_staging_one(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "int4"
    assert main(["convert", str(tiny_model_dir), "--bits", "4", "--target", "ort-int4", "--out", str(out),
                 "--max-tokens", "200", "--ctx", "128", "--json"]) == 0
    capsys.readouterr()
    doc = json.loads((out / "conversion.json").read_text())
    assert doc["out_dir"] == str(out) and ".partial" not in json.dumps(doc)
    assert all(Path(f["path"]).parent == out and Path(f["path"]).is_file() for f in doc["files"])
    assert Path(doc["measured_on"]).is_file()


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
