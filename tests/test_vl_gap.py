"""The device comparison's vision-language rows: table plumbing with a stand-in target (never a real figure), and
the simulation's real row on demo-vl through bench/devices_gap.py, its file and the report."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from workbench.errors import PlanError
from workbench.run import devices_gap, vl_gap
from workbench.run.devices_gap import read_devices_gap


def _stand_in(model, plan_doc, work):  # plumbing only: numbers that test the table, shown nowhere
    return {"embedding_cosine": 0.5, "embedding_rel_error": 0.25, "answer_kl": 0.125, "answer_top1": 0.75,
            "itm_accuracy": None, "encoder_ms": 2.0, "decode_tps": 10.0, "note": "stand-in"}


def test_a_registered_target_fills_its_row_and_the_others_say_why(monkeypatch, tmp_path):
    monkeypatch.setattr(vl_gap, "_REGISTRY", {"htp": vl_gap.VLTarget("htp", "stand-in runtime", _stand_in)})
    monkeypatch.setattr(devices_gap, "in_child", lambda fn, *a: (fn(*a), 1.5, 1000))
    rows = vl_gap.measure_vl_rows("demo-vl", bits=4, targets=("mnn-llm", "htp"), work=tmp_path)
    assert [r["target"] for r in rows] == ["htp", "mnn-llm"]  # VL_TARGETS order
    assert rows[0]["answer_kl"] == 0.125 and rows[0]["itm_accuracy"] is None and rows[0]["seconds"] == 1.5
    assert rows[1]["absent"] and "no vision form of mnn-llm" in rows[1]["note"]
    table = vl_gap.format_vl_table(rows).splitlines()
    assert table[0].startswith("target") and "embedding cosine" in table[0]
    assert vl_gap.vl_table_cells(rows[0])[2:8] == ["0.50000", "0.2500", "0.12500", "75.00%", "-", "2.0"]


def test_a_failing_target_is_a_row_saying_how(monkeypatch, tmp_path):
    def broken(model, plan_doc, work):
        raise RuntimeError("engine crashed")
    monkeypatch.setattr(vl_gap, "_REGISTRY", {"htp": vl_gap.VLTarget("htp", "x", broken)})
    monkeypatch.setattr(devices_gap, "in_child", lambda fn, *a: (fn(*a), 0.0, 0))
    (row,) = vl_gap.measure_vl_rows("demo-vl", bits=4, targets=("htp",), work=tmp_path)
    assert row["absent"] and "RuntimeError: engine crashed" in row["note"]


def test_bad_measurements_and_inputs_are_refused(tmp_path):
    with pytest.raises(PlanError):
        vl_gap.vl_row("htp", "x", {"answer_kl": "low"})
    with pytest.raises(PlanError, match="no vision encoder"):
        vl_gap.measure_vl_rows("demo", bits=4, work=tmp_path)
    with pytest.raises(PlanError, match="unknown VL target"):
        vl_gap.measure_vl_rows("demo-vl", bits=4, targets=("npu",), work=tmp_path)


def test_bench_prints_the_simulation_vl_row_and_the_report_shows_it(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_gap", Path(__file__).parents[1] / "bench" / "devices_gap.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    work = tmp_path / "run" / "gap"
    assert bench.main(["--model", "demo-vl", "--bits", "4", "--targets", "simulation", "--pictures", "8",
                       "--work", str(work)]) == 0
    out = capsys.readouterr().out
    assert "embedding cosine" in out and "simulation (PyTorch)" in out
    gap = read_devices_gap(work)
    sim = gap.vl_rows[0]
    assert sim["target"] == "simulation" and not sim["absent"] and sim["note"].startswith("8 questions")
    assert 0.99 < sim["embedding_cosine"] <= 1.0 and 0 < sim["embedding_rel_error"] < 0.1
    assert 0 <= sim["answer_kl"] < 0.05 and sim["answer_top1"] > 0.9 and 0.25 < sim["itm_accuracy"] <= 1
    assert sim["encoder_ms"] > 0 and sim["decode_tps"] > 0 and sim["peak_bytes"] > 0
    from workbench.charts.report import write_report
    html = tmp_path / "r.html"
    write_report(tmp_path / "run", html)
    text = html.read_text()
    assert "devices-gap-vl" in text and "embedding rel. error" in text


def test_vl_measure_of_reads_each_targets_conversion_details():
    """The converted targets' rows come from the figures their conversions record (shapes as the converters write
    them); what a conversion did not measure stays None or says why, never a made-up figure."""
    htp = {"vision_encoder": {"htp": {"soc": "8 Gen 3", "time": {"median_ms": 485.0},
                                      "embeddings": {"vs_float": {"cosine": 0.99999, "relative_error": 0.0027}},
                                      "answers": {"whole_model": {"answer_kl": 2.8e-4, "answer_top1": 0.99,
                                                                  "itm_accuracy": 0.854}}}}}
    row = vl_gap.vl_row("htp", "HTP", vl_gap.vl_measure_of("htp", htp))
    assert (row["embedding_rel_error"], row["answer_kl"], row["encoder_ms"], row["decode_tps"]) == \
        (0.0027, 2.8e-4, 485.0, None)
    mnn = {"mnn_llm_vision": {"embeddings_vs_float": {"cosine": 0.9993, "relative_error": 0.04}, "answer_kl": 6.2e-4,
                              "answer_top1": 0.993, "itm_accuracy": 0.875,
                              "speed": {"encoder_ms": 0.72, "decode_tokens_per_second": 1500.0}}}
    row = vl_gap.vl_row("mnn-llm", "MNN.llm", vl_gap.vl_measure_of("mnn-llm", mnn))
    assert (row["itm_accuracy"], row["encoder_ms"], row["decode_tps"]) == (0.875, 0.72, 1500.0)
    assert vl_gap.vl_measure_of("llama.cpp", {})["note"].startswith("llama-mtmd-cli not found")
    assert vl_gap.vl_measure_of("htp", {"vision_encoder": {}}).get("answer_kl") is None
    with pytest.raises(PlanError):
        vl_gap.vl_measure_of("tensorrt", {})
