"""The project panel without a browser: plans on chosen devices, each plan once, measured plans on the speed chart."""
from workbench.models import load_model
from workbench.plan import QuantPlan
from workbench.projection import project
from workbench.ui.overrides import OverridePanel
from workbench.ui.project import ProjectPanel
from workbench.ui.session import AppSession


def test_shapes_and_plans_on_chosen_devices():
    plans = {"int8": QuantPlan.uniform("int8", keep_embeddings="int8"), "int4": QuantPlan.uniform("int4")}
    panel = ProjectPanel("qwen2.5-1.5b", plans=plans, devices=["rk3588", "kirin-9000"], context=2048)
    out = panel.run()
    assert panel.error is None and list(out) == ["int8", "int4"]
    direct = project("qwen2.5-1.5b", "rk3588", plans["int4"], context=2048)
    assert out["int4"][0].to_dict() == direct.to_dict()
    assert "RK3588" in panel.table.value and "Kirin 9000" in panel.table.value and "2048" in panel.status.value
    assert set(panel.figures) == {"devices"}  # nothing measured: no quality / speed chart
    assert list(panel.pareto_device.options) == ["RK3588"]  # Kirin 9000's bandwidth is unknown
    panel.devices.value = ()
    assert panel.run() is None and "at least one device" in panel.error


def test_in_the_app_session_quantized_and_evaluated_plans(tiny_model_dir, workspace, tmp_path):
    session = AppSession(out_dir=tmp_path / "run", workspace=workspace)
    panel = ProjectPanel(session=session)
    assert panel.run() is None and panel.error == "load a model first"
    lm = load_model(tiny_model_dir)
    session.set_model(lm)  # its plan: uniform INT4
    precisions = OverridePanel(lm, plan=session.plan, tokens=64)
    points = precisions.evaluate_uniform()  # uniform INT8 and INT4, measured
    panel.close()
    panel = ProjectPanel(session=session, points=lambda: precisions.points, devices=["8gen3", "jetson-nano"])
    out = panel.run()
    assert panel.error is None
    # the session's plan is the evaluated uniform INT4: one candidate, carrying that measurement
    assert list(out) == ["session plan", "uniform int8"]
    assert [r["label"] for r in panel.rows] == ["uniform int8", "session plan"]  # in the order measured
    assert panel.rows[1]["kl_divergence"] == points[1].kl_divergence
    assert set(panel.figures) == {"devices", "pareto"}
    assert panel.pareto_device.value == "Snapdragon 8 Gen 3"  # the first device chosen
    assert "Snapdragon 8 Gen 3" in panel.figures["pareto"].layout.title.text
    panel.pareto_device.value = "Jetson Nano 4GB"
    assert "Jetson Nano 4GB" in panel.figures["pareto"].layout.title.text
    nano = out["uniform int8"][1]
    assert nano.unsupported_layers and "(int8)" in panel.table.value  # the Nano computes in fp16
    panel.close()


def test_the_app_has_a_project_tab(tiny_model_dir, workspace, tmp_path):
    from workbench.ui.app import TAB_TITLES, WorkbenchApp
    app = WorkbenchApp(str(tiny_model_dir), sweep_tokens=64, out_dir=tmp_path / "run", workspace=workspace)
    assert app.load() is not None
    k = TAB_TITLES.index("Project")
    assert app.tabs.children[k] is app.project_panel
    app.override_panel.evaluate()
    assert app.project_panel.run() is not None
    assert [r["label"] for r in app.project_panel.rows] == ["session plan"]  # "plan 1" is the session's plan
    assert "project-devices" in app.figures_on_show()
    app.project_panel.context.value = -1
    assert app.project_panel.context.value == 0  # bounded: a negative context cannot be typed
