"""ONNX export with KV cache: parity with PyTorch, weight naming, inventory, and bad files."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from workbench.errors import ModelLoadError
from workbench.onnx.export import export_onnx
from workbench.onnx.inspect import load_onnx, operator_inventory
from workbench.runtime.onnx_runner import OnnxCausalLM
from workbench.model.load import load_model


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def exported(tiny_lm, tmp_path_factory):
    return export_onnx(tiny_lm, tmp_path_factory.mktemp("onnx"), greedy_steps=12)


def test_export_matches_pytorch_and_decodes_greedily(exported):
    assert exported.prefill_path.is_file() and exported.decode_path.is_file()
    assert exported.max_abs_diff < 1e-4
    assert set(exported.diffs) == {"prefill.logits", "prefill.kv", "decode.logits", "decode.kv"}
    assert exported.greedy_match_steps == 12
    assert exported.onnx_tokens == exported.torch_tokens


def test_every_layer_weight_has_a_named_initializer(exported, tiny_lm):
    proto = onnx.load(str(exported.prefill_path))
    inits = {i.name: i for i in proto.graph.initializer}
    assert set(exported.weight_names) == {info.name for info in tiny_lm.layers}
    for fqn, name in exported.weight_names.items():
        assert name in inits, fqn
        assert name.startswith(fqn)
    q = exported.weight_names["model.layers.0.self_attn.q_proj"]
    assert q == "model.layers.0.self_attn.q_proj.weight.T" and exported.weight_layouts["model.layers.0.self_attn.q_proj"] == "in_out"
    w = tiny_lm.model.get_submodule("model.layers.0.self_attn.q_proj").weight.detach().numpy()
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(inits[q]), w.T)
    assert exported.weight_names["model.embed_tokens"] == "model.embed_tokens.weight"


def test_decode_graph_accepts_other_past_lengths_and_batches(exported, tiny_lm):
    runner = OnnxCausalLM(exported.prefill_path, exported.decode_path)
    ids = torch.randint(0, 4096, (3, 7))
    with torch.no_grad():
        ref = tiny_lm.model(input_ids=ids).logits.numpy()
    assert np.abs(runner.logits(ids.numpy()) - ref).max() < 1e-4
    prompt = ids[0].tolist()
    _, _, kv = runner.run_prefill(prompt[:3])
    for pos in range(3, 7):
        last, kv, _ = runner.run_decode(prompt[pos], kv, pos)
    assert np.abs(last - ref[0, -1]).max() < 1e-4


def test_static_export_has_fixed_shapes_and_matches(tiny_lm, tmp_path):
    res = export_onnx(tiny_lm, tmp_path, static=(16, 48), greedy_steps=8)
    proto = onnx.load(str(res.decode_path))
    dims = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in proto.graph.input}
    assert dims["input_ids"] == [1, 1] and dims["attention_mask"] == [1, 49]
    assert dims["past_key_values.0.key"][2] == 48
    assert not any(n.op_type in ("Shape", "Range", "ConstantOfShape") for n in proto.graph.node)  # folded
    assert res.max_abs_diff < 1e-4 and res.greedy_match_steps == 8


def test_operator_inventory_counts_every_node(exported):
    proto = onnx.load(str(exported.prefill_path))
    inv = operator_inventory(exported.prefill_path)
    assert sum(r.count for r in inv) == len(proto.graph.node)
    matmul = next(r for r in inv if r.op_type == "MatMul")
    assert matmul.domain == "ai.onnx" and matmul.opset == 17 and matmul.count >= 2 * 7 + 1


def test_non_onnx_file_is_rejected(tmp_path):
    p = tmp_path / "plan.onnx"
    p.write_text('{"version": 1}')
    with pytest.raises(ModelLoadError, match="is not an ONNX model"):
        load_onnx(p)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is empty"):
        load_onnx(empty)


def test_truncated_onnx_is_rejected(exported, tmp_path):
    data = exported.prefill_path.read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_onnx(cut)


def test_half_precision_model_exports_its_values_in_float32(tiny_model_dir, tmp_path):
    lm = load_model(tiny_model_dir, dtype="float16")  # stored dtype; no float32 copy of the model is made
    res = export_onnx(lm, tmp_path, greedy_steps=6)
    assert res.max_abs_diff < 1e-4 and res.greedy_match_steps == 6
    inits = {i.name: i for i in onnx.load(str(res.prefill_path)).graph.initializer}
    w = lm.model.get_submodule("model.layers.1.mlp.down_proj").weight
    got = onnx.numpy_helper.to_array(inits["model.layers.1.mlp.down_proj.weight.T"])
    assert got.dtype == np.float32 and np.array_equal(got, w.detach().float().numpy().T)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_other_architectures_export_with_parity(make_tiny_model, tmp_path, arch):
    lm = load_model(make_tiny_model(arch, tie=False))
    res = export_onnx(lm, tmp_path / arch, greedy_steps=6)
    assert res.max_abs_diff < 1e-4 and res.greedy_match_steps == 6
    assert res.weight_names["lm_head"] == "lm_head.weight.T"  # untied: its own initializer


def _external(proto) -> dict[str, tuple[str, int, int]]:
    """initializer -> (location, offset, length) for weights kept in external data."""
    from onnx.external_data_helper import uses_external_data
    out = {}
    for init in proto.graph.initializer:
        if uses_external_data(init):
            info = {e.key: e.value for e in init.external_data}
            out[init.name] = (info["location"], int(info["offset"]), int(info["length"]))
    return out


def test_graph_over_the_inline_limit_shares_one_external_data_file(tiny_lm, tmp_path):
    res = export_onnx(tiny_lm, tmp_path, greedy_steps=8, inline_limit=0)  # as if over protobuf's 2 GB
    assert res.data_path == tmp_path / "weights.data" and res.data_path in res.files
    assert res.max_abs_diff < 1e-4 and res.greedy_match_steps == 8
    pre, dec = (_external(onnx.load(str(p), load_external_data=False)) for p in (res.prefill_path, res.decode_path))
    assert pre == dec and {loc for loc, _, _ in pre.values()} == {"weights.data"}  # both graphs read the same bytes
    assert set(res.weight_names.values()) <= set(pre)
    spans = sorted((off, off + n) for _, off, n in pre.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # every tensor written once, none overlapping
    written = sum(n for _, _, n in pre.values())
    assert written <= res.data_path.stat().st_size < written + 64 * 2**10 * len(pre)
    assert res.prefill_path.stat().st_size < 64 * 2**10  # the graph itself holds no weights
    runner = OnnxCausalLM(res.prefill_path, res.decode_path)
    assert runner.serves_prefill and runner.prefill is runner.decode  # one session, prefill as a past of 0


def test_missing_or_short_external_data_is_named(tiny_lm, tmp_path):
    res = export_onnx(tiny_lm, tmp_path, check=False, inline_limit=0)
    data = res.data_path.read_bytes()
    res.data_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="weights.data', which holds .* bytes the graph reads"):
        load_onnx(res.decode_path)
    res.data_path.unlink()
    with pytest.raises(ModelLoadError, match="weights.data', which is missing"):
        load_onnx(res.prefill_path)


def test_released_model_is_reread_for_the_greedy_check(tiny_model_dir, tmp_path):
    lm = load_model(tiny_model_dir, dtype="float16")
    kept = export_onnx(load_model(tiny_model_dir, dtype="float16"), tmp_path / "kept", greedy_steps=6)
    res = export_onnx(lm, tmp_path / "released", greedy_steps=6, release_model=True)
    assert next(lm.model.parameters()).device.type == "meta"  # the caller's weights were let go
    assert res.diffs == kept.diffs and res.torch_tokens == kept.torch_tokens and res.greedy_match_steps == 6


def test_static_sessions_read_shared_external_weights_from_one_map(tiny_lm, tmp_path):
    """Static prefill and decode sessions use one memory map of weights.data, with the same outputs."""
    import onnxruntime as ort
    res = export_onnx(tiny_lm, tmp_path, static=(16, 32), greedy_steps=4, inline_limit=0)
    runner = OnnxCausalLM(res.prefill_path, res.decode_path)
    assert not runner.serves_prefill and runner.prefill is not runner.decode
    maps = [v for v in runner._shared.values() if isinstance(v, np.memmap)]
    assert len(maps) == 1 and str(maps[0].filename) == str(res.data_path.resolve())
    assert res.max_abs_diff < 1e-4 and res.greedy_match_steps == 4
    feed = runner.prefill_feed(list(range(5, 15)))
    plain = ort.InferenceSession(str(res.prefill_path), providers=["CPUExecutionProvider"])
    for a, b in zip(runner.prefill.run(None, feed), plain.run(None, feed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    _, _, kv = runner.run_prefill(list(range(5, 15)))
    dfeed = runner.decode_feed(20, kv, 10)
    plain = ort.InferenceSession(str(res.decode_path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(runner.decode.run(None, dfeed)[0], plain.run(None, dfeed)[0], rtol=1e-5, atol=1e-5)
