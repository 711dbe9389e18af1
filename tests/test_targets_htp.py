"""The Hexagon HTP runner (onnxruntime-qnn's emulator) on the demo model's QDQ graphs: agreement with CPU QDQ,
refused nodes named, the 8 Gen 1 adaptation, context binaries reloaded. Skipped without onnxruntime-qnn."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from workbench.errors import WorkbenchError

from workbench.devices.profiles import get_device
from workbench.targets import get_target
from workbench.targets.htp import (INSTALL, HtpRefused, backend_soc, float_layers_refused, htp_soc, htp_socs,
                                   open_htp, qnn_available, refusals, soc_findings, write_context_binaries)

needs_qnn = pytest.mark.skipif(not qnn_available(), reason=f"onnxruntime-qnn is not installed: {INSTALL}")


@pytest.fixture(scope="module")
def demo_qdq(tmp_path_factory):
    """The demo model at INT8 as `convert --target ort-qdq` writes it (prefill + decode QDQ graphs)."""
    from workbench.targets.convert import convert
    out = tmp_path_factory.mktemp("qdq")
    convert("demo", "ort-qdq", out, bits=8, evaluate_outputs=False)
    return out / "prefill.qdq.onnx", out / "decode.qdq.onnx"


@pytest.fixture(scope="module")
def tokens():
    from workbench.evaluation.evaluate import encode_text, read_text
    from workbench.assets import demo_text_path
    from workbench.model.load import load_model
    lm = load_model("demo")
    return encode_text(lm.tokenizer, read_text(demo_text_path("heldout"))).tolist()[:128]


def test_socs_come_from_the_device_profiles():
    socs = htp_socs()
    assert {k: (s.soc_model, s.arch) for k, s in socs.items()} == {
        "snapdragon-8-gen-1": (36, 69), "snapdragon-8-gen-2": (43, 73), "snapdragon-8-gen-3": (57, 75),
        "snapdragon-8-elite": (69, 79), "snapdragon-x-elite": (60, 73)}
    assert htp_soc("8gen1").context_limit_bytes == 2 << 30 and htp_soc("8gen3").context_limit_bytes == 4 << 30
    assert get_device("8gen1").to_dict()["htp_arch"]["value"] == 69
    with pytest.raises(Exception, match="rk3588.*no Hexagon HTP"):
        htp_soc("rk3588")


def test_v69_refuses_the_plans_float_layers_before_compiling():
    precisions = {"model.layers.0.mlp.up_proj": "int8", "lm_head": "fp16", "model.embed_tokens": "fp16"}
    assert float_layers_refused(precisions, htp_soc("8gen1")) == ["lm_head", "model.embed_tokens"]
    assert float_layers_refused(precisions, htp_soc("8gen2")) == []


def test_inspect_names_the_16bit_lm_head_on_v69_only(demo_qdq):
    (finding,) = soc_findings(demo_qdq[0], "8gen1")
    assert finding.severity == "error" and finding.nodes == ["lm_head.weight.T"] and "HTP v69" in finding.message
    assert soc_findings(demo_qdq[0], "8gen2") == []


def test_refusals_parse_the_backends_log_once_per_node():
    log = ("QNN.backendValidateOpConfig() failed for node `/lm_head/MatMul` of type `FullyConnected` with error code "
           "3110\n... Unsupported nodes in QNN EP: { name: /lm_head/MatMul, type: MatMul }\n"
           "QNN.backendValidateOpConfig() failed for node `/lm_head/MatMul_2` of type `FullyConnected` with error code "
           "3110\n Unsupported nodes in QNN EP: { name: /lm_head/MatMul, type: MatMul }")
    (node, op, why), = refusals(log)
    assert node == "/lm_head/MatMul" and op == "FullyConnected" and "3110" in why and "v73" in why


def test_htp_is_a_registered_runner(tmp_path):
    t = get_target("htp")
    assert t.runner is not None and t.runnable and t.convert is None and t.files == ("prefill_ctx.onnx", "decode_ctx.onnx")
    with pytest.raises(WorkbenchError, match="has no prefill.qdq.onnx / decode.qdq.onnx"):
        t.runner(tmp_path)


@needs_qnn
def test_profiles_match_what_the_backend_says_of_each_soc(demo_qdq):
    for key, soc in htp_socs().items():
        assert backend_soc(soc.soc_model, demo_qdq[1])["arch"] == soc.arch, key


@needs_qnn
def test_htp_runs_prefill_and_decode_like_cpu_qdq(demo_qdq, tokens):
    from workbench.runtime.onnx_runner import OnnxCausalLM
    htp = get_target("htp").runner(demo_qdq[0].parent, device="8gen3")  # CPU fallback off: all nodes on HTP
    cpu = OnnxCausalLM(*demo_qdq)

    def kl(a, b):
        la, lb = (x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
                  for x in (a.astype(np.float64), b.astype(np.float64)))
        return float((np.exp(la) * (la - lb)).sum(-1).mean())
    ids = np.array([tokens[:96]])
    assert kl(cpu.logits(ids)[0], htp.logits(ids)[0]) < 1e-3
    _, _, kv_h = htp.run_prefill(tokens[:64])
    _, _, kv_c = cpu.run_prefill(tokens[:64])
    steps_h, steps_c = [], []
    for pos in range(64, 68):
        h, kv_h, _ = htp.run_decode(tokens[pos], kv_h, pos)
        c, kv_c, _ = cpu.run_decode(tokens[pos], kv_c, pos)
        steps_h.append(h), steps_c.append(c)
    assert kl(np.stack(steps_c), np.stack(steps_h)) < 1e-3


@needs_qnn
def test_8gen1_refuses_the_16bit_lm_head_naming_it(demo_qdq):
    with pytest.raises(HtpRefused, match=r"Snapdragon 8 Gen 1 \(soc 36, HTP v69\) refuses 1 node.*/lm_head/MatMul "
                                         r"\(FullyConnected: error 3110.*v73"):
        open_htp(demo_qdq[0], device="8gen1")


@needs_qnn
def test_context_binaries_reload_with_identical_outputs(demo_qdq, tokens, tmp_path):
    written = write_context_binaries({"prefill": demo_qdq[0]}, tmp_path, "8gen3")
    (ctx,) = written
    assert (tmp_path / "prefill_ctx.onnx").is_file() and ctx["bytes"] > 1e6 and ctx["bytes"] < ctx["limit_bytes"]
    ids = np.array([tokens[:128]])
    compiled = open_htp(demo_qdq[0], device="8gen3").logits(ids)
    reloaded = open_htp(tmp_path / "prefill_ctx.onnx", device="8gen3").logits(ids)
    np.testing.assert_array_equal(compiled, reloaded)


@needs_qnn
def test_convert_qnn_for_8gen1_adapts_the_lm_head_and_scores_on_htp(tmp_path):
    from workbench.targets.convert import convert
    report = convert("demo", "qnn", tmp_path, bits=8, soc="8gen1", max_tokens=300)
    # the demo plan keeps the embedding and lm_head float: both get 8-bit weights (only the MatMul is refused)
    assert report.details["htp_adapted_layers"] == ["model.embed_tokens", "lm_head"]
    assert any("lm_head" in n and "8-bit weights" in n for n in report.notes)
    htp = report.details["htp"]
    m = htp["measurement"]
    assert htp["soc_model"] == 36 and m["prefill"]["kl_vs_simulation"] < 1e-3 and m["decode"]["tokens"] == 63
    assert (tmp_path / "htp-snapdragon-8-gen-1" / "decode_ctx.onnx").is_file()
    saved = json.loads((tmp_path / "conversion.json").read_text())
    assert saved["details"]["htp"]["measurement"]["decode"]["kl_vs_simulation"] == m["decode"]["kl_vs_simulation"]


# -- Qualcomm's w4a16 recipe: int8 KV cache, the plan preset, layers that depart on the HTP -------------------------

def _kl(a, b):
    la, lb = (x - x.max(-1, keepdims=True) for x in (a.astype(np.float64), b.astype(np.float64)))
    la, lb = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in (la, lb))
    return float((np.exp(la) * (la - lb)).sum(-1).mean())


def test_recipe_plan_is_qualcomms_w4a16():
    from workbench.targets.qnn import RECIPE, recipe_plan
    plan = recipe_plan(int8_layers=["model.layers.2.mlp.down_proj"])
    assert plan.default == "int4" and plan.group_size is None and plan.symmetric
    assert plan.precision_name_for("lm_head") == "int8" and plan.precision_name_for("model.embed_tokens") == "fp16"
    assert plan.precision_name_for("model.layers.2.mlp.down_proj") == "int8"
    assert plan.precision_name_for("model.layers.1.mlp.down_proj") == "int4"
    assert plan.meta["recipe"] == RECIPE and plan.meta["kv_cache_bits"] == 8


def test_int8_kv_cache_shares_encodings_and_feeds_back_codes(demo_qdq, tokens, tmp_path):
    import shutil
    import onnx
    from onnx import numpy_helper
    from workbench.runtime.onnx_runner import OnnxCausalLM
    from workbench.targets.ort_qdq import int8_kv_cache, kv_cache_dtype
    for f in demo_qdq[0].parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    paths = [tmp_path / p.name for p in demo_qdq]
    info = int8_kv_cache(paths)
    assert info["bits"] == 8 and info["bytes_per_token"] * 4 == info["float32_bytes_per_token"]
    assert all(kv_cache_dtype(p) == np.int8 for p in paths)
    # past and present of a layer read one scale, in both graphs: the prefill's codes are the decode's input as is
    for p in paths:
        g = onnx.load(str(p), load_external_data=False).graph
        scales = {i.name: float(numpy_helper.to_array(i)) for i in g.initializer if i.name.startswith("kv_cache.")}
        assert scales and all(scales[k] == pytest.approx(info["encodings"][k[len("kv_cache."):-len("_scale")]])
                              for k in scales if k.endswith("_scale"))
        for n in g.node:
            if n.op_type in ("QuantizeLinear", "DequantizeLinear") and any(
                    t.startswith(("present.", "past_key_values.")) and not t.endswith("_dequantized")
                    for t in (*n.input[:1], *n.output)):
                assert n.input[1].startswith("kv_cache."), n.name
    wide, narrow = OnnxCausalLM(*demo_qdq), OnnxCausalLM(*paths)
    _, _, kv_w = wide.run_prefill(tokens[:64])
    _, _, kv_n = narrow.run_prefill(tokens[:64])
    assert kv_n[0].dtype == np.int8 and kv_w[0].dtype == np.float32
    a, b = [], []
    for pos in range(64, 70):
        x, kv_w, _ = wide.run_decode(tokens[pos], kv_w, pos)
        y, kv_n, _ = narrow.run_decode(tokens[pos], kv_n, pos)
        a.append(x), b.append(y)
    assert kv_n[0].dtype == np.int8 and kv_n[0].shape[2] == 70
    assert 0 < _kl(np.stack(a), np.stack(b)) < 1e-3  # int8 rounding, not a broken cache


def test_a_departing_layer_is_one_far_off_the_simulation():
    from workbench.targets.htp import DEPART_ERROR, _output_error
    rng = np.random.default_rng(0)
    cpu = rng.integers(0, 65535, size=(1, 16, 64)).astype(np.uint16)
    rounding = np.clip(cpu.astype(np.int64) + rng.integers(-3, 4, size=cpu.shape), 0, 65535).astype(np.uint16)
    saturated = np.clip(cpu, 32768 - 8000, 32768 + 8000)  # an accumulator that clips
    assert _output_error(cpu, rounding, 32768, 16)["relative_error"] < DEPART_ERROR
    err = _output_error(cpu, saturated, 32768, 16)
    assert err["relative_error"] > DEPART_ERROR and err["max_steps"] > 20000
    assert _output_error(cpu, saturated, 32768, 0)["relative_error"] == 0  # no rows compared: nothing off


def test_plan_preset_raises_the_departing_layers_to_int8(tmp_path, capsys):
    from workbench.cli import main
    from workbench.quantize.plan import QuantPlan
    conv = tmp_path / "conv"
    conv.mkdir()
    (conv / "conversion.json").write_text(json.dumps({"details": {"htp": {"divergence": {
        "departing": ["model.layers.1.mlp.down_proj"]}}}}))
    out = tmp_path / "plan.json"
    assert main(["plan", "demo", "--preset", "qualcomm-w4a16", "--htp-divergence", str(conv), "--out", str(out),
                 "--eval-tokens", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    plan = QuantPlan.load(out)
    assert doc["htp_int8_layers"] == ["model.layers.1.mlp.down_proj"] and doc["kl_divergence"] > 0
    assert plan.precision_name_for("model.layers.1.mlp.down_proj") == "int8"
    assert plan.precision_name_for("model.layers.0.mlp.down_proj") == "int4" and plan.meta["kv_cache_bits"] == 8
    (conv / "conversion.json").write_text("{}")
    assert main(["plan", "demo", "--preset", "qualcomm-w4a16", "--htp-divergence", str(conv), "--out",
                 str(tmp_path / "p2.json")]) == 2
    assert "no HTP layer comparison" in capsys.readouterr().err and not (tmp_path / "p2.json").exists()


@needs_qnn
def test_the_recipe_runs_on_the_htp_for_8gen3_with_an_int8_kv_cache(tmp_path):
    from workbench.targets.convert import convert
    from workbench.targets.ort_qdq import kv_cache_dtype
    from workbench.targets.qnn import recipe_plan
    report = convert("demo", "qnn", tmp_path, plan=recipe_plan(), soc="8gen3", max_tokens=300)
    kv = report.details["qdq"]["kv_cache"]
    assert kv["bits"] == 8 and kv["bytes_per_token"] == 1024
    ctx = tmp_path / "htp-snapdragon-8-gen-3"
    assert kv_cache_dtype(ctx / "decode_ctx.onnx") == np.int8
    m = report.details["htp"]["measurement"]
    for g in ("prefill", "decode"):  # on the HTP as in the simulation, both scored against the float model
        assert m[g]["kl_vs_simulation"] < 1e-3 and m[g]["top1_vs_simulation"] > 0.98
        assert m[g]["kl_vs_float"] < 1.5 * m["simulation"][g]["kl_vs_float"] + 0.002
    assert m["decode"]["tokens"] == 63 and not report.gap
    enc = json.loads((tmp_path / "quant_overrides_decode.json").read_text())["activation_encodings"]
    assert enc["past_key_values.0.key"] == enc["present.0.key"] and enc["present.0.key"][0]["bitwidth"] == 8
    div = report.details["htp"]["divergence"]
    assert len(div["layers"]) == 29 and "lm_head" in div["layers"]
    assert all(0 < v["relative_error"] for v in div["layers"].values())  # the HTP rounds differently, slightly
    assert div["departing"] == [n for n, v in div["layers"].items() if v["relative_error"] > div["threshold"]]
    saved = json.loads((tmp_path / "conversion.json").read_text())["details"]["htp"]["divergence"]
    assert saved["departing"] == div["departing"]


# -- parts: a context binary over the SoC's limit split at block boundaries --------------------------------------

def test_plan_parts_fills_each_part_up_to_the_limit():
    from workbench.errors import PlanError
    from workbench.targets.htp_parts import plan_parts
    assert plan_parts([10] * 6, limit=100, head_bytes=5, tail_bytes=5) == [(0, 6)]
    assert plan_parts([10] * 6, limit=30, head_bytes=5, tail_bytes=5) == [(0, 2), (2, 5), (5, 6)]
    assert plan_parts([10] * 4, limit=30, tail_bytes=20) == [(0, 3), (3, 4)]  # the head needs a part of its own
    with pytest.raises(PlanError, match="block 1 alone .* over the context limit"):
        plan_parts([10, 40, 10], limit=30)


def test_split_parts_chained_compute_the_whole_graph(demo_qdq, tokens):
    import onnxruntime as ort
    from workbench.runtime.onnx_runner import OnnxCausalLM
    from workbench.targets.htp_parts import plan_parts, run_parts, split_graph, weight_bytes_by_block
    runner = OnnxCausalLM(*demo_qdq)
    _, _, kv = runner.run_prefill(tokens[:64])
    feeds = {"prefill": runner.prefill_feed(tokens[:64]), "decode": runner.decode_feed(tokens[64], kv, 64)}
    for graph, feed in zip(demo_qdq, feeds.values()):
        head, blocks, tail = weight_bytes_by_block(graph)
        assert len(blocks) == 4 and min(blocks) > 100_000 and head > 0 and tail > 0
        limit = head + blocks[0] + blocks[1] + 1000  # a small "SoC": at most two blocks beside the embedding
        parts = plan_parts(blocks, limit=limit, head_bytes=head, tail_bytes=tail)
        assert len(parts) >= 2 and parts[0] == (0, 2) and parts[-1][1] == 4
        files = split_graph(graph, graph.parent, parts)
        whole = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        names = [o.name for o in whole.get_outputs()]
        got = run_parts(files, feed)
        for name, ref in zip(names, whole.run(names, feed)):
            np.testing.assert_array_equal(got[name], ref, err_msg=name)


@needs_qnn
def test_each_part_compiles_for_the_htp_under_the_limit(demo_qdq, tmp_path):
    from dataclasses import replace
    from workbench.targets.htp_parts import plan_parts, split_graph, weight_bytes_by_block
    graph = demo_qdq[0]
    head, blocks, tail = weight_bytes_by_block(graph)
    whole = write_context_binaries({"whole": graph}, tmp_path / "whole", "8gen3")[0]["bytes"]
    limit = int(whole * 0.7)  # a SoC whose limit the whole graph's binary exceeds
    small = replace(htp_soc("8gen3"), context_limit_bytes=limit)
    with pytest.raises(HtpRefused, match="over .* context limit"):
        write_context_binaries({"whole": graph}, tmp_path / "refused", small)
    parts = plan_parts(blocks, limit=int(limit * 0.8), head_bytes=head, tail_bytes=tail)  # room for the graph
    files = split_graph(graph, graph.parent, parts)
    written = write_context_binaries({f.stem: f for f in files}, tmp_path / "parts", small)
    assert len(written) == len(parts) >= 2 and all(w["bytes"] <= limit for w in written)


def test_split_to_fit_numbers_the_parts_and_names_what_passes_between_them(demo_qdq, tokens, tmp_path):
    from workbench.runtime.onnx_runner import OnnxCausalLM
    from workbench.targets.htp_parts import PartsCausalLM, check_chained, split_to_fit, weight_bytes_by_block
    graph = demo_qdq[0]
    head, blocks, tail = weight_bytes_by_block(graph)
    assert split_to_fit(graph, head + sum(blocks) + tail, tmp_path)["parts"][0]["onnx"] == str(graph)  # fits: whole
    budget = max(head + blocks[0], blocks[-1] + tail) + 1000  # the embedding or the head beside one block at most
    split = split_to_fit(graph, budget, tmp_path)
    parts = split["parts"]
    assert len(parts) >= 3 and [p["part"] for p in parts] == list(range(1, len(parts) + 1))
    assert parts[0]["blocks"][0] == 0 and parts[-1]["blocks"][1] == 4
    assert all(a["blocks"][1] == b["blocks"][0] for a, b in zip(parts, parts[1:]))  # contiguous, in order
    assert [f"prefill_part_{k}_of_{len(parts)}.onnx" for k in range(1, len(parts) + 1)] == \
        [p["onnx"].rsplit("/", 1)[-1] for p in parts]
    assert sum(p["weight_bytes"] for p in parts) == split["weight_bytes"] == head + sum(blocks) + tail
    for a, b in zip(parts, parts[1:]):  # each part gives the next the residual stream's 16-bit codes
        (given,) = [o for o in a["outputs"] if o.get("to_part") == b["part"]]
        (taken,) = [i for i in b["inputs"] if i.get("from_part") == a["part"]]
        assert given["name"] == taken["name"] and given["dtype"] == taken["dtype"] == "uint16"
        assert given["shape"] == taken["shape"] == [1, 128, 256]  # batch, static sequence, hidden size
    assert [o["name"] for o in parts[-1]["outputs"]][0] == "logits" and split["outputs"][0] == "logits"
    files = [p["onnx"] for p in parts]
    feed = OnnxCausalLM(graph).prefill_feed(tokens[:100])
    assert check_chained(graph, files, feed) == {"identical": True, "max_abs_diff": 0.0, "outputs": 9}
    # the parts driven as one prefill graph (and the decode graph's parts as one decode graph): the same numbers
    dsplit = split_to_fit(demo_qdq[1], budget, tmp_path)
    chained = PartsCausalLM(files, [p["onnx"] for p in dsplit["parts"]])
    whole = OnnxCausalLM(*demo_qdq)
    np.testing.assert_array_equal(chained.logits(np.array([tokens[:100]])), whole.logits(np.array([tokens[:100]])))
    _, _, kv_p = chained.run_prefill(tokens[:64])
    _, _, kv_w = whole.run_prefill(tokens[:64])
    step_p, _, _ = chained.run_decode(tokens[64], kv_p, 64)
    step_w, _, _ = whole.run_decode(tokens[64], kv_w, 64)
    np.testing.assert_array_equal(step_p, step_w)


def test_split_limit_needs_a_soc(tmp_path, capsys):
    from workbench.cli import main
    assert main(["convert", "demo", "--bits", "8", "--target", "qnn", "--split-limit-mib", "4",
                 "--out", str(tmp_path / "a")]) == 2
    assert "--soc DEVICE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "demo", "--bits", "8", "--target", "qnn", "--soc", "8gen3", "--split-limit-mib", "0",
              "--out", str(tmp_path / "b")])
    assert "split-limit-mib" in capsys.readouterr().err


@pytest.fixture(scope="module")
def split_conversion(tmp_path_factory):
    """`convert --target qnn --soc 8gen3 --split-limit-mib 4` of the demo at INT8: its output folder and report."""
    from workbench.targets.convert import convert
    out = tmp_path_factory.mktemp("qnn-split")
    # the demo's graphs hold 7.1 MiB of weights: over this limit, so each is split
    return out, convert("demo", "qnn", out, bits=8, soc="8gen3", split_limit_bytes=4 << 20, evaluate_outputs=False)


@needs_qnn
def test_convert_qnn_splits_each_graph_into_parts_under_the_limit(split_conversion, tokens):
    from workbench.targets.htp_parts import PARTS_FILE, read_parts
    tmp_path, report = split_conversion
    limit = 4 << 20
    folder = tmp_path / "htp-snapdragon-8-gen-3"
    manifest = read_parts(folder)
    assert manifest["limit_bytes"] == limit and manifest["soc_limit_bytes"] == 4 << 30
    assert manifest == json.loads((folder / PARTS_FILE).read_text())
    for g in ("prefill", "decode"):
        parts = manifest["graphs"][g]["parts"]
        n = len(parts)
        assert n >= 2 and [p["part"] for p in parts] == list(range(1, n + 1))
        assert [p["bin"] for p in parts] == [[f"{g}_part_{k}_of_{n}.bin"] for k in range(1, n + 1)]
        for p in parts:
            size = (folder / p["bin"][0]).stat().st_size
            assert size == p["bytes"] <= limit and (folder / p["ctx"]).is_file()
            assert (folder / p["qdq"]).resolve().parent == tmp_path / "ort-qdq-twin"
        assert parts[0]["blocks"][0] == 0 and parts[-1]["blocks"][1] == 4
    htp = report.details["htp"]
    assert htp["context_limit_bytes"] == limit and htp["parts"]["prefill_chained_on_cpu"]["identical"]
    assert any("split to fit a context limit of 4.0 MiB (--split-limit-mib): prefill in 2 part(s)" in n
               for n in report.notes)
    assert not report.gap
    # the folder runs through the htp runner as its parts chained, computing what the whole graph does on the HTP
    chained = get_target("htp").runner(folder)
    whole = open_htp(tmp_path / "ort-qdq-twin" / "prefill.qdq.onnx", device="8gen3")
    ids = np.array([tokens[:128]])
    np.testing.assert_array_equal(chained.logits(ids), whole.logits(ids))


@needs_qnn
def test_generate_and_profile_open_a_split_folder(split_conversion, tokens, tmp_path):
    from workbench.run.generate import open_model
    from workbench.run.profile import profile_runtime
    from workbench.run.locate import locate
    folder = split_conversion[0] / "htp-snapdragon-8-gen-3"
    found = locate(folder)
    manifest = json.loads((folder / "parts.json").read_text())
    parts = [p for g in ("prefill", "decode") for p in manifest["graphs"][g]["parts"]]
    bins = [folder / p["bin"][0] for p in parts]
    assert found.target.name == "htp" and found.entry == folder / parts[0]["ctx"]
    assert [g.name for g in found.decode_graphs] == [p["ctx"] for p in manifest["graphs"]["decode"]["parts"]]
    generation = open_model(folder).generate(tokens[:8], max_new_tokens=4)
    assert generation.tokens  # the parts chained stream tokens through the HTP emulator
    prof = profile_runtime("split", folder, prompt_lengths=(16,), decode_steps=2, repeats=1)
    assert prof.size_bytes >= sum(b.stat().st_size for b in bins)  # the context binaries count, not only the stubs
    decode_bins = sum(b.stat().st_size for b, p in zip(bins, parts) if p["bin"][0].startswith("decode"))
    assert prof.decode_bytes == decode_bins and prof.decode_tokens_per_second > 0
    damaged = tmp_path / "copy" / folder.name
    shutil.copytree(folder, damaged)
    (damaged / bins[-1].name).unlink()  # a part's binary gone: named, with what to do
    with pytest.raises(WorkbenchError, match=f"{bins[-1].name} is missing.*convert again"):
        profile_runtime("damaged", damaged)


@needs_qnn
def test_a_part_over_the_limit_once_compiled_is_split_again(demo_qdq, tmp_path, monkeypatch):
    from workbench.targets import htp
    from workbench.targets.htp_parts import weight_bytes_by_block
    head, blocks, tail = weight_bytes_by_block(demo_qdq[0])
    monkeypatch.setattr(htp, "CONTEXT_OVERHEAD", 0.0)  # planned by the weights alone: the binaries come out larger
    limit = head + blocks[0] + blocks[1] + 1000
    written = htp.write_htp_binaries({"prefill": demo_qdq[0]}, tmp_path, "8gen3", limit=limit)
    parts = written["parts"]["graphs"]["prefill"]["parts"]
    assert len(parts) >= 3 and all(p["bytes"] <= limit for p in parts)  # two blocks and the embedding did not fit
    assert sorted(f.name for f in tmp_path.glob("*.bin")) == sorted(p["bin"][0] for p in parts)  # nothing left over
    # under the SoC's own limit (4 GiB) the graph is one context binary, as before, and no manifest is written
    whole = htp.write_htp_binaries({"prefill": demo_qdq[0]}, tmp_path / "whole", "8gen3")
    assert whole["parts"] is None and whole["limit_bytes"] == 4 << 30
    assert not (tmp_path / "whole" / "parts.json").exists()
    assert [Path(c["ctx"]).name for c in whole["context_binaries"]] == ["prefill_ctx.onnx"]


@pytest.mark.slow
@needs_qnn
def test_split_graphs_are_scored_on_the_htp_as_parts(tmp_path):
    from workbench.targets.convert import convert
    report = convert("demo", "qnn", tmp_path, bits=8, soc="8gen3", split_limit_bytes=4 << 20, max_tokens=300)
    htp = report.details["htp"]
    m = htp["measurement"]
    assert len(htp["parts"]["graphs"]["prefill"]["parts"]) >= 2
    assert len(m["context_files"]) == sum(len(g["parts"]) for g in htp["parts"]["graphs"].values())
    assert m["prefill"]["kl_vs_simulation"] < 1e-3 and m["decode"]["kl_vs_simulation"] < 1e-3
    assert m["decode"]["tokens"] == 63 and not report.gap
