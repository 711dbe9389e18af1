"""The override panel without a browser: dropdowns change the plan and totals, rules, undo, evaluate, files."""
from __future__ import annotations

import ipywidgets as widgets
import pytest

from workbench.quantize.plan import QuantPlan
from workbench.precision.sensitivity import PlanEvaluator, evaluation_tokens, run_sensitivity
from workbench.ui.overrides import OverridePanel

Q0 = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def evaluator(lm):
    return PlanEvaluator(lm, evaluation_tokens(lm, tokens=256))


def test_dropdown_changes_plan_and_totals_and_undo_restores(lm, evaluator):
    panel = OverridePanel(lm, evaluator=evaluator)
    before_plan, before = panel.plan, panel.totals
    assert panel.dropdowns[Q0].value == "int8"
    panel.dropdowns[Q0].value = "fp16"  # what a click does
    assert panel.plan.precision_name_for(Q0) == "fp16"
    assert panel.totals["size_bytes"] == before["size_bytes"] + (lm.layer(Q0).bytes_at("fp16") -
                                                                 lm.layer(Q0).bytes_at("int8"))
    assert panel.totals["bits_per_weight"] > before["bits_per_weight"]
    assert f"{panel.totals['size_bytes']:,}" in panel.totals_label.value
    assert panel.undo() and panel.plan == before_plan and panel.totals == before
    assert panel.dropdowns[Q0].value == "int8" and panel.undo_button.disabled


def test_bulk_rule_overrides_earlier_choices_and_bad_patterns_are_refused(lm, evaluator):
    panel = OverridePanel(lm, evaluator=evaluator)
    panel.set_precision(Q0, "int4")
    assert panel.apply_rule("*.q_proj", "fp16")
    assert all(panel.dropdowns[n].value == "fp16" for n in panel.dropdowns if n.endswith("q_proj"))
    # what a rule did is said beside its button (issue 55.9: it was at the bottom of the tab, under the chart)
    assert "*.q_proj:" in panel.rule_note.value and "set to fp16" in panel.rule_note.value
    assert not panel.apply_rule("*.qkv_proj", "fp16")
    assert "rule not applied" in panel.rule_note.value and "#c0392b" in panel.rule_note.value
    assert panel.plan.precision_name_for(Q0) == "fp16"
    panel.undo()
    assert panel.plan.precision_name_for(Q0) == "int4"


def test_evaluate_measures_the_current_plan_and_adds_a_point(lm, evaluator):
    sens = run_sensitivity(lm, evaluator=evaluator, progress=False)
    panel = OverridePanel(lm, evaluator=evaluator, sensitivity=sens)
    first = panel.evaluate()
    panel.apply_rule("*.mlp.*", "int4")
    second = panel.evaluate()
    assert len(panel.points) == 2 and second.kl_divergence > first.kl_divergence
    assert second.kl_divergence == pytest.approx(evaluator.evaluate(panel.plan).kl_divergence)
    assert second.predicted_kl is not None and second.bits_per_weight < first.bits_per_weight
    assert "KL" in panel.result_label.value and not panel.evaluate_button.disabled
    assert len(panel.chart.data) > 0
    uniform = panel.evaluate_uniform()
    assert [p.label for p in uniform] == ["uniform int8", "uniform int4"]


def test_save_and_load_plan(lm, evaluator, tmp_path):
    panel = OverridePanel(lm, evaluator=evaluator)
    panel.apply_rule("*.v_proj", "fp16")
    path = tmp_path / "plan.json"
    panel.save(str(path))
    other = OverridePanel(lm, evaluator=evaluator, plan=QuantPlan.uniform("int4"))
    assert other.load(str(path)) and other.plan == panel.plan
    assert other.dropdowns["model.layers.1.self_attn.v_proj"].value == "fp16"
    assert not other.load(str(tmp_path / "missing.json"))
    assert other.plan == panel.plan


def test_a_proxy_sweep_is_labelled_as_an_estimate(lm, evaluator):
    from workbench.charts.precision import make_sensitivity_figure
    sens = run_sensitivity(lm, evaluator=evaluator, score="proxy", progress=False)
    panel = OverridePanel(lm, evaluator=evaluator, sensitivity=sens)
    assert "est. KL alone at int4" in panel.table.children[0].value
    assert "estimated" in make_sensitivity_figure(sens).layout.title.text
    assert "measured" in make_sensitivity_figure(run_sensitivity(lm, evaluator=evaluator, score="kl",
                                                                 progress=False)).layout.title.text


def test_every_registered_precision_is_offered_and_sized_as_stored(lm, evaluator):
    from workbench.quantize.plan import PRECISIONS
    panel = OverridePanel(lm, evaluator=evaluator)
    offered = {v for _, v in panel.dropdowns[Q0].options}
    assert {p.name for p in PRECISIONS.values() if not p.is_float} | {"fp16"} <= offered
    assert {v for _, v in panel.rule_precision.options} >= {"int3", "int4-lpbq"}
    before = panel.totals
    panel.dropdowns[Q0].value = "int4-lpbq"
    assert panel.plan.precision_name_for(Q0) == "int4-lpbq"
    assert panel.totals["size_bytes"] == before["size_bytes"] + (lm.layer(Q0).bytes_at("int4-lpbq") -
                                                                 lm.layer(Q0).bytes_at("int8"))


def test_each_row_has_int4_int8_fp16_buttons_and_a_menu_for_the_rest(lm, evaluator):
    panel = OverridePanel(lm, evaluator=evaluator)
    row = panel.dropdowns[Q0]
    assert [v for _, v in row.buttons.options] == ["int4", "int8", "fp16"] and row.buttons.value == "int8"
    row.buttons.value = "fp16"  # a click on FP16
    assert panel.plan.precision_name_for(Q0) == "fp16" and row.more.value == ""
    row.more.value = "int3"  # the menu
    assert panel.plan.precision_name_for(Q0) == "int3" and row.buttons.value is None
    assert panel.undo() and row.buttons.value == "fp16"
    assert not any(o[1] in ("int4", "int8", "fp16") for o in row.more.options)
    assert "max_height" not in str(panel.table.layout.max_height or "")  # the whole table, no inner scroll


def test_select_many_by_type_and_block_range_without_a_pattern(lm, evaluator):
    panel = OverridePanel(lm, evaluator=evaluator)
    before = {name: panel.plan.precision_name_for(name) for name in panel.dropdowns}
    n = panel.apply_selection(["v_proj", "down_proj"], (1, 1), "fp16")
    changed = {name for name in panel.dropdowns if panel.plan.precision_name_for(name) != before[name]}
    assert n == 2 and changed == {"model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj"}
    assert panel.undo() and {name: panel.plan.precision_name_for(name) for name in panel.dropdowns} == before
    everything = panel.apply_selection([], (0, 1), "int4")  # no type picked: every type, embedding included
    assert everything == len(lm.layers) and all(d.value == "int4" for d in panel.dropdowns.values())
    assert panel.selected_layers(["embed_tokens"], (0, 0), outside=False) == []
    assert panel.apply_selection(["q_proj"], (5, 9), "fp16") == 0  # the tiny model has blocks 0-1


def test_layer_types_are_ticked_not_ctrl_clicked(lm, evaluator):
    panel = OverridePanel(lm, evaluator=evaluator)
    boxes = panel.select_roles.boxes
    assert {"q_proj", "down_proj"} <= set(boxes) and all(isinstance(b, widgets.Checkbox) for b in boxes.values())
    before = {name: panel.plan.precision_name_for(name) for name in panel.dropdowns}
    boxes["down_proj"].value = True
    panel.select_blocks.value = (0, 0)
    panel.select_precision.value = "fp16"
    panel.select_button.click()
    changed = {name for name in panel.dropdowns if panel.plan.precision_name_for(name) != before[name]}
    assert changed == {"model.layers.0.mlp.down_proj"} and panel.select_roles.value == ("down_proj",)


def test_the_bars_have_a_colour_legend_with_thresholds_and_sizes_are_in_mb(lm, evaluator):
    sens = run_sensitivity(lm, evaluator=evaluator, score="proxy", progress=False)
    panel = OverridePanel(lm, evaluator=evaluator, sensitivity=sens)
    assert "below" in panel.legend.value and "above" in panel.legend.value and "nats per token" in panel.legend.value
    assert "MB = 10<sup>6</sup> bytes" in panel.totals_label.value and "MiB" not in panel.totals_label.value
    assert "bits/weight:" in panel.totals_label.value


def test_the_layer_table_headings_do_not_run_together(lm, evaluator):
    """Issue 55.11: the headings read "parametersKL alone at int4": each now ends with a gap inside its width."""
    panel = OverridePanel(lm, evaluator=evaluator)
    header = panel.table.children[0].value if hasattr(panel.table, "children") else ""
    spans = [s for s in header.split("<span ")[1:]]
    assert len(spans) == 5 and all("padding-right:8px" in s and "box-sizing:border-box" in s for s in spans)
