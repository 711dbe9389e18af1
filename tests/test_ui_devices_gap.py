"""The Export tab's Compare on the devices: the session's plan measured by workbench.run.devices_gap, table and chart
filled target by target, a target without its toolchain disabled with what to install."""
import html

import pytest

from workbench.run.devices_gap import GAP_FILE, GAP_RULE, read_devices_gap
from workbench.quantize.plan import QuantPlan
from workbench.ui.devices_gap import DevicesGapPanel, gap_table_html
from workbench.ui.session import AppSession, report_markdown


@pytest.fixture
def session(tiny_model_dir, workspace, tmp_path):
    s = AppSession(out_dir=tmp_path / "run", workspace=workspace)
    s.load(str(tiny_model_dir))
    s.plan = QuantPlan.uniform("int8")
    return s


def test_missing_toolchain_is_disabled_and_says_what_to_install(session, monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_RKNN_PYTHON", str(tmp_path / "no-python"))
    p = DevicesGapPanel(session)
    assert p.checks["rknn"].disabled and not p.checks["rknn"].value
    assert "rknn" in p.missing and "make rknn-env" in p.missing_label.value
    assert p.chosen() == ["simulation", "ort-qdq"]  # the cheapest pair by default
    assert p.soc.value == "snapdragon-8-gen-3" and "snapdragon-8-gen-1" in dict(p.soc.options).values()
    for c in p.checks.values():
        c.value = False
    assert p.run() is None and p.error == "choose at least one target"
    assert p.checks["rknn"].disabled and not p.checks["simulation"].disabled  # still, after the controls thaw


@pytest.mark.slow
def test_run_fills_table_chart_session_and_report(session, tmp_path):
    p = DevicesGapPanel(session, max_tokens=256, targets=("simulation", "htp"))
    if p.checks["htp"].disabled:  # onnxruntime-qnn not installed: the simulation alone
        p.checks["htp"].value = False
    thread = p.start()  # the button: in the background
    thread.join(600)
    gap = p.result
    assert gap is not None and p.error is None, p.status.value
    sim = gap.row("simulation")
    assert 0 < sim["prefill"]["kl"] < 1 and sim["prefill"]["positions"] > 100
    assert f"{sim['prefill']['kl']:.2e}" in p.table.value and "data-target='simulation'" in p.table.value
    if gap.row("htp") is not None:  # chosen without ort-qdq: its row says so, the simulation is unaffected
        assert "choose ort-qdq too" in gap.row("htp")["note"]
    assert p.progress.value == len(gap.rows) and html.escape(f"no gap flagged ({GAP_RULE})") in p.status.value
    assert list(dict.fromkeys(t.name for t in p.chart.data)) == ["prefill", "decode"]  # bars and their legend keys
    assert p.chart.data[0].y[0] == sim["prefill"]["kl"]
    assert p.figures["devices-gap"] is p.chart and p.chart_box.layout.display == ""
    assert session.devices_gap is gap and gap.plan_hash == session.plan.content_hash()
    path = session.devices_gap_dir / GAP_FILE
    assert path.is_file() and read_devices_gap(path).rows[0]["prefill"]["kl"] == sim["prefill"]["kl"]
    assert "| simulation |" in report_markdown(session.report())
    import zipfile
    archive = session.write_archive()  # the rows travel with the run, and its report.html shows them
    with zipfile.ZipFile(archive) as z:
        names = z.namelist()
        page = z.read(f"{archive.stem}/report.html").decode()
    assert f"{archive.stem}/devices-gap/{session.devices_gap_dir.name}/{GAP_FILE}" in names
    assert "<h2>On the devices</h2>" in page and f"{sim['prefill']['kl']:.2e}" in page


def test_table_marks_gaps_and_failures():
    rows = [{"target": "ort-qdq", "runtime": "cpu", "prefill": {"kl": 0.1, "top1": 0.9}, "decode": None,
             "bytes": 10**6, "seconds": 3.0, "peak_bytes": 2**30, "gap": "prefill: KL <big>", "note": "", "error": None},
            {"target": "mnn", "runtime": "failed", "prefill": None, "decode": None, "bytes": None, "seconds": None,
             "peak_bytes": None, "gap": None, "note": "failed: RuntimeError: x", "error": "failed: RuntimeError: x"}]
    out = gap_table_html(rows)
    assert "GAP</span> prefill: KL &lt;big&gt;" in out and "1.00e-01" in out and "font-style:italic" in out
    assert out.count("<tr class='gap-row'") == 2
    assert f"</table><div class='gap-rule' style='font-size:12px;color:#566573'>{html.escape(GAP_RULE)}</div>" in out
    assert "1.5x the simulation" in GAP_RULE  # the threshold, not only the verdict
    # issue 55.10: one convention of units (decimal, workbench.units): size in MB beside peak memory in GB, no GiB
    assert "<th>MB</th>" in out and "<th>peak GB</th>" in out and "GiB" not in out and "MiB" not in out
    assert "<td>1.0</td>" in out and "<td>1.07</td>" in out  # 10^6 bytes; 2^30 bytes = 1.07 GB


def test_the_runtimes_that_time_themselves_show_their_tok_s(session, monkeypatch):
    """The Export tab offers the mnn-llm and executorch rows, and the table shows a runtime's own tok/s in its columns
    (a row without them: '-')."""
    import workbench.ui.devices_gap as ui
    monkeypatch.setattr(ui, "toolchains", lambda: {t: None for t in ui.TARGETS})  # as if every toolchain were here
    p = DevicesGapPanel(session)
    assert {"mnn-llm", "executorch"} <= set(p.checks) and p.checks["executorch"].description.startswith("ExecuTorch")
    assert not p.checks["executorch"].disabled and not p.checks["executorch"].value  # one click, not a default
    base = {"prefill": {"kl": 0.01, "top1": 0.95}, "decode": {"kl": 0.02, "top1": 0.9}, "bytes": 2 * 10**6,
            "seconds": 9.0, "peak_bytes": 2**30, "gap": None, "note": "", "error": None}
    rows = [{**base, "target": "executorch", "runtime": "ExecuTorch runtime, XNNPACK CPU",
             "speed": {"runtime": "ExecuTorch (XNNPACK)", "prefill_tps": 4321.0, "decode_tps": 123.4}},
            {**base, "target": "ort-qdq", "runtime": "cpu"}]
    out = gap_table_html(rows)
    assert "<th>prefill tok/s</th><th>decode tok/s</th>" in out
    et, qdq = out.split("<tr class='gap-row'")[1:]
    assert "<td>2.0</td><td>4,321</td><td>123</td>" in et and "<td>2.0</td><td>-</td><td>-</td>" in qdq


def test_side_by_side_runs_the_targets_on_worker_processes(session, monkeypatch):
    """The panel's "side by side" box picks the sweep backend measure_devices_gap runs the targets on: one after
    another by default (each row's time and memory its own), worker processes when raised."""
    import workbench.ui.devices_gap as ui
    from workbench.model.sweep_backends import LocalBackend, ProcessBackend
    seen = []

    def fake(model, *, backend, work, **kw):
        seen.append(backend)
        raise ui.WorkbenchError("stopped here")
    monkeypatch.setattr(ui, "measure_devices_gap", fake)
    p = DevicesGapPanel(session)
    assert p.workers.value == 1 and p.workers in p.controls
    p.run()
    p.workers.value = 2
    p.run()
    assert isinstance(seen[0], LocalBackend)
    assert isinstance(seen[1], ProcessBackend) and seen[1].workers == 2
    assert p.error == "stopped here" and not p.workers.disabled


def test_a_flag_says_what_to_try_and_its_button_widens_the_layers_it_names(session):
    """Issue 55.4: a red GAP with no next step; the layer-wise cause names the layers, the button sets them."""
    from workbench.run.devices_gap import gap_advice
    base = {"runtime": "cpu", "prefill": {"kl": 0.1, "top1": 0.9}, "decode": None, "bytes": 1, "seconds": 1.0,
            "peak_bytes": 1, "note": "", "error": None}
    qdq = {**base, "target": "ort-qdq", "gap": "prefill: KL big", "layerwise": {"first_block": 1},
           "cause": "the QDQ graph departs from the simulation at block 1's mlp (model.layers.1.mlp gate/up/down_proj)"}
    rknn = {**base, "target": "rknn", "gap": "prefill: top-1 vs simulation 0.9 < 0.95", "cause": None}
    fine = {**base, "target": "mnn", "gap": None}
    names = [i.name for i in session.lm.layers]
    a = gap_advice(qdq, session.plan, names)
    assert a.layers == [f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    assert a.precision == "fp16" and "instead of int8" in a.text  # the session's plan is INT8: one step wider
    assert gap_advice(fine, session.plan, names) is None and "fp16" in gap_advice(rknn, session.plan, names).text
    p = DevicesGapPanel(session)
    p._show_advice([qdq, rknn, fine])
    assert len(p.advice.children) == 2
    row, button = p.advice.children[0].children
    assert "what to try" in row.value and "block 1&#x27;s mlp" in row.value
    button.click()
    assert all(session.plan.precision_name_for(n) == "fp16" for n in a.layers)
    assert session.plan.precision_name_for("model.layers.0.mlp.up_proj") == "int8"
    assert "press Compare on the devices" in p.status.value


def test_kl_top1_and_nats_are_said_in_words_beside_the_table():
    """Issue 55.10: KL, top-1 and nats unexplained in the app and the report."""
    out = gap_table_html([])
    assert "how far the model&#x27;s next-token probabilities are" in out and "nats/token: the unit of KL" in out
    assert "top-1 agreement: the share of tokens" in out and "title=" in out  # a hover too
