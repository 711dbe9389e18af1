"""Override files say what the plan says, in each converter's own names, and QNN's format validates."""
from __future__ import annotations

import json

import numpy as np
import pytest

from workbench.errors import PlanError
from workbench.precision.overrides import (OVERRIDE_FORMATS, gguf_tensor_name, graph_tensor_names, load_ort_overrides,
                                 mnn_op_name, read_overrides, read_qnn_encodings, validate_qnn_encodings,
                                 write_overrides, write_qnn_encodings)
from workbench.quantize.plan import QuantPlan
from workbench.quantize import quantize_model

QV_FP16 = QuantPlan.uniform("int8").with_override("*.q_proj", "fp16").with_override("*.v_proj", "fp16")


@pytest.fixture(scope="module")
def graph(lm, tmp_path_factory):
    from workbench.onnx.export import export_onnx
    return export_onnx(lm, tmp_path_factory.mktemp("onnx"), check=False)


def _names(lm):
    return [info.name for info in lm.layers]


def test_qnn_encodings_for_q_v_fp16_plan_validate_and_name_only_graph_tensors(lm, graph, tmp_path):
    qm = quantize_model(lm, QV_FP16, progress=False)
    f = write_qnn_encodings(tmp_path / "q.json", qm, graph)
    doc = json.loads(f.path.read_text())
    validate_qnn_encodings(f.path, onnx_path=graph.prefill_path)
    initializers, _ = graph_tensor_names(graph.prefill_path)
    assert doc["version"] and set(doc["param_encodings"]) <= set(initializers)
    assert len(doc["param_encodings"]) == len(lm.layers)
    for info in lm.layers:
        encs = doc["param_encodings"][graph.weight_names[info.name]]
        if info.role in ("q_proj", "v_proj") or info.kind == "embedding" or info.name == "lm_head":
            assert encs == [{"bitwidth": 16, "dtype": "float"}]
            continue
        qw = qm.weights[info.name]
        assert len(encs) == qw.scales.numel()
        assert {e["bitwidth"] for e in encs} == {8} and {e["dtype"] for e in encs} == {"int"}
        assert all(e["is_symmetric"] == "True" and e["offset"] == -128 for e in encs)
        np.testing.assert_allclose([e["scale"] for e in encs], qw.scales.reshape(-1).numpy(), rtol=1e-7)
        assert encs[0]["min"] == pytest.approx(-128 * encs[0]["scale"])
        assert encs[0]["max"] == pytest.approx(127 * encs[0]["scale"])
    assert read_overrides("qnn", f.path, lm, export=graph) == QV_FP16.resolve(_names(lm))


def test_per_channel_asymmetric_int4_encodings_round_trip(lm, graph, tmp_path):
    plan = QuantPlan.uniform("int4", group_size=None, symmetric=False).with_override("*.down_proj", "int8")
    qm = quantize_model(lm, plan, progress=False)
    f = write_qnn_encodings(tmp_path / "q4.json", qm, graph)
    back = read_qnn_encodings(f.path)
    for info in lm.layers:
        if info.name not in qm.weights or info.tied_to:
            continue
        got = back[graph.weight_names[info.name]]
        qw = qm.weights[info.name]
        assert got["precision"] == plan.precision_name_for(info.name) and got["symmetric"] is False
        assert len(got["scales"]) == info.shape[0]  # one encoding per output channel
        np.testing.assert_array_equal(got["offsets"], -qw.zeros.reshape(-1).numpy().astype(np.int64))
    assert read_overrides("qnn", f.path, lm, export=graph) == plan.resolve(_names(lm))


def test_validator_reports_each_problem(graph):
    bad = {"param_encodings": {
        "not.in.graph": [{"bitwidth": 8, "dtype": "int", "is_symmetric": "True", "scale": 0.1, "offset": -128,
                          "min": -12.8, "max": 12.7}],
        "model.layers.0.mlp.up_proj.weight.T": [{"bitwidth": 8, "dtype": "int", "is_symmetric": "True",
                                                 "scale": 0.1, "offset": -3, "min": -0.3, "max": 25.2}],
    }}
    with pytest.raises(PlanError) as e:
        validate_qnn_encodings(bad, onnx_path=graph.prefill_path)
    msg = str(e.value)
    assert "missing 'version'" in msg
    assert "param_encodings['not.in.graph']: no initializer of that name in the graph" in msg
    assert "symmetric 8-bit encodings have offset -128, got -3" in msg
    with pytest.raises(PlanError, match="'dtype' must be"):
        validate_qnn_encodings({"version": "0.6.1", "param_encodings": {"x": [{"bitwidth": 8, "dtype": "uint"}]}})
    with pytest.raises(PlanError, match="min/max .* disagree"):
        validate_qnn_encodings({"version": "0.6.1", "param_encodings": {"x": [
            {"bitwidth": 4, "dtype": "int", "is_symmetric": "False", "scale": 1.0, "offset": -2, "min": -2.0,
             "max": 99.0}]}})


def test_ort_overrides_are_accepted_by_onnxruntime(lm, graph, tmp_path):
    import onnx
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.tensor_quant_overrides import TensorQuantOverridesHelper
    plan = QuantPlan.uniform("int8", group_size=None).with_override("*.q_proj", "fp16").with_override("*.up_proj",
                                                                                                     "int4")
    qm = quantize_model(lm, plan, progress=False)
    f = write_overrides("ort", tmp_path / "ort.json", lm, plan, quantized=qm, export=graph)
    kwargs = load_ort_overrides(f.path)
    inits = {i.name: i for i in onnx.load(str(graph.prefill_path)).graph.initializer}
    ok, why = TensorQuantOverridesHelper(kwargs["init_overrides"]).is_valid(inits, set(), QuantType.QUInt16)
    assert ok, why
    up = kwargs["init_overrides"][graph.weight_names["model.layers.0.mlp.up_proj"]]
    assert up[0]["quant_type"] == QuantType.QInt4 and up[0]["axis"] == 1
    np.testing.assert_allclose([e["scale"] for e in up], qm.weights["model.layers.0.mlp.up_proj"].scales.reshape(-1))
    q = kwargs["init_overrides"][graph.weight_names["model.layers.0.self_attn.q_proj"]]
    assert q == [{"quant_type": QuantType.QUInt16}]  # float layers: 16-bit weights, never a float x fixed-point MatMul
    assert read_overrides("ort", f.path, lm, export=graph) == plan.resolve(_names(lm))


def test_llamacpp_names_and_round_trip(lm, tmp_path):
    assert gguf_tensor_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert gguf_tensor_name("model.layers.10.mlp.gate_proj") == "blk.10.ffn_gate"
    assert gguf_tensor_name("model.layers.0.self_attn.o_proj") == "blk.0.attn_output"
    assert gguf_tensor_name("model.embed_tokens") == "token_embd" and gguf_tensor_name("lm_head") == "output"
    plan = QV_FP16.with_override("*.down_proj", "int4")
    f = write_overrides("llamacpp", tmp_path / "types.txt", lm, plan)
    lines = f.path.read_text().splitlines()
    assert "^blk\\.1\\.attn_q\\.weight$=f16" in lines and "^blk\\.0\\.ffn_down\\.weight$=q4_0" in lines
    assert read_overrides("llamacpp", f.path, lm) == plan.resolve(_names(lm))
    assert any("computes its own scales" in n for n in f.notes)
    untied = plan.with_override("lm_head", "int8")
    g = write_overrides("llamacpp", tmp_path / "types2.txt", lm, untied)
    assert any("tied to model.embed_tokens" in n for n in g.notes)
    assert read_overrides("llamacpp", g.path, lm)["lm_head"] == "fp16"  # what llama.cpp will really do


def test_mnn_quant_config_round_trip(lm, tmp_path):
    assert mnn_op_name("model.layers.2.mlp.down_proj") == "/layers.2/mlp/down_proj/Linear"
    assert mnn_op_name("lm_head") == "/lm/lm_head/Linear"
    plan = QV_FP16.with_override("*.gate_proj", "int4")
    f = write_overrides("mnn", tmp_path / "mnn.json", lm, plan)
    cfg = json.loads(f.path.read_text())
    assert cfg["/layers.0/self_attn/q_proj/Linear"] == {"bits": 16}
    assert cfg["/layers.0/mlp/gate_proj/Linear"]["bits"] == 4
    back = read_overrides("mnn", f.path, lm)
    want = plan.resolve(_names(lm))
    assert back == {k: v for k, v in want.items() if k != "model.embed_tokens"}
    assert any("--embed_bit 16" in n for n in f.notes)


def test_missing_graph_and_bad_format_are_clear(lm, tmp_path):
    with pytest.raises(PlanError, match="pass export=export_onnx"):
        write_overrides("qnn", tmp_path / "q.json", lm, QV_FP16)
    with pytest.raises(PlanError, match="unknown override format 'tflite'"):
        write_overrides("tflite", tmp_path / "x", lm, QV_FP16)
    with pytest.raises(PlanError, match="matches no layer"):
        write_overrides("mnn", tmp_path / "m.json", lm, QV_FP16.with_override("*.c_attn", "fp16"))
    assert set(OVERRIDE_FORMATS) == {"qnn", "ort", "llamacpp", "mnn"}


def test_activation_encodings_from_calibration_name_graph_tensors(lm, graph, tmp_path, workspace):
    from workbench.model.calibrate import calibrate
    _, stats = calibrate(lm, samples=4, seq_len=64, workspace=workspace, progress=False)
    qm = quantize_model(lm, QV_FP16, progress=False)
    f = write_qnn_encodings(tmp_path / "qa.json", qm, graph, calibration=stats)
    doc = json.loads(f.path.read_text())
    acts = doc["activation_encodings"]
    _, names = graph_tensor_names(graph.prefill_path)
    assert acts and set(acts) <= names
    ints = [e[0] for e in acts.values() if e[0]["dtype"] == "int"]
    assert ints and all(e["bitwidth"] == 16 and e["min"] < 0 < e["max"] for e in ints)
    # q/k/v share one input: q_proj and v_proj are fp16 there, k_proj int8, so the converter is told
    assert any("feeds float and integer layers" in n for n in f.notes)
