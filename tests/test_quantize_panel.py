"""The quantization panel and its figures, headless."""
import pytest

from workbench.charts.quantize import make_cost_table_figure, make_layer_error_figure
from workbench.model.load import load_model
from workbench.quantize.plan import QuantPlan
from workbench.ui.quantize import QuantizePanel


@pytest.fixture
def heldout(tmp_path):
    from workbench.assets import demo_text_path
    p = tmp_path / "heldout.txt"
    p.write_text(demo_text_path("heldout").read_text(encoding="utf-8")[:2500], encoding="utf-8")
    return p


def test_panel_runs_and_accumulates_rows(tiny_model_dir, heldout):
    lm = load_model(tiny_model_dir)
    panel = QuantizePanel(lm, bits=8, group_size=32, text=heldout)
    cost = panel.run()
    assert panel.error is None and cost is not None and cost.kl_divergence >= 0
    panel.bits.value = 4
    panel.run()
    assert [r["label"] for r in panel.rows] == ["float (reference)", "INT8 RTN g32", "INT4 RTN g32"]
    assert panel.rows[2]["kl_divergence"] > panel.rows[1]["kl_divergence"]
    assert set(panel.figures) == {"cost", "errors"}
    assert not panel.run_button.disabled


def test_panel_shows_errors_instead_of_raising(tiny_model_dir, heldout):
    lm = load_model(tiny_model_dir)
    plan = QuantPlan.uniform("int4").with_override("model.layers.9.mlp.up_proj", "fp16")
    panel = QuantizePanel(lm, plan=plan, group_size=32, text=heldout)
    assert panel.bits.value == "plan"
    assert panel.run() is None
    assert "matches no layer" in panel.error and "error" in panel.status.value


def test_figures():
    layers = [{"name": "a.q_proj", "precision": "int4", "group_size": 128, "fallback": None, "weight_error": 0.1},
              {"name": "a.k_proj", "precision": "int8", "group_size": 32, "fallback": "group size 128 ...",
               "weight_error": 0.01},
              {"name": "lm_head", "precision": "fp16", "group_size": None, "fallback": None, "weight_error": None}]
    fig = make_layer_error_figure(layers)
    assert [t.name for t in fig.data] == ["int4", "int8", "fp16"]
    assert list(fig.data[0].y) == [0.1]
    table = make_cost_table_figure([{"label": "float", "perplexity": 10.0},
                                    {"label": "INT4", "perplexity": 10.5, "perplexity_change": 0.5,
                                     "perplexity_change_stderr": 0.1, "kl_divergence": 0.01,
                                     "kl_divergence_stderr": 0.001, "top1_agreement": 0.9, "bits_per_weight": 4.1,
                                     "size_bytes": 2e6, "seconds": 1.0}])
    cells = table.data[0].cells.values
    assert tuple(cells[0]) == ("float", "INT4")
    assert tuple(cells[2]) == ("-", "+0.500 ± 0.100")
    assert tuple(cells[3]) == ("-", "0.01000 ± 0.00100")


def test_a_plans_settings_are_not_reset_to_the_widget_defaults(tiny_model_dir):
    from dataclasses import replace
    lm = load_model(tiny_model_dir)
    plan = replace(QuantPlan.uniform("int4"), group_size=32, symmetric=False, method="awq", scale_search=False)
    panel = QuantizePanel(lm, plan=plan)
    assert (panel.method.value, panel.group_size.value, panel.symmetric.value) == ("awq", 32, False)
    assert panel.scale_search.value is False and panel.current_plan() == plan
    panel.scale_search.value = True
    assert panel.current_plan() == replace(plan, scale_search=True)
    assert QuantizePanel(lm).current_plan().scale_search is True  # no plan: the default
    odd = replace(plan, group_size=96)  # a group size the dropdown does not list is added, not replaced
    assert QuantizePanel(lm, plan=odd).current_plan() == odd


def test_eval_tokens_start_the_comparison_again(tiny_model_dir, heldout):
    lm = load_model(tiny_model_dir)
    panel = QuantizePanel(lm, bits=8, group_size=32, text=heldout, max_tokens=300)
    assert panel.run().tokens < 300
    panel.eval_tokens.value = 0  # the whole text: a new reference, and the rows start over
    cost = panel.run()
    assert cost.tokens > 300 and [r["label"] for r in panel.rows] == ["float (reference)", "INT8 RTN g32"]


def test_panel_offers_every_registered_integer_precision(tiny_model_dir):
    lm = load_model(tiny_model_dir)
    panel = QuantizePanel(lm, bits=4, group_size=32)
    values = [v for _, v in panel.bits.options]
    assert values[:2] == [4, 8] and {2, 3, 5, 6, "int4-lpbq", "int8-lpbq"} <= set(values)
    panel.bits.value = "int4-lpbq"
    assert panel.current_plan().default == "int4-lpbq" and panel.current_plan().group_size == 32
    panel.bits.value = 3
    assert panel.current_plan().default == "int3"


def test_rtn_reads_importance_and_the_16_level_grid_is_a_checkbox(tiny_model_dir, heldout, workspace):
    """The panel rounds as `workbench quantize` does by default (the scale search weighed by importance
    statistics, computed into the workspace); "16 levels" is the full-range grid, dropped for asymmetric codes."""
    lm = load_model(tiny_model_dir)
    panel = QuantizePanel(lm, bits=4, group_size=32, text=heldout, workspace=workspace)
    assert panel.current_plan().full_range is False and panel.current_plan().scale_search is True
    assert panel.run() is not None and panel.error is None
    assert list(workspace.root.glob("calibrate/*")), "the importance statistics were not computed"
    panel.full_range.value = True
    assert panel.current_plan().full_range is True
    assert panel.run() is not None and panel.rows[-1]["label"] == "INT4 RTN g32 16-level"
    panel.symmetric.value = False
    assert panel.current_plan().full_range is False
