"""Projections fitted to the vendors' own measurements: sources, the fit, its held-out error, the issue's cases."""
import json
import math
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.devices.runtimes import get_runtime
from workbench.devices.profiles import load_devices
from workbench.errors import WorkbenchError
from workbench.devices.projection import SHAPES_FILE, project
from workbench.devices.vendor_fit import (_fit, _runtime_name, class_transfer_errors, measurement_features, vendor_fits,
                                  vendor_measurements, vendor_sources)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vendor_measurements as script  # noqa: E402


def test_every_measurement_names_its_source_a_known_shape_runtime_and_device():
    shapes = json.loads(SHAPES_FILE.read_text())["shapes"]
    devices = load_devices()
    sources = vendor_sources()
    rows = vendor_measurements()
    assert len(rows) > 400
    for r in rows:
        assert r["shape"] in shapes and r["source"] in sources and r["file"]
        assert r["device"] is None or r["device"] in devices
        get_runtime(_runtime_name(r["runtime"]))
        assert r["decode_tps"] > 0 and r["context"] >= r["prompt"] > 0
    assert sources["airockchip/rknn-llm"]["commit"] == "878f9361fd3afa7e167b7079918918f78d2c1c2a"
    assert sources["qai-hub-models"]["version"] == "0.65.0"
    rk = {(r["model"], r["vendor_device"], r["precision"]): r for r in rows if r["runtime"] == "rkllm"}
    assert rk[("Qwen2.5-1.5B", "RK3588", "w8a8")]["peak_mb"] == 1689.21  # as published
    s25 = [r for r in rows if r["vendor_device"] == "Samsung Galaxy S25" and r["runtime"] == "genie"
           and r["model"] == "Qwen3-4B" and r["precision"] == "w4a16"]
    assert [round(r["decode_tps"], 1) for r in s25] == [26.1] and s25[0]["device"] == "snapdragon-8-elite"


def _commit(repo, files: dict[str, str]) -> str:
    """A one-commit repository holding ``files``; its commit."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "bench"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True)
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_script_reads_every_source_as_published(tmp_path):
    perf = {"precisions": {"w4a16": {"components": {"Qwen3-0.6B": {"performance_metrics": {"Samsung Galaxy S25": {
        "genie": {"llm_metrics": [{"context_length": 4096, "desired_compute_unit": "npu", "tokens_per_second": 125.0,
                                   "prefill_tokens_per_second": 2262.4,
                                   "time_to_first_token_range_milliseconds": {"min": 15.92, "max": 509.44}},
                                  {"context_length": 2048, "desired_compute_unit": "npu", "tokens_per_second": 0.0,
                                   "prefill_tokens_per_second": 0.0,  # AI Hub's "no figure": not a measurement
                                   "time_to_first_token_range_milliseconds": {"min": 0.0, "max": 0.0}}]},
        "qnn_context_binary": {"inference_time": 1}}}}}}}}
    chips = {"devices": {"Samsung Galaxy S25": {"chipset": "qualcomm-snapdragon-8-elite-for-galaxy"}}}
    wheel = tmp_path / "qai_hub_models-0.65.0-py3-none-any.whl"
    import yaml
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("qai_hub_models/devices_and_chipsets.yaml", yaml.safe_dump(chips))
        for model in script.QAI_MODELS:
            z.writestr(f"qai_hub_models/models/{model}/perf.yaml",
                       yaml.safe_dump(perf if model == "qwen3_0_6b" else {"precisions": {}}))
    source, rows = script.qai_rows(wheel)
    assert source["version"] == "0.65.0" and len(source["sha256"]) == 64
    (row,) = rows
    assert row["prompt"] == 128 and row["ttft_ms"] == 15.92 and row["device"] == "snapdragon-8-elite"
    assert row["runtime"] == "genie" and row["shape"] == "qwen3-0.6b"
    assert row["parts"] is None and row["reference_chipset"] is None  # no model.py, no reference chipset given

    repo = tmp_path / "rknn-llm"
    commit = _commit(repo, {"benchmark.md": (
        "### RK3576\n\n| Model | Model Size | Dtype | Seqlen | New_tokens | TTFT(ms) | Tokens/s | memory(MB) |\n"
        "| :-- | :--: | :--: | :--: | :--: | :--: | :--: | :--: |\n"
        "| Qwen2 | 0.5B | w4a16 | 128 | 64 | 342.37 | 32.56 | 443.44 |\n"
        "|       | 0.5B | w8a8  | 128 | 64 | 344.27 | 21.73 | 678.43 |\n"
        "| Gemma2 | 2B | w8a8 | 128 | 64 | 956.77 | 5.24 | 2784.78 |\n")})
    source, rows = script.rknn_rows(repo, commit)
    assert source["commit"] == commit
    with pytest.raises(SystemExit, match="has no benchmark.md at commit 878f9361fd3a"):
        script.rknn_rows(repo)  # a clone without the recorded commit: said, not a traceback
    assert [(r["model"], r["precision"], r["decode_tps"], r["peak_mb"]) for r in rows] == [
        ("Qwen2-0.5B", "w4a16", 32.56, 443.44), ("Qwen2-0.5B", "w8a8", 21.73, 678.43)]  # the name carries down
    assert rows[0]["context"] == 192 and rows[0]["device"] is None  # no RK3576 profile in the workbench

    repo = tmp_path / "jetson-ai-lab"
    commit = _commit(repo, {"docs/benchmarks.md": (
        "    | Model        | Jetson Orin Nano (original) | Jetson Orin Nano Super | Perf Gain (X) |\n"
        "    |--------------|:---------------------------:|:----------------------:|:-------------:|\n"
        "    | Llama 3.2 3B |             27.7            |          43.07         |      1.55     |\n"
        "    | Gemma 2 2B   |             21.5            |          34.97         |      1.63     |\n"
        "    | Qwen2.5 7B   |             14.2            |          21.75         |      1.53     |\n"
        "    | SmolLM2      |              41             |          64.5          |      1.57     |\n\n"
        "    | Model          | Jetson Orin Nano (original) | Jetson Orin Nano Super | Perf Gain (X) |\n"
        "    | VILA 1.5 3B    |             0.7             |          1.06          |      1.51     |\n")})
    source, rows = script.jetson_rows(repo, commit)
    assert source["commit"] == commit and source["method"]["quantization"] == "q4f16_ft"
    assert [(r["shape"], r["device"], r["decode_tps"]) for r in rows] == [
        ("llama-3.2-3b", "jetson-orin-nano", 27.7), ("llama-3.2-3b", "jetson-orin-nano-super", 43.07),
        ("qwen2.5-7b", "jetson-orin-nano", 14.2), ("qwen2.5-7b", "jetson-orin-nano-super", 21.75)]
    assert rows[0]["runtime"] == "mlc"
    assert (rows[0]["prompt"], rows[0]["new_tokens"], rows[0]["context"]) == (16, 128, 144)


def _synthetic(tmp_path, law, runtime="qairt", device=None):
    """Measurements made by a known law over real shapes: the fit must find it and project held-out models exactly."""
    rows = []
    for shape in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "llama-3.2-1b", "llama-3.2-3b"):
        for ctx in (512, 4096):
            r = {"source": "s", "file": "f", "vendor_model": shape, "model": shape, "shape": shape,
                 "vendor_device": "Board", "chipset": None, "device": device, "runtime": runtime,
                 "compute_unit": "npu", "precision": "w4a16", "context": ctx, "prompt": 128, "new_tokens": None,
                 "prefill_tps": None, "peak_mb": None}
            f = measurement_features(r)
            r["decode_tps"] = 1e3 / law(f)
            r["ttft_ms"] = 5 + 40 * f["tflop"] + 100 * f["kv_gb"]
            rows.append(r)
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"sources": {"s": {"kind": "package", "package": "p", "version": "1"}},
                                "measurements": rows}))
    return path


def test_the_history_script_shows_how_one_builds_figure_moved_between_releases(tmp_path, capsys):
    import yaml
    import vendor_history
    def wheel(release, genie, qairt):
        perf = {"precisions": {"w4a16": {"components": {"Qwen3-4B": {"performance_metrics": {"Board X": {
            rt: {"llm_metrics": [{"context_length": 4096, "desired_compute_unit": "npu", "tokens_per_second": v}]}
            for rt, v in (("genie", genie), ("geniex_qairt", qairt))}}}}}}}
        path = tmp_path / f"qai_hub_models-{release}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("qai_hub_models/devices_and_chipsets.yaml", yaml.safe_dump({"devices": {}}))
            z.writestr("qai_hub_models/models/qwen3_4b/perf.yaml", yaml.safe_dump(perf))  # the only model it has
        return path
    wheels = [wheel("0.65.0", 6.0, 12.0), wheel("0.60.0", 18.0, 12.0), wheel("0.62.2", 6.0, 12.0)]
    assert vendor_history.history(wheels, "Board X")[("Qwen3-4B", "genie", "w4a16", 4096)] == {
        "0.60.0": 18.0, "0.62.2": 6.0, "0.65.0": 6.0}  # oldest release first, whatever the order given
    assert vendor_history.main([str(w) for w in wheels] + ["--device", "Board X"]) == 0
    out = capsys.readouterr().out
    assert "18.0" in out and "=" in out and "200%" in out  # 18 -> 6 -> 6 (repeated): figures 3x apart
    assert "qairt    a build's figures apart: median 0%" in out


def test_the_fit_recovers_a_known_law_and_projects_held_out_models_exactly(tmp_path):
    path = _synthetic(tmp_path, lambda f: 2.0 + 20.0 * f["weights_gb"] + 50.0 * f["kv_gb"])
    (fit,) = vendor_fits(path).values()
    assert fit.decode.features == ("1", "weights_gb", "kv_gb")
    assert fit.decode.coef == pytest.approx((2.0, 20.0, 50.0), rel=1e-6)
    assert fit.decode.n == 10 and fit.decode.median_error == pytest.approx(0, abs=1e-9)
    assert fit.ttft.coef == pytest.approx((5.0, 40.0, 100.0), rel=1e-6)
    assert fit.memory is None  # nobody measured memory here


def test_genie_fits_a_byte_rate_per_family_and_a_new_family_gets_the_error_of_a_family_left_out(tmp_path):
    def law(f):  # Qwen3 builds read their bytes 1.5x faster than Llama builds
        return 2.0 + (20.0 if "weights_gb@llama" in f else 13.0) * f["weights_gb"]
    (genie,) = vendor_fits(_synthetic(tmp_path, law, "genie", "snapdragon-8-elite")).values()
    assert genie.families == ["llama", "qwen3"]
    assert genie.decode.features == ("1", "weights_gb@llama", "weights_gb@qwen3")
    assert genie.decode.coef == pytest.approx((2.0, 20.0, 13.0), rel=1e-6)
    assert genie.decode.median_error == pytest.approx(0, abs=1e-9)  # each model held out, its family's rate kept
    assert not genie.decode.held_out_family  # a per-family rate says nothing of a family left out
    one = genie.decode_any  # one rate for all: what a family not measured here is projected with
    assert "weights_gb@llama" not in one.features and one.median_error > 0.02
    feats = [measurement_features(r) for r in genie.rows]
    by_hand = []
    for fam in ("llama", "qwen3"):  # each family projected by a fit to the other alone
        train = [(r, f) for r, f in zip(genie.rows, feats) if not r["shape"].startswith(fam)]
        part = _fit("decode_ms", [r for r, _ in train], [f for _, f in train])
        by_hand += [(1e3 / part(f)) / r["decode_tps"] - 1 for r, f in zip(genie.rows, feats)
                    if r["shape"].startswith(fam)]
    assert sorted(one.held_out_family) == pytest.approx(sorted(by_hand))
    assert one.family_error > one.median_error  # a new family is less sure than a new model of a known one

    (tmp_path / "qairt").mkdir()
    (qairt,) = vendor_fits(_synthetic(tmp_path / "qairt", law)).values()
    assert qairt.decode is qairt.decode_any  # QAIRT's rows show no family rate: one rate for every family


def test_a_plan_of_a_family_not_measured_says_so_and_quotes_the_family_held_out_error():
    fit = next(f for f in vendor_fits(device="snapdragon-8-elite", runtime="genie").values() if f.precision == "w4a16")
    assert fit.families == ["llama", "qwen3"] and fit.decode is not fit.decode_any
    qwen3 = project("qwen3-1.7b", "8elite", context=4096, runtime="genie").vendor
    assert qwen3.family == "qwen3" and qwen3.family_measured
    assert qwen3.decode_error == pytest.approx(fit.decode.median_error) and "qwen3 models' own byte rate" in qwen3.basis
    qwen25 = project("qwen2.5-1.5b", "8elite", context=4096, runtime="genie").vendor
    assert qwen25.family == "qwen2" and not qwen25.family_measured and qwen25.held_out_by == "family"
    assert qwen25.decode_error == pytest.approx(fit.decode_any.family_error)
    assert qwen25.decode_error > qwen3.decode_error
    assert qwen25.ttft_error == pytest.approx(fit.ttft.family_error)
    assert "held out by family" in qwen25.basis
    assert any("no genie measurement of a qwen2 model" in n for n in qwen25.notes)


def test_held_out_error_is_leave_one_model_out():
    fit = vendor_fits(device="rk3588", runtime="rkllm")[("RK3588", "rkllm", "w8a8")]
    assert fit.models == ["qwen2-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "tinyllama-1.1b"]
    feats = [measurement_features(r) for r in fit.rows]
    by_hand = []
    for shape in fit.models:  # each model projected by a fit to the other three
        train = [(r, f) for r, f in zip(fit.rows, feats) if r["shape"] != shape]
        part = _fit("decode_ms", [r for r, _ in train], [f for _, f in train])
        assert part.features == ("1", "weights_gb+kv_gb")  # three models: two coefficients, not an exact pass
        by_hand += [(1e3 / part(f)) / r["decode_tps"] - 1 for r, f in zip(fit.rows, feats) if r["shape"] == shape]
    assert sorted(fit.decode.held_out) == pytest.approx(sorted(by_hand))  # of tokens/s, each model held out
    assert fit.decode.median_error == pytest.approx(statistics.median(abs(e) for e in by_hand))
    assert fit.decode.median_error <= 0.15 and fit.memory.median_error <= 0.20 and fit.ttft.median_error <= 0.30


@pytest.mark.parametrize("shape,device,runtime,bits,ctx,measured,measured_mb", [
    ("qwen3-4b", "8elite", "genie", None, 4096, 26.1, None),
    ("qwen3-1.7b", "8elite", "genie", None, 4096, 56.7, None),
    ("qwen2.5-1.5b", "rk3588", "rkllm", "8", 192, 16.69, 1689.21),
])
def test_the_vendors_figures_are_projected_within_20_percent_with_error_and_nearest(
        capsys, shape, device, runtime, bits, ctx, measured, measured_mb):
    argv = ["project", shape, "--device", device, "--runtime", runtime, "--context", str(ctx), "--json"]
    assert main(argv + (["--bits", bits] if bits else [])) == 0
    out = json.loads(capsys.readouterr().out)
    v = out["vendor"]
    assert v["decode_tps"] == pytest.approx(measured, rel=0.20) and out["projected_decode_tps"] == v["decode_tps"]
    assert v["decode_error"] is not None and v["decode_n"] >= 4 and not v["fallback"]
    assert v["nearest"]["decode_tps"] == pytest.approx(measured, rel=0.01)  # the same model is the nearest
    if measured_mb:
        assert v["peak_bytes"] / 1e6 == pytest.approx(measured_mb, rel=0.20) and v["memory_n"] == 4
    assert main(argv[:-1] + (["--bits", bits] if bits else [])) == 0
    text = capsys.readouterr().out
    assert "held-out measurement(s)" in text and "nearest measured" in text and "decode (fitted)" in text


def test_a_device_without_measurements_borrows_from_its_class_with_the_class_error():
    # a family no Genie group measured (Qwen2.5): measured devices project it at their one byte rate too, which is
    # what a borrowed fit scales by bandwidth
    p = project("qwen2.5-1.5b", "8gen3", context=4096)  # the class's own runtime, its recipe
    v = p.vendor
    devices = load_devices()
    measured = {f.device for f in vendor_fits(runtime="genie").values() if f.device}
    assert {"snapdragon-8-elite", "snapdragon-8-elite-gen-5", "snapdragon-x2-elite", "dragonwing-iq-9075"} <= measured
    gen3 = devices["snapdragon-8-gen-3"].memory_bandwidth_gbps
    nearest = min(sorted(measured), key=lambda k: abs(math.log(devices[k].memory_bandwidth_gbps / gen3)))
    assert p.runtime == "genie" and v.fallback and f"borrowed from " in v.basis and v.held_out_by == "chipset"
    own_fit = next(f for f in vendor_fits(device=nearest, runtime="genie").values() if f.precision == "w4a16")
    assert own_fit.vendor_device in v.basis  # the measured device of the class nearest in bandwidth
    errs = class_transfer_errors("hexagon-htp", "genie", "w4a16")
    assert v.decode_error == pytest.approx(statistics.median(abs(e) for e in errs["decode"]))
    assert v.decode_n == len(errs["decode"]) > 20  # every measured device's rows, each projected from the others
    own = project("qwen2.5-1.5b", nearest, context=4096).vendor
    assert v.decode_error > own.decode_error  # borrowed is less sure than measured
    ratio = devices[nearest].memory_bandwidth_gbps / gen3
    assert own.decode_tps / v.decode_tps == pytest.approx(ratio, rel=0.05)  # mostly bandwidth-bound


def test_runtimes_refuse_other_classes_and_unmeasured_ones_say_so():
    with pytest.raises(WorkbenchError, match="does not run on Snapdragon 8 Elite"):
        project("qwen3-1.7b", "8elite", runtime="rkllm")
    with pytest.raises(WorkbenchError, match="unknown runtime"):
        project("qwen3-1.7b", "8elite", runtime="tflite")
    p = project("qwen3-1.7b", "8elite", runtime="mnn")
    assert p.vendor is None and any("no vendor measurement" in n for n in p.notes)
    generic = project("qwen3-1.7b", "8elite", runtime=None)
    assert generic.runtime is None and generic.vendor is None and generic.kv_bytes_per_token == 2 * 2 * 28 * 8 * 128


def test_a_plan_is_projected_at_the_measured_precision_it_matches():
    from workbench.quantize.plan import QuantPlan
    rk = get_runtime("rkllm")
    assert rk.precision_label(rk.plan("w8a8")) == ("w8a8", None)
    assert rk.precision_label(QuantPlan(default="int4", group_size=128)) == ("w4a16_g128", None)
    label, note = rk.precision_label(QuantPlan(default="int4", group_size=64))
    assert label == "w4a16" and "no Rockchip RKLLM measurement at int4 in groups of 64" in note
    p = project("qwen2.5-1.5b", "rk3588", QuantPlan.uniform("int4"), runtime="rkllm")
    assert p.vendor.precision == "w4a16_g128"  # Rockchip measured it on the RK3576 only, which has no profile here
    # no RK3588 measurement at w4a16_g128: the RK3588's own w8a8 fit (its time per byte) with the plan's own bytes,
    # not the bandwidth bound times a pooled efficiency (which put it 20x above the measured w8a8 rate)
    assert "its w8a8 fit" in p.vendor.basis and p.vendor.held_out_by == "model at w8a8"
    w8 = project("qwen2.5-1.5b", "rk3588", rk.plan("w8a8"), runtime="rkllm")
    assert w8.projected_decode_tps < p.projected_decode_tps < 2.5 * w8.projected_decode_tps
    assert p.projected_decode_tps == p.vendor.decode_tps


def test_a_filled_cache_is_read_at_the_tokens_it_holds_an_allocated_one_at_its_context():
    genie, rkllm = get_runtime("genie"), get_runtime("rkllm")
    assert genie.kv_read == "allocated" and rkllm.kv_read == "filled"
    assert genie.kv_tokens(4096, 128, 64) == 4096  # a static graph reads its whole cache
    assert rkllm.kv_tokens(192, 128, 64) == 160  # 128 prompt tokens, then 0..63 generated: 32 on average
    assert rkllm.kv_tokens(1024, 128) == 1024  # no generation given: the context is what the cache holds
    row = next(r for r in vendor_measurements() if r["runtime"] == "rkllm" and r["model"] == "Qwen2.5-1.5B")
    f = measurement_features(row)
    from workbench.model.shapes import model_shape, plan_bytes
    b = plan_bytes(model_shape("qwen2.5-1.5b"), rkllm.plan("w8a8"), context=192, prompt=128, kv_bytes=2)
    assert f["kv_gb"] == pytest.approx(b.kv_per_token * 160 / 1e9)  # read per step
    assert f["resident_gb"] == pytest.approx((b.weight_bytes + b.kv_per_token * 192) / 1e9)  # held


def test_a_projection_counts_its_plans_bytes_once(monkeypatch):
    import workbench.devices.projection as projection
    import workbench.devices.vendor_fit as vendor_fit
    project("qwen3-1.7b", "8elite", context=4096)  # the fits' own rows are counted (and cached) on first use
    calls = []
    for module in (projection, vendor_fit):
        real = module.plan_bytes
        monkeypatch.setattr(module, "plan_bytes", lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    p = project("qwen3-1.7b", "8elite", context=4096)
    assert len(calls) == 1 and p.vendor.decode_tps and not p.vendor.fallback


@pytest.mark.parametrize("device,vendor_device", [("s26", "Samsung Galaxy S26"), ("x2-elite", "Snapdragon X2 Elite CRD"),
                                                  ("iq-9075", "Dragonwing IQ-9075 EVK")])
def test_the_measured_boards_and_phones_have_profiles_projected_from_their_own_measurements(device, vendor_device):
    p = project("qwen3-4b", device, context=4096)
    v = p.vendor
    measured = next(r for r in vendor_measurements() if r["vendor_device"] == vendor_device and r["runtime"] == "genie"
                    and r["model"] == "Qwen3-4B" and r["precision"] == "w4a16")
    assert not v.fallback and vendor_device in v.basis and v.decode_n >= 8
    assert v.nearest["decode_tps"] == measured["decode_tps"]  # the same model, measured on it
    assert v.decode_tps == pytest.approx(measured["decode_tps"], rel=0.30)
    assert v.decode_tps < p.decode_bound_tps  # the profile's sourced bandwidth bounds what was measured


def test_a_board_ai_hub_lists_by_its_reference_chipset_is_marked_so():
    rows = vendor_measurements()
    q8750 = [r for r in rows if r["vendor_device"] == "Dragonwing Q-8750"]
    assert q8750 and all(r["reference_chipset"] == "qualcomm-snapdragon-8-elite-for-galaxy" and r["device"] is None
                         for r in q8750)
    s25 = {(r["model"], r["precision"], r["context"]): r["decode_tps"] for r in rows
           if r["vendor_device"] == "Samsung Galaxy S25" and r["runtime"] == "genie"}
    # a copy where AI Hub lists the model on both (its Llama-3 fine-tunes it lists on the Q-8750 alone)
    genie = [r for r in q8750 if r["runtime"] == "genie" and (r["model"], r["precision"], r["context"]) in s25]
    assert len(genie) >= 8 and all(s25[(r["model"], r["precision"], r["context"])] == r["decode_tps"] for r in genie)


def test_no_measurement_reads_its_weights_faster_than_its_profiles_sourced_bandwidth():
    devices = load_devices()
    checked = set()
    for f in vendor_fits().values():
        if f.device:
            bw = devices[f.device].memory_bandwidth_gbps
            for r, feat in zip(f.rows, f.feats):  # the weights alone must stream at the measured rate
                assert r["decode_tps"] * feat["weights_gb"] <= bw, (r["model"], r["vendor_device"], r["runtime"])
            checked.add(f.device)
    assert checked >= {"snapdragon-8-elite-gen-5", "snapdragon-x2-elite", "dragonwing-iq-9075", "rk3588"}


def test_the_residual_study_finds_a_feature_the_measurements_follow(tmp_path):
    parts = {"qwen3-0.6b": 2, "qwen3-1.7b": 4, "qwen3-4b": 4, "llama-3.2-1b": 3, "llama-3.2-3b": 3, "qwen3-8b": 5}
    rows = []
    for shape, n in parts.items():  # one context: decode made by weights and a cost per part
        r = {"source": "s", "file": "f", "vendor_model": shape, "model": shape, "shape": shape, "vendor_device": "Board",
             "chipset": None, "reference_chipset": None, "device": None, "runtime": "genie", "compute_unit": "npu",
             "precision": "w4a16", "context": 4096, "prompt": 128, "new_tokens": None, "parts": n,
             "prefill_tps": None, "ttft_ms": None, "peak_mb": None}
        r["decode_tps"] = 1e3 / (1.0 + 20.0 * measurement_features(r)["weights_gb"] + 3.0 * n)
        rows.append(r)
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"sources": {"s": {"kind": "package", "package": "p", "version": "1"}},
                                "measurements": rows}))
    from workbench.devices.vendor_fit import family_residuals, residual_study
    (fit,) = vendor_fits(path).values()
    study = residual_study(fit)
    assert study["+ parts"] == pytest.approx(0, abs=1e-6)  # the law is found, held out
    assert study["weights only"] > 0.02 and study["as fitted"] > 0.02  # without it the parts show as error
    assert study["chosen / fold"] > 0.02  # a plan has no parts to project from: never chosen
    assert set(family_residuals(fit)) == {"qwen3", "llama"}


def test_the_absolute_and_per_shape_fits_move_less_for_far_off_or_repeated_rows():
    from workbench.devices.vendor_fit import SOLVERS, _nlad_relative, _nnls_relative
    xs = [0.4, 0.8, 1.0, 1.8, 2.2, 4.0]
    y = [2.0 + 30.0 * x for x in xs]
    y[2] *= 2.0  # one measurement twice as slow as the law
    x = [[1.0, v] for v in xs]
    assert _nlad_relative(x, y) == pytest.approx([2.0, 30.0], rel=1e-9)  # the other five, exactly
    assert _nnls_relative(x, y) != pytest.approx([2.0, 30.0], rel=0.02)  # squares are pulled by it
    assert _nlad_relative([[1.0, v] for v in xs], [1.0 - 0.1 * v for v in xs])[1] == 0.0  # never a negative slope
    # one weight per shape: three builds of one shape measured alike pull the fit no harder than one
    rows = [{"shape": "a", "context": 1}] * 3 + [{"shape": "b", "context": 1}]
    weighted = SOLVERS["squares / shape"]([[1.0]] * 4, [1.0, 1.0, 1.0, 2.0], rows)
    assert weighted == pytest.approx(_nnls_relative([[1.0]] * 2, [1.0, 2.0]))
    assert weighted != pytest.approx(_nnls_relative([[1.0]] * 4, [1.0, 1.0, 1.0, 2.0]))


def test_the_first_token_study_finds_attention_over_the_whole_context(tmp_path):
    from workbench.devices.vendor_fit import residual_study, study_features
    path = _synthetic(tmp_path, lambda f: 2.0 + 20.0 * f["weights_gb"] + 50.0 * f["kv_gb"])
    data = json.loads(path.read_text())
    for r in data["measurements"]:  # a 128-token graph that attends to every slot of its cache
        r["ttft_ms"] = 5.0 + 40.0 * study_features(r, measurement_features(r))["tflop_ctx"]
    path.write_text(json.dumps(data))
    (fit,) = vendor_fits(path).values()
    study = residual_study(fit, "ttft_ms")
    assert study["attn. to ctx"] == pytest.approx(0, abs=1e-6)  # the law, held out
    assert study["as fitted"] > 0.005 and study["FLOPs only"] > 0.02
    assert study["chosen / fold"] == pytest.approx(0, abs=1e-6)  # each fold finds the law from its training models
    assert residual_study(fit)["as fitted"] == pytest.approx(0, abs=1e-9)  # decode follows its own law


def test_without_each_model_names_the_rows_that_carry_an_error(tmp_path):
    from workbench.devices.vendor_fit import without_each_model
    path = _synthetic(tmp_path, lambda f: 2.0 + 20.0 * f["weights_gb"] + 50.0 * f["kv_gb"])
    data = json.loads(path.read_text())
    for r in data["measurements"]:
        if r["model"] == "qwen3-1.7b":
            r["decode_tps"] /= 2.5  # one model measured far slower than its siblings
    path.write_text(json.dumps(data))
    (fit,) = vendor_fits(path).values()
    assert fit.decode.median_error > 0.05
    without = without_each_model(fit)
    assert without["qwen3-1.7b"] == pytest.approx(0, abs=1e-6)
    assert min(e for m, e in without.items() if m != "qwen3-1.7b") > 0.05
    assert set(without_each_model(fit, by="shape")) == set(without)


def test_genie_and_qairt_run_the_same_binaries_and_the_rows_named_in_the_docs_stand_apart():
    from workbench.devices.vendor_fit import runtime_ratios
    ratios = runtime_ratios()
    assert "Dragonwing Q-8750" not in ratios  # a copy of the S25's rows
    decode = {(d, m): r for d, rs in ratios.items() for m, r, _ in rs}
    ttft = {(d, m): t for d, rs in ratios.items() for m, _, t in rs}
    xe = "Snapdragon X Elite CRD"
    assert decode[(xe, "Qwen3-1.7B")] == pytest.approx(0.42, abs=0.01)
    assert min(r for (d, _), r in decode.items() if d != xe) >= 0.84  # Genie keeps up with QAIRT everywhere else
    assert sum(r < 0.7 for (d, _), r in decode.items() if d == xe) == 8  # of its 10 models
    assert ttft[("Arduino VENTUNO Q", "Llama-v3.2-3B-Instruct")] == pytest.approx(2.15, abs=0.01)
    assert max(t for (d, m), t in ttft.items() if d == "Dragonwing IQ-9075 EVK") < 1.01  # its sibling board


def test_a_jetson_orin_projects_from_nvidias_mlc_measurements_and_the_nano_is_not_given_mlc():
    p = project("llama-3.2-3b", "orin-nano-super", context=144, prompt=16)
    assert p.runtime == "mlc" and not p.vendor.fallback and p.vendor.precision == "q4f16_ft"
    assert p.vendor.decode_tps == pytest.approx(43.07, rel=0.2) and p.vendor.decode_n == 3
    assert p.vendor.nearest["decode_tps"] == 43.07 and "jetson-generative-ai-playground" in p.vendor.nearest["source"]
    # the Orin Nano and its "Super" clocks are one chipset: neither says anything held out of another chip
    assert class_transfer_errors("jetson-gpu", "mlc", "q4f16_ft") == {"decode": [], "ttft": [], "memory": []}
    # MLC is not built for the Jetson Nano's JetPack: its default stays the generic projection, asking is refused
    assert project("qwen2.5-1.5b", "jetson-nano", context=512).runtime is None
    with pytest.raises(WorkbenchError, match="L4T 35"):
        project("qwen2.5-1.5b", "jetson-nano", runtime="mlc")


def test_a_plan_far_outside_the_measured_models_is_said_to_be_extrapolated():
    from workbench.charts.report import projection_rows
    inside = project("qwen3-4b", "8elite", context=4096)
    assert not inside.vendor.extrapolated and not any("extrapolation" in n for n in inside.vendor.notes)
    tiny = project("qwen2.5-0.5b", "orin-nano", context=144, prompt=16)  # NVIDIA measured 3B-8B models only
    assert tiny.vendor.extrapolated and any("outside the 1.61-3.76 GB" in n for n in tiny.vendor.notes)
    (row,) = projection_rows({"recipe": [tiny]})
    assert "extrapolated" in row[8]
