"""workbench.run.devices_gap: the rows built from fake measurements (which graphs they flag), and a real run on a tiny
model where one target fails and the others still fill their rows."""
import json
import os
import stat

import pytest

from workbench.targets.convert import GAP_KL_FLOOR, GAP_KL_RATIO, GAP_TOP1
from workbench.run.devices_gap import (GAP_FILE, GAP_RULE, DevicesGap, absent_row, convert_row, format_table, gap_of,
                                   graph_scores, htp_row, measure_devices_gap, read_devices_gap, rknn_row,
                                   simulation_row, toolchains)
from workbench.errors import PlanError, WorkbenchError
from workbench.quantize.plan import QuantPlan
from workbench.targets.htp import INSTALL, HtpMeasurement, qnn_available
from workbench.targets.qnn import HTP_GAP_KL
from workbench.targets.rknn import RknnMeasurement, RknnScores

SIM_KL = 0.004


def _report(kl, top1, vs_sim, decode=None):
    return {"kl_divergence": kl, "top1_agreement": top1, "top1_agreement_vs_simulation": vs_sim,
            "simulation": {"kl_divergence": SIM_KL}, "eval_tokens": 1000, "decode": decode or {},
            "files": [{"path": "/x/prefill.qdq.onnx", "bytes": 3_000_000}, {"path": "/x/conversion.json", "bytes": 9}]}


def _htp(kl_vs_qdq):
    g = {"kl_vs_float": SIM_KL, "top1_vs_float": 0.97, "kl_vs_simulation": kl_vs_qdq, "top1_vs_simulation": 0.99,
         "tokens": 508}
    return HtpMeasurement("8gen3", 57, 75, dict(g), {**g, "kl_vs_simulation": 1e-4, "tokens": 63, "prompt": 64}, {},
                          7_900_000, [], 10.0, 20.0, 2**29)


def _rknn(decode_kl):
    pre = RknnScores(512, 0.005, 0.96, 0.97, SIM_KL, 0.97)
    dec = RknnScores(64, decode_kl, 0.5, 0.5, SIM_KL, 0.97)
    return RknnMeasurement("demo", "w8a8", pre, dec, 5_000_000, 60.0, {}, 2**30, 2**29, [])


def test_rows_flag_what_convert_and_the_htp_rule_would():
    rows = [simulation_row({"kl_divergence": SIM_KL, "top1_agreement": 0.97, "tokens": 1000}, 5.0, 2**28),
            convert_row("ort-qdq", "cpu", _report(SIM_KL, 0.97, 0.99, {"kl_divergence": 0.04,
                        "top1_agreement": 0.9, "top1_agreement_vs_simulation": 0.99, "tokens": 512}), 30.0, 2**29),
            convert_row("mnn", "mnn", _report(SIM_KL, 0.97, GAP_TOP1 - 0.01), 20.0, 2**29),
            htp_row(_htp(HTP_GAP_KL * 2), SIM_KL, 40.0, 2**28),
            rknn_row(_rknn(0.001), 90.0, 2**28),
            absent_row("rknn", "rknn-toolkit2 is not installed: make rknn-env")]
    sim, qdq, mnn, htp, rknn, absent = rows
    assert sim["gap"] is None and sim["decode"] is None
    # ort-qdq: prefill within the simulation, decode KL 0.04 > 1.5 x 0.004 + 0.002
    assert qdq["gap"].startswith("decode: KL") and "prefill" not in qdq["gap"]
    assert qdq["bytes"] == 3_000_000  # graph files only, not conversion.json
    assert mnn["gap"].startswith("prefill: top-1 vs simulation") and mnn["note"] == "no decode graph scored"
    assert htp["gap"].startswith("prefill: KL vs CPU QDQ") and "decode" not in htp["gap"]
    assert htp["peak_bytes"] == 2**29  # the larger of the child and the HTP process
    assert rknn["gap"] == f"decode: top-1 vs simulation 0.500 < {GAP_TOP1:g}"
    assert rknn["peak_bytes"] == 2**30 and absent["gap"] is None and absent["error"] is None
    text = format_table(rows)
    table, rule = text.split("\n\n")  # the table, then the rule its gaps are flagged by
    table = table.splitlines()
    assert rule == GAP_RULE and f"above {GAP_KL_RATIO:g}x the simulation's + {GAP_KL_FLOOR:g}" in rule
    assert f"below {GAP_TOP1:g}" in rule and f"above {HTP_GAP_KL:g}" in rule
    assert len(table) == 2 + len(rows) and all(line.count("|") == table[0].count("|") for line in table)
    assert "**GAP**" in table[3] and "**GAP**" not in table[2]
    assert "make rknn-env" in table[-1] and "| - | - | - | - |" in table[-1]
    assert "| 1,000 / 512 |" in table[3]  # positions scored: prefill / decode
    qdq["cause"] = "CPU QDQ departs from the simulation at block 1's mlp"
    assert format_table(rows).splitlines()[3].endswith("Layer-wise: CPU QDQ departs from the simulation at block 1's "
                                                       "mlp |")


def test_gap_threshold_is_convert_rule():
    edge = GAP_KL_RATIO * SIM_KL + GAP_KL_FLOOR
    assert gap_of(graph_scores(edge * 0.99, 0.9, 0.99, SIM_KL)) is None
    assert gap_of(graph_scores(edge * 1.01, 0.9, 0.99, SIM_KL)) is not None
    assert gap_of(graph_scores(SIM_KL, 0.9, GAP_TOP1, SIM_KL)) is None
    assert gap_of(None) is None


def test_bad_requests_are_refused_before_anything_runs(tiny_model_dir, tmp_path):
    with pytest.raises(PlanError, match="unknown device target"):
        measure_devices_gap(tiny_model_dir, bits=8, targets=["npu"], work=tmp_path)
    with pytest.raises(PlanError, match="give a plan or bits"):
        measure_devices_gap(tiny_model_dir, targets=["simulation"], work=tmp_path)
    with pytest.raises(PlanError, match="has no Hexagon HTP"):
        measure_devices_gap(tiny_model_dir, bits=8, targets=["htp"], soc="rk3588", work=tmp_path)
    assert not (tmp_path / GAP_FILE).exists()


def test_read_refuses_what_is_not_a_gap_file(tmp_path):
    (tmp_path / GAP_FILE).write_text(json.dumps({"rows": 3}))
    with pytest.raises(WorkbenchError, match="not a devices gap file"):
        read_devices_gap(tmp_path)


def test_toolchains_name_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_RKNN_PYTHON", str(tmp_path / "none"))
    t = toolchains()
    assert t["simulation"] is None and t["ort-qdq"] is None
    assert "make rknn-env" in t["rknn"] or "rknn" in t["rknn"]


@pytest.mark.slow
def test_real_run_one_failing_target_leaves_the_other_rows(tiny_model_dir, tmp_path, monkeypatch):
    """simulation and ort-qdq measured for real; the rknn row fails (a 'toolkit' that exits at once) alone; the HTP
    without ort-qdq in the run is a row saying so; the file is written after every target."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("WORKBENCH_RKNN_PYTHON", str(fake))  # the spawned children inherit it
    plan = QuantPlan.uniform("int8")
    seen = []
    gap = measure_devices_gap(tiny_model_dir, plan=plan, targets=["rknn", "ort-qdq", "simulation"], max_tokens=256,
                              work=tmp_path / "gap", on_row=lambda g: seen.append(len(g.rows)))
    assert [r["target"] for r in gap.rows] == ["simulation", "ort-qdq", "rknn"] and seen == [1, 2, 3]
    sim, qdq, rknn = gap.rows
    assert 0 < sim["prefill"]["kl"] < 1 and 0 < sim["prefill"]["top1"] <= 1 and sim["prefill"]["positions"] > 100
    assert 0 < qdq["prefill"]["kl"] and qdq["decode"]["kl"] > 0 and qdq["bytes"] > 100_000
    assert sim["seconds"] > 0 and sim["peak_bytes"] > 50 * 2**20 and qdq["peak_bytes"] > 50 * 2**20
    # the tiny model's 256 positions are refused before the 'toolkit' is started, or the toolkit itself fails
    assert rknn["error"].startswith("failed: ") and rknn["prefill"] is None and rknn["runtime"] == "failed"
    assert gap.complete and gap.plan_hash == plan.content_hash() and gap.plan == plan.to_dict()
    again = read_devices_gap(tmp_path / "gap")
    assert again.rows == json.loads(json.dumps(gap.rows)) and again.complete
    alone = measure_devices_gap(tiny_model_dir, plan=plan, targets=["htp"], work=tmp_path / "gap2")
    if alone.rows[0]["runtime"] == "not run" and "onnxruntime-qnn" not in alone.rows[0]["note"]:
        assert "choose ort-qdq too" in alone.rows[0]["note"]


@pytest.mark.slow
@pytest.mark.skipif(not qnn_available(), reason=f"needs onnxruntime-qnn: {INSTALL}")
def test_htp_refuses_a_plan_its_generation_cannot_run_naming_the_layers(tiny_model_dir, tmp_path):
    """8 Gen 1 (v69) runs no 16-bit weights: uniform INT8 keeps the embeddings (and the tied lm_head) in fp16."""
    gap = measure_devices_gap(tiny_model_dir, plan=QuantPlan.uniform("int8"), targets=["ort-qdq", "htp"],
                              soc="8gen1", max_tokens=256, work=tmp_path)
    qdq, htp = gap.rows
    assert qdq["prefill"]["kl"] > 0 and gap.soc == "snapdragon-8-gen-1"
    assert htp["error"].startswith("failed: HtpRefused: Snapdragon 8 Gen 1 (soc 36, HTP v69) runs no 16-bit weights")
    assert "lm_head" in htp["error"] and "--soc snapdragon-8-gen-1" in htp["error"]


def _speed(runtime, prefill, decode):
    return {"runtime": runtime, "source": "its own counters", "threads": 2, "prompt_tokens": 64,
            "prefill_ms": 64 / prefill * 1000, "prefill_tokens_per_second": prefill,
            "decode_tokens_per_second": decode, "load_seconds": 0.1}


def test_a_runtime_that_times_itself_has_its_tok_s_in_the_row_and_table():
    """mnn-llm and executorch rows carry their runtime's own prefill / decode tok/s in two columns, beside KL, top-1
    and size; a row without them (ort-qdq, an older file) shows '-' there."""
    dec = {"kl_divergence": 0.005, "top1_agreement": 0.96, "top1_agreement_vs_simulation": 0.98, "tokens": 512}
    mnn = convert_row("mnn-llm", "MNN-LLM engine, CPU", {**_report(SIM_KL, 0.97, 0.99, dec),
                      "details": {"runtime_speed": _speed("MNN-LLM", 2345.6, 321.4)}}, 20.0, 2**29)
    et = convert_row("executorch", "ExecuTorch runtime, XNNPACK CPU", {**_report(SIM_KL, 0.97, 0.99, dec),
                     "details": {"runtime_speed": _speed("ExecuTorch (XNNPACK)", 1500.0, 210.0)}}, 30.0, 2**29)
    qdq = convert_row("ort-qdq", "cpu", _report(SIM_KL, 0.97, 0.99), 30.0, 2**29)
    old = {k: v for k, v in qdq.items() if k != "speed"}  # a devices_gap.json written before rows had speed
    assert mnn["speed"]["prefill_tps"] == 2345.6 and mnn["speed"]["decode_tps"] == 321.4
    assert et["speed"]["runtime"] == "ExecuTorch (XNNPACK)" and qdq["speed"] is None
    assert "MNN-LLM's own, 2 thread(s), 64-token prompt" in mnn["note"]
    table = format_table([mnn, et, qdq, old]).splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    p, d, mb = head.index("prefill tok/s"), head.index("decode tok/s"), head.index("MB")
    assert (cells[0][p], cells[0][d], cells[0][mb]) == ("2,346", "321", "3.0")
    assert (cells[1][p], cells[1][d]) == ("1,500", "210")
    assert cells[2][p] == cells[2][d] == cells[3][p] == "-"


def test_the_new_targets_are_offered_with_what_to_install():
    from workbench.run.devices_gap import TARGET_TITLES, TARGETS
    assert {"mnn-llm", "executorch"} <= set(TARGETS) and TARGET_TITLES["executorch"].startswith("ExecuTorch")
    t = toolchains()
    assert set(t) == set(TARGETS) and (t["executorch"] is None or "executorch==1.5.1" in t["executorch"])


@pytest.mark.slow
def test_real_run_of_the_runtimes_that_time_themselves(tiny_model_dir, tmp_path):
    """executorch and mnn-llm measured for real on a tiny model's int4 plan: KL and top-1 against the float model,
    decode through each runtime's own cache, and each runtime's own tok/s in its row."""
    missing = {t: toolchains()[t] for t in ("executorch", "mnn-llm")}
    if any(missing.values()):
        pytest.skip("; ".join(w for w in missing.values() if w))
    gap = measure_devices_gap(tiny_model_dir, bits=4, targets=["simulation", "mnn-llm", "executorch"],
                              max_tokens=256, work=tmp_path / "gap")
    assert [r["target"] for r in gap.rows] == ["simulation", "mnn-llm", "executorch"]
    for row in gap.rows[1:]:
        assert row["error"] is None, row["note"]
        assert 0 < row["prefill"]["kl"] < 1 and row["decode"]["kl"] > 0 and row["bytes"] > 10_000
        assert row["speed"]["prefill_tps"] > 0 and row["speed"]["decode_tps"] > 0
    table = format_table(gap.rows)
    assert f"{gap.rows[2]['speed']['decode_tps']:,.0f}" in table.splitlines()[4]


@pytest.mark.slow
def test_targets_side_by_side_give_the_rows_one_after_another_gives(tiny_model_dir, tmp_path):
    """On two worker processes the rows come back in the table's order with the same scores; the HTP row, which
    needs ort-qdq's graphs, still waits for them."""
    from workbench.model.sweep_backends import ProcessBackend
    plan = QuantPlan.uniform("int8")
    kw = dict(plan=plan, targets=["ort-qdq", "simulation", "htp"], max_tokens=128)
    serial = measure_devices_gap(tiny_model_dir, **kw, work=tmp_path / "a")
    seen = []
    spread = measure_devices_gap(tiny_model_dir, **kw, work=tmp_path / "b", backend=ProcessBackend(2),
                                 on_row=lambda g: seen.append(len(g.rows)))
    assert [r["target"] for r in spread.rows] == [r["target"] for r in serial.rows] == ["simulation", "ort-qdq", "htp"]
    assert seen == [1, 2, 3] and spread.complete
    for a, b in zip(serial.rows, spread.rows):
        assert (a["prefill"] or {}).get("kl") == (b["prefill"] or {}).get("kl") and a["runtime"] == b["runtime"]
    assert read_devices_gap(tmp_path / "b").rows == json.loads(json.dumps(spread.rows))
