"""Per-target compatibility rules: unsupported ops, dynamic shapes, fp16 hazards, mixed MatMuls, memory."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from workbench.errors import WorkbenchError
from workbench.model.load import load_model
from workbench.onnx.export import export_onnx
from workbench.targets import RULE_TABLES, RULES_DIR, TARGETS, get_target, inspect_graph, load_rules, target_names
from workbench.targets.base import _check_memory


def _save(tmp_path, nodes, inputs, outputs, inits=(), name="g.onnx", ms_domain=False):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if ms_domain else [])
    path = tmp_path / name
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


@pytest.fixture
def rotary_graph(tmp_path):
    """A fused RotaryEmbedding (com.microsoft) and a DynamicQuantizeLinear, static shapes."""
    f = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    inits = [numpy_helper.from_array(np.zeros((16, 4), np.float32), "cos_cache"),
             numpy_helper.from_array(np.zeros((16, 4), np.float32), "sin_cache"),
             numpy_helper.from_array(np.arange(8, dtype=np.int64).reshape(1, 8), "pos")]
    nodes = [helper.make_node("RotaryEmbedding", ["x", "pos", "cos_cache", "sin_cache"], ["rot"], name="rope_q",
                              domain="com.microsoft"),
             helper.make_node("DynamicQuantizeLinear", ["rot"], ["q", "q_scale", "q_zp"], name="dynq_0")]
    outs = [helper.make_tensor_value_info("q", TensorProto.UINT8, [1, 8, 8]),
            helper.make_tensor_value_info("q_scale", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("q_zp", TensorProto.UINT8, [])]
    return _save(tmp_path, nodes, [f("x", [1, 8, 8])], outs, inits, ms_domain=True)


def test_every_rule_table_names_its_source():
    for t in RULE_TABLES:
        rules = json.loads((RULES_DIR / f"{t}.json").read_text())
        assert rules["target"] == t and rules["sources"] and all(s["where"] for s in rules["sources"])
        assert rules["ops"]["mode"] in ("allow", "deny") and rules["ops"]["domains"]


def test_each_target_is_one_module_in_one_registry():
    builtin = {"ort-int4", "ort-genai", "ort-qdq", "qnn", "mnn", "mnn-llm", "executorch", "llama.cpp", "tensorrt",
               "tensorrt-edgellm", "rknn"}
    assert builtin == set(target_names("convert"))
    modules = {get_target(n).module for n in builtin}
    assert len(modules) == len(builtin) and all(m.startswith("workbench.targets.") for m in modules)
    for name in builtin:
        t = get_target(name)
        if t.rules is not None:  # inspect takes the target's name and applies its rule table
            assert name in TARGETS and load_rules(name) == load_rules(t.rules)
    assert get_target("llama.cpp").rules is None and "llama.cpp" not in TARGETS  # GGUF, not ONNX
    assert {get_target(n).overrides.name for n in builtin if get_target(n).overrides} == \
        {"qnn", "ort", "llamacpp", "mnn"}


def test_unsupported_ops_are_named_with_their_fix(rotary_graph):
    report = inspect_graph(rotary_graph, "qnn")
    assert not report.ok
    by_op = {f.op_type: f for f in report.findings if f.rule == "unsupported-op"}
    assert by_op["RotaryEmbedding"].nodes == ["rope_q"]
    assert "com.microsoft" in by_op["RotaryEmbedding"].message
    assert "Sin/Cos" in by_op["RotaryEmbedding"].fix
    assert by_op["DynamicQuantizeLinear"].nodes == ["dynq_0"]
    assert "static quantization" in by_op["DynamicQuantizeLinear"].fix


def test_same_graph_is_fine_for_onnxruntime_cpu(rotary_graph):
    report = inspect_graph(rotary_graph, "ort")
    assert not [f for f in report.findings if f.rule == "unsupported-op"]
    assert {r.op_type for r in report.inventory} == {"RotaryEmbedding", "DynamicQuantizeLinear"}


def test_deny_list_targets_reject_other_domains(rotary_graph):
    for target in ("tensorrt", "rknn"):
        report = inspect_graph(rotary_graph, target)
        ops = {f.op_type for f in report.findings if f.rule == "unsupported-op"}
        assert {"RotaryEmbedding", "DynamicQuantizeLinear"} <= ops, target


def test_unknown_target_lists_the_known_ones(rotary_graph):
    with pytest.raises(WorkbenchError, match="unknown target 'hexagon'.*qnn"):
        load_rules("hexagon")


def test_small_layernorm_epsilon_is_flagged_for_fp16_targets(tmp_path):
    f = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    inits = [numpy_helper.from_array(np.ones(8, np.float32), "gamma")]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma"], ["y"], name="ln_0", epsilon=1e-6)]
    path = _save(tmp_path, nodes, [f("x", [1, 4, 8])], [f("y", [1, 4, 8])], inits)
    eps = [f for f in inspect_graph(path, "qnn").findings if f.rule == "fp16-epsilon"]
    assert eps and eps[0].nodes == ["ln_0"] and "1e-06" in eps[0].message
    assert not [f for f in inspect_graph(path, "ort").findings if f.rule == "fp16-epsilon"]


def test_mixed_fixed_point_and_float_matmul_is_named(tmp_path):
    f = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    inits = [numpy_helper.from_array(np.ones((8, 8), np.uint8), "w_q"),
             numpy_helper.from_array(np.array(0.1, np.float32), "w_scale"),
             numpy_helper.from_array(np.array(0, np.uint8), "w_zp"),
             numpy_helper.from_array(np.ones((8, 8), np.float32), "w_float")]
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_deq"], name="dq_w"),
             helper.make_node("MatMul", ["x", "w_deq"], ["h"], name="quantized_mm"),
             helper.make_node("MatMul", ["h", "w_float"], ["y"], name="float_mm")]
    path = _save(tmp_path, nodes, [f("x", [1, 8])], [f("y", [1, 8])], inits)
    mixed = [f for f in inspect_graph(path, "qnn").findings if f.rule == "mixed-matmul"]
    assert len(mixed) == 1 and mixed[0].severity == "error"
    assert mixed[0].nodes == ["quantized_mm"]  # x is float, w is fixed point; float_mm has two float inputs


def test_context_memory_limits():
    rules = load_rules("qnn")
    three_gib = _check_memory(3 << 30, rules)
    assert [f.severity for f in three_gib] == ["warning"] and "2 GiB" in three_gib[0].message
    assert [f.severity for f in _check_memory(5 << 30, rules)] == ["warning", "error"]
    assert _check_memory(1 << 30, rules) == []


@pytest.fixture(scope="module")
def exported_pair(tiny_model_dir, tmp_path_factory):
    lm = load_model(tiny_model_dir)
    dyn = export_onnx(lm, tmp_path_factory.mktemp("dyn"), check=False)
    static = export_onnx(lm, tmp_path_factory.mktemp("static"), static=(16, 32), check=False)
    return dyn, static


def test_dynamic_export_needs_static_shapes_on_qnn_but_not_on_ort(exported_pair):
    dyn, static = exported_pair
    report = inspect_graph(dyn.decode_path, "qnn")
    dynamic = [f for f in report.findings if f.rule == "dynamic-shape"]
    assert dynamic and all(f.severity == "error" for f in dynamic)
    assert any("past_key_values.0.key" in f.nodes for f in dynamic)
    assert "--static" in dynamic[0].fix
    assert inspect_graph(dyn.decode_path, "ort").ok
    static_report = inspect_graph(static.decode_path, "qnn")
    assert static_report.ok and static_report.folded
    assert {f.rule for f in static_report.findings} <= {"int64", "fp16-epsilon", "fp16-overflow"}


def test_rknn_takes_neg_from_the_rotary(exported_pair):
    _, static = exported_pair  # rknn-toolkit2 2.5.0 builds the rotary's Neg (and every other op of these graphs)
    report = inspect_graph(static.prefill_path, "rknn")
    assert not [f for f in report.findings if f.op_type == "Neg"]
    assert report.ok and {f.severity for f in report.findings} <= {"warning", "info"}


def test_graph_panel_inspects_and_stops_netron_on_close(exported_pair, tmp_path):
    import socket
    import time

    from workbench.ui.graph import GraphPanel
    _, static = exported_pair
    panel = GraphPanel(static.decode_path, target="qnn")
    report = panel.run()
    assert report.ok and set(panel.figures) == {"operators", "bytes"}
    assert "layers.0" in panel.figures["bytes"].data[0].x
    url = panel.open_netron()
    host, port = panel.netron.address
    assert host == "127.0.0.1" and url.endswith(str(port)) and "iframe" in panel.netron_view.value
    with socket.create_connection((host, port), timeout=5):
        pass
    panel.close()
    assert panel.netron.address is None
    deadline, closed = time.monotonic() + 10, False
    while not closed and time.monotonic() < deadline:  # the server thread shuts down asynchronously
        try:
            socket.create_connection((host, port), timeout=1).close()
            time.sleep(0.2)
        except OSError:
            closed = True
    assert closed
    bad = GraphPanel(tmp_path / "missing.onnx", target="qnn", serve_netron=False)
    assert bad.run() is None and "does not exist" in bad.error and not bad.inspect_button.disabled


def test_inspection_reads_no_external_weights(tiny_model_dir, tmp_path):
    static = export_onnx(load_model(tiny_model_dir), tmp_path, static=(16, 32), check=False, inline_limit=0)
    data = static.data_path.read_bytes()
    static.data_path.write_bytes(b"\0" * len(data))  # same size, no weights: inspection must not need them
    report = inspect_graph(static.decode_path, "qnn")
    assert report.ok and report.folded and report.static  # built with constant shapes: nothing left to fold
    assert report.initializer_bytes > 0.9 * len(data)  # counted from shapes, not read


TOY_MODULE = '''"""Toy runtime: the simulation's float graph run by onnxruntime, and a JSON file of layer precisions."""
import json
from pathlib import Path

from workbench.onnx.export import export_onnx
from workbench.runtime.onnx_runner import OnnxCausalLM
from workbench.targets import OverrideFormat, Target, register_target
from workbench.targets.common import OverrideFile, layer_precisions


def convert_toy(job):
    ex = export_onnx(job.prep.sim_lm, job.out, check=False)
    job.report.details["toy"] = "float graph of the simulation"
    job.measure(OnnxCausalLM(ex.prefill_path).logits, ex.prefill_path, "toy")


def write(path, lm, plan, *, quantized=None, export=None, calibration=None):
    doc = layer_precisions(lm.layers, plan)
    Path(path).write_text(json.dumps(doc))
    return OverrideFile(Path(path), "toy-json", len(doc))


def read(path, lm, export=None):
    return json.loads(Path(path).read_text())


def open_toy(folder, *, threads=None):
    return OnnxCausalLM(Path(folder) / "prefill.onnx", Path(folder) / "decode.onnx", threads=threads)


TARGET = register_target(Target("toy", "Toy runtime", rules=Path(__file__).with_name("toy.json"),
                                convert=convert_toy, runnable=True, runner=open_toy,
                                overrides=OverrideFormat("toy-json", write, read), module=__name__))
'''

TOY_RULES = {"target": "toy", "title": "Toy runtime", "sources": [{"where": "this test"}],
             "ops": {"mode": "allow", "domains": {"ai.onnx": ["MatMul", "Add", "Mul", "Gather", "Softmax"]}}}


@pytest.fixture
def toy_target(tmp_path, monkeypatch):
    """A target from a test-local module and rule table, registered for this test only."""
    import importlib.util

    from workbench.targets import registry
    monkeypatch.setattr(registry, "_TARGETS", dict(registry._TARGETS))
    (tmp_path / "toy.json").write_text(json.dumps(TOY_RULES))
    (tmp_path / "toy_target.py").write_text(TOY_MODULE)
    spec = importlib.util.spec_from_file_location("toy_target", tmp_path / "toy_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TARGET


def test_a_new_target_is_one_module_and_one_rule_table(toy_target, tiny_model_dir, lm, tmp_path):
    from workbench.cli import main
    from workbench.targets.convert import CONVERT_TARGETS, convert, prepare_models
    from workbench.precision.overrides import OVERRIDE_FORMATS, read_overrides, write_overrides
    from workbench.quantize.plan import QuantPlan
    assert "toy" in CONVERT_TARGETS and "toy" in TARGETS and "toy-json" in OVERRIDE_FORMATS
    report = convert(tiny_model_dir, "toy", tmp_path / "out", prepared=prepare_models(tiny_model_dir, bits=8),
                     max_tokens=300, ctx=64)
    assert report.details["toy"] and report.runnable
    assert report.top1_agreement_vs_simulation > 0.99  # the simulation's own graph: what was evaluated
    found = inspect_graph(tmp_path / "out" / "prefill.onnx", "toy")
    assert found.title == "Toy runtime" and not found.ok
    assert {"Sqrt", "Sigmoid"} <= {f.op_type for f in found.errors}  # outside the toy's table
    assert main(["inspect", str(tmp_path / "out" / "prefill.onnx"), "--target", "toy"]) == 1
    plan = QuantPlan.uniform("int4").with_override("*.v_proj", "int8")
    f = write_overrides("toy-json", tmp_path / "toy-plan.json", lm, plan)
    assert read_overrides("toy-json", f.path, lm) == plan.resolve([i.name for i in lm.layers])


@pytest.fixture(scope="module")
def static_feeds(tiny_model_dir, exported_pair):
    from workbench.targets.convert import calibration_feeds
    from workbench.runtime.onnx_runner import OnnxCausalLM
    _, static = exported_pair
    return calibration_feeds(load_model(tiny_model_dir), samples=3, seq_len=16,
                             runner=OnnxCausalLM(static.prefill_path, static.decode_path))


def _onnxruntime_ranges(graph, feeds, op_types, tmp_path):
    """Ranges from onnxruntime's own MinMax calibrator, the reference for ``activation_ranges``."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator
    calibrator = create_calibrator(graph, op_types, augmented_model_path=str(tmp_path / "augmented.onnx"),
                                   calibrate_method=CalibrationMethod.MinMax)
    it = iter(feeds)
    calibrator.collect_data(type("Reader", (), {"get_next": lambda self: next(it, None)})())
    return calibrator.compute_data()


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_activation_ranges_equal_onnxruntime_calibrators(exported_pair, static_feeds, graph, tmp_path):
    from workbench.targets.ort_qdq import activation_ranges
    _, static = exported_pair
    path = static.prefill_path if graph == "prefill" else static.decode_path
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
    ops = get_qnn_qdq_config(str(path), None).op_types_to_quantize
    before = sorted(p.name for p in path.parent.iterdir())
    ours = activation_ranges(path, static_feeds[graph], ops)
    theirs = _onnxruntime_ranges(path, static_feeds[graph], ops, tmp_path)
    assert len(ours.data) > 20 and set(ours.data) == set(theirs.data)
    for name in theirs.data:
        for a, b in zip(ours[name].range_value, theirs[name].range_value):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert sorted(p.name for p in path.parent.iterdir()) == before  # no scratch graph left beside it


def test_quantize_qdq_writes_what_onnxruntimes_calibrated_quantize_writes(exported_pair, static_feeds, tmp_path):
    """Same scales, zero points, weights and nodes as ``quantize`` with the QNN config and its own calibrator."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
    from workbench.targets.ort_qdq import MASK_RANGE, _with_quant_types, causal_mask_tensors, quantize_qdq
    _, static = exported_pair
    path = static.prefill_path
    weight = "model.layers.0.mlp.down_proj.weight.T"
    overrides = {weight: [{"quant_type": "QInt4", "axis": 1, "symmetric": True}]}
    quantize_qdq(path, tmp_path / "ours.onnx", static_feeds["prefill"], init_overrides=overrides)
    pinned = {t: [{"rmin": -MASK_RANGE, "rmax": MASK_RANGE}] for t in causal_mask_tensors(onnx.load(str(path)))}
    it = iter(static_feeds["prefill"])
    reader = type("Reader", (), {"get_next": lambda self: next(it, None)})()
    config = get_qnn_qdq_config(str(path), reader, activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8,
                                per_channel=True, init_overrides=_with_quant_types({**pinned, **overrides}, "test"))
    quantize(str(path), tmp_path / "theirs.onnx", config)
    ours, theirs = onnx.load(str(tmp_path / "ours.onnx")), onnx.load(str(tmp_path / "theirs.onnx"))
    a = {i.name: numpy_helper.to_array(i) for i in ours.graph.initializer}
    b = {i.name: numpy_helper.to_array(i) for i in theirs.graph.initializer}
    assert set(a) == set(b) and any(k.endswith("_scale") for k in a) and f"{weight}_scale" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k], equal_nan=True), k
    assert [(n.op_type, list(n.input), list(n.output)) for n in ours.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in theirs.graph.node]


@pytest.fixture(scope="module")
def demo():
    return load_model("demo")


@pytest.fixture(scope="module")
def demo_lpbq(demo):
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import quantize_model
    return quantize_model(demo, QuantPlan.uniform("int4-lpbq", group_size=32), progress=False)


def test_refusal_names_the_layer_and_the_precision(demo):
    from workbench.errors import PlanError
    from workbench.quantize.plan import QuantPlan
    from workbench.targets import check_precisions
    from workbench.targets.common import layer_precisions
    plan = QuantPlan.uniform("int4").with_override("model.layers.1.mlp.down_proj", "int3")
    precisions = layer_precisions(demo.layers, plan)
    with pytest.raises(PlanError, match="llama.cpp cannot carry precision 'int3' \\(3-bit integer\\) for layer\\(s\\) "
                                        "model.layers.1.mlp.down_proj: .*Q3_K"):
        check_precisions(get_target("llama.cpp"), precisions, "llama.cpp")
    with pytest.raises(PlanError, match="'int3' .* model.layers.1.mlp.down_proj: .*2, 4 and 8-bit codes only"):
        check_precisions(get_target("ort-int4"), precisions)
    with pytest.raises(PlanError, match=r"make one that fits with `workbench plan MODEL --bits-per-weight B --target "
                                        r"ort-int4 --out PLAN\.json` \(in the app: .* in the Precisions tab\)"):
        check_precisions(get_target("ort-int4"), precisions)
    two = layer_precisions(demo.layers, QuantPlan.uniform("int8-lpbq"))
    with pytest.raises(PlanError, match="'int8-lpbq' \\(8-bit integer, 4-bit sub-scales\\) for layer\\(s\\) "
                                        "model.layers.0.self_attn.q_proj, .* and \\d+ more: "
                                        ".*int4 with 4-bit sub-scales"):
        check_precisions(get_target("qnn"), two)
    for name in ("mnn", "ort-qdq", "llama.cpp"):
        with pytest.raises(PlanError, match="int4-lpbq"):
            check_precisions(get_target(name), layer_precisions(demo.layers, QuantPlan.uniform("int4-lpbq")))
    check_precisions(get_target("qnn"), layer_precisions(demo.layers, QuantPlan.uniform("int4-lpbq")))  # LPBQ
    check_precisions(get_target("ort-int4"), two)  # two-level scales expand into exact float32 block scales


def test_k_layouts_with_minimums_are_llamacpp_only_and_refused_by_name_elsewhere(demo):
    from workbench.errors import PlanError
    from workbench.targets import check_precisions
    for precision in ("int4-k", "int5-k"):
        asked = {"model.layers.0.mlp.down_proj": precision}
        check_precisions(get_target("llama.cpp"), asked)
        from workbench.targets.registry import registered_targets
        assert len(registered_targets()) > 5
        for target in registered_targets():
            if target.name != "llama.cpp":
                with pytest.raises(PlanError, match=f"cannot carry precision '{precision}' .* for layer\\(s\\) "
                                                    "model.layers.0.mlp.down_proj"):
                    check_precisions(target, asked)


def test_qnn_lpbq_encodings_validate_and_carry_the_stored_scales(demo, demo_lpbq, tmp_path):
    from workbench.errors import PlanError
    from workbench.precision.overrides import read_qnn_encodings, validate_qnn_encodings, write_qnn_encodings
    export = export_onnx(demo, tmp_path / "onnx", check=False)
    f = write_qnn_encodings(tmp_path / "lpbq.json", demo_lpbq, export)
    doc = json.loads(f.path.read_text())
    assert doc["version"] == "1.0.0" and isinstance(doc["param_encodings"], list)
    name = "model.layers.0.mlp.down_proj"
    entry = next(e for e in doc["param_encodings"] if e["name"] == export.weight_names[name])
    qw = demo_lpbq.weights[name]
    assert (entry["enc_type"], entry["bw"], entry["compressed_bw"], entry["block_size"], entry["is_sym"]) == \
        ("LPBQ", 8, 4, 32, True)
    assert entry["scale"] == qw.channel_scales.tolist() and entry["offset"] == [-128] * qw.shape[0]
    assert entry["per_block_int_scale"] == qw.sub_scales.reshape(-1).tolist()
    # the encoding reproduces the stored weight: q * per_block_int_scale * scale
    ints = np.array(entry["per_block_int_scale"]).reshape(qw.shape[0], -1)
    w = qw.qweight.numpy().reshape(qw.shape[0], -1, 32) * (ints * np.array(entry["scale"])[:, None])[..., None]
    assert np.array_equal(w.reshape(qw.shape).astype(np.float32), qw.dequantize().numpy())
    embed = next(e for e in doc["param_encodings"] if e["name"] == export.weight_names["model.embed_tokens"])
    assert embed == {"name": embed["name"], "dtype": "FLOAT", "enc_type": "PER_TENSOR", "bw": 16}
    back = read_qnn_encodings(f.path)
    assert back[export.weight_names[name]]["precision"] == "int4-lpbq"
    validate_qnn_encodings(f.path, onnx_path=export.prefill_path)
    entry["per_block_int_scale"][0] = 17  # beyond 4 bits
    with pytest.raises(PlanError, match="per_block_int_scale' must be a list of integers in \\[1, 16\\]"):
        validate_qnn_encodings(doc, onnx_path=export.prefill_path)
    entry["per_block_int_scale"][0] = 1
    entry["scale"] = entry["scale"][:-1]
    with pytest.raises(PlanError, match="'offset' must be a list of"):
        validate_qnn_encodings(doc, onnx_path=export.prefill_path)


@pytest.mark.parametrize("precision", ["int4-lpbq", "int2"])
def test_two_level_and_int2_plans_run_in_ort_int4_as_simulated(tmp_path, precision):
    """MatMulNBits runs the plan's own codes: two-level scales as their exact products, int2 as 2-bit blocks."""
    from workbench.targets.convert import convert
    from workbench.quantize.plan import QuantPlan
    report = convert("demo", "ort-int4", tmp_path, plan=QuantPlan.uniform(precision, group_size=32),
                     max_tokens=2048, ctx=256, greedy_steps=8)
    assert report.details["replaced_layers"] == 28 and not report.details["kept_float"]
    assert report.top1_agreement_vs_simulation >= 0.95 and report.gap is None
    assert report.kl_divergence == pytest.approx(report.simulation["kl_divergence"], rel=0.05)
    if precision == "int4-lpbq":
        assert any("exact float32 product" in n for n in report.notes)
