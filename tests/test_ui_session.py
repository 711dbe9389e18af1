"""ui.session: the state every tab shares: a new model starts over, a quantized model is saved by its plan's hash."""
from workbench.quantize.plan import QuantPlan
from workbench.quantize import quantize_model
from workbench.ui.session import AppSession, describe_plan


def test_a_model_starts_over_and_a_quantized_model_is_saved_under_its_plan(lm, tmp_path, workspace):
    s = AppSession(out_dir=tmp_path / "run", workspace=workspace)
    assert s.conversion_dir == tmp_path / "run" / "convert" / "not-quantized"
    s.set_model(lm)
    assert s.plan == QuantPlan.uniform("int4") and s.quantized is None and s.conversions == []
    plan = QuantPlan.uniform("int8")
    qm = quantize_model(lm, plan, progress=False)
    path = s.set_quantized(qm)
    assert path == tmp_path / "run" / "quantized" / f"rtn-{plan.content_hash()}" and (path / "manifest.json").is_file()
    assert s.quantized is qm and s.plan == plan and s.quantized_is_current
    assert s.conversion_dir == tmp_path / "run" / "convert" / path.name
    info = s.plan_info()
    assert info["hash"] == plan.content_hash() and info["bits_per_weight"] > 8  # int8 codes plus their scales
    assert f"plan {plan.content_hash()} (RTN, g" in s.describe() and "bits/w" in s.describe()
    s.plan = QuantPlan.uniform("int4")
    assert not s.quantized_is_current
    s.set_model(lm)  # a model loaded again: nothing quantized, converted or profiled is kept
    assert s.quantized is None and s.quantized_path is None and s.profiles == []


def test_a_plan_is_named_by_its_content_not_its_meta():
    plan = QuantPlan.uniform("int4")
    renamed = QuantPlan.from_dict({**plan.to_dict(), "meta": {"label": "another name"}})
    assert renamed.content_hash() == plan.content_hash() != QuantPlan.uniform("int8").content_hash()
    assert describe_plan(plan) == f"uniform INT4, plan {plan.content_hash()} (RTN, g{plan.group_size})"


def test_a_plan_is_called_by_what_it_does_and_its_bits_per_weight_say_why(tiny_model_dir):
    """Issue 55.10: plan hashes where a name would do; "7.09 bits/w" for "uniform INT4" with no reason."""
    from workbench.model.load import load_model
    lm = load_model(tiny_model_dir)
    plan = QuantPlan.uniform("int4")
    text = describe_plan(plan, lm)
    assert text.startswith("uniform INT4, plan ") and "kept at FP16 hold" in text and "embed_tokens" in text
    mixed = plan.with_override(lm.layers[1].name, "int8")
    assert describe_plan(mixed, lm).startswith("mixed INT4 / INT8, plan ")
