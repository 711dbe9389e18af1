"""QDQ weights from the plan's integers: what onnxruntime's own quantizer writes, without its float copies."""
from __future__ import annotations

import numpy as np
import torch
import onnx
import pytest
from onnx import numpy_helper

from workbench.targets.convert import calibration_feeds, prepare_models
from workbench.onnx.export import export_onnx
from workbench.quantize.plan import QuantPlan
from workbench.runtime.onnx_runner import OnnxCausalLM
from workbench.targets.ort_qdq import ort_overrides, quantize_qdq

pytest.importorskip("onnxruntime")


PLANS = {  # per-channel plans carry their own scales; group-wise ones get onnxruntime's per-channel parameters
    "per-channel": (QuantPlan.uniform("int4", group_size=None, symmetric=False)
                    .with_override("model.layers.0.self_attn.v_proj", "int8")
                    .with_override("model.layers.1.self_attn.o_proj", "fp16")),
    "group-wise": QuantPlan.uniform("int8", group_size=32).with_override("model.layers.0.mlp.up_proj", "int4"),
}
TYPES = {"per-channel": {onnx.TensorProto.UINT4, onnx.TensorProto.UINT8, onnx.TensorProto.UINT16},
         "group-wise": {onnx.TensorProto.INT8, onnx.TensorProto.INT4, onnx.TensorProto.UINT16}}


@pytest.fixture(scope="module")
def setups(tiny_model_dir, tmp_path_factory):
    """``setups(kind)`` -> (prepared models, static export, calibration feeds, overrides), built once per kind."""
    made = {}

    def get(kind):
        if kind not in made:
            prep = prepare_models(tiny_model_dir, plan=PLANS[kind])
            static = export_onnx(prep.float_lm, tmp_path_factory.mktemp(kind), static=(16, 32), check=False)
            feeds = calibration_feeds(prep.float_lm, samples=2, seq_len=16,
                                      runner=OnnxCausalLM(static.prefill_path, static.decode_path))
            made[kind] = prep, static, feeds, ort_overrides(prep.qm, static)
        return made[kind]
    return get


def _weights(path):
    """``{weight: (codes, scale, zero point, axis)}`` of every pre-quantized initializer behind a DequantizeLinear."""
    proto = onnx.load(str(path))
    inits = {i.name: i for i in proto.graph.initializer}
    out = {}
    for n in proto.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in inits:
            axis = [a.i for a in n.attribute if a.name == "axis"]
            out[n.input[0]] = (numpy_helper.to_array(inits[n.input[0]]), numpy_helper.to_array(inits[n.input[1]]),
                               numpy_helper.to_array(inits[n.input[2]]), axis, inits[n.input[0]].data_type)
    return out


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_prequantized_weights_equal_onnxruntimes_own(setups, kind, tmp_path):
    """Same codes, scales, zero points, axes and types as onnxruntime's quantizer computes from the float weights."""
    prep, static, feeds, doc = setups(kind)
    info = quantize_qdq(static.prefill_path, tmp_path / "ours.qdq.onnx", feeds["prefill"],
                        init_overrides=doc["init_overrides"], quantized=prep.qm, export=static)
    quantize_qdq(static.prefill_path, tmp_path / "theirs.qdq.onnx", feeds["prefill"],
                 init_overrides=doc["init_overrides"])
    ours, theirs = _weights(tmp_path / "ours.qdq.onnx"), _weights(tmp_path / "theirs.qdq.onnx")
    matmul = {k for k in ours if ".weight.T" in k}
    assert info["prequantized"] == len(matmul) + 1 == 16  # 14 linear layers, the float lm_head and the embedding
    assert set(ours) == set(theirs)
    types = {ours[k][4] for k in matmul}
    assert types == TYPES[kind]
    for k in ours:
        (qa, sa, za, axa, ta), (qb, sb, zb, axb, tb) = ours[k], theirs[k]
        assert ta == tb and axa == axb and sa.dtype == sb.dtype, k
        assert np.array_equal(qa.astype(np.int32), qb.astype(np.int32)), k
        assert np.array_equal(sa, sb) and np.array_equal(za.astype(np.int32), zb.astype(np.int32)), k
    lookup = {}  # the embedding lookup's output Q/DQ: the table's own scale and zero point in both graphs
    for name in ("ours", "theirs"):
        proto = onnx.load(str(tmp_path / f"{name}.qdq.onnx"))
        gather = next(n for n in proto.graph.node if n.op_type == "Gather" and "embed_tokens" in n.input[0])
        q = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == gather.output[0])
        inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
        lookup[name] = (inits[q.input[1]], inits[q.input[2]])
    assert lookup["ours"][0] == lookup["theirs"][0] and lookup["ours"][1] == lookup["theirs"][1]
    feed = feeds["prefill"][0]
    import onnxruntime as ort
    logits = [ort.InferenceSession(str(tmp_path / f"{n}.qdq.onnx"), providers=["CPUExecutionProvider"])
              .run(["logits"], feed)[0] for n in ("ours", "theirs")]
    # the same weights; activation ranges calibrated with the quantized weights (ours) or the float ones (theirs)
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).mean() >= 0.9
    scratch = [p.name for p in static.prefill_path.parent.iterdir() if "qweights" in p.name or "opset21" in p.name]
    assert not scratch  # no side graph or data file left beside the export


def test_the_plans_own_codes_reach_the_graph(setups, tmp_path):
    """A code that is not round(w / scale) (as GPTQ writes them) is kept; re-rounding the float weight would lose it."""
    prep, static, feeds, doc = setups("per-channel")
    layer = "model.layers.0.self_attn.v_proj"  # int8, asymmetric
    qw = prep.qm.weights[layer]
    original = qw.qweight.clone()
    far = 255 if int(original[0, 0]) < 128 else 0  # far from what rounding gives
    try:
        qw.qweight[0, 0] = far
        quantize_qdq(static.prefill_path, tmp_path / "ours.qdq.onnx", feeds["prefill"],
                     init_overrides=doc["init_overrides"], quantized=prep.qm, export=static)
    finally:
        qw.qweight.copy_(original)
    codes = _weights(tmp_path / "ours.qdq.onnx")[f"{static.weight_names[layer]}_quantized"][0]
    assert codes.shape == tuple(reversed(qw.shape))  # the graph's [in, out] layout
    assert int(codes[0, 0]) == far
    assert np.array_equal(np.delete(codes.ravel(), 0), np.delete(original.numpy().T.ravel(), 0))


def test_activations_are_calibrated_without_the_weights(setups, tmp_path):
    """The dequantized weights get no activation Q/DQ pair: each MatMul reads its weight from a DequantizeLinear."""
    prep, static, feeds, doc = setups("group-wise")
    quantize_qdq(static.prefill_path, tmp_path / "ours.qdq.onnx", feeds["prefill"],
                 init_overrides=doc["init_overrides"], quantized=prep.qm, export=static)
    proto = onnx.load(str(tmp_path / "ours.qdq.onnx"))
    producer = {o: n for n in proto.graph.node for o in n.output}
    matmuls = [n for n in proto.graph.node if n.op_type == "MatMul" and ".weight.T" in n.input[1]]
    assert len(matmuls) == 15
    for n in matmuls:
        assert producer[n.input[1]].op_type == "DequantizeLinear" and producer[n.input[0]].op_type == "DequantizeLinear"
        assert producer[n.input[1]].input[0] == n.input[1] + "_quantized"


def test_an_embedding_quantized_per_row_keeps_its_codes_and_runs(tiny_model_dir, tmp_path):
    """A per-row integer embedding (onnxruntime's own quantizer gives its lookup per-row output scales, which its
    QuantizeLinear refuses): the table carries the plan's codes, the lookup's output its own calibrated range."""
    import onnxruntime as ort
    prep = prepare_models(tiny_model_dir, plan=QuantPlan.uniform("int8", group_size=None, keep_embeddings=None))
    static = export_onnx(prep.float_lm, tmp_path / "static", static=(16, 32), check=False)
    feeds = calibration_feeds(prep.float_lm, samples=2, seq_len=16,
                              runner=OnnxCausalLM(static.prefill_path, static.decode_path))
    doc = ort_overrides(prep.qm, static)
    quantize_qdq(static.prefill_path, tmp_path / "ours.qdq.onnx", feeds["prefill"],
                 init_overrides=doc["init_overrides"], quantized=prep.qm, export=static)
    table = static.weight_names["model.embed_tokens"]
    codes, scale, _, axis, _ = _weights(tmp_path / "ours.qdq.onnx")[table + "_quantized"]
    qw = prep.qm.weights["model.embed_tokens"]
    assert axis == [0] and np.array_equal(codes, qw.qweight.numpy()) and scale.shape == (qw.shape[0],)
    proto = onnx.load(str(tmp_path / "ours.qdq.onnx"))
    gather = next(n for n in proto.graph.node if n.op_type == "Gather" and n.input[0] == table)
    q = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == gather.output[0])
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    assert inits[q.input[1]].size == 1  # one activation scale for the lookup's output, not the rows'
    feed = feeds["prefill"][0]
    session = ort.InferenceSession(str(tmp_path / "ours.qdq.onnx"), providers=["CPUExecutionProvider"])
    qdq = session.run(["logits"], feed)
    with torch.no_grad():
        sim = prep.sim_lm.model(torch.from_numpy(feed["input_ids"])).logits.numpy()
    n = int(feed["attention_mask"].sum())
    assert (qdq[0][0, :n].argmax(-1) == sim[0, :n].argmax(-1)).mean() >= 0.9


def test_calibration_ranges_on_the_prequantized_graph_equal_onnxruntimes(setups, tmp_path):
    """The calibration session looks rows up before dequantizing them (no float32 copy of the table): the same
    ranges, tensor by tensor, as onnxruntime's own MinMax calibrator on the pre-quantized graph."""
    import json
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
    from workbench.targets.ort_qdq import activation_ranges, load_ort_overrides
    from workbench.targets.qdq_weights import prequantize_weights
    prep, static, feeds, doc = setups("per-channel")
    (tmp_path / "ort.json").write_text(json.dumps(doc))
    config = get_qnn_qdq_config(str(static.prefill_path), None, activation_type=QuantType.QUInt16,
                                per_channel=True, **load_ort_overrides(tmp_path / "ort.json"))
    opset21 = tmp_path / "opset21.onnx"  # 4-bit and 16-bit DequantizeLinear need opset 21 (weights inline here)
    proto = onnx.load(str(static.prefill_path), load_external_data=False)
    onnx.save(onnx.version_converter.convert_version(proto, 21), str(opset21))
    side, written, excluded = prequantize_weights(opset21, prep.qm, static,
                                                  config.extra_options["TensorQuantOverrides"],
                                                  tmp_path / "side.onnx")
    assert excluded == ["/model.embed_tokens/Gather"] and static.weight_names["model.embed_tokens"] in written
    ours = activation_ranges(side, feeds["prefill"], config.op_types_to_quantize)
    calibrator = create_calibrator(side, config.op_types_to_quantize, calibrate_method=CalibrationMethod.MinMax,
                                   augmented_model_path=str(tmp_path / "augmented.onnx"))
    it = iter(feeds["prefill"])
    calibrator.collect_data(type("Reader", (), {"get_next": lambda self: next(it, None)})())
    theirs = calibrator.compute_data()
    gathered = next(n.output[0] for n in onnx.load(str(side)).graph.node if n.name == excluded[0])
    assert gathered in ours.data and len(ours.data) > 20 and set(ours.data) <= set(theirs.data)
    for name in ours.data:
        for a, b in zip(ours[name].range_value, theirs[name].range_value):
            assert np.array_equal(a, b), name
