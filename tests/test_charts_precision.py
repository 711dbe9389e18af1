"""charts.precision: the sensitivity bars and the size/damage Pareto plot, from the data given."""
import pytest

from workbench.charts.precision import make_pareto_figure, make_sensitivity_figure

REPORT = {"tokens": 512, "layers": [
    {"name": "model.layers.0.mlp.up_proj", "block": "layers.0", "role": "mlp.up_proj", "damage": {"int4": {"kl": 0.01}}},
    {"name": "model.layers.0.self_attn.q_proj", "block": "layers.0", "role": "self_attn.q_proj",
     "damage": {"int4": {"kl": 0.0}}},
    {"name": "model.layers.1.mlp.up_proj", "block": "layers.1", "role": "mlp.up_proj", "damage": {"int4": {"kl": 0.03}}},
    {"name": "lm_head", "block": "lm_head", "role": "lm_head", "damage": {"int8": {"kl": 0.001}}}]}


def test_sensitivity_bars_by_block_coloured_by_role():
    fig = make_sensitivity_figure(REPORT, "int4")
    by = {t.name: t for t in fig.data}
    assert set(by) == {"mlp.up_proj", "self_attn.q_proj"}  # lm_head has no int4 damage
    assert list(by["mlp.up_proj"].x) == ["layers.0", "layers.1"] and list(by["mlp.up_proj"].y) == [0.01, 0.03]
    assert list(by["self_attn.q_proj"].y) == [1e-12]  # zero damage still shows on a log axis
    assert fig.layout.yaxis.type == "log" and "measured (512 tokens)" in fig.layout.title.text
    linear = make_sensitivity_figure({**REPORT, "score": "proxy"}, "int4", by="role", log_y=False)
    assert {t.name for t in linear.data} == {"layers.0", "layers.1"} and "estimated" in linear.layout.yaxis.title.text
    with pytest.raises(ValueError, match="by must be"):
        make_sensitivity_figure(REPORT, by="layer")


def test_pareto_points_per_kind_with_predictions():
    points = [{"label": "uniform int8", "bits_per_weight": 8.5, "kl_divergence": 0.001, "perplexity": 10.0},
              {"label": "uniform int4", "bits_per_weight": 4.5, "kl_divergence": 0.05, "perplexity": 11.0},
              {"label": "auto 5.0", "bits_per_weight": 5.0, "kl_divergence": 0.01, "perplexity": 10.3,
               "predicted_kl": 0.012, "predicted_perplexity": 10.4}]
    fig = make_pareto_figure(points)
    names = [t.name for t in fig.data]
    assert names == ["uniform", "uniform", "auto", "auto", "auto (predicted)", "auto (predicted)"]
    uniform_kl = fig.data[0]
    assert list(uniform_kl.x) == [4.5, 8.5] and list(uniform_kl.y) == [0.05, 0.001]  # sorted by size
    assert list(fig.data[4].y) == [0.012] and list(fig.data[5].y) == [10.4]
    with pytest.raises(ValueError, match="x must be"):
        make_pareto_figure(points, x="kl")


def test_pareto_points_from_two_evaluations_are_refused_and_the_one_evaluation_is_in_the_title():
    """Issue 55.1: a plan at 27.7 on 255 tokens beside the float model at 54.3 on 4,088 reads as halving perplexity."""
    a = {"label": "plan 1", "bits_per_weight": 7.1, "kl_divergence": 0.003, "perplexity": 27.7, "tokens": 255}
    b = {"label": "uniform int4", "bits_per_weight": 4.5, "kl_divergence": 0.05, "perplexity": 54.45, "tokens": 4088}
    with pytest.raises(ValueError, match="different evaluations"):
        make_pareto_figure([a, b])
    fig = make_pareto_figure([b, {**a, "tokens": 4088}])
    assert "same 4,088 tokens" in fig.layout.title.text


def test_the_float_model_is_drawn_as_the_float_model_not_a_custom_plan():
    rows = [{"label": "float", "size_bytes": 10, "bits_per_weight": 16.0, "kl_divergence": 0.0, "perplexity": 54.3},
            {"label": "uniform int4", "size_bytes": 4, "bits_per_weight": 4.5, "kl_divergence": 0.05,
             "perplexity": 56.0}]
    fig = make_pareto_figure(rows, x="size_bytes")
    names = [t.name for t in fig.data]
    assert "custom" not in names and names.count("float model") == 1  # only on the perplexity panel
    fl = next(t for t in fig.data if t.name == "float model")
    assert fl.xaxis == "x2" and list(fl.y) == [54.3] and fl.marker.symbol != "diamond"
