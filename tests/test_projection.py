import json
import math

import pytest

from workbench.devices.profiles import get_device, load_devices
from workbench.quantize.plan import QuantPlan
from workbench.devices.projection import (SHAPES_FILE, check_claim, check_memory_claim, fit_efficiency, model_shape, plan_from_spec,
                                  project, published_measurements)

LLAMA_7B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=11008,
                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False,
                max_position_embeddings=4096)
INT8_ALL = QuantPlan.uniform("int8", keep_embeddings="int8")


def test_shapes_alone_give_the_loaded_models_bytes(lm, tiny_model_dir):
    plan = QuantPlan.uniform("int4")
    from_dir, from_lm = project(tiny_model_dir, "8gen3", plan), project(lm, "8gen3", plan)
    assert from_dir.weight_bytes == from_lm.weight_bytes == lm.size_bytes(plan)
    assert from_dir.parameters == from_lm.parameters == lm.parameters
    assert from_dir.bits_per_weight == from_lm.bits_per_weight


def test_decode_bytes_kv_and_bound_by_hand():
    cfg = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
    p = project(cfg, "rk3588", QuantPlan.uniform("fp16"), context=100)
    h, i, kv_dim, v = 64, 96, 2 * 16, 1000
    block = h * h * 2 + h * kv_dim * 2 + 3 * h * i  # q, o; k, v; gate, up, down
    biases = 3 * (h + 2 * kv_dim)  # qwen2 has q/k/v biases
    norms = 3 * 2 * h + h
    weights = 2 * (3 * block + 2 * v * h) + 2 * (biases + norms)
    assert p.weight_bytes == weights
    assert p.bytes_per_token == weights - 2 * v * h + 2 * h  # the embedding table: one row read
    assert p.kv_bytes == 2 * 3 * 2 * 16 * 2 * 100  # K and V, layers, KV heads, head_dim, fp16, tokens
    assert p.decode_bound_tps == pytest.approx(34e9 / (p.bytes_per_token + p.kv_bytes))
    flops = 2 * 3 * block * 128 + 2 * v * h + 2 * 3 * 4 * 16 * 128 ** 2
    assert p.prefill_flops == flops
    assert p.compute_precision == "int8" and any("no fp16 throughput" in n for n in p.notes)  # RK3588: no FP16 figure


def test_a_7b_projects_without_loading_and_9_3_mb_is_rejected_with_arithmetic():
    lm = model_shape(LLAMA_7B, name="llama-7b")
    assert next(lm.model.parameters()).is_meta
    p = project(lm, "8gen3", QuantPlan.uniform("int4", keep_embeddings="int4"))
    assert 6.7e9 < p.parameters < 6.8e9 and 3.3e9 < p.weight_bytes < 4.0e9
    (claim,) = check_claim(p, peak_gb=0.0093)
    assert claim.possible is False and "> the claimed 0.0093 GB" in claim.arithmetic
    by_count = check_memory_claim(7_000_000_000, 0.0093, bits=4)
    assert by_count.possible is False and "0.0106 bits per weight" in by_count.arithmetic
    assert check_memory_claim(7_000_000_000, 4.0, bits=4).possible


def test_memory_fit_and_npu_limit():
    big = project(LLAMA_7B, "jetson-nano", QuantPlan.uniform("fp16"))
    assert big.fits_ram is False and big.total_bytes > 13e9
    on_phone = project(LLAMA_7B, "8gen3", QuantPlan.uniform("fp16"))
    assert on_phone.fits_npu is False and on_phone.fits_ram is None  # a phone's RAM is not the SoC's
    small = project("qwen2.5-0.5b", "8gen3", INT8_ALL)
    assert small.fits_npu is True


def test_layers_the_accelerator_cannot_run_at_the_plans_precision(tiny_model_dir):
    nano = get_device("jetson-nano")
    p = project(tiny_model_dir, nano, QuantPlan.uniform("int8"))
    assert {q for _, q in p.unsupported_layers} == {"int8"}
    assert "model.layers.0.mlp.down_proj" in {n for n, _ in p.unsupported_layers}
    assert "model.embed_tokens" not in {n for n, _ in p.unsupported_layers}  # fp16 by the uniform plan
    assert project(tiny_model_dir, nano, QuantPlan.uniform("fp16")).unsupported_layers == []
    kirin = project(tiny_model_dir, "kirin-9000", QuantPlan.uniform("int4"))
    assert {q for _, q in kirin.unsupported_layers} == {"fp16"}  # embedding and lm_head kept fp16


def test_a_decode_claim_above_the_bandwidth_bound_is_impossible():
    p = project("qwen3-1.7b", "rk3588", INT8_ALL)
    (claim,) = check_claim(p, decode_tps=22)
    assert claim.possible is False and claim.bound < 22
    assert f"> {p.bandwidth_gbps:g} GB/s" in claim.arithmetic
    assert check_claim(p, decode_tps=claim.bound * 0.99)[0].possible


def test_efficiency_fit_on_published_measurements():
    fit = fit_efficiency()
    rk = fit.classes["rknpu"]
    assert rk.factor is None and [m["label"] for m in rk.impossible] == ["Qwen3-1.5B INT8 (RKNN)"]
    for c in ("hexagon-htp", "jetson-gpu"):
        cf = fit.classes[c]
        assert 0 < cf.factor <= 1 and len(cf.points) == 2
        ratios = [pt["measured"] / pt["bound"] for pt in cf.points]
        assert cf.factor == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
        assert cf.max_error == pytest.approx(max(abs(cf.factor / r - 1) for r in ratios))
    factor, err, basis = fit.factor_for("rknpu")
    assert factor == fit.pooled.factor and "pooled" in basis
    p = project("qwen2.5-1.5b", "8gen3", INT8_ALL, runtime=None)  # no runtime: the practitioners' efficiency
    assert p.projected_decode_tps == pytest.approx(p.decode_bound_tps * fit.classes["hexagon-htp"].factor)


def test_efficiency_fit_recovers_a_known_factor(tmp_path):
    devices = load_devices()
    rows = []
    for shape in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        bound = project(shape, devices["rk3588"], INT8_ALL).decode_bound_tps
        rows.append({"label": shape, "shape": shape, "plan": {"precision": "int8", "keep_embeddings": "int8"},
                     "device": "rk3588", "decode_tps": 0.4 * bound})
    fit = fit_efficiency(rows, devices)
    cf = fit.classes["rknpu"]
    assert cf.factor == pytest.approx(0.4) and cf.max_error == pytest.approx(0, abs=1e-12)
    assert cf.max_loo_error == pytest.approx(0, abs=1e-12)


def test_published_measurements_name_known_devices_shapes_and_sources():
    for m in published_measurements():
        get_device(m["device"])
        model_shape(m["shape"])
        plan_from_spec(m["plan"])
        assert m["source"].startswith("shared/docs/FIELD.md") and m["decode_tps"] > 0


@pytest.mark.parametrize("name,total,non_embedding", [
    ("qwen2.5-7b", 7.61e9, 6.53e9),  # Qwen2.5-7B model card: 7.61B, 6.53B non-embedding (untied)
    ("qwen3-1.7b", 1.7e9, 1.4e9),  # Qwen3-1.7B model card: 1.7B, 1.4B non-embedding (tied)
])
def test_shapes_give_the_published_parameter_counts(name, total, non_embedding):
    lm = model_shape(name)
    embedding = sum(info.parameters for info in lm.layers if info.kind == "embedding" or info.name == "lm_head")
    if lm.config.tie_word_embeddings:
        embedding = lm.model.get_input_embeddings().weight.numel()
    assert lm.parameters == pytest.approx(total, rel=0.015)
    assert lm.parameters - embedding == pytest.approx(non_embedding, rel=0.01)


def test_a_context_past_the_models_positions_is_said():
    p = project("qwen2.5-0.5b", "rk3588", context=10 ** 12)
    assert any("past the 32,768 positions the model's config allows" in n for n in p.notes)
    assert not any("positions" in n for n in project("qwen2.5-0.5b", "rk3588", context=32768).notes)


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 1_000_000, "layer_types": ["full_attention"] * 4}, "1,000,000 layers"),
    ({"num_hidden_layers": 24.5}, "num_hidden_layers must be a positive whole number"),
    ({"hidden_size": float("nan")}, "hidden_size must be a positive whole number"),
])
def test_a_config_no_model_has_is_one_line_before_anything_is_built(tmp_path, capsys, change, message):
    from workbench.cli import main
    cfg = {**json.loads(SHAPES_FILE.read_text())["shapes"]["qwen2.5-0.5b"], **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["project", str(path), "--device", "rk3588"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(path) in err[0]
