"""The Compress panel without a browser: prediction follows the sliders, Score / Prune / Distil add points."""
import re

import pytest

from workbench.quantize.plan import QuantPlan
from workbench.ui.compress import CompressPanel


@pytest.fixture
def panel(tiny_model_dir, tmp_path, workspace):
    p = CompressPanel(tiny_model_dir, out_dir=tmp_path / "c", workspace=workspace, heads=0.5, mlp=0.25, steps=2,
                      eval_tokens=128, importance_tokens=256)
    yield p
    p.close()


def test_the_prediction_follows_the_sliders_and_says_when_a_ratio_cannot_be(panel):
    assert "50% of query heads, 50% of KV heads, 25.0% of MLP channels removed" in panel.predicted.value
    assert "by layer: 2/96, 2/96; of 4/128" in panel.predicted.value
    panel.head_unit.value = "query"
    assert "50% of query heads, 0% of KV heads" in panel.predicted.value
    panel.heads.value = 0.95
    assert "leaves" in panel.predicted.value and "color:#c0392b" in panel.predicted.value


def test_score_prune_distil_put_every_model_on_the_chart(panel, monkeypatch):
    import workbench.ui.compress as ui
    real = ui.DistillConfig
    monkeypatch.setattr(ui, "DistillConfig", lambda **kw: real(batch_size=2, seq_len=16, eval_every=2, **kw))
    assert panel.distill() is None and "prune first" in panel.error
    # before any data the tab says what will appear, and no KL words stand without a table
    assert "after Score: every head" in panel.waiting.value and panel.words.value == ""
    assert panel.score() is not None and {"heads", "channels"} <= set(panel.figures)
    assert "after Score" not in panel.waiting.value and "after Prune" in panel.waiting.value
    report = panel.prune()
    assert report is not None, panel.error
    assert report["geometry_after"]["kv_heads"] == 1
    tag = f"plan {QuantPlan.uniform('int4').content_hash()}"  # no session: uniform INT4
    labels = [p["label"] for p in panel.points]
    assert labels == ["float", tag, "pruned", f"pruned + {tag}"]
    assert panel.waiting.value == "" and "KL divergence:" in panel.words.value
    counts = []
    panel.status_line.count = lambda n, total, desc: counts.append((n, total, desc))
    assert panel.distill() is not None, panel.error
    assert panel.points[-1]["label"] == f"pruned + {tag} + distilled"
    assert max(n for n, t, d in counts if d == "distill") == 2  # the status line's bar counted the steps
    from test_ui_finetune import bars
    assert bars(panel) == [panel.status_line.bar]  # one bar: no "distil" bar of the panel's own beside it
    pareto = panel.figures["pareto"]
    assert any(t.name == "pruned" for t in pareto.data)  # pruned points drawn as their own kind
    assert panel.figures["distill"].data and panel.figures["table"].data
    assert all(not w.disabled for w in panel.controls)


def test_bad_input_is_a_red_line_not_a_traceback(panel):
    panel.heads.value = 0.95
    assert panel.prune() is None and "leaves none" in panel.error


def test_a_model_the_tab_cannot_prune_disables_it_and_says_why(tiny_model_dir, tmp_path, workspace, monkeypatch):
    import workbench.ui.compress as ui
    from workbench.errors import PlanError

    def refuse(model):
        raise PlanError("structured pruning supports Llama-style decoders")
    monkeypatch.setattr(ui, "geometry", refuse)
    p = CompressPanel(tiny_model_dir, out_dir=tmp_path / "c", workspace=workspace)
    assert "Llama-style" in p.error and p.prune_button.disabled and p.heads.disabled
    p.close()


def test_the_app_has_a_compress_tab_that_shares_the_precisions_chart(tiny_model_dir, workspace, tmp_path):
    from workbench.ui.app import WorkbenchApp
    app = WorkbenchApp(str(tiny_model_dir), out_dir=tmp_path / "run", workspace=workspace)
    assert app.load() is not None and app.error is None
    titles = [app.tabs.get_title(i) for i in range(len(app.tabs.children))]
    assert app.tabs.children[titles.index("Compress")] is app.compress_panel
    assert app.compress_panel.out_dir == tmp_path / "run" / "compress"
    app.override_panel.points.append({"label": "uniform int4", "size_bytes": 1, "kl_divergence": 0.1,
                                      "perplexity": 2.0})
    assert app.compress_panel.extra_points() is app.override_panel.points
    app.close()


def test_quantized_points_and_qat_use_the_session_plan_and_follow_it(tiny_model_dir, tmp_path, workspace, monkeypatch):
    """The app's one plan: a session plan of INT8 gives INT8 sizes, labels and a distillation trained for INT8."""
    import workbench.ui.compress as ui
    from workbench.model.load import load_model
    from workbench.ui.session import AppSession
    real = ui.DistillConfig
    monkeypatch.setattr(ui, "DistillConfig", lambda **kw: real(batch_size=2, seq_len=16, eval_every=2, **kw))
    session = AppSession(out_dir=tmp_path / "run", workspace=workspace)
    lm = session.load(tiny_model_dir)
    p = CompressPanel(lm, out_dir=tmp_path / "c", workspace=workspace, heads=0.5, mlp=0.25, steps=2, eval_tokens=128,
                      importance_tokens=256, session=session)
    int4, int8 = QuantPlan.uniform("int4"), QuantPlan.uniform("int8")
    assert p.quant_plan == int4 and f"plan {int4.content_hash()}" in p.predicted.value
    session.plan = int8  # Use this plan / Quantize elsewhere in the app: this tab follows
    assert p.quant_plan == int8 and int8.content_hash() in p.plan_note.value and int8.content_hash() in p.predicted.value
    assert p.prune() is not None, p.error
    pruned = load_model(tmp_path / "c" / "pruned")
    by = {q["label"]: q for q in p.points}
    tag = f"plan {int8.content_hash()}"
    assert set(by) == {"float", tag, "pruned", f"pruned + {tag}"}
    assert by[tag]["size_bytes"] == lm.size_bytes(int8) != lm.size_bytes(int4)
    assert by[f"pruned + {tag}"]["size_bytes"] == pruned.size_bytes(int8) != pruned.size_bytes(int4)
    assert by[f"pruned + {tag}"]["bits_per_weight"] > 8  # INT8 codes and their scales, not INT4's
    title = p.figures["pareto"].layout.title.text
    assert title.count("plan ") == 1 and f"quantized by: {by[tag]['plan']}" in title  # one plan, named once
    # a two-line title above the panels' titles: room for both (its second line sat on the left panel's title)
    assert p.figures["pareto"].layout.margin.t >= 110 and p.figures["pareto"].layout.title.yanchor == "top"
    assert not re.search(r"\d,\d{3} B\b", p.predicted.value) and re.search(r"[\d.]+ [kMG]B</b> at fp16",
                                                                           p.predicted.value)  # units.format_bytes
    assert list(p.figures["table"].data[0].cells.values[-1]) == ["-", by[tag]["plan"], "-", by[tag]["plan"]]
    assert by[tag]["plan"].startswith(f"uniform INT8, plan {int8.content_hash()} (RTN")
    report = p.distill()
    assert report is not None, p.error
    assert report.plan == int8.to_dict() and p.points[-1]["label"] == f"pruned + {tag} + distilled"
    p.quant_plan = int4  # set here, it is the session's plan: one plan for every tab
    assert session.plan == int4
    p.close()


def test_a_group_size_that_does_not_divide_a_pruned_width_falls_back_and_says_so(panel):
    """96 kept MLP channels at group 64: down_proj falls back as quantize_model does, and the status says it."""
    plan = QuantPlan.uniform("int4", group_size=64)
    panel.quant_plan = plan
    assert panel.prune() is not None, panel.error
    point = next(p for p in panel.points if p["label"] == f"pruned + plan {plan.content_hash()}")
    assert "group size 64 does not divide 96 input features; using 32" in \
        point["fallbacks"]["model.layers.0.mlp.down_proj"]
    pruned_size = point["size_bytes"]
    from workbench.model.load import load_model
    assert pruned_size == load_model(panel.out_dir / "pruned").size_bytes(plan)
    assert "fell back to another group size" in panel.status.value


def _bar_colours(fig):
    return [c for t in fig.data if t.type == "bar" for c in t.marker.color]


def test_after_score_the_channel_chart_greys_what_the_sliders_remove_and_prune_keeps_the_prediction(panel):
    from workbench.charts.checks import figure_problems
    assert panel.score() is not None
    channels = panel.figures["channels"]
    colours = _bar_colours(channels)
    grey = colours.count("#d9d9d9")
    assert grey > 0 and grey < len(colours) and "removed by these settings" in channels.layout.title.text
    assert "by the scores" in panel.predicted.value and figure_problems(channels) == []
    predicted = panel.predicted.value.split("by layer: ")[1].split(";")[0]
    panel.mlp.value = 0.5  # moving a slider re-greys
    assert _bar_colours(panel.figures["channels"]).count("#d9d9d9") > grey
    panel.mlp.value = 0.25
    report = panel.prune()
    assert report is not None, panel.error
    kept = [len(k) for k in report["kept"]["mlp"]]
    assert _bar_colours(panel.figures["channels"]).count("#d9d9d9") == sum(128 - k for k in kept)
    assert "removed by Prune" in panel.figures["channels"].layout.title.text
    after = panel.predicted.value.split("by layer: ")[1].split(";")[0]
    assert after == predicted and [int(x.split("/")[1]) for x in after.split(", ")] == kept


def test_precision_plans_measured_on_other_tokens_are_measured_again_on_this_tabs_evaluation(
        tiny_model_dir, tmp_path, workspace):
    """Issue 55.1: one chart, one evaluation: a Precisions point scored on 255 tokens is not drawn as it is."""
    from workbench.charts.precision import evaluation_of
    other = {"label": "uniform int8", "size_bytes": 1, "bits_per_weight": 8.5, "kl_divergence": 1e-4,
             "perplexity": 27.7, "tokens": 255, "plan": QuantPlan.uniform("int8")}
    p = CompressPanel(tiny_model_dir, out_dir=tmp_path / "c", workspace=workspace, heads=0.5, mlp=0.25, steps=2,
                      eval_tokens=128, importance_tokens=256, extra_points=lambda: [other])
    try:
        assert p.prune() is not None, p.error
        again = next(q for q in p.points if q["label"] == "uniform int8")
        assert again["tokens"] != 255 and again["perplexity"] != 27.7
        assert len({evaluation_of(q) for q in p.points}) == 1
        fig = p.figures["pareto"]
        assert f"same {again['tokens']:,} tokens" in fig.layout.title.text
        assert any(t.name == "float model" for t in fig.data)
        assert not any("float" in str(h) for t in fig.data if t.name != "float model" for h in t.hovertext or ())
    finally:
        p.close()


def test_a_plan_and_its_rtn_preview_are_measured_once(tiny_model_dir, tmp_path, workspace):
    """An AWQ plan and the same plan's RTN preview round to the same weights here: one point, not two."""
    awq = QuantPlan.uniform("int8", method="awq")
    rtn = QuantPlan.uniform("int8")
    extra = [{"label": "plan 1 (RTN preview)", "plan": rtn, "tokens": 255}, {"label": "uniform int8", "plan": awq}]
    p = CompressPanel(tiny_model_dir, out_dir=tmp_path / "c", workspace=workspace, heads=0.5, mlp=0.25, steps=2,
                      eval_tokens=128, importance_tokens=256, extra_points=lambda: extra)
    try:
        assert p.prune() is not None, p.error
        labels = [q["label"] for q in p.points]
        assert labels.count("plan 1") == 1 and "uniform int8 (RTN)" not in labels, labels
    finally:
        p.close()
