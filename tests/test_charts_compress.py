"""Compression figures: what they draw is what the importance and the reports hold."""
import pytest

from workbench.charts.compress import (make_channel_importance_figure, make_compress_table_figure, make_distill_figure,
                                       make_head_importance_figure)
from workbench.charts.precision import make_pareto_figure

IMP = {"geometry": {"heads": 4, "kv_heads": 2}, "taylor_heads": [[1, 2, 3, 4], [4, 3, 2, 1]],
       "activation_heads": [[1, 1, 1, 1], [2, 2, 2, 2]], "taylor_mlp": [[3, 1, 2], [1, 2, 3]],
       "activation_mlp": [[1, 1, 1], [1, 1, 1]], "kl_groups": [[0.5, 0.1], [0.2, 0.3]], "kl_heads": None}


def test_head_heatmap_sums_query_heads_per_group_and_marks_the_kept():
    fig = make_head_importance_figure(IMP, score="taylor", kept=[[1], [0]])
    assert [list(r) for r in fig.data[0].z] == [[3, 7], [7, 3]]
    assert list(fig.data[1].x) == ["group 1", "group 0"] and list(fig.data[1].y) == ["layer 0", "layer 1"]
    assert [list(r) for r in make_head_importance_figure(IMP, score="kl").data[0].z] == IMP["kl_groups"]
    assert list(make_head_importance_figure(IMP, unit="query").data[0].z[1]) == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="without measured KL"):
        make_head_importance_figure(IMP, score="kl", unit="query")


def test_channels_are_sorted_per_layer_and_the_removed_are_grey():
    fig = make_channel_importance_figure(IMP, kept=[[0, 2], [1, 2]])
    assert len(fig.data) == 2 and list(fig.data[0].y) == [3, 2, 1]
    assert list(fig.data[0].marker.color) == ["#08519c", "#08519c", "#d9d9d9"]


def test_distill_and_table_and_pruned_points_on_the_pareto_chart():
    report = {"losses": [1.0, 0.5], "validation": [(0, 0.9), (2, 0.4)], "best_step": 2, "teacher_perplexity": 50.0,
              "student_before": {"perplexity": 170.0, "kl": 1.0}, "student_after": {"perplexity": 80.0, "kl": 0.4}}
    fig = make_distill_figure(report)
    assert "170.00 -> 80.00" in fig.layout.title.text and fig.data[2].name == "held-back KL to the teacher"
    rows = [{"label": "float", "size_bytes": 10, "bits_per_weight": 16.0, "perplexity": 50.0, "perplexity_stderr": 1.0,
             "kl_divergence": 0.0, "kl_stderr": 0.0, "top1_agreement": 1.0},
            {"label": "pruned", "size_bytes": 8, "bits_per_weight": 16.0, "perplexity": 170.0,
             "perplexity_stderr": 9.0, "kl_divergence": 1.0, "kl_stderr": 0.03, "top1_agreement": 0.4}]
    assert list(make_compress_table_figure(rows).data[0].cells.values[3]) == ["50.00 ± 1.00", "170.00 ± 9.00"]
    table = make_compress_table_figure(rows).data[0]
    assert table.header.values[1] == "size" and list(table.cells.values[1]) == ["10 B", "8 B"]  # units.format_bytes
    pareto = make_pareto_figure(rows, x="size_bytes")
    assert {t.name for t in pareto.data} == {"float model", "pruned"}  # the float model is not a "custom" plan
    # sizes in MB like everywhere else in the app (the axis read "size (bytes)" with 8,394,240)
    assert pareto.layout.xaxis.title.text == "size (MB = 10^6 bytes)" and list(pareto.data[0].x)[0] in (8e-6, 1e-5)
    assert [t.marker.symbol for t in pareto.data if t.name == "pruned"] == ["star", "star"]
