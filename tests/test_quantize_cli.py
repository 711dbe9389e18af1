"""`workbench quantize`: JSON output with the measured cost and per-layer report; bad input exits 2."""
import json

import pytest

from workbench.cli import main


@pytest.fixture
def heldout(tmp_path):
    from workbench.assets import demo_text_path
    p = tmp_path / "heldout.txt"
    p.write_text(demo_text_path("heldout").read_text(encoding="utf-8")[:3000], encoding="utf-8")
    return p


def test_quantize_json(tiny_model_dir, tmp_path, heldout, capsys):
    out = tmp_path / "q8"
    rc = main(["quantize", str(tiny_model_dir), "--out", str(out), "--bits", "8", "--group-size", "32",
               "--text", str(heldout), "--ctx", "128", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("perplexity", "reference_perplexity", "kl_divergence", "top1_agreement", "bits_per_weight",
                "size_bytes", "perplexity_change_stderr", "kl_divergence_stderr", "nll_difference_stderr"):
        assert isinstance(data[key], float | int), key
    layers = {r["name"]: r for r in data["layers"]}
    assert layers["model.layers.0.self_attn.q_proj"] == {**layers["model.layers.0.self_attn.q_proj"],
                                                         "precision": "int8", "group_size": 32, "fallback": None}
    assert layers["lm_head"]["precision"] == "fp16" and layers["lm_head"]["group_size"] is None
    assert data["size_bytes"] == sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert json.loads((out / "report.json").read_text())["perplexity"] == data["perplexity"]


def test_quantize_table_output_with_a_plan_and_fallback(tiny_model_dir, tmp_path, heldout, capsys):
    from workbench.quantize.plan import QuantPlan
    plan = tmp_path / "plan.json"
    QuantPlan.uniform("int4").with_override("*.down_proj", "int8").save(plan)
    rc = main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q"), "--plan", str(plan),
               "--text", str(heldout), "--ctx", "128"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "group size 128 does not divide 64 input features; using 64" in text
    assert "perplexity" in text and "KL" in text and "top-1 agreement" in text


@pytest.mark.parametrize("extra,message", [
    (["--strict"], "layer 'model.layers.0.self_attn.q_proj': group size 128 does not divide 64"),
    (["--group-size", "-4"], "argument --group-size: must be at least 0, got -4"),  # refused by the parser
])
def test_bad_input_exits_2_with_one_line(tiny_model_dir, tmp_path, heldout, capsys, extra, message):
    try:
        rc = main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q"), "--text", str(heldout),
                   "--ctx", "128", *extra])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_naming_a_missing_layer(tiny_model_dir, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "default": "int4", "rules": [
        {"pattern": "model.layers.7.mlp.up_proj", "precision": "fp16"}]}))
    rc = main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q"), "--plan", str(plan)])
    assert rc == 2
    assert f"plan file '{plan}': rule 'model.layers.7.mlp.up_proj' matches no layer of this model" in \
        capsys.readouterr().err


def _quantize(model_dir, out, heldout, *extra):
    return main(["quantize", str(model_dir), "--out", str(out), "--bits", "8", "--group-size", "32",
                 "--text", str(heldout), "--ctx", "128", "--json", *extra])


def test_out_holding_other_files_is_refused_not_deleted(tiny_model_dir, tmp_path, heldout, capsys):
    out = tmp_path / "d"
    out.mkdir()
    (out / "thesis.txt").write_text("x")
    (out / "quantization.json").write_text("{}")  # a file name alone does not make it a workbench output
    assert _quantize(tiny_model_dir, out, heldout) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"--out '{out}'" in err and "no workbench manifest.json" in err
    assert sorted(p.name for p in out.iterdir()) == ["quantization.json", "thesis.txt"]


def test_earlier_output_is_replaced_but_not_when_a_file_was_added(tiny_model_dir, tmp_path, heldout, capsys):
    out = tmp_path / "q"
    assert _quantize(tiny_model_dir, out, heldout) == 0
    (out / "report.json").write_text("{}")  # changed since written: no longer a complete earlier output
    assert _quantize(tiny_model_dir, out, heldout) == 2
    assert "is incomplete or was changed after it was written ('report.json')" in capsys.readouterr().err
    (out / "report.json").unlink()
    (out / "notes.md").write_text("mine")
    assert _quantize(tiny_model_dir, out, heldout) == 2
    assert "holds files the workbench did not write there (notes.md)" in capsys.readouterr().err
    assert (out / "notes.md").read_text() == "mine"
    (out / "notes.md").unlink()
    assert _quantize(tiny_model_dir, out, heldout, "--asymmetric") == 2  # report.json is still gone: incomplete
    capsys.readouterr()


def test_complete_earlier_output_is_replaced(tiny_model_dir, tmp_path, heldout, capsys):
    out = tmp_path / "q"
    assert _quantize(tiny_model_dir, out, heldout) == 0
    assert _quantize(tiny_model_dir, out, heldout, "--asymmetric") == 0
    capsys.readouterr()
    assert json.loads((out / "plan.json").read_text())["symmetric"] is False
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("failure", [RuntimeError("evaluation broke"), KeyboardInterrupt()])
def test_failed_evaluation_leaves_no_output(tiny_model_dir, tmp_path, heldout, capsys, monkeypatch, failure):
    import workbench.quantize as quantize
    import workbench.files.workspace as workspace

    def broken(*a, **k):
        raise failure
    monkeypatch.setattr(quantize, "measure_cost", broken)
    monkeypatch.setattr(workspace, "DEFAULT_WORKSPACE", tmp_path / "ws")  # where a bug's log goes
    out = tmp_path / "q"
    assert _quantize(tiny_model_dir, out, heldout) in (2, 130)
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "ws") == [heldout.name]  # no --out, no staged dir


@pytest.mark.parametrize("extra, message", [
    (["--ctx", "100000"], "--ctx 100000 is out of range for this model: use 2 to"),
    (["--text", "/nonexistent/heldout.txt"], "does not exist"),
])
def test_bad_evaluation_input_fails_before_quantizing(tiny_model_dir, tmp_path, heldout, capsys, monkeypatch,
                                                     extra, message):
    import workbench.quantize as quantize

    def must_not_run(*a, **k):
        raise AssertionError("quantized before checking the evaluation input")
    monkeypatch.setattr(quantize, "quantize_model", must_not_run)
    out = tmp_path / "q"
    assert _quantize(tiny_model_dir, out, heldout, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_quantize_gptq_records_its_settings_and_loads_back(tiny_model_dir, tmp_path, heldout, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the calibration statistics go to ./workspace there
    out = tmp_path / "gptq"
    rc = main(["quantize", str(tiny_model_dir), "--out", str(out), "--bits", "4", "--group-size", "32",
               "--method", "gptq", "--act-order", "--data", str(heldout), "--samples", "4", "--seq-len", "64",
               "--text", str(heldout), "--ctx", "128", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "gptq" and data["kl_divergence"] > 0
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["method"] == "gptq" and meta["gptq"]["act_order"] is True and meta["gptq"]["tokens"] > 0
    assert main(["eval", str(out), "--text", str(heldout), "--ctx", "128", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] == pytest.approx(data["perplexity"], rel=1e-6)


@pytest.mark.parametrize("args,precision", [(["--bits", "3"], "int3"), (["--bits", "4", "--two-level"], "int4-lpbq"),
                                            (["--bits", "8", "--two-level"], "int8-lpbq")])
def test_quantize_new_widths_and_two_level_scales(tiny_model_dir, tmp_path, heldout, capsys, args, precision):
    out = tmp_path / "q"
    rc = main(["quantize", str(tiny_model_dir), "--out", str(out), *args, "--group-size", "32", "--text", str(heldout),
               "--ctx", "128", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["default"] == precision
    linear = {r["precision"] for r in data["layers"] if r["name"] != "lm_head" and "embed" not in r["name"]}
    assert linear == {precision}
    assert json.loads((out / "quantization.json").read_text())["version"] == 3


def test_two_level_needs_a_width_that_has_it(tiny_model_dir, tmp_path, capsys):
    rc = main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q"), "--bits", "3", "--two-level"])
    assert rc == 2 and "no two-level precision with 3-bit codes is registered (int8-lpbq, int4-lpbq)" in \
        capsys.readouterr().err
    rc = main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q"), "--bits", "4", "--two-level",
               "--asymmetric"])
    assert rc == 2 and "two-level scales, which are symmetric" in capsys.readouterr().err


def test_scale_search_is_on_for_bits_and_a_plan_files_own_otherwise(tmp_path):
    """--bits plans search by default; a plan file keeps its setting (absent: off, as when it was saved);
    --scale-search / --no-scale-search override either."""
    import argparse

    from workbench.cli.quantize import _plan_from_args, add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def plan(*argv):
        return _plan_from_args(parser.parse_args(["demo", "--out", str(tmp_path / "q"), *argv]))
    assert plan("--bits", "4").scale_search is True
    assert plan("--bits", "4", "--no-scale-search").scale_search is False
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": 1, "default": "int4", "rules": []}))
    assert plan("--plan", str(old)).scale_search is False
    assert plan("--plan", str(old), "--scale-search").scale_search is True


def test_rtn_weighs_its_search_by_importance_by_default_and_says_where_it_came_from(tiny_model_dir, tmp_path,
                                                                                  heldout, capsys, monkeypatch):
    """`--bits 4 --method rtn` computes (then reuses) importance statistics from the bundled calibration text
    and says so; --no-importance rounds without them, as does a plan without the scale search."""
    import workbench.files.workspace
    monkeypatch.setattr(workbench.files.workspace, "DEFAULT_WORKSPACE", tmp_path / "ws")  # nothing stored yet
    def run(out, *extra):
        assert main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / out), "--bits", "4", "--group-size",
                     "32", "--method", "rtn", "--text", str(heldout), "--ctx", "128", *extra]) == 0
        return capsys.readouterr().out, json.loads((tmp_path / out / "report.json").read_text())
    out, report = run("first")
    assert "importance from 16 x 256 tokens of the bundled calibration text (computed now" in out
    assert report["importance"].startswith("importance from 16 x 256 tokens")
    out, again = run("second")
    assert "(stored in the workspace;" in out and again["kl_divergence"] == report["kl_divergence"]
    out, plain = run("plain", "--no-importance")
    assert "importance from" not in out and plain["importance"] is None
    out, minmax = run("minmax", "--no-scale-search")
    assert "importance from" not in out and minmax["importance"] is None


def test_target_picks_the_grid_it_holds_and_a_plans_own_targets_do_too(tmp_path):
    """--target qnn (or a plan's meta "targets") rounds on the 15-level grid a device target holds; targets that all
    hold the 16-level grid keep it; --full-range against a device target is refused in one line."""
    import argparse

    from workbench.cli.quantize import _plan_from_args, add_arguments
    from workbench.errors import PlanError
    from workbench.quantize.plan import QuantPlan
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def plan(*argv):
        return _plan_from_args(parser.parse_args(["demo", "--out", str(tmp_path / "q"), *argv]))
    assert plan("--bits", "4").full_range is True
    assert plan("--bits", "4", "--target", "qnn").full_range is False
    assert plan("--bits", "4", "--target", "qnn").meta["targets"] == ["qnn"]
    assert plan("--bits", "4", "--target", "llama.cpp", "--target", "ort-int4").full_range is True
    assert plan("--bits", "4", "--target", "llama.cpp", "--target", "mnn").full_range is False
    with pytest.raises(PlanError, match="--full-range rounds on the 16-level grid, which rknn cannot hold"):
        plan("--bits", "4", "--target", "rknn", "--full-range")
    own = tmp_path / "own.json"
    QuantPlan.default_for("int4", meta={"targets": ["ort-qdq"]}).save(own)
    assert plan("--plan", str(own)).full_range is False
    bad = tmp_path / "bad.json"
    QuantPlan.default_for("int4", meta={"targets": "qnn"}).save(bad)
    with pytest.raises(PlanError, match='meta "targets" must be a list'):
        plan("--plan", str(bad))


def test_quantize_says_which_targets_its_model_reaches(tiny_model_dir, tmp_path, heldout, capsys):
    """The default (16-level grid) reaches llama.cpp / ort-int4 / ort-genai and says how to reach the rest;
    --target qnn writes a model qnn (and every other device target) takes, and says so."""
    from workbench.model.load import load_quantized
    from workbench.targets import check_signed_scales, get_target, quantized_reach
    common = ["--group-size", "32", "--text", str(heldout), "--ctx", "128", "--no-importance"]
    assert main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q16"), "--bits", "4", *common]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.startswith("reaches: "))
    reached = line.removeprefix("reaches: ").split(";")[0].split(", ")
    assert sorted(reached) == ["llama.cpp", "ort-genai", "ort-int4"] and "; not " in line and "--target qnn" in line
    assert main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "qnn"), "--bits", "4", "--target", "qnn",
                 *common, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"qnn", "mnn", "rknn", "ort-qdq", "llama.cpp", "ort-int4"} <= set(data["reaches"])
    assert not data["plan"].get("full_range") and data["unreachable"] == {}
    _, qm = load_quantized(tmp_path / "qnn")
    assert quantized_reach(qm)["qnn"] is None
    check_signed_scales(get_target("qnn"), qm)  # what convert --target qnn checks: passes


def test_a_target_that_cannot_carry_the_plan_is_refused_before_quantizing(tiny_model_dir, tmp_path, capsys):
    from workbench.quantize.plan import QuantPlan
    plan = tmp_path / "p.json"
    QuantPlan.uniform("int3", group_size=32).save(plan)
    assert main(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q"), "--plan", str(plan),
                 "--target", "qnn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot carry precision 'int3'" in err[0]
    assert not (tmp_path / "q").exists()
