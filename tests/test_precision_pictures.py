"""A VLM's plans measured on pictures: each trial's answer KL given the image over vision, projector and language
layers; the auto plan under a budget spans the three parts; a target's recipe holds the vision parts."""
from __future__ import annotations

import json

import pytest

from workbench.cli import main
from workbench.errors import DataError, PlanError
from workbench.files.workspace import Workspace
from workbench.model.load import load_model
from workbench.model.vision_quality import layer_parts, vision_eval_set
from workbench.precision.autoplan import measure_plan, plan_for_budget
from workbench.precision.pictures import VisionPlanEvaluator
from workbench.precision.sensitivity import LayerVariants, run_sensitivity
from workbench.quantize import quantize_model
from workbench.quantize.plan import QuantPlan, vision_recipe

VISION, PROJECTOR, LANGUAGE = ("model.visual.blocks.2.attn.qkv", "model.visual.merger.mlp.0",
                               "model.language_model.layers.0.self_attn.v_proj")


@pytest.fixture(scope="module")
def vl():
    return load_model("demo-vl")


@pytest.fixture(scope="module")
def evaluator(vl):
    return VisionPlanEvaluator(vl, LayerVariants(vl), vision_eval_set(), questions=6)


@pytest.fixture(scope="module")
def sweep(vl, tmp_path_factory):
    ws = Workspace(tmp_path_factory.mktemp("ws"))
    return ws, run_sensitivity(vl, layers=[VISION, PROJECTOR, LANGUAGE], precisions=("int8", "int4"), questions=6,
                               workspace=ws, progress=False)


def test_a_trial_is_the_quantized_models_answer_kl_given_the_picture(vl, evaluator):
    base = evaluator.evaluate_baseline()
    assert base.kl_divergence == pytest.approx(0, abs=1e-9) and base.samples == 6
    assert base.perplexity == pytest.approx(base.reference_perplexity)
    swapped = evaluator.evaluate_assignments({PROJECTOR: "int4"})
    assert swapped.kl_divergence > 1e-7 and swapped.tokens == base.tokens
    # the same layer rounded by quantize_model and built from its codes: the same damage
    plan = QuantPlan(default=None, rules=({"pattern": PROJECTOR, "precision": "int4"},),
                     **evaluator.variants.settings.quantizer_settings)
    built = evaluator.evaluate_model(quantize_model(vl, plan, progress=False).build_model())
    assert built.kl_divergence == pytest.approx(swapped.kl_divergence, rel=1e-3)


def test_the_sweep_measures_every_part_on_pictures(sweep):
    ws, report = sweep
    assert report.score == "kl" and "questions about pictures" in report.measured_on
    assert [layer.name for layer in report.layers] == [VISION, PROJECTOR, LANGUAGE]
    for name in (VISION, PROJECTOR, LANGUAGE):
        assert report.damage(name, "int4") > report.damage(name, "int8") > 0
    assert report.to_dict()["measured_on"] == report.measured_on


def test_the_sweep_is_cached_with_its_pictures(vl, sweep):
    ws, report = sweep
    again = run_sensitivity(vl, layers=[VISION, PROJECTOR, LANGUAGE], precisions=("int8", "int4"), questions=6,
                            workspace=ws, progress=False)
    assert again.trials_run == 0 and again.damage(VISION, "int4") == report.damage(VISION, "int4")
    fewer = run_sensitivity(vl, layers=[VISION], precisions=("int4",), questions=3, workspace=ws, progress=False)
    assert fewer.trials_run == 1  # other questions: measured again


def test_refusals(vl, lm, tmp_path):
    with pytest.raises(PlanError, match="proxy"):
        run_sensitivity(vl, layers=[VISION], precisions=("int4",), score="proxy", progress=False)
    with pytest.raises(DataError, match="text model"):
        run_sensitivity(lm, images=tmp_path, progress=False)
    with pytest.raises(DataError, match="not both"):
        run_sensitivity(vl, text_path="x.txt", images=tmp_path, progress=False)
    with pytest.raises(DataError, match="not a vision-language model"):
        VisionPlanEvaluator(lm, LayerVariants(lm))


def test_the_auto_plan_spans_the_parts_and_is_measured_on_pictures(vl, sweep, evaluator):
    _, report = sweep
    parts = layer_parts(vl)
    swept = {VISION, PROJECTOR, LANGUAGE}
    full = vl.size_bytes(QuantPlan(default=None, rules=tuple({"pattern": n, "precision": "fp16"} for n in swept)))
    int4 = QuantPlan(default="fp16", rules=tuple({"pattern": n, "precision": "int4"} for n in swept))
    auto = plan_for_budget(vl, report, size_bytes=int(vl.size_bytes(int4)) + 1, choices=("fp16", "int8", "int4"))
    assert {parts[n] for n in swept} == {"vision encoder", "projector", "language model"}
    assert all(auto.assignments[n] == "int4" for n in swept)  # the tightest budget: every swept layer at int4
    roomy = plan_for_budget(vl, report, size_bytes=full, choices=("fp16", "int8", "int4"))
    assert all(roomy.assignments[n] == "fp16" for n in swept)
    point = measure_plan(vl, auto.plan, evaluator, label="auto", prediction=auto)
    assert point.kl_divergence > 0 and point.tokens == evaluator.evaluate_baseline().tokens


def test_a_targets_recipe_holds_the_vision_parts(vl, sweep):
    _, report = sweep
    recipe = vision_recipe("mnn", vl.config.model_type)
    fixed = {VISION: recipe.vision, PROJECTOR: recipe.projector}
    budget = vl.size_bytes(QuantPlan(default="fp16", rules=({"pattern": LANGUAGE, "precision": "int8"},
                                                          *({"pattern": n, "precision": "int4"} for n in fixed))))
    auto = plan_for_budget(vl, report, size_bytes=budget, choices=("fp16", "int8", "int4"), fixed=fixed)
    assert auto.assignments[VISION] == auto.assignments[PROJECTOR] == "int4"
    assert auto.assignments[LANGUAGE] == "int8"
    with pytest.raises(PlanError, match="not quantizable layers"):
        plan_for_budget(vl, report, size_bytes=budget, fixed={"model.nothing": "int4"})


def test_cli_sensitivity_of_a_vlm_on_pictures(tmp_path, capsys):
    assert main(["sensitivity", "demo-vl", "--precisions", "int4", "--questions", "2", "--workspace",
                 str(tmp_path / "ws"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "questions about pictures" in out["measured_on"]
    assert {layer["part"] for layer in out["layers"]} == {"vision encoder", "projector", "language model"}
    assert all(layer["int4"]["kl"] >= 0 for layer in out["layers"])
    assert main(["sensitivity", "demo-vl", "--precisions", "int4", "--questions", "2", "--workers", "2",
                 "--workspace", str(tmp_path / "ws")]) == 2
    assert "in this process" in capsys.readouterr().err


def test_cli_plan_preset_on_a_vlm_holds_qualcomms_vision_recipe(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    assert main(["plan", "demo-vl", "--preset", "qualcomm-w4a16", "--out", str(out_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parts"]["vision encoder"] == {"int8": 15} and out["parts"]["projector"] == {"int8": 2}
    assert out["parts"]["language model"]["int4"] == 14 and out["vision_recipe"]["vision"] == "int8"
    plan = QuantPlan.load(out_path)
    assert plan.meta["vision_recipe"]["runtime"].startswith("Qualcomm") and plan.group_size is None
    assert main(["plan", "demo", "--preset", "qualcomm-w4a16", "--mmproj", "q8_0", "--out",
                 str(tmp_path / "p2.json")]) == 2
    assert "text model" in capsys.readouterr().err


def test_cli_plan_images_on_a_text_model_is_one_line_exit_2(tmp_path, capsys):
    assert main(["plan", "demo", "--preset", "qualcomm-w4a16", "--images", str(tmp_path), "--out",
                 str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "text model" in err


def test_quantize_for_a_target_takes_its_vision_recipe(tmp_path, capsys):
    """`quantize --target`: a VLM's vision parts follow the target's recipe unless --vision-bits / --projector-bits
    are given."""
    import argparse

    from workbench.cli import quantize as quantize_cmd
    p = argparse.ArgumentParser()
    quantize_cmd.add_arguments(p)
    args = p.parse_args(["demo-vl", "--bits", "4", "--out", str(tmp_path / "q"), "--no-importance", "--json",
                         "--target", "mnn"])
    assert quantize_cmd.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    precisions = {layer["name"]: layer["precision"] for layer in out["layers"]}
    assert precisions[PROJECTOR] == precisions[VISION] == "int4"  # MNN: int4 visual for Qwen2.5-VL
    assert out["plan"]["meta"]["vision_recipe"]["runtime"].startswith("MNN") and out["vision"]["answer_kl"] > 0
    args = p.parse_args(["demo-vl", "--bits", "4", "--out", str(tmp_path / "q2"), "--no-importance", "--json",
                         "--vision-bits", "16", "--target", "mnn"])
    assert quantize_cmd.run(args) == 0
    precisions = {layer["name"]: layer["precision"] for layer in json.loads(capsys.readouterr().out)["layers"]}
    assert precisions[VISION] is None and precisions[PROJECTOR] is None  # asked for: left unquantized
