"""The project panel without a browser: plans on chosen devices, each plan once, measured plans on the speed chart."""
from workbench.model.load import load_model
from workbench.quantize.plan import QuantPlan
from workbench.devices.projection import project
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
    assert set(panel.figures) == {"devices", "vendor"}  # nothing measured: no quality / speed chart
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
    # before a run: what will appear, and no empty "speed on" menu
    assert "after Project:" in panel.waiting.value and panel.pareto_device.layout.display == "none"
    out = panel.run()
    assert panel.waiting.value == "" and panel.pareto_device.layout.display == ""
    assert panel.error is None
    # the session's plan is the evaluated uniform INT4: one candidate, carrying that measurement
    assert list(out) == ["session plan", "uniform int8"]
    assert [r["label"] for r in panel.rows] == ["uniform int8", "session plan"]  # in the order measured
    assert panel.rows[1]["kl_divergence"] == points[1].kl_divergence
    assert set(panel.figures) == {"devices", "vendor", "pareto"}
    assert panel.pareto_device.value == "Snapdragon 8 Gen 3"  # the first device chosen
    assert "Snapdragon 8 Gen 3" in panel.figures["pareto"].layout.title.text
    panel.pareto_device.value = "Jetson Nano 4GB"
    assert "Jetson Nano 4GB" in panel.figures["pareto"].layout.title.text
    nano = out["uniform int8"][1]
    assert nano.unsupported_layers and "(int8)" in panel.table.value  # the Nano computes in fp16
    # a quantized model is named by what it is, not by its folder's hash ("quantized awq-56903f2e")
    from workbench.quantize import quantize_model
    session.set_quantized(quantize_model(lm, QuantPlan.uniform("int8", group_size=32)))
    plans, _ = panel.candidates()
    assert list(plans)[0] == "quantized model (uniform INT8, RTN)" and session.quantized_path.name not in str(list(plans))
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


def test_the_runtime_choice_and_the_vendor_evidence():
    from workbench.devices.runtimes import get_runtime
    plans = {"w4a16": get_runtime("genie").plan(), "int8": QuantPlan.uniform("int8")}
    panel = ProjectPanel("qwen3-1.7b", plans=plans, devices=["8elite", "rk3588"], context=4096)
    assert panel.runtime.value == "auto"
    out = panel.run()
    elite, rk = out["w4a16"]
    assert (elite.runtime, rk.runtime) == ("genie", "rkllm")  # each device's own
    assert elite.vendor.decode_tps == elite.projected_decode_tps and elite.vendor.decode_error is not None
    table = panel.table.value
    assert "Qwen3-1.7B w4a16, Samsung Galaxy S25, ctx 4096: 56.7 tok/s" in table  # the nearest measurement
    assert "held out by model, 8)" in table
    other = ProjectPanel("qwen2.5-1.5b", plans={"w4a16": plans["w4a16"]}, devices=["8elite"], context=4096)
    other.run()  # no Genie measurement of a Qwen2 / Qwen2.5 model: the error of a family left out, and said
    assert "held out by family, 8; no qwen2 model measured)" in other.table.value
    other.close()
    fig = panel.figures["vendor"]
    measured = next(t for t in fig.data if t.name.startswith("Snapdragon 8 Elite: measured"))
    assert 56.7 in [round(y, 1) for y in measured.y] and len(measured.x) == len(elite.vendor.points)
    held = [t for t in fig.data if t.name.startswith("Snapdragon 8 Elite: fit, each model held out")]
    assert sorted(t.name.rsplit("(", 1)[1] for t in held) == ["llama rate)", "qwen3 rate)"]  # Genie: per family
    assert sum(len(t.x) for t in held) == len(elite.vendor.points)
    star = next(t for t in fig.data if t.name == "Snapdragon 8 Elite: w4a16")
    assert star.y[0] == elite.vendor.decode_tps and star.error_y.array[0] > 0
    panel.runtime.value = "qairt"  # a named runtime: the Snapdragon takes it, the Rockchip board keeps its own
    out = panel.run()
    elite, rk = out["w4a16"]
    assert elite.runtime == "qairt" and rk.runtime == "rkllm" and any("qairt does not run on rknpu" in n
                                                                        for n in rk.notes)
    panel.runtime.value = None
    out = panel.run()
    assert all(p.runtime is None and p.vendor is None for p in out["w4a16"])
    assert "none" in panel.table.value
    panel.close()


def test_no_row_is_an_order_of_magnitude_off_its_fitted_neighbour_and_every_row_answers_first():
    """Issue 55.2: RK3588 INT4 at 2,186 tok/s ("no vendor fit") beside INT8 at 113; "Fits RAM: unknown" with no why."""
    from workbench.ui.project import DEFAULT_DEVICES
    plans = {p: QuantPlan.uniform(p) for p in ("int8", "int4", "fp16")}
    panel = ProjectPanel("qwen2.5-0.5b", plans=plans, devices=list(DEFAULT_DEVICES))
    out = panel.run()
    assert panel.error is None, panel.error
    for i, device in enumerate(DEFAULT_DEVICES):
        row = [out[p][i] for p in plans]
        fitted = [r.projected_decode_tps for r in row if r.vendor is not None and r.vendor.decode_tps is not None
                  and not r.vendor.basis.startswith("no vendor fit")]
        for r in row:
            if r.projected_decode_tps is not None and fitted:
                assert max(fitted) / 10 < r.projected_decode_tps < min(fitted) * 10, (device, r.efficiency_basis)
            if r.ram_bytes is None:
                assert r.ram_why and "unknown" not in r.ram_why[:8]  # says why, not just "unknown"
    rk = out["int4"][DEFAULT_DEVICES.index("rk3588")]
    assert "w8a8 fit" in rk.vendor.basis and rk.projected_decode_tps < 2 * out["int8"][DEFAULT_DEVICES.index("rk3588")].projected_decode_tps
    table = panel.table.value
    head, fold = table.split("<details>", 1)
    assert "<th>tokens/s</th>" in head and "<th>first token</th>" in head and "<th>fits in memory</th>" in head
    assert "decode bound tok/s" not in head and "decode bound tok/s" in fold  # the rest behind the fold
    assert "unknown: set by the phone" in head  # a SoC's RAM: why it is unknown, on the row
