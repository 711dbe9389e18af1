"""The automatic plan: optimal under its prediction, within budget, and measured for real."""
from __future__ import annotations

import itertools

import pytest

from workbench.precision.autoplan import (measure_plan, pareto_points, plan_footprint, plan_for_budget, predict_damage,
                                compare_points)
from workbench.errors import PlanError
from workbench.quantize.plan import QuantPlan
from workbench.precision.sensitivity import LayerSensitivity, PlanEvaluator, SensitivityReport, evaluation_tokens, run_sensitivity


@pytest.fixture(scope="module")
def evaluator(lm):
    return PlanEvaluator(lm, evaluation_tokens(lm, tokens=256))


@pytest.fixture(scope="module")
def sens(lm, evaluator):
    return run_sensitivity(lm, evaluator=evaluator, progress=False)


def _synthetic(lm, names, seed=0):
    """A sensitivity report with made-up damages for a few layers (to check the optimiser exactly)."""
    import random
    rng = random.Random(seed)
    layers = []
    for info in lm.layers:
        if info.name in names:
            d8 = rng.uniform(0, 1e-3)
            layers.append(LayerSensitivity(info.name, info.block, info.role, info.shape, info.parameters, info.tied_to,
                                           {"int8": {"kl": d8, "nll_delta": d8},
                                            "int4": {"kl": d8 * rng.uniform(2, 40), "nll_delta": d8 * 3}}))
    return SensitivityReport("tiny", ("int8", "int4"), 256, 256, 128, True, 10.0, layers)


def test_knapsack_matches_brute_force(lm):
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj",
             "model.layers.1.self_attn.v_proj", "model.layers.0.mlp.gate_proj"]
    sens = _synthetic(lm, names)
    others = {info.name: "fp16" for info in lm.layers if info.name not in names}
    full = plan_footprint(lm, QuantPlan(default="fp16"))["size_bytes"]
    low = plan_footprint(lm, QuantPlan(default="fp16", rules=tuple({"pattern": n, "precision": "int4"}
                                                                    for n in names)))["size_bytes"]
    for budget in (int(low + f * (full - low)) for f in (0.2, 0.5, 0.8)):
        best = None
        for combo in itertools.product(("fp16", "int8", "int4"), repeat=len(names)):
            assign = {**others, **dict(zip(names, combo))}
            plan = QuantPlan(default="fp16", rules=tuple({"pattern": n, "precision": p} for n, p in assign.items()))
            if plan_footprint(lm, plan)["size_bytes"] <= budget:
                dmg = predict_damage(sens, assign)["kl_divergence"]
                best = dmg if best is None else min(best, dmg)
        auto = plan_for_budget(lm, sens, size_bytes=budget)
        assert auto.size_bytes <= budget
        assert auto.predicted_kl == pytest.approx(best, rel=1e-9, abs=1e-15)
        assert all(auto.assignments[n] == "fp16" for n in others)


def test_plan_at_int8_size_is_no_worse_than_uniform_int8_predicted(lm, sens):
    int8 = QuantPlan.uniform("int8")
    size = plan_footprint(lm, int8)["size_bytes"]
    auto = plan_for_budget(lm, sens, size_bytes=size)
    assert auto.size_bytes <= size
    assert auto.predicted_kl <= predict_damage(sens, int8.resolve(i.name for i in lm.layers))["kl_divergence"]
    by_bits = plan_for_budget(lm, sens, bits_per_weight=8 * size / lm.parameters)
    assert by_bits.size_bytes <= size
    assert auto.plan.resolve(i.name for i in lm.layers) == auto.assignments
    assert QuantPlan.from_json(auto.plan.to_json()) == auto.plan


def test_impossible_budgets_say_the_smallest_that_fits(lm, sens):
    with pytest.raises(PlanError, match="smallest with fp16/int8/int6/int5/int4/int3/int2/int8-lpbq/int4-lpbq/"
                                        "int4-min/int5-min is"):
        plan_for_budget(lm, sens, size_bytes=1000)
    with pytest.raises(PlanError, match="exactly one budget"):
        plan_for_budget(lm, sens)
    with pytest.raises(PlanError, match="positive"):
        plan_for_budget(lm, sens, bits_per_weight=-1)


def test_measured_plan_reports_prediction_beside_measurement(lm, sens, evaluator):
    size4 = plan_footprint(lm, QuantPlan.uniform("int4"))["size_bytes"]
    auto = plan_for_budget(lm, sens, size_bytes=int(size4 * 1.1))
    point = measure_plan(lm, auto.plan, evaluator, label="auto", prediction=auto)
    fast = evaluator.evaluate(auto.plan)
    assert point.kl_divergence == pytest.approx(fast.kl_divergence, rel=1e-6)
    assert point.predicted_kl == auto.predicted_kl
    assert point.size_bytes == auto.size_bytes and point.bits_per_weight < 16
    d = point.to_dict()
    assert {"kl_divergence", "perplexity", "predicted_kl", "bits_per_weight", "plan"} <= set(d)


def test_pareto_points_cover_uniform_and_automatic_plans(lm, sens, evaluator):
    points = pareto_points(lm, sens, evaluator, budgets=(1.0, 1.3))
    labels = [p.label for p in points]
    assert labels[:2] == ["uniform int8", "uniform int4"]
    autos = [p for p in points if p.label.startswith("auto")]
    assert len(autos) >= 2
    int4 = points[1]
    assert int4.kl_divergence > points[0].kl_divergence
    same_size = min(autos, key=lambda p: p.size_bytes)
    assert same_size.size_bytes <= int4.size_bytes
    diff = compare_points(same_size, int4)
    assert set(diff) == {"mean", "stderr", "windows"}


def test_pareto_figure_plots_measured_and_predicted_points(lm, sens, evaluator):
    from workbench.charts.precision import make_pareto_figure
    size4 = plan_footprint(lm, QuantPlan.uniform("int4"))["size_bytes"]
    auto = plan_for_budget(lm, sens, size_bytes=int(size4 * 1.2))
    points = [measure_plan(lm, QuantPlan.uniform("int4"), evaluator, label="uniform int4"),
              measure_plan(lm, auto.plan, evaluator, label="auto", prediction=auto)]
    fig = make_pareto_figure(points)
    names = [t.name for t in fig.data]
    assert names.count("uniform") == 2 and names.count("auto") == 2 and "auto (predicted)" in names
    kl_trace = next(t for t in fig.data if t.name == "auto" and t.xaxis == "x")
    assert kl_trace.y[0] == pytest.approx(points[1].kl_divergence)
    assert make_pareto_figure([p.to_dict() for p in points], x="size_bytes").data[0].x[0] == \
        pytest.approx(points[0].size_bytes / 1e6)  # MB, as everywhere in the app


@pytest.mark.parametrize("symmetric", [True, False])
def test_plan_estimate_is_the_quantized_models_bits_per_weight(lm, symmetric):
    from workbench.quantize import quantize_model
    # group 48 falls back to 32 on these layers; lm_head is untied from its fp16 embedding by going int8
    plan = (QuantPlan.uniform("int4", group_size=48, symmetric=symmetric).with_override("*.v_proj", "int8")
            .with_override("model.layers.0.mlp.down_proj", "fp16").with_override("lm_head", "int8"))
    qm = quantize_model(lm, plan, progress=False)
    estimate = plan_footprint(lm, plan)["bits_per_weight"]
    assert estimate == qm.bits_per_weight
    assert 4 < estimate < 16
    if symmetric:  # codes and float16 scales: exactly the bytes stored
        assert estimate == pytest.approx(8 * qm.storage_bytes() / qm.parameters, rel=1e-12)


def test_refinement_keeps_the_budget_and_only_accepts_measured_gains(lm, sens, evaluator):
    from workbench.precision.autoplan import refine_plan
    budget = int(1.1 * plan_footprint(lm, QuantPlan.uniform("int4", keep_embeddings="int4"))["size_bytes"])
    auto = plan_for_budget(lm, sens, size_bytes=budget)
    assert len({p for p in auto.assignments.values() if p != "fp16"}) >= 2  # a mixed plan to refine
    ref = refine_plan(lm, sens, auto, evaluator, trials=6, per_round=2)
    assert 0 < ref.trials <= 6 and ref.prediction.size_bytes <= budget
    assert ref.measured_kl <= ref.start_kl
    assert ref.start_kl == pytest.approx(evaluator.evaluate_assignments(auto.assignments).kl_divergence)
    assert ref.measured_kl == pytest.approx(evaluator.evaluate_assignments(ref.prediction.assignments).kl_divergence)
    kls = [m["kl"] for m in ref.moves]
    assert kls == sorted(kls, reverse=True) and all(k < ref.start_kl for k in kls)  # each accepted move helped
    for m in ref.moves:
        assert all(ref.prediction.assignments[n] in ("fp16", *sens.precisions) for n in m["set"])
    unchanged = refine_plan(lm, sens, auto, evaluator, trials=0)
    assert unchanged.prediction.assignments == auto.assignments and unchanged.moves == []


def test_auto_plan_chooses_among_every_registered_precision(lm, sens):
    from workbench.quantize.plan import PRECISIONS
    # all but the fixed 256-weight layouts, which the tiny model's 64-wide layers cannot hold
    assert set(sens.precisions) == {p.name for p in PRECISIONS.values() if not p.is_float and not p.misfit(64)}
    budget = plan_footprint(lm, QuantPlan.uniform("int3", keep_embeddings="int3"))["size_bytes"]
    auto = plan_for_budget(lm, sens, size_bytes=budget)
    assert auto.size_bytes <= budget
    assert {"int2", "int3"} & set(auto.assignments.values())  # below 4 bits a weight on average: int4 alone cannot fit


@pytest.mark.parametrize("precision", ["int4-lpbq", "int8-lpbq", "int3", "int5", "int6", "int2"])
def test_plan_estimate_is_the_stored_bytes_of_every_precision(lm, precision):
    from workbench.quantize import quantize_model
    plan = QuantPlan.uniform(precision, group_size=32).with_override("lm_head", "int8")  # lm_head untied: stored apart
    qm = quantize_model(lm, plan, progress=False)
    estimate = plan_footprint(lm, plan)["bits_per_weight"]
    assert estimate == qm.bits_per_weight
    assert estimate == pytest.approx(8 * qm.storage_bytes() / qm.parameters, rel=1e-12)


def test_auto_plan_keeps_to_what_the_named_targets_carry(lm, sens):
    budget = plan_footprint(lm, QuantPlan.uniform("int4", keep_embeddings="int4"))["size_bytes"]
    free = plan_for_budget(lm, sens, size_bytes=int(1.1 * budget))
    assert set(free.assignments.values()) - {"fp16", "int8", "int4"}  # unrestricted, it takes other precisions
    for targets, allowed in ((("qnn", "llama.cpp"), {"fp16", "int8", "int4"}),
                             (("qnn",), {"fp16", "int8", "int4", "int4-lpbq"}),
                             (("ort-int4",), {"fp16", "int8", "int4", "int2", "int8-lpbq", "int4-lpbq"})):
        auto = plan_for_budget(lm, sens, size_bytes=int(1.1 * budget), targets=targets)
        assert set(auto.assignments.values()) <= allowed and auto.size_bytes <= int(1.1 * budget)
    with pytest.raises(PlanError, match="no precision among .* is carried by every one of qnn"):
        plan_for_budget(lm, sens, size_bytes=budget, choices=("int3",), targets=("qnn",))


def test_auto_plans_round_layers_as_their_sweep_measured_them(lm, sens, evaluator):
    """A plan made from a sweep carries the sweep's group size, symmetry and scale search, so Quantize ships
    the layers the sweep (and refinement) measured; refinement refuses an evaluator that rounds otherwise."""
    import dataclasses

    from workbench.precision.autoplan import refine_plan
    assert sens.scale_search and evaluator.variants.scale_search  # the defaults, as in new plans
    budget = int(1.1 * plan_footprint(lm, QuantPlan.uniform("int4", keep_embeddings="int4"))["size_bytes"])
    for search in (True, False):
        report = dataclasses.replace(sens, scale_search=search)
        auto = plan_for_budget(lm, report, size_bytes=budget)
        assert auto.plan.quantizer_settings == report.quantizer_settings
        assert QuantPlan.from_json(auto.plan.to_json()).scale_search is search
    min_max = dataclasses.replace(sens, scale_search=False)
    with pytest.raises(PlanError, match="evaluator rounds layers with .*scale_search=True"):
        refine_plan(lm, min_max, plan_for_budget(lm, min_max, size_bytes=budget), evaluator, trials=1)


def test_auto_plan_gives_a_block_layout_only_to_layers_it_fits(make_tiny_model):
    """A sweep with int4-k measures it on the 256-wide down projections only; the knapsack and the refinement's
    moves offer it to those layers alone, and the plan quantizes."""
    from workbench.precision.autoplan import refine_plan
    from workbench.model.load import load_model
    from workbench.quantize import quantize_model
    lm = load_model(make_tiny_model("qwen2", hidden=64, intermediate=256))
    ev = PlanEvaluator(lm, evaluation_tokens(lm, tokens=128))
    report = run_sensitivity(lm, evaluator=ev, precisions=("int4", "int4-k", "int8"), progress=False)
    wide = {info.name for info in lm.layers if info.shape[1] == 256}
    floor = plan_footprint(lm, QuantPlan(default="int4", group_size=report.group_size))["size_bytes"]
    for budget in (floor, int(1.3 * floor)):
        auto = plan_for_budget(lm, report, size_bytes=budget, choices=("int4", "int4-k", "int8"))
        assert auto.size_bytes <= budget
        assert {n for n, p in auto.assignments.items() if p == "int4-k"} <= wide
        refined = refine_plan(lm, report, auto, ev, trials=4, choices=("int4", "int4-k", "int8"))
        assert {n for n, p in refined.prediction.assignments.items() if p == "int4-k"} <= wide
        quantize_model(lm, refined.prediction.plan, progress=False)
