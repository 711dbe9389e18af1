"""The app without a browser: one session shared by every tab, AWQ from Quantize to Export, the run's archive."""
import hashlib
import json
import zipfile
from dataclasses import replace

import pytest

from workbench.model.load import load_model
from workbench.quantize.plan import QuantPlan
from workbench.ui.app import TAB_TITLES, WorkbenchApp
from workbench.ui.session import AppSession

EVAL_TOKENS = 512


@pytest.fixture
def app(tiny_model_dir, workspace, tmp_path):
    a = WorkbenchApp(str(tiny_model_dir), samples=4, seq_len=32, sweep_tokens=64, eval_tokens=EVAL_TOKENS,
                     finetune_steps=2, out_dir=tmp_path / "run", workspace=workspace)
    assert a.load() is not None and a.error is None
    return a


def test_load_builds_every_tab_on_one_session(app, tmp_path):
    assert [app.tabs.get_title(i) for i in range(len(TAB_TITLES))] == list(TAB_TITLES)
    assert app.tabs.children[1] is app.calibrate_panel and app.tabs.children[4] is app.convert_panel
    s = app.session
    assert s.lm is app.lm and s.plan == QuantPlan.uniform("int4") and s.quantized is None
    assert app.quantize_panel.session is s and app.convert_panel.session is s and app.profile_panel.session is s
    assert app.quantize_panel.bits.value == "plan" and app.quantize_panel.current_plan() == s.plan
    assert app.override_panel.plan == s.plan
    assert f"plan {s.plan.content_hash()}" in app.precisions_label.value and "none yet" in app.precisions_label.value
    assert s.out_dir == (tmp_path / "run").resolve()


def test_default_outputs_are_under_the_workspace(tiny_model_dir, workspace):
    a = WorkbenchApp(str(tiny_model_dir), workspace=workspace)
    assert a.out_dir.is_absolute() and a.out_dir.parent == (workspace.root / "app").resolve()
    assert not a.out_dir.exists()  # nothing is written before something is made


def test_bad_model_path_is_a_status_line_not_a_traceback(tmp_path, workspace):
    a = WorkbenchApp(str(tmp_path / "nowhere"), workspace=workspace)
    assert a.load() is None
    assert "does not exist" in a.error and "error:" in a.status.value
    assert a.run_sensitivity() is None and a.error == "load a model first"


def test_quantize_keeps_the_plans_settings(app):
    name = app.lm.layers[0].name
    plan = replace(QuantPlan.uniform("int4").with_override(name, "fp16"), group_size=32, symmetric=False,
                   method="awq")
    app.override_panel.set_plan(plan)
    app.use_plan()
    q = app.quantize_panel
    assert (q.method.value, q.group_size.value, q.symmetric.value, q.bits.value) == ("awq", 32, False, "plan")
    assert q.current_plan() == plan == app.session.plan


def test_sweep_then_plan_reaches_quantize_and_precisions_follows_quantize(app):
    report = app.run_sensitivity(frontier=False)
    assert report is not None and app.override_panel.sensitivity is report is app.session.sensitivity
    name = app.lm.layers[0].name
    app.override_panel.dropdowns[name].value = "fp16"
    plan = app.use_plan()
    assert plan.precision_name_for(name) == "fp16" and app.session.plan is plan
    assert app.quantize_panel.current_plan().precision_name_for(name) == "fp16"
    assert "bits/weight" in app.plan_label.value
    app.quantize_panel.bits.value = 8  # Quantize runs another plan: it becomes the session's, Precisions shows it
    assert app.quantize_panel.run() is not None
    assert app.session.plan == QuantPlan.uniform("int8") == app.override_panel.plan
    assert app.session.quantized.plan == app.session.plan and app.quantize_panel.bits.value == "plan"
    app.override_panel.dropdowns[name].value = "int4"
    app.use_plan()
    assert "is not of the current plan" in app.precisions_label.value


def test_precisions_evaluate_says_rtn_preview_for_an_awq_plan(app):
    app.override_panel.set_plan(replace(app.session.plan, method="awq"))
    point = app.override_panel.evaluate()
    assert point is not None and "RTN preview" in point.label
    assert "RTN preview" in app.override_panel.result_label.value


def test_awq_from_quantize_is_what_export_converts(app):
    """Quantize with AWQ in the app, convert to ort-int4: the simulation Export compares with is that AWQ model."""
    assert "until the Calibrate tab has run" in app.quantize_panel.calibration_note.value
    assert app.calibrate_panel.run() is not None
    assert "AWQ and RTN's importance use the Calibrate tab's run: 4 samples" in app.quantize_panel.calibration_note.value
    app.quantize_panel.method.value = "awq"
    cost = app.quantize_panel.run()
    assert cost is not None, app.quantize_panel.error
    assert cost.size_bytes > 0 and app.quantize_panel.rows[-1]["size_bytes"] == cost.size_bytes
    s = app.session
    qm = s.quantized
    assert qm.method == "awq" and qm.awq is not None and s.cost is cost and s.plan.method == "awq"
    assert s.quantized_path.is_dir() and s.quantized_path.is_relative_to(s.out_dir)
    assert "awq" in app.convert_panel.children[1].value.lower()  # the Export tab names the plan and the model
    report = app.convert_panel.run("ort-int4")
    assert report is not None, app.convert_panel.error
    assert s.prepared().qm is qm  # no reload, no re-quantization
    assert report.gap is None  # the converted model's KL is within the gap of the simulation's
    assert report.eval_tokens == cost.tokens
    assert report.simulation["kl_divergence"] == pytest.approx(cost.kl_divergence, rel=1e-3, abs=1e-6)
    assert report.kl_divergence == pytest.approx(report.simulation["kl_divergence"], rel=0.5, abs=2e-3)
    doc = json.loads((report.out_dir / "conversion.json").read_text())
    assert QuantPlan.from_dict(doc["plan"]).content_hash() == qm.plan.content_hash() and doc["plan"]["method"] == "awq"
    assert doc["quantized_model"]["path"] == str(s.quantized_path.resolve())  # written by convert() itself
    assert doc["quantized_model"]["manifest_sha256"] == \
        hashlib.sha256((s.quantized_path / "manifest.json").read_bytes()).hexdigest()
    assert doc["upstream"]["awq_search"] == qm.awq["workspace_key"]
    assert report.out_dir.is_relative_to(s.conversion_dir)
    assert "Quantize tab measured this model" in app.convert_panel.status.value


def test_export_before_quantize_says_what_to_do(app):
    assert app.convert_panel.run("ort-int4") is None
    assert "quantize first" in app.convert_panel.error


def test_download_packs_the_run(app, tmp_path):
    assert app.calibrate_panel.run() is not None
    assert app.quantize_panel.run() is not None
    assert app.convert_panel.run("ort-int4") is not None
    app.profile_panel.prompt_lengths.value, app.profile_panel.repeats.value = "8", 1
    assert app.profile_panel.run() is not None and app.session.profiles
    assert "KL divergence:" in app.quantize_panel.words.value  # the tables' terms said beside them
    assert "top-1 agreement:" in app.convert_panel.table.value and "nats/token" in app.convert_panel.table.value
    messages = []
    app.download_link.send = lambda content, buffers=None: messages.append((content, buffers or []))
    app.download_link.chunk_bytes = 1 << 20
    path = app.download()
    assert path is not None and app.error is None and path.parent == app.out_dir
    assert app.download_link.sent == path.name
    # the zip crosses in 1 MB pieces between a start (its size, for the page's "receiving k of n MB") and an end
    kinds = [m["kind"] for m, _ in messages]
    size = path.stat().st_size
    assert kinds == ["start"] + ["chunk"] * -(-size // (1 << 20)) + ["end"] and messages[0][0]["bytes"] == size
    assert b"".join(b for m, bufs in messages for b in bufs) == path.read_bytes()
    assert max(len(b) for _, bufs in messages for b in bufs) <= 1 << 20
    run = app.out_dir.name
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "unpacked")
    for member in ("model/quantization.json", "model/plan.json", "convert/ort-int4/conversion.json",
                   "convert/ort-int4/prefill.onnx", "plan.json", "report.json", "report.md", "report.html",
                   "overrides/llamacpp-tensor-types.txt", "overrides/mnn-quant-config.json", "figures/figures.html",
                   "figures/quantize-cost.json", "figures/calibrate-heatmap.json"):
        assert f"{run}/{member}" in names
    report = json.loads((tmp_path / "unpacked" / run / "report.json").read_text())
    assert report["quantized"]["cost"]["kl_divergence"] == app.session.cost.kl_divergence
    assert [c["target"] for c in report["conversions"]] == ["ort-int4"] and report["profiles"]
    model = load_model(tmp_path / "unpacked" / run / "model")  # what `workbench eval` reads
    assert model.quantized is not None and model.quantized.plan == app.session.plan


def test_finetune_tab_and_continue_with_its_model(app):
    assert app.tabs.children[0].children[1] is app.finetune_panel
    assert app.use_finetuned() is None and "fine-tune first" in app.error
    app.finetune_panel.batch_size.value, app.finetune_panel.seq_len.value = 2, 32
    tuned = app.finetune_panel.run()
    assert tuned is not None and tuned.out_dir.startswith(str(app.out_dir))
    lm = app.use_finetuned()
    assert lm is not None and app.session.lm is lm and str(lm.path) == tuned.out_dir
    assert app.calibrate_panel.lm is lm and app.session.quantized is None


def test_outputs_folder_can_be_chosen(app, tmp_path):
    app.out_dir_text.value = str(tmp_path / "elsewhere")
    assert app.session.out_dir == (tmp_path / "elsewhere").resolve()
    assert app.convert_panel.out_dir.value.startswith(str(app.session.out_dir))
    assert app.profile_panel.directory.value.startswith(str(app.session.out_dir))


def test_session_resets_on_a_new_model(tiny_model_dir, workspace, tmp_path):
    s = AppSession(out_dir=tmp_path / "r", workspace=workspace)
    s.load(tiny_model_dir)
    s.plan = QuantPlan.uniform("int8")
    s.calibration = ("set", "stats")
    seen = []
    s.observe(lambda c: seen.append(c["name"]), names=["lm", "plan", "calibration"])
    s.load(tiny_model_dir)
    assert s.plan == QuantPlan.uniform("int4") and s.calibration is None and set(seen) == {"lm", "plan", "calibration"}


def test_library_progress_is_a_status_line_not_a_widget(app):
    """tqdm.auto's widget bars close themselves; captured in a panel's log they became "model not found"."""
    import tqdm.auto

    from workbench.ui.base import progress_into

    def work():
        for _ in tqdm.auto.tqdm(range(3), desc="layers", leave=False):
            pass
        return type(tqdm.auto.tqdm(disable=True)).__module__

    lines = []
    with progress_into(lines.append):
        module = work()
    assert module == "workbench.ui.base" and lines and "layers" in lines[-1] and "/3" in lines[-1]
    assert tqdm.auto.tqdm.__module__ != "workbench.ui.base"  # given back afterwards
    ok, _ = app._attempt("working", work)
    assert ok and "layers" in app.status.value


def test_attempt_reports_failure_when_the_output_widget_keeps_the_exception(app, monkeypatch):
    """In a kernel an Output widget shows an exception's traceback and swallows it: the step must still fail."""
    import contextlib

    from workbench.errors import PlanError

    @contextlib.contextmanager
    def kernel_like_output():
        try:
            yield
        except Exception:  # what ipywidgets.Output.__exit__ does inside a kernel
            pass

    monkeypatch.setattr(app, "log_output", kernel_like_output())
    assert app._attempt("working", lambda: 1 / 0) == (False, None)
    assert "unexpected error" in app.status.value
    monkeypatch.setattr(app, "log_output", kernel_like_output())
    assert app._attempt("working", lambda: (_ for _ in ()).throw(PlanError("bad plan"))) == (False, None)
    assert "bad plan" in app.status.value


def test_a_second_model_starts_a_new_run_and_the_zip_holds_only_its_results(app, make_tiny_model, tmp_path):
    """Loading another model moves the outputs to a new run folder: its report and zip describe that model alone."""
    first_dir, first = app.out_dir, app.lm
    assert app.calibrate_panel.run() is not None and app.quantize_panel.run() is not None
    assert app.download() is not None and (first_dir / "figures" / "calibrate-heatmap.json").is_file()
    other = make_tiny_model("llama", hidden=96, intermediate=160)
    lm = app.load(str(other))
    assert lm is not None and app.error is None
    assert app.out_dir != first_dir and app.out_dir_text.value == str(app.out_dir)
    assert "new run folder" in app.status.value
    assert app.quantize_panel.run() is not None
    path = app.download()
    assert path is not None and path.parent == app.out_dir
    run = app.out_dir.name
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        report = json.loads(z.read(f"{run}/report.json"))
        page = z.read(f"{run}/report.html").decode()
        record = json.loads(z.read(f"{run}/run.json"))
    assert record["fingerprint"] == report["model"]["fingerprint"] == app.session.fingerprint
    assert report["model"]["path"] == str(lm.path) and "calibration" not in report
    assert not any("calibrate" in n for n in names)  # the first model's calibration figures stayed behind
    assert str(first.path) not in page and str(first.path) not in json.dumps(report)
    # the first run is untouched and still names its own model
    assert json.loads((first_dir / "run.json").read_text())["path"] == str(first.path)
    # choosing the first run's folder for the second model is refused in one line
    app.out_dir_text.value = str(first_dir)
    assert "holds the run of another model" in app.error and app.session.out_dir != first_dir


def test_reloading_the_same_model_keeps_its_run_folder(app):
    before = app.out_dir
    assert app.load() is not None and app.out_dir == before


def test_default_sensitivity_is_the_fisher_estimate_and_fills_the_chart(app):
    """The quick estimate by default, then uniform and automatic plans measured: the chart has points at once."""
    assert app.sweep_how.value == "proxy" and app.sweep_precisions.value == ("int8", "int4")
    report = app.run_sensitivity()
    assert report is not None and report.score == "proxy" and report.precisions == ("int8", "int4")
    labels = [p.label for p in app.override_panel.points]
    assert labels[:2] == ["uniform int8", "uniform int4"] and sum(lab.startswith("auto") for lab in labels) == 2
    fig = app.override_panel.chart
    assert {t.name for t in fig.data} >= {"uniform", "auto"} and all(len(t.x) for t in fig.data)
    assert "estimated KL" in app.sweep_line.html.value and "chart" in app.sweep_line.html.value
    assert app.sweep_line.bar.layout.display == "none"  # the bar shows only while it runs
    assert "precisions-pareto" in app.figures_on_show()
    again = app.run_sensitivity()  # cached, and the chart is not measured twice
    assert again.trials_run == 0 and [p.label for p in app.override_panel.points] == labels


def test_the_measured_sweep_stays_available(app):
    app.sweep_how.value = "kl"
    report = app.run_sensitivity(precisions=("int4",), frontier=False)
    assert report is not None and report.score == "kl" and report.precisions == ("int4",)
    assert "measured KL" in app.sweep_line.html.value


def test_library_progress_drives_the_status_lines_bar(app):
    import tqdm.auto
    seen = []

    def work():
        with tqdm.auto.tqdm(total=4, desc="layers") as bar:
            for _ in range(4):
                for _ in tqdm.auto.tqdm(range(7), desc="inner", leave=False):  # nested: not the widget's count
                    pass
                bar.update(1)
                seen.append((app.sweep_line.bar.value, app.sweep_line.bar.max, app.sweep_line.bar.layout.display))
        return True

    ok, _ = app._attempt("working", work, app.sweep_line)
    assert ok and seen[-1] == (4, 4, "") and [v for v, _, _ in seen] == [1, 2, 3, 4]
    assert app.sweep_line.bar.layout.display == "none" and app.sweep_line.bar.description == "layers"


def test_a_status_line_clears_when_another_action_succeeds(app):
    assert app.convert_panel.run("ort-int4") is None and "quantize first" in app.convert_panel.status.value
    assert app.download_line.html.value == "" and app.status.value.startswith("loaded")
    assert app.quantize_panel.run() is not None
    assert app.convert_panel.status.value == "" and app.status.value == ""  # earlier messages are gone
    assert "integer layers" in app.quantize_panel.status.value  # the new one sits under its own button
    assert app.download() is not None and app.quantize_panel.status.value == ""
    assert "downloading" in app.download_line.html.value


# figures of workbench/charts/projection.py (the Project tab), checked on their own below
PROJECTION_FIGURES = ("project-devices", "project-vendor", "project-pareto")


@pytest.fixture
def walked(app):
    """Every tab's main action once, so that every figure the app makes is on show."""
    assert app.calibrate_panel.run() is not None
    assert app.run_sensitivity() is not None and app.override_panel.evaluate() is not None
    assert app.quantize_panel.run() is not None and app.convert_panel.run("ort-int4") is not None
    app.profile_panel.prompt_lengths.value, app.profile_panel.repeats.value = "8", 1
    assert app.profile_panel.run() is not None and app.project_panel.run() is not None
    app.compress_panel.mlp.value = 0.25
    assert app.compress_panel.score() is not None and app.compress_panel.prune() is not None
    return app.figures_on_show()


def test_every_figure_the_app_makes_reads_true(walked):
    """Legend colours are marker colours, no axis zooms near-equal points apart, log axes tick at decades."""
    from workbench.charts.checks import check_figures
    expected = {"calibrate-coverage", "calibrate-heatmap", "calibrate-overview", "calibrate-channels",
                "precisions-pareto", "quantize-cost", "quantize-errors", "export-conversions", "profile-profile",
                "profile-decode-bound", "compress-pareto", "compress-table", "compress-heads", "compress-channels"}
    assert expected <= set(walked)
    problems = check_figures({k: v for k, v in walked.items() if k not in PROJECTION_FIGURES})
    assert problems == {}


def test_the_project_tabs_figures_read_true(walked):
    from workbench.charts.checks import check_figures
    assert set(PROJECTION_FIGURES) <= set(walked)
    assert check_figures({k: walked[k] for k in PROJECTION_FIGURES}) == {}


# advance widths of DejaVu Sans (units of 1/2048 em), the widest of the fonts a Linux browser shows the app in
_ADVANCE = {**dict(zip("abcdefghijklmnopqrstuvwxyz", (1255, 1300, 1126, 1300, 1260, 721, 1300, 1298, 569, 569, 1186,
                                                      569, 1995, 1298, 1253, 1300, 1300, 842, 1067, 803, 1298, 1212,
                                                      1675, 1212, 1212, 1075))),
            **dict(zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", (1401, 1405, 1430, 1577, 1294, 1178, 1587, 1540, 604, 604, 1343,
                                                      1141, 1767, 1532, 1612, 1235, 1612, 1423, 1300, 1251, 1499, 1401,
                                                      2025, 1403, 1251, 1403))),
            **dict.fromkeys("0123456789", 1303), " ": 651, ".": 651, ",": 651, "-": 739, "/": 690, ":": 690,
            "(": 799, ")": 799, "'": 563, "_": 1024, "%": 1946}
LABEL_PX = 80  # ipywidgets 8's --jp-widgets-inline-label-width, at its 13 px font
CHECKBOX_PX = 22  # the box and its gap before a checkbox's label


def label_px(text: str, font_px: float = 13) -> float:
    """How wide ``text`` is drawn (a character not in the table counts as wide as a capital)."""
    return sum(_ADVANCE.get(c, 1540) for c in text) * font_px / 2048


def cut_labels(root) -> list[str]:
    """Every widget under ``root`` whose description is wider than its label (ipywidgets cuts it: "temperat…").
    A label of width "initial" (or "auto") is as wide as its text; buttons and checkboxes of no fixed width show
    theirs whole."""
    import ipywidgets as widgets
    seen, stack, cut = set(), [root], []
    while stack:
        w = stack.pop()
        if id(w) in seen:
            continue
        seen.add(id(w))
        stack.extend(getattr(w, "children", None) or ())
        desc = getattr(w, "description", None)
        if desc and isinstance(w, widgets.Checkbox) and str(w.layout.width or "").endswith("px"):
            room = float(w.layout.width[:-2]) - CHECKBOX_PX  # a fixed-width checkbox: its label is what is left
            if label_px(desc) > room:
                cut.append(f"Checkbox '{desc}' ({label_px(desc):.0f} px in {room:.0f} px)")
            continue
        if not desc or isinstance(w, (widgets.Button, widgets.ToggleButton, widgets.Checkbox)):
            continue
        width = getattr(getattr(w, "style", None), "description_width", "") or f"{LABEL_PX}px"
        if width.endswith("px") and label_px(desc) > float(width[:-2]):
            cut.append(f"{type(w).__name__} '{desc}' ({label_px(desc):.0f} px in {width})")
    return cut


def test_no_label_in_the_app_is_cut(app):
    """No "learning r…", "INT4 acc. …" or "temperat…": each description fits its label, or its label fits it."""
    from workbench.ui.graph import GraphPanel
    assert label_px("temperature") > LABEL_PX > label_px("max tokens")  # what a browser cut, and what it did not
    assert app.finetune_panel.lr.description == "learning rate" and app.compress_panel is not None
    assert cut_labels(app) == []
    panel = GraphPanel(serve_netron=False)
    assert cut_labels(panel) == []
    panel.close()


def test_export_offers_the_targets_the_plan_reaches_and_greys_the_rest_with_why(app):
    """Issue 55.6: every target offered whatever the plan; one the plan cannot go to is greyed with its reason."""
    from workbench.quantize.plan import QuantPlan
    from workbench.targets.registry import plan_reach
    panel = app.convert_panel
    app.session.plan = QuantPlan.uniform("int8")
    offered = [v for _, v in panel.target.options]
    assert "tensorrt-edgellm" not in offered and "ort-int4" in offered  # Edge-LLM carries int4 only
    assert "tensorrt-edgellm" in panel.reach_note.value and "cannot carry int8" in panel.reach_note.value
    assert any("tensorrt (files for the device; not run here)" == label for label, _ in panel.target.options)
    assert panel.run("tensorrt-edgellm") is None and "cannot carry int8" in panel.error
    app.session.plan = QuantPlan.uniform("int4")
    assert "cannot carry" not in panel.reach_note.value  # int4 it carries (offered where its exporter is installed)
    assert plan_reach(["int4", "fp16"])["tensorrt-edgellm"] is None


def test_choosing_every_precision_keeps_the_menu_showing_it(app, monkeypatch):
    """Issue 55.7: a dropdown whose value is None shows nothing chosen: the menu went blank."""
    import workbench.ui.app as ui
    app.sweep_precisions.label = "every precision"
    assert app.sweep_precisions.index == 2 and app.sweep_precisions.label == "every precision"
    seen = {}

    def fake(lm, precisions, **kw):
        seen["precisions"] = precisions
        raise ValueError("stop here")
    monkeypatch.setattr(ui, "run_sensitivity", fake)
    app.run_sensitivity()
    assert seen["precisions"] is None  # every registered precision, as run_sensitivity reads None


def test_an_output_folder_the_app_cannot_create_is_one_red_line(app, tmp_path):
    """Issue 55.14: an output folder the app cannot create showed Path.mkdir's traceback on the page."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    panel = app.convert_panel
    assert app.quantize_panel.run() is not None, app.quantize_panel.error
    panel.out_dir.value = str(blocker / "convert")
    assert panel.run("ort-int4") is None
    assert panel.error.startswith(f"cannot use '{blocker / 'convert'}") and "not a directory" in panel.error
    assert "choose an output folder you can write to" in panel.error
    assert "Traceback" not in str(panel.log_output.outputs) and panel.error.count("\n") == 0


def test_no_stale_status_after_a_later_success_or_a_new_load(app, monkeypatch, tmp_path):
    """Issue 55.8/55.9: a Convert error stayed after Compare on the devices succeeded; "downloading..." and the first
    run's "save again" link stayed after a (failed) Load."""
    import workbench.ui.devices_gap as dg
    from workbench.run.devices_gap import DevicesGap, make_row, graph_scores
    assert app.convert_panel.run("ort-int4") is None and "quantize first" in app.convert_panel.status.value

    def measured(model, *, plan, targets, work, on_row, **kw):
        gap = DevicesGap(str(model), None, None, "8gen3", 512, 4, work_dir=str(work))
        gap.rows.append(make_row("simulation", "PyTorch", prefill=graph_scores(0.01, 0.9, positions=512)))
        on_row(gap)
        return gap
    monkeypatch.setattr(dg, "measure_devices_gap", measured)
    assert app.convert_panel.gap_panel.run() is not None
    assert app.convert_panel.status.value == ""  # the Convert error is gone
    counts = []  # issue 55.8: packing the run moves the bar under Download (it froze the page without one)
    monkeypatch.setattr(app.download_line, "count", lambda n, total, desc: counts.append((n, total, desc)))
    assert app.download() is not None and "downloading" in app.download_line.html.value
    assert any(desc.startswith("packing the run") and total and n == total for n, total, desc in counts), counts
    assert app.download_link.sent
    assert app.load(str(tmp_path / "no-such-model")) is None and app.error
    assert app.download_line.html.value == "" and app.download_link.sent == ""


def test_the_intro_sentence_is_said_once():
    """Issue 55.12: the page said what the app does twice (the notebook's markdown, then the app's own line)."""
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "app.ipynb").read_text(encoding="utf-8"))
    markdown = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "INT4 / INT8 / FP16" not in markdown and "precision" not in markdown.lower()


def test_a_target_this_machine_cannot_convert_for_is_greyed_in_one_sentence(app, monkeypatch):
    """Issue 55.13: Edge-LLM's refusal was lines sending the user to the command line, after the click."""
    import workbench.targets.edgellm as edgellm
    from workbench.quantize.plan import QuantPlan
    monkeypatch.setattr(edgellm, "edgellm_python", lambda: None)  # as on a machine without `make edgellm-env`
    app.session.plan = QuantPlan.uniform("int8")  # a new plan: the targets it reaches are worked out again
    app.session.plan = QuantPlan.uniform("int4")
    panel = app.convert_panel
    assert "tensorrt-edgellm" not in [v for _, v in panel.target.options]
    import html
    note = html.unescape(panel.reach_note.value)
    why = note.split("<b>tensorrt-edgellm</b>: ", 1)[1].split("; <b>", 1)[0]
    assert "not installed on this machine" in why and "the app cannot convert for it here" in note
    assert panel.run("tensorrt-edgellm") is None and panel.error.count(". ") == 0 and "\n" not in panel.error


def test_a_refusals_command_line_example_becomes_what_to_do_in_the_app(app, monkeypatch):
    from workbench.errors import PlanError
    panel = app.convert_panel

    def refuse():
        raise PlanError("executorch cannot carry layer 'x' as 8-bit per-128 codes: XNNPACK holds int8 weights per "
                        "channel only; give it int8 per channel (e.g. `workbench quantize MODEL --bits 8 "
                        "--group-size 0 --out Q`, then convert Q)")
    monkeypatch.setattr(panel, "_convert_now", refuse)
    assert panel.run("ort-int4") is None
    assert "`workbench" not in panel.error and "in the app: a layer's precision is set in Precisions" in panel.error


def test_the_apps_rows_wrap_rather_than_scroll(app):
    """Issue 55.12: ipywidgets boxes scroll (overflow: auto): every layer row had a tiny scrollbar, wide rows a
    horizontal one. The app's style makes its rows wrap; the logs keep their own scrolling (set on their layout)."""
    from workbench.ui.app import APP_STYLE
    assert "workbench-app" in app._dom_classes and app.children[0].value.startswith(APP_STYLE)
    assert ".workbench-app .widget-hbox" in APP_STYLE and "overflow: visible" in APP_STYLE and "flex-wrap: wrap" in APP_STYLE
    assert app.log_output.layout.overflow == "auto" and app.quantize_panel.log_output.layout.overflow == "auto"
