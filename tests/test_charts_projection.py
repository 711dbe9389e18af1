"""Projection figures draw exactly what workbench.run.profile and workbench.devices.projection computed."""
import pytest

from workbench.charts.checks import check_figures
from workbench.charts.projection import (NO_FIT, make_device_figure, make_host_bound_figure,
                                         make_speed_pareto_figure, make_vendor_fit_figure, pareto_optimal)
from workbench.errors import WorkbenchError
from workbench.quantize.plan import QuantPlan
from workbench.run.profile import RuntimeProfile
from workbench.devices.projection import project_plans

PLANS = {"fp16": QuantPlan.uniform("fp16"), "int8": QuantPlan.uniform("int8", keep_embeddings="int8"),
         "int4": QuantPlan.uniform("int4")}


@pytest.fixture(scope="module")
def projections():
    return project_plans("qwen3-1.7b", ["jetson-nano", "rk3588", "kirin-9000"], PLANS, context=8192)


def test_device_figure_shows_bound_projection_and_memory(projections):
    fig = make_device_figure(projections)
    by_name = {t.name: t for t in fig.data if t.xaxis == "x"}  # the decode panel
    for label, ps in projections.items():
        assert list(by_name[f"{label} bound"].y) == [p.decode_bound_tps for p in ps]
        assert list(by_name[label].y) == [p.projected_decode_tps for p in ps]
        memory = next(t for t in fig.data if t.name == label and t.xaxis == "x2")
        assert list(memory.y) == pytest.approx([p.total_bytes / 1e9 for p in ps])
    # fp16 weights of 1.7 B parameters and an 8k-token KV cache do not fit the Jetson Nano's 4 GB: the bar is
    # hatched and outlined in red, and keeps the plan's colour (its legend entry's)
    fp16 = next(t for t in fig.data if t.name == "fp16" and t.xaxis == "x2")
    assert projections["fp16"][0].fits_ram is False and fp16.marker.color == by_name["fp16"].marker.color
    assert fp16.marker.line.color[0] == NO_FIT and fp16.marker.pattern.shape[0] == "x"
    assert fp16.text[0] == "does not fit"
    assert fp16.marker.line.color[1] != NO_FIT and fp16.marker.pattern.shape[1] == ""
    assert "not on NPU" in by_name["int8"].text[0]  # the Nano computes in fp16 only
    assert [a.x for a in fig.layout.annotations if a.text == "bandwidth unknown"] == ["Kirin 9000"]
    ram = next(t for t in fig.data if t.name == "RAM")
    assert list(ram.x) == ["Jetson Nano 4GB", "RK3588"] and list(ram.y) == [4.0, 8.0]
    assert "8192-token context" in fig.layout.title.text


def test_pareto_optimal_marks_the_undominated():
    rows = [{"kl": 1, "size": 4, "speed": 10}, {"kl": 2, "size": 5, "speed": 9}, {"kl": 0.1, "size": 8, "speed": 5},
            {"kl": None, "size": 1, "speed": 100}]
    assert pareto_optimal(rows, (("kl", -1), ("size", -1), ("speed", 1))) == [True, False, True, False]
    assert pareto_optimal([{"a": 1}, {"a": 1}], (("a", 1),)) == [True, True]  # equals do not dominate


def test_speed_pareto_places_measured_plans(projections):
    points = [{"label": "fp16", "kl_divergence": 1e-6, "bits_per_weight": 16.0},
              {"label": "int8", "kl_divergence": 2e-5, "bits_per_weight": 8.1},
              {"label": "int4", "kl_divergence": 7e-3, "bits_per_weight": 4.6},
              {"label": "worse int4", "kl_divergence": 9e-3, "bits_per_weight": 4.6}]
    with pytest.raises(WorkbenchError, match="no projected speed on Kirin 9000"):
        make_speed_pareto_figure(points, projections, "Kirin 9000")
    with pytest.raises(WorkbenchError, match="was not projected"):
        make_speed_pareto_figure(points, projections, "Snapdragon 8 Gen 3")
    fig = make_speed_pareto_figure(points, projections, "RK3588")
    speed = {label: ps[1].projected_decode_tps for label, ps in projections.items()}
    kl_vs_speed = fig.data[1]
    # numbered by size ("worse int4" was never projected: no speed, so not on this panel); the key names each
    assert list(kl_vs_speed.text) == ["4", "3", "1"]
    key = fig.layout.annotations[-1].text
    assert "<b>4</b> fp16" in key and "<b>1</b> int4" in key and "<b>2</b> worse int4 (not ringed)" in key
    assert list(kl_vs_speed.x) == [speed["fp16"], speed["int8"], speed["int4"]]
    assert list(fig.data[0].marker.line.width) == [3, 3, 3, 0]  # the unprojected one cannot be shown optimal
    assert "RK3588" in fig.layout.title.text
    with pytest.raises(WorkbenchError, match="no measured plans"):
        make_speed_pareto_figure([], projections)


def test_host_bound_figure_uses_the_profiles_own_bound():
    p = RuntimeProfile("ort-int4", "onnxruntime", [], 7_000_000, 1, 1, {32: 1.0}, decode_tokens_per_second=1500.0,
                       decode_bytes=3_780_000)
    no_decode = RuntimeProfile("mnn", "MNN", [], 1, 1, 1, {32: 1.0})
    fig = make_host_bound_figure([p, no_decode.to_dict()], 23.5)
    bound, measured = fig.data
    assert list(bound.x) == ["ort-int4"] and bound.y[0] == pytest.approx(p.decode_bound(23.5))
    assert measured.y[0] == 1500.0 and measured.text[0] == f"{p.fraction_of_bound(23.5):.2f} of the bound"
    empty = make_host_bound_figure([no_decode], 23.5)
    assert "profile a conversion first" in empty.layout.annotations[0].text


def test_every_projection_figure_reads_true(projections):
    """Log axes tick at decades over at least one; one plan (or near-equal ones) is not zoomed apart."""
    points = [{"label": "fp16", "kl_divergence": 1e-6, "bits_per_weight": 16.0},
              {"label": "int8", "kl_divergence": 2e-5, "bits_per_weight": 8.1},
              {"label": "int4", "kl_divergence": 7e-3, "bits_per_weight": 4.6}]
    fitted = project_plans("qwen3-1.7b", ["snapdragon-8-elite", "rk3588"], PLANS, context=2048)
    assert any(p.vendor is not None and p.vendor.points for p in fitted["int4"])  # the vendor chart has points
    one = {"int4": projections["int4"]}
    figures = {"devices": make_device_figure(projections), "devices-one-plan": make_device_figure(one),
               "vendor": make_vendor_fit_figure(fitted), "vendor-none": make_vendor_fit_figure(projections),
               "pareto": make_speed_pareto_figure(points, projections, "RK3588"),
               "pareto-one-plan": make_speed_pareto_figure(points[2:], one, "RK3588"),
               "pareto-fitted": make_speed_pareto_figure(points, fitted, "Snapdragon 8 Elite")}
    assert check_figures(figures) == {}
    fig = figures["devices"]
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.dtick == 1 and fig.layout.yaxis2.dtick == 1
    lo, hi = figures["pareto-one-plan"].layout.xaxis2.range  # one speed: a span around it, not a zoom into it
    speed = projections["int4"][1].projected_decode_tps
    assert lo < speed < hi and hi - lo >= 0.2 * speed


def test_speed_colours_span_a_fifth_of_the_speed_and_only_ringed_plans_are_named(projections):
    """Issue 55.11: a colour scale over 429-437 tok/s painted near-equal speeds as opposite ends; names collided."""
    points = [{"label": "fp16", "kl_divergence": 1e-6, "bits_per_weight": 16.0},
              {"label": "int8", "kl_divergence": 2e-5, "bits_per_weight": 8.1},
              {"label": "int4", "kl_divergence": 7e-3, "bits_per_weight": 4.6}]
    fig = make_speed_pareto_figure(points, projections, "RK3588")
    m = fig.data[2].marker
    speeds = [s for s in m.color]
    assert m.cmax - m.cmin >= 0.2 * max(speeds) * 0.99
    # short numbers on the points, the names once in the key (names on the points collided)
    assert all(t in {"1", "2", "3"} for p in fig.data for t in p.text) and fig.layout.annotations[-1].yanchor == "top"
    assert "#d62728" not in {p.marker.line.color for p in fig.data} and "#c0392b" not in {p.marker.line.color
                                                                                          for p in fig.data}


def test_the_share_colour_bar_title_is_not_cut_by_the_bar_panel():
    from types import SimpleNamespace
    import torch
    from workbench.charts.calibration import make_layer_overview_figure
    layer = SimpleNamespace(hist_counts=torch.tensor([1, 2, 3]), outlier_ratio=0.1, outlier_channels=[1], in_features=4,
                            max_to_median=3.0, kurtosis=1.0, abs_max_value=2.0, near_zero_fraction=0.0)
    stats = SimpleNamespace(hist_edges=[-2.0, -1.0, 0.0, 1.0], layers={"model.layers.0.mlp.up_proj": layer})
    fig = make_layer_overview_figure(stats, sort_by="order")
    bar = fig.data[0].colorbar
    assert bar.x >= 1.0 and fig.layout.margin.r >= 80  # right of both panels, with room for its title


def test_plans_on_one_place_share_one_label():
    """The quantized model and the plan it ran sit on one point: "2, 3" over it, not a 3 drawn over a 2."""
    from workbench.charts.projection import _numbers_at_places
    assert _numbers_at_places([7.1, 7.65, 7.65, 8.9], [6e-3, 5.1e-3, 5.1e-3, 6e-5], [1, 2, 3, 4]) == ["1", "2, 3", "",
                                                                                                     "4"]
