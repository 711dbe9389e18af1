"""charts.graph: operator histogram, bytes per block and the conversion bars, each from the data given."""
from workbench.charts.checks import figure_problems
from workbench.charts.graph import (DOMAIN_COLORS, PROBLEM_COLOR, make_block_bytes_figure, make_conversion_figure,
                                    make_device_gap_figure, make_op_histogram_figure)
from workbench.onnx.inspect import OpCount


def test_op_histogram_sorts_by_count_and_marks_rejected_ops():
    inventory = [OpCount("MatMul", "ai.onnx", 17, 12), OpCount("Sqrt", "ai.onnx", 17, 3),
                 OpCount("MatMulNBits", "com.microsoft", 1, 7)]
    [bar] = make_op_histogram_figure(inventory, problem_ops=["Sqrt"]).data
    assert list(bar.y) == ["Sqrt", "MatMulNBits", "MatMul"] and list(bar.x) == [3, 7, 12]
    assert list(bar.marker.color) == [PROBLEM_COLOR, DOMAIN_COLORS["com.microsoft"], DOMAIN_COLORS["ai.onnx"]]
    assert [list(c) for c in bar.customdata] == [["ai.onnx", 17], ["com.microsoft", 1], ["ai.onnx", 17]]


def test_block_bytes_in_model_order_and_megabytes():
    [bar] = make_block_bytes_figure({"embed_tokens": 2_000_000, "layers.0": 1_000_000, "lm_head": 0}).data
    assert list(bar.x) == ["embed_tokens", "layers.0", "lm_head"] and list(bar.y) == [2.0, 1.0, 0.0]
    assert list(bar.text) == ["2.00", "1.00", "0.00"]


def test_conversion_bars_leave_out_what_did_not_run_and_mark_a_gap():
    reports = [{"target": "ort-int4", "kl_divergence": 0.02, "simulation": {"kl_divergence": 0.019},
                "top1_agreement_vs_simulation": 0.99, "gap": False},
               {"target": "mnn", "kl_divergence": 0.2, "simulation": {"kl_divergence": 0.02},
                "top1_agreement_vs_simulation": 0.8, "gap": True},
               {"target": "qnn", "kl_divergence": None}]
    sim, conv = make_conversion_figure(reports).data
    assert list(sim.x) == list(conv.x) == ["ort-int4", "mnn"]
    assert list(sim.y) == [0.019, 0.02] and list(conv.y) == [0.02, 0.2]
    # the gap is outlined and labelled in red; the fill keeps the legend's colour
    assert conv.marker.line.color[1] == PROBLEM_COLOR and conv.marker.line.color[0] != PROBLEM_COLOR
    assert isinstance(conv.marker.color, str) and conv.marker.color != PROBLEM_COLOR
    assert list(conv.text) == ["top-1 vs sim 0.990", "GAP, top-1 vs sim 0.800"]
    fig = make_conversion_figure(reports, gap_rule="gap (red): KL above 1.5 x the simulation's")
    assert "KL above 1.5" in fig.layout.title.text and figure_problems(fig) == []


def test_device_gap_bars_per_graph_mark_the_flagged_graph_and_skip_absent_targets():
    rows = [{"target": "simulation", "prefill": {"kl": 0.004, "top1": 0.97}, "decode": None, "gap": None},
            {"target": "rknn", "prefill": {"kl": 0.005, "top1": 0.96}, "decode": {"kl": 0.5, "top1": 0.5},
             "gap": "decode: KL 0.5 > 1.5 x simulation 0.004 + 0.002"},
            {"target": "htp", "prefill": None, "decode": None, "gap": None}]
    pre, dec = make_device_gap_figure(rows).data[:2]
    assert list(pre.x) == ["simulation", "rknn"] and list(pre.y) == [0.004, 0.005]
    assert list(dec.x) == ["rknn"] and list(dec.y) == [0.5] and list(dec.marker.line.color) == [PROBLEM_COLOR]
    assert list(dec.text) == ["GAP: KL 0.5 > 1.5 x simulation 0.004 + 0.002"] and list(dec.textfont.color) == [PROBLEM_COLOR]
    assert PROBLEM_COLOR not in list(pre.marker.line.color) and list(pre.text) == ["top-1 0.970 vs float", "top-1 0.960"]
    assert pre.marker.color != dec.marker.color  # the legend tells the graphs apart, gap or not
    layout = make_device_gap_figure(rows).layout.yaxis
    assert layout.type == "log" and layout.range[0] == -3 and 0.5 < 10 ** layout.range[1]  # from the decade below
    assert figure_problems(make_device_gap_figure(rows)) == []
    one = make_device_gap_figure([rows[0]])  # one bar: still a decade, ticks at the powers of ten
    assert figure_problems(one) == [] and one.layout.yaxis.range[1] - one.layout.yaxis.range[0] >= 1


def test_a_gap_label_shows_the_quantity_its_rule_judges_and_other_tokens_are_said_on_the_bar():
    """Issue 55.3: "GAP, top-1 0.952" beside a rule of top-1 below 0.95 (the label was top-1 against the float model,
    the rule top-1 against the simulation); rknn's lower KL on 512 tokens beside others on 23,298."""
    from workbench.run.devices_gap import make_row, graph_scores
    sim = make_row("simulation", "PyTorch", prefill=graph_scores(0.00389, 0.96, positions=23_298))
    qnn = make_row("htp", "emulator", prefill=graph_scores(0.004, 0.952, 0.948, 0.00389, positions=23_298))
    rknn = make_row("rknn", "sim", prefill=graph_scores(0.00278, 0.97, 0.96, 0.0025, positions=512))
    fig = make_device_gap_figure([sim, qnn, rknn])
    pre = fig.data[0]
    assert qnn["gap"] and pre.text[1] == "GAP: top-1 vs sim 0.948 < 0.95"
    assert "0.952" not in pre.text[1]
    assert "512 tokens, sim 23,298" in pre.text[2] and "not comparable" in fig.layout.title.text
    swatches = [t for t in fig.data if t.showlegend is not False]
    assert [t.name for t in swatches] == ["prefill", "decode"]
    assert all(not getattr(t.marker, "line", None) or t.marker.line.color is None for t in swatches)  # no red outline


def test_decode_bars_are_not_held_to_the_simulations_prefill_tokens():
    """Decode is teacher-forced at fewer positions by design: only a prefill on other tokens says so."""
    from workbench.run.devices_gap import make_row, graph_scores
    sim = make_row("simulation", "PyTorch", prefill=graph_scores(0.006, 0.90, positions=254))
    qdq = make_row("ort-qdq", "cpu", prefill=graph_scores(0.008, 0.89, 0.97, 0.006, positions=254),
                   decode=graph_scores(0.007, 0.90, 0.97, 0.006, positions=126))
    fig = make_device_gap_figure([sim, qdq])
    assert not any("tokens, sim" in t for trace in fig.data[:2] for t in trace.text)
    assert "not comparable" not in fig.layout.title.text
