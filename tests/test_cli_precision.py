"""`workbench sensitivity`, `workbench plan` and `workbench overrides` end to end on a tiny model."""
from __future__ import annotations

import json

import pytest

from workbench.cli import main
from workbench.quantize.plan import QuantPlan


def run_json(capsys, *argv):
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return tmp_path_factory.mktemp("ws")


def test_sensitivity_json_lists_every_layer_with_damage_per_precision(capsys, tiny_model_dir, ws):
    out = run_json(capsys, "sensitivity", tiny_model_dir, "--tokens", 256, "--workspace", ws, "--json")
    names = [layer["name"] for layer in out["layers"]]
    assert "model.layers.1.mlp.down_proj" in names and "lm_head" in names
    for layer in out["layers"]:
        assert layer["int8"]["kl"] >= 0 and "ppl_delta" in layer["int4"]
    assert out["trials_run"] == len(out["precisions"]) * len(names) and "int4-lpbq" in out["precisions"]
    again = run_json(capsys, "sensitivity", tiny_model_dir, "--tokens", 256, "--workspace", ws, "--json")
    assert again["trials_run"] == 0 and again["layers"] == out["layers"]
    assert out["score"] == "kl" and out["score_reason"].startswith("auto")
    assert out["scale_search"] is True  # the default, as in the plans Quantize runs
    assert main(["sensitivity", str(tiny_model_dir), "--tokens", "256", "--workspace", str(ws)]) == 0
    text = capsys.readouterr().out
    assert "most sensitive at int4" in text and "score: measured KL (auto:" in text


def test_sensitivity_proxy_score_says_it_is_an_estimate(capsys, tiny_model_dir, ws):
    out = run_json(capsys, "sensitivity", tiny_model_dir, "--tokens", 256, "--score", "proxy", "--workspace", ws,
                   "--json")
    assert out["score"] == "proxy" and "estimated" in out["metric"]
    assert all(layer["int4"]["kl"] > layer["int8"]["kl"] > 0 for layer in out["layers"])
    assert main(["sensitivity", str(tiny_model_dir), "--tokens", "256", "--score", "proxy", "--workspace",
                 str(ws)]) == 0
    assert "score: estimated KL (Fisher proxy) (proxy asked for; read from the workspace)" in capsys.readouterr().out


def test_plan_json_has_measured_and_predicted_figures(capsys, tiny_model_dir, ws, tmp_path):
    out_path = tmp_path / "plan.json"
    out = run_json(capsys, "plan", tiny_model_dir, "--bits-per-weight", 14, "--out", out_path, "--tokens", 256,
                   "--eval-tokens", 512, "--workspace", ws, "--json")
    for key in ("bits_per_weight", "size_bytes", "kl_divergence", "perplexity", "predicted_kl_divergence",
                "predicted_perplexity"):
        assert isinstance(out[key], float | int), key
    assert out["bits_per_weight"] <= 14 and 500 < out["eval_tokens"] < 512
    plan = QuantPlan.load(out_path)
    assert plan.to_dict()["rules"] == out["plan"]["rules"]
    assert out["score"] == "kl" and plan.meta["score"] == "kl"
    assert plan.scale_search is True and out["plan"]["scale_search"] is True  # the sweep's setting, carried
    assert main(["plan", str(tiny_model_dir), "--bits-per-weight", "14", "--out", str(out_path), "--tokens", "256",
                 "--eval-tokens", "512", "--score", "proxy", "--no-scale-search", "--workspace", str(ws)]) == 0
    text = capsys.readouterr().out
    assert "predicted from the sweep's estimated KL (Fisher proxy)" in text and "measured" in text
    assert QuantPlan.load(out_path).scale_search is False


def test_plan_refined_by_measurement_reports_both_kls(capsys, tiny_model_dir, ws, tmp_path):
    out = run_json(capsys, "plan", tiny_model_dir, "--bits-per-weight", 5, "--out", tmp_path / "plan.json",
                   "--tokens", 256, "--eval-tokens", 256, "--refine", 4, "--workspace", ws, "--json")
    ref = out["refinement"]
    assert 0 < ref["trials"] <= 4 and ref["measured_kl"] <= ref["start_kl"]
    assert out["kl_divergence"] == pytest.approx(ref["measured_kl"], rel=1e-6)  # measured on the same tokens
    assert QuantPlan.load(tmp_path / "plan.json").meta["refined_by"] == "measured KL"


@pytest.mark.parametrize("fmt", ["qnn", "ort", "llamacpp", "mnn"])
def test_overrides_for_each_format(capsys, tiny_model_dir, tmp_path, fmt):
    plan_path = QuantPlan.uniform("int8").with_override("*.q_proj", "fp16").save(tmp_path / "plan.json")
    out = run_json(capsys, "overrides", plan_path, "--model", tiny_model_dir, "--format", fmt, "--out",
                   tmp_path / f"out.{fmt}", "--json")
    assert out["tensors"] > 0 and (tmp_path / f"out.{fmt}").is_file()
    if fmt in ("qnn", "ort"):
        assert (tmp_path / "out-onnx" / "prefill.onnx").is_file()


def test_bad_inputs_exit_2_with_one_line(capsys, tiny_model_dir, tmp_path):
    assert main(["overrides", str(tmp_path / "nope.json"), "--model", str(tiny_model_dir), "--format", "mnn",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "plan file" in capsys.readouterr().err
    assert main(["plan", str(tiny_model_dir), "--size", "100", "--out", str(tmp_path / "p.json"), "--tokens", "256",
                 "--workspace", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err
    assert "no plan fits 100 bytes" in err and len(err.strip().splitlines()) == 1


def test_plan_out_that_is_not_a_plan_is_refused_before_the_sweep(capsys, tiny_model_dir, tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    argv = ["plan", str(tiny_model_dir), "--bits-per-weight", "8", "--tokens", "256", "--workspace", str(tmp_path / "ws")]
    assert main([*argv, "--out", str(notes)]) == 2
    err = capsys.readouterr().err
    assert f"--out '{notes}' exists and is not a workbench plan" in err and len(err.strip().splitlines()) == 1
    assert notes.read_text() == '{"mine": true}' and not (tmp_path / "ws").exists()  # no sweep was run
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "is a directory; name the plan JSON file" in capsys.readouterr().err


def test_convert_refuses_an_out_holding_other_files(capsys, tiny_model_dir, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["convert", str(tiny_model_dir), "--bits", "4", "--target", "ort-int4", "--out", str(tmp_path)]) == 2
    assert f"--out '{tmp_path}' is not empty and has no workbench manifest.json" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_plan_for_a_soc_keeps_to_what_its_htp_runs_and_names_the_changes(capsys, tiny_model_dir, ws, tmp_path):
    """At 14 bits/weight the plan keeps layers in fp16; for 8 Gen 1 (HTP v69: no 16-bit weights) it may not, and
    says which layers it changed; 8 Gen 3 (v75) runs them, so nothing changes there."""
    from workbench.quantize.plan import get_precision
    argv = ["plan", tiny_model_dir, "--bits-per-weight", 14, "--tokens", 256, "--eval-tokens", 256, "--workspace", ws]
    free = run_json(capsys, *argv, "--out", tmp_path / "free.json", "--target", "qnn", "--json")
    floats = {n for n, p in free["assignments"].items() if get_precision(p).is_float}
    assert floats and free["soc"] is None
    v69 = run_json(capsys, *argv, "--out", tmp_path / "v69.json", "--soc", "8gen1", "--json")
    plan = QuantPlan.load(tmp_path / "v69.json")
    resolved = plan.resolve(free["assignments"])
    assert all(not get_precision(p).is_float and get_precision(p).bits in (4, 8) for p in resolved.values())
    assert set(v69["soc"]["changed"]) == floats and v69["soc"]["arch"] == 69 and "fp16" not in v69["soc"]["choices"]
    assert all(c["from"] == free["assignments"][n] for n, c in v69["soc"]["changed"].items())
    assert v69["bits_per_weight"] < free["bits_per_weight"] and v69["kl_divergence"] > 0
    v75 = run_json(capsys, *argv, "--out", tmp_path / "v75.json", "--soc", "8gen3", "--json")
    assert v75["soc"]["changed"] == {} and v75["assignments"] == free["assignments"]
    assert main([str(a) for a in argv] + ["--out", str(tmp_path / "t.json"), "--soc", "8gen1"]) == 0
    text = capsys.readouterr().out
    assert "for Snapdragon 8 Gen 1 (soc 36, HTP v69)" in text and f"{sorted(floats)[0]} fp16 -> int" in text
    assert main([str(a) for a in argv] + ["--out", str(tmp_path / "x.json"), "--soc", "rk3588"]) == 2
    assert "has no Hexagon HTP" in capsys.readouterr().err
