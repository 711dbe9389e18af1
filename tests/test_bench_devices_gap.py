"""bench/devices_gap.py: the table built from fake measurements (no toolchain), and which graphs it flags."""
import importlib.util
from pathlib import Path

from workbench.convert import GAP_KL_FLOOR, GAP_KL_RATIO, GAP_TOP1
from workbench.targets.htp import HtpMeasurement
from workbench.targets.qnn import HTP_GAP_KL
from workbench.targets.rknn import RknnMeasurement, RknnScores

_spec = importlib.util.spec_from_file_location("devices_gap", Path(__file__).parents[1] / "bench" / "devices_gap.py")
gap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gap)

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
    rows = [gap.simulation_row({"kl_divergence": SIM_KL, "top1_agreement": 0.97, "tokens": 1000}, 5.0, 2**28),
            gap.convert_row("ort-qdq", "cpu", _report(SIM_KL, 0.97, 0.99, {"kl_divergence": 0.04,
                            "top1_agreement": 0.9, "top1_agreement_vs_simulation": 0.99, "tokens": 512}), 30.0, 2**29),
            gap.convert_row("mnn", "mnn", _report(SIM_KL, 0.97, GAP_TOP1 - 0.01), 20.0, 2**29),
            gap.htp_row(_htp(HTP_GAP_KL * 2), SIM_KL, 40.0, 2**28),
            gap.rknn_row(_rknn(0.001), 90.0, 2**28),
            gap.absent_row("rknn", "rknn-toolkit2 is not installed: make rknn-env")]
    sim, qdq, mnn, htp, rknn, absent = rows
    assert sim["gap"] is None and sim["decode"] is None
    # ort-qdq: prefill within the simulation, decode KL 0.04 > 1.5 x 0.004 + 0.002
    assert qdq["gap"].startswith("decode: KL") and "prefill" not in qdq["gap"]
    assert qdq["bytes"] == 3_000_000  # graph files only, not conversion.json
    assert mnn["gap"].startswith("prefill: top-1 vs simulation") and mnn["note"] == "no decode graph scored"
    assert htp["gap"].startswith("prefill: KL vs CPU QDQ") and "decode" not in htp["gap"]
    assert htp["peak_bytes"] == 2**29  # the larger of the child and the HTP process
    assert rknn["gap"] == f"decode: top-1 vs simulation 0.500 < {GAP_TOP1:g}"
    assert rknn["peak_bytes"] == 2**30 and absent["gap"] is None
    table = gap.format_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and all(line.count("|") == table[0].count("|") for line in table)
    assert "**GAP**" in table[3] and "**GAP**" not in table[2]
    assert "make rknn-env" in table[-1] and "| - | - | - | - |" in table[-1]
    assert "| 1,000 / 512 |" in table[3]  # positions scored: prefill / decode


def test_gap_threshold_is_convert_rule():
    edge = GAP_KL_RATIO * SIM_KL + GAP_KL_FLOOR
    assert gap.gap_of(gap.graph_scores(edge * 0.99, 0.9, 0.99, SIM_KL)) is None
    assert gap.gap_of(gap.graph_scores(edge * 1.01, 0.9, 0.99, SIM_KL)) is not None
    assert gap.gap_of(gap.graph_scores(SIM_KL, 0.9, GAP_TOP1, SIM_KL)) is None
    assert gap.gap_of(None) is None
