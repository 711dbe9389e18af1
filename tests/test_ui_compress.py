"""The Compress panel without a browser: prediction follows the sliders, Score / Prune / Distil add points."""
import pytest

from workbench.ui.compress import CompressPanel


@pytest.fixture
def panel(tiny_model_dir, tmp_path, workspace):
    p = CompressPanel(tiny_model_dir, out_dir=tmp_path / "c", workspace=workspace, heads=0.5, mlp=0.25, steps=2,
                      eval_tokens=128, importance_tokens=256)
    yield p
    p.close()


def test_the_prediction_follows_the_sliders_and_says_when_a_ratio_cannot_be(panel):
    assert "2/4 query heads, 1/2 KV heads, 96/128 MLP channels" in panel.predicted.value
    panel.head_unit.value = "query"
    assert "2/4 query heads, 2/2 KV heads" in panel.predicted.value
    panel.heads.value = 0.95
    assert "leaves" in panel.predicted.value and "color:#c0392b" in panel.predicted.value


def test_score_prune_distil_put_every_model_on_the_chart(panel, monkeypatch):
    import workbench.ui.compress as ui
    real = ui.DistillConfig
    monkeypatch.setattr(ui, "DistillConfig", lambda **kw: real(batch_size=2, seq_len=16, eval_every=2, **kw))
    assert panel.distill() is None and "prune first" in panel.error
    assert panel.score() is not None and {"heads", "channels"} <= set(panel.figures)
    report = panel.prune()
    assert report is not None, panel.error
    assert report["geometry_after"]["kv_heads"] == 1
    labels = [p["label"] for p in panel.points]
    assert labels == ["float", "int4", "pruned", "pruned + int4"]
    assert panel.distill() is not None, panel.error
    assert panel.points[-1]["label"] == "pruned + int4 + distilled" and panel.progress.value == 2
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
