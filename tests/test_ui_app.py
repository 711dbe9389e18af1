"""The app without a browser: load, bad path, sweep, a plan handed from Precisions to Quantize and Export."""
import pytest

from workbench.ui.app import TAB_TITLES, WorkbenchApp


@pytest.fixture
def app(tiny_model_dir, workspace, tmp_path):
    a = WorkbenchApp(str(tiny_model_dir), samples=4, seq_len=32, sweep_tokens=64, out_dir=tmp_path / "out",
                     workspace=workspace)
    assert a.load() is not None and a.error is None
    return a


def test_load_builds_every_tab(app):
    assert [app.tabs.get_title(i) for i in range(len(TAB_TITLES))] == list(TAB_TITLES)
    assert app.tabs.children[0] is app.calibrate_panel and app.tabs.children[3] is app.convert_panel
    assert app.quantize_panel.bits.value == 4 and app.convert_panel.bits == 4


def test_bad_model_path_is_a_status_line_not_a_traceback(tmp_path, workspace):
    a = WorkbenchApp(str(tmp_path / "nowhere"), workspace=workspace)
    assert a.load() is None
    assert "does not exist" in a.error and "error:" in a.status.value
    assert a.run_sensitivity() is None and a.error == "load a model first"


def test_sweep_then_plan_reaches_quantize_and_export(app):
    report = app.run_sensitivity()
    assert report is not None and app.override_panel.sensitivity is report
    assert len(report.layers) == len(app.lm.layers)
    name = app.lm.layers[0].name
    app.override_panel.dropdowns[name].value = "fp16"
    plan = app.use_plan()
    assert plan.precision_name_for(name) == "fp16"
    assert app.quantize_panel.bits.value == "plan" and app.quantize_panel.current_plan().precision_name_for(name) == "fp16"
    assert app.convert_panel.plan is plan and app.convert_panel.bits is None
    assert app.tabs.children[2] is app.quantize_panel and "bits/weight" in app.plan_label.value


def test_profile_tab_times_what_export_writes(app):
    assert app.tabs.children[4] is app.profile_panel
    assert app.profile_panel.directory.value == str(app.out_dir / "convert") == app.convert_panel.out_dir.value
