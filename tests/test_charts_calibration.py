"""Calibration figures: one row per layer, sorting, thresholds, coverage bars."""
from __future__ import annotations

import pytest
import torch

from workbench.model.calibrate import HIST_EDGES, CalibrationStats, LayerStats
from workbench.charts.calibration import (layer_order, make_channel_magnitude_figure, make_layer_overview_figure,
                                          make_stat_heatmap_figure, make_token_length_figure)
from workbench.evaluation.data import CoverageReport


def layer(name, abs_max, kurtosis=0.0):
    t = torch.tensor(abs_max, dtype=torch.float32)
    hist = torch.zeros(len(HIST_EDGES) - 1, dtype=torch.long)
    hist[20] = 10
    return LayerStats(name, len(abs_max), 5, t, t / 2, t / 2, hist, 0.0, 1.0, kurtosis,
                      {"p50": 0.5, "p99": 0.9, "p99.9": 1.0}, 0.01)


@pytest.fixture
def stats():
    layers = [layer("model.layers.0.mlp.up_proj", [1.0] * 8, kurtosis=5.0),
              layer("model.layers.0.mlp.down_proj", [1.0] * 6 + [10.0, 20.0], kurtosis=1.0),
              layer("lm_head", [1.0] * 7 + [8.0], kurtosis=2.0)]
    return CalibrationStats({s.name: s for s in layers}, {"tokens": 5})


def test_layer_order(stats):
    assert layer_order(stats, "outlier_ratio") == ["model.layers.0.mlp.down_proj", "lm_head",
                                                   "model.layers.0.mlp.up_proj"]
    assert layer_order(stats, "kurtosis")[0] == "model.layers.0.mlp.up_proj"
    assert layer_order(stats, "order") == list(stats.layers)
    with pytest.raises(ValueError, match="unknown sort key 'bogus'"):
        layer_order(stats, "bogus")


def test_layer_overview_one_row_per_layer(stats):
    fig = make_layer_overview_figure(stats, sort_by="outlier_ratio")
    heat, bars = fig.data
    assert list(heat.y) == ["layers.0.mlp.down_proj", "lm_head", "layers.0.mlp.up_proj"]
    assert len(heat.z) == 3 and all(abs(sum(row) - 1) < 1e-9 for row in heat.z)
    assert list(bars.x) == pytest.approx([25.0, 12.5, 0.0])
    assert "outlier" in fig.layout.title.text


def test_channel_magnitude_marks_outliers(stats):
    fig = make_channel_magnitude_figure(stats["model.layers.0.mlp.down_proj"])
    outliers = [t for t in fig.data if t.name == "outlier channel"][0]
    assert list(outliers.x) == [6, 7] and list(outliers.y) == [10.0, 20.0]
    assert [s.y0 for s in fig.layout.shapes] == [1.0, 6.0]  # median and the 6x threshold
    assert "2 outlier channel(s) of 8" in fig.layout.title.text


def test_stat_heatmap(stats):
    fig = make_stat_heatmap_figure(stats, statistics=("abs_max", "kurtosis", "outlier_ratio"))
    heat = fig.data[0]
    assert list(heat.x) == ["largest |x|", "kurtosis (tails)", "outlier channels"] and len(heat.y) == 3
    assert [row[0] for row in heat.z] == pytest.approx([0.0, 1.0, 7 / 19])  # abs-max 1, 20, 8 scaled to the range
    assert heat.text[1][0] == "20"


def test_token_length_figure():
    r = CoverageReport("x.jsonl", "jsonl", 4, 64, 8, 2, 0, False, samples=2, tokens=100,
                       dropped={"empty": {"pieces": 1, "tokens": 0, "where": ["line 3"]}},
                       piece_lengths=[64, 36, 0, 70], piece_fates=["sampled", "sampled", "empty", "too_long"])
    fig = make_token_length_figure(r, bins=4)
    by_name = {t.name: list(t.y) for t in fig.data}
    assert by_name["sampled"] == [0, 0, 1, 1, 0]
    assert by_name["dropped: empty"] == [1, 0, 0, 0, 0]
    assert by_name["dropped: too long"] == [0, 0, 0, 0, 1]
    assert fig.data[0].x[-1] == "> 64" and "1 piece(s) dropped" in fig.layout.title.text
    assert make_token_length_figure(r.to_dict()).layout.title.text == fig.layout.title.text


def test_stat_heatmap_columns_are_words_not_field_names(stats):
    heat = make_stat_heatmap_figure(stats).data[0]
    assert not [c for c in heat.x if "_" in c], list(heat.x)  # abs_max, max_to_median, near_zero_fraction


def test_layer_overview_says_no_outliers_instead_of_an_empty_panel():
    calm = CalibrationStats({n: layer(n, [1.0] * 8) for n in ("a", "b")}, {"tokens": 5})
    fig = make_layer_overview_figure(calm)
    notes = [a.text for a in fig.layout.annotations if "no outlier" in (a.text or "")]
    assert notes == ["no outlier channels<br>in any of 2 layers"] and list(fig.layout.xaxis2.range) == [0, 1]


def test_layer_overview_with_outliers_draws_no_such_note(stats):
    fig = make_layer_overview_figure(stats)
    assert not [a for a in fig.layout.annotations if "no outlier" in (a.text or "")]
