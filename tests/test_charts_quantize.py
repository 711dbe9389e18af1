"""charts.quantize: weight error per layer by precision and the cost table, from the rows given."""
from workbench.charts.quantize import PRECISION_COLOURS, make_cost_table_figure, make_layer_error_figure


def test_layer_error_bars_one_trace_per_precision_in_plan_order():
    layers = [{"name": "a", "precision": "int4", "weight_error": 0.1, "group_size": 32},
              {"name": "b", "precision": "int8", "weight_error": 0.01, "group_size": None},
              {"name": "c", "precision": None, "weight_error": None},
              {"name": "d", "precision": "int4", "weight_error": 0.2, "group_size": 64, "fallback": "g64"}]
    fig = make_layer_error_figure(layers)
    assert [t.name for t in fig.data] == ["int4", "int8", "unchanged"]
    int4 = fig.data[0]
    assert list(int4.x) == ["a", "d"] and list(int4.y) == [0.1, 0.2] and int4.marker.color == PRECISION_COLOURS["int4"]
    assert [list(c) for c in int4.customdata] == [[32, ""], [64, "g64"]]
    assert list(fig.data[1].customdata[0]) == ["per-channel", ""] and list(fig.data[2].y) == [0.0]
    assert list(fig.layout.xaxis.categoryarray) == ["a", "b", "c", "d"]


def test_cost_table_cells_with_standard_errors_and_missing_values():
    rows = [{"label": "float", "perplexity": 10.0},
            {"label": "int4", "perplexity": 10.5, "perplexity_change": 0.5, "perplexity_change_stderr": 0.05,
             "kl_divergence": 0.02, "kl_divergence_stderr": 0.001, "top1_agreement": 0.95, "bits_per_weight": 4.5,
             "size_bytes": 2_500_000, "seconds": 3.21}]
    [table] = make_cost_table_figure(rows).data
    cells = [list(c) for c in table.cells.values]
    assert cells[0] == ["float", "int4"] and cells[1] == ["10.000", "10.500"]
    assert cells[2] == ["-", "+0.500 ± 0.050"] and cells[3] == ["-", "0.02000 ± 0.00100"]
    assert cells[4] == ["-", "95.00%"] and cells[5] == ["-", "4.50"] and cells[6] == ["-", "2.50"]
    assert cells[7] == ["-", "3.2"]
