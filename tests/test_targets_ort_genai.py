"""The fused ort-genai graph: the plan's integers packed exactly, parity with the simulation, onnxruntime-genai."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from workbench.cli import main
from workbench.evaluation.data import load_calibration_set
from workbench.errors import ModelLoadError
from workbench.runtime.parity import greedy_agreement, parity, torch_reference
from workbench.model.load import load_model
from workbench.quantize.plan import QuantPlan
from workbench.quantize import quantize_model
from workbench.targets import inspect_graph
from workbench.targets.ort_genai import (GenaiCausalLM, build_fused_onnx, fused_runner, is_genai_folder,
                                         write_genai_folder)

PROMPT = "The workbench measures what each choice costs."


def _build(lm, qm, out, level=0):
    sim = qm.build_model(lm.model)
    build = build_fused_onnx(sim, out, qm.precisions, accuracy_level=level)
    write_genai_folder(out, sim, lm.path, lm.tokenizer)
    return sim, build


def _initializers(path):
    proto = onnx.load(str(path))  # external data read from beside the graph
    return proto, {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}


def _source(name, nodes, inits):
    """The initializer behind ``name``, looking through the Cast that widens float16 scales."""
    if name in inits:
        return inits[name]
    node = next(n for n in nodes if name in n.output)
    assert node.op_type == "Cast"
    return inits[node.input[0]].astype(np.float32)


def _dequantize_nbits(codes, scales, zeros, bits, block, n, k):
    """MatMulNBits' weight ``[N, K]`` from its packed inputs, as onnxruntime's docs define it (written apart)."""
    raw = codes.reshape(n, -1)
    if bits == 4:
        q = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, -1)[:, :k].astype(np.float32)
    else:
        q = raw[:, :k].astype(np.float32)
    kb = k // block
    if zeros is None:
        z = np.full((n, kb), 2 ** (bits - 1), np.float32)
    elif bits == 4:
        z = np.stack([zeros & 0x0F, zeros >> 4], axis=-1).reshape(n, -1)[:, :kb].astype(np.float32)
    else:
        z = zeros.reshape(n, kb).astype(np.float32)
    s = scales.reshape(n, kb).astype(np.float32)
    return ((q.reshape(n, kb, block) - z[..., None]) * s[..., None]).reshape(n, k)


@pytest.fixture(scope="module")
def demo():
    return load_model("demo")


@pytest.fixture(scope="module")
def prompt(demo):
    return demo.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]


def test_packed_codes_dequantize_exactly_to_the_simulation(demo, tmp_path):
    """Mixed INT4/INT8, asymmetric (zero points), a quantized tied head: every fused MatMulNBits and the
    GatherBlockQuantized embedding hold exactly the simulation's weights."""
    plan = QuantPlan.uniform("int4", keep_embeddings=None, group_size=32, symmetric=False) \
        .with_override("*.v_proj", "int8").with_override("*.down_proj", "int8")
    qm = quantize_model(demo, plan, progress=False)
    sim, build = _build(demo, qm, tmp_path)
    proto, inits = _initializers(build.path)
    nodes = list(proto.graph.node)
    checked = set()
    for node in nodes:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        layers = build.fused.get(node.name) or [f for f, n in build.replaced.items() if n == node.name]
        zeros = inits[node.input[3]] if len(node.input) > 3 and node.input[3] else None
        got = _dequantize_nbits(inits[node.input[1]], _source(node.input[2], nodes, inits), zeros, attrs["bits"],
                                attrs["block_size"], attrs["N"], attrs["K"])
        want = torch.cat([sim.get_submodule(f).quantized.dequantize() for f in layers]).numpy()
        np.testing.assert_array_equal(got, want)
        checked.update(layers)
    assert checked == set(qm.weights) - {"model.embed_tokens"}  # the head too (tied: the embedding's codes)
    assert set(build.fused) and all(len(v) in (2, 3) for v in build.fused.values())
    assert any("qkv" not in k for k in build.fused)  # q/k/v at mixed widths stay apart, gate/up fuse
    gbq = next(n for n in nodes if n.op_type == "GatherBlockQuantized")
    emb = sim.get_submodule("model.embed_tokens").quantized
    codes = inits[gbq.input[0]]
    got = _dequantize_nbits(codes, _source(gbq.input[2], nodes, inits), inits[gbq.input[3]], 4, 32, *emb.shape)
    np.testing.assert_array_equal(got, emb.dequantize().numpy())
    head = next(n for n in nodes if n.name == build.replaced["lm_head"])
    assert head.input[1] != gbq.input[0] and build.weight_bytes < qm.storage_bytes() + 200_000  # one copy of codes


@pytest.mark.parametrize("plan", [
    QuantPlan.uniform("int4", group_size=32),
    QuantPlan.uniform("int4", group_size=128),
    QuantPlan.uniform("int4", keep_embeddings=None).with_override("*.v_proj", "int8")
    .with_override("model.layers.0.*", "int8"),
], ids=["int4-g32", "int4-g128", "mixed-int4-int8"])
def test_parity_with_the_simulation(demo, prompt, plan, tmp_path):
    qm = quantize_model(demo, plan, progress=False)
    sim, build = _build(demo, qm, tmp_path)
    ref = torch_reference(sim, prompt)
    runner = fused_runner(tmp_path)
    diffs = parity(ref, runner, prompt)
    assert max(diffs.values()) < 1e-3, diffs  # float activations: the simulation's arithmetic
    tokens = runner.generate_greedy(prompt, 32)
    assert greedy_agreement(sim, prompt, tokens)[0] == 32
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization", "MatMulNBits"} <= set(build.ops)
    assert sum(build.ops.values()) < 30 * 4  # a few fused nodes a block, not hundreds
    assert not build.kept_float


@pytest.mark.parametrize("method,symmetric", [("gptq", True), ("awq", False)], ids=["gptq", "awq-zero-points"])
def test_calibrated_models_run_with_their_own_integers(demo, prompt, method, symmetric, tmp_path):
    """GPTQ's integers, and AWQ's (scales folded into the norms before them, zero points), unchanged."""
    calib = load_calibration_set(None, tokenizer=demo.tokenizer, samples=4, seq_len=64)
    qm = quantize_model(demo, QuantPlan.uniform("int4", group_size=32, symmetric=symmetric), method=method,
                        calibration=calib, gptq_tokens=256, awq_tokens=256, progress=False)
    assert method != "awq" or qm.float_overrides  # AWQ changed float tensors the graph must carry
    sim, _ = _build(demo, qm, tmp_path)
    ref = torch_reference(sim, prompt)
    runner = fused_runner(tmp_path)
    assert max(parity(ref, runner, prompt).values()) < 1e-3
    assert greedy_agreement(sim, prompt, runner.generate_greedy(prompt, 32))[0] == 32


@pytest.mark.parametrize("arch,kw", [("qwen2", {"tie": False}), ("llama", {})], ids=["qwen2-bias-untied", "llama"])
def test_qwen2_and_llama_match_their_simulation(make_tiny_model, arch, kw, tmp_path):
    lm = load_model(make_tiny_model(arch, **kw))
    qm = quantize_model(lm, QuantPlan.uniform("int4", group_size=32), progress=False)
    sim, build = _build(lm, qm, tmp_path / "out")
    if arch == "qwen2":  # q/k/v biases ride along the fused projection
        names = [i.name for i in onnx.load(str(build.path), load_external_data=False).graph.initializer]
        assert any(n.endswith("qkv_proj.bias") for n in names)
    ids = list(range(5, 25))
    ref = torch_reference(sim, ids)
    assert max(parity(ref, fused_runner(tmp_path / "out"), ids).values()) < 1e-3


def test_other_architectures_are_refused(lm, tmp_path):
    model = lm.model
    before = model.config.model_type
    model.config.model_type = "phi3"
    try:
        with pytest.raises(ModelLoadError, match="ort-genai builds Llama.*--target ort-int4"):
            build_fused_onnx(model, tmp_path, {})
    finally:
        model.config.model_type = before
    assert not (tmp_path / "model.onnx").exists()


def test_onnxruntime_genai_runs_the_folder_as_onnxruntime_does(demo, prompt, tmp_path):
    qm = quantize_model(demo, QuantPlan.uniform("int4", keep_embeddings=None), progress=False)
    _build(demo, qm, tmp_path, level=4)
    assert is_genai_folder(tmp_path)
    doc = json.loads((tmp_path / "genai_config.json").read_text())
    assert doc["model"]["type"] == "qwen3" and doc["search"]["past_present_share_buffer"] is True
    assert (tmp_path / "tokenizer.json").is_file()
    tokens = fused_runner(tmp_path).generate_greedy(prompt, 24)
    genai = GenaiCausalLM(tmp_path, threads=1)
    assert genai.greedy(prompt, 24) == tokens  # onnxruntime-genai's own search
    steps = genai.steps()
    last = steps.start(prompt)
    assert last.shape == (demo.model.config.vocab_size,) and int(np.argmax(last)) == tokens[0]
    assert int(np.argmax(steps.step(tokens[0], len(prompt)))) == tokens[1]
    assert genai.decode_speed(prompt, steps=8, repeats=1) > 0
    with pytest.raises(ModelLoadError, match="convert with --target ort-genai"):
        GenaiCausalLM(tmp_path / "missing")


def test_convert_and_profile_from_the_command_line(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "genai"
    assert main(["convert", str(tiny_model_dir), "--bits", "4", "--target", "ort-genai", "--out", str(out),
                 "--max-tokens", "300", "--ctx", "128", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    d = report["details"]
    assert max(d["parity_vs_simulation_accuracy_level_0"].values()) < 1e-3
    assert d["greedy_match_steps_genai_vs_onnxruntime"] == d["greedy_steps"] == 32
    assert d["greedy_match_steps_vs_simulation"] >= 4 and report["gap"] is None
    assert report["top1_agreement_vs_simulation"] >= 0.95 and d["decode_tokens_per_second"]
    assert d["weight_bytes"] <= d["plan_storage_bytes"] + 200_000  # the plan's bytes once, plus norms and rotary
    assert {f["path"].rsplit("/", 1)[-1] for f in report["files"]} >= {"model.onnx", "genai_config.json",
                                                                         "tokenizer.json", "conversion.json"}
    graph_report = inspect_graph(out / "model.onnx", "ort-genai")  # the CPU kernels' rule table applies as to ort-int4
    assert graph_report.ok, graph_report.summary()
    assert main(["profile", str(out), "--prompt-lengths", "8", "--repeats", "1", "--decode-steps", "4",
                 "--workspace", str(tmp_path / "ws"), "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)["profiles"]
    assert p["runtime"] == "onnxruntime-genai" and p["decode_tokens_per_second"] > 0 and p["prefill_ms"]["8"] > 0
    head = 4096 * 64 * 4  # the plan's float16 tied head is read widened to float32 every token; the table a row
    assert head < p["decode_bytes"] < p["size_bytes"] + head
    assert any("lm_head stays fp16" in n for n in report["notes"])
