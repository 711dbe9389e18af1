"""Plan application: group-size fallback per layer, strict mode, mixed precisions, ties, bad plans."""
import copy

import pytest
import torch

from workbench.errors import PlanError
from workbench.model.load import load_model
from workbench.quantize.plan import PRECISIONS, Precision, QuantPlan
from workbench.quantize import quantize_model, resolve_group_size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import build_tiny_model
    return load_model(build_tiny_model(tmp_path_factory.mktemp("q") / "m", hidden=64, intermediate=128))


@pytest.mark.parametrize("in_features,group,expected", [
    (768, 128, 128), (192, 128, 96), (64, 128, 64), (160, 128, 32), (172, 128, None), (256, None, None),
    (256, 7, 32), (256, 100, 64), (96, 40, 32), (224, 200, 32), (100, 7, None), (32, 7, None), (320, 48, 32)])
def test_resolve_group_size(in_features, group, expected):
    g, note = resolve_group_size(in_features, group)
    assert g == expected
    assert (note is None) == (group is None or in_features % group == 0)
    if note:
        assert f"does not divide {in_features}" in note
        assert ("per-channel" in note) == (expected is None)
        if expected is None:  # the note's claim is true: no multiple of 32 below the input size divides it
            assert all(in_features % g for g in range(32, in_features, 32))
        else:
            assert f"using {expected}, the nearest multiple of 32 {'below' if expected < group else 'above'}" in note


def test_fallback_is_reported_per_layer_and_strict_names_the_layer(make_tiny_model):
    lm = load_model(make_tiny_model(hidden=96, intermediate=160, heads=4, kv_heads=2))
    qm = quantize_model(lm, QuantPlan.uniform("int4", group_size=128), progress=False)
    q = qm.layer("model.layers.0.self_attn.q_proj")
    assert q.group_size == 96 and "group size 128 does not divide 96 input features; using 96" in q.fallback
    down = qm.layer("model.layers.0.mlp.down_proj")
    assert down.group_size == 32 and "160" in down.fallback
    assert qm.weights["model.layers.0.mlp.down_proj"].group_size == 32
    assert set(qm.fallbacks) == {r.name for r in qm.layers if r.name in qm.weights}
    with pytest.raises(PlanError, match="layer 'model.layers.0.self_attn.q_proj': group size 128 does not divide 96 "
                                        ".*strict"):
        quantize_model(lm, QuantPlan.uniform("int4", group_size=128), strict=True, progress=False)
    ok = quantize_model(lm, QuantPlan.uniform("int4", group_size=32), strict=True, progress=False)
    assert not ok.fallbacks


def test_mixed_plan_gives_exactly_the_precisions_asked_for(tiny):
    plan = (QuantPlan.uniform("int4", group_size=32)
            .with_override("model.layers.0.self_attn.q_proj", "fp16")
            .with_override("*.mlp.down_proj", "int8")
            .with_override("model.layers.1.self_attn.o_proj", None)
            .with_override("model.embed_tokens", "int8"))
    names = [info.name for info in tiny.layers]
    qm = quantize_model(tiny, plan, progress=False)
    assert qm.precisions == plan.resolve(names)
    for name, prec in qm.precisions.items():
        if prec in ("int4", "int8"):
            assert qm.weights[name].bits == int(prec[3:]), name
        else:
            assert name not in qm.weights, name
    assert qm.precisions["model.layers.0.self_attn.q_proj"] == "fp16"
    assert qm.precisions["model.layers.1.mlp.down_proj"] == "int8"
    assert qm.precisions["model.layers.1.self_attn.o_proj"] is None
    assert qm.precisions["lm_head"] == "fp16" and qm.layer("lm_head").untied


def test_apply_writes_dequantized_weights_and_leaves_the_source_alone(tiny):
    before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    plan = QuantPlan.uniform("int4", group_size=32).with_override("model.layers.0.mlp.up_proj", "fp16")
    qm = quantize_model(tiny, plan, progress=False)
    assert all(torch.equal(before[k], v) for k, v in tiny.model.state_dict().items())
    model = qm.apply_(copy.deepcopy(tiny.model))
    q = model.get_submodule("model.layers.1.mlp.gate_proj").weight
    assert torch.equal(q, qm.weights["model.layers.1.mlp.gate_proj"].dequantize())
    up = model.get_submodule("model.layers.0.mlp.up_proj").weight
    assert torch.equal(up, before["model.layers.0.mlp.up_proj.weight"].half().float())
    assert 0 < qm.layer("model.layers.1.mlp.gate_proj").weight_error < 0.2


def test_tied_embeddings_untie_only_when_precisions_differ(tiny):
    assert tiny.model.lm_head.weight is tiny.model.model.embed_tokens.weight
    same = quantize_model(tiny, QuantPlan.uniform("int8", keep_embeddings="int8", group_size=32), progress=False)
    assert same.weights["lm_head"] is same.weights["model.embed_tokens"] and not same.unties_embeddings
    m = same.apply_(copy.deepcopy(tiny.model))
    assert m.lm_head.weight is m.model.embed_tokens.weight
    plan = QuantPlan.uniform("int8", group_size=32).with_override("model.embed_tokens", "int8")
    diff = quantize_model(tiny, plan, progress=False)
    assert diff.unties_embeddings and "lm_head" not in diff.weights
    m = diff.apply_(copy.deepcopy(tiny.model))
    assert m.lm_head.weight is not m.model.embed_tokens.weight and not m.config.tie_word_embeddings
    assert torch.equal(m.lm_head.weight, tiny.model.lm_head.weight.half().float())
    assert torch.equal(m.model.embed_tokens.weight, diff.weights["model.embed_tokens"].dequantize())


def test_bad_plans_are_named(tiny, monkeypatch):
    with pytest.raises(PlanError, match="plan rule 'model.layers.0.self_attn.qproj' matches no layer.*closest layer "
                                        "names: model.layers.0.self_attn.q_proj"):
        quantize_model(tiny, QuantPlan.uniform("int4").with_override("model.layers.0.self_attn.qproj", "fp16"),
                       progress=False)
    monkeypatch.setitem(PRECISIONS, "int7", Precision("int7", 7, False))
    with pytest.raises(PlanError, match="layer 'model.layers.0.self_attn.q_proj': int7 \\(7-bit\\) weights are not "
                                        "supported; weight quantization supports int2, int3, int4, int5, int6, int8"):
        quantize_model(tiny, QuantPlan.uniform("int7"), progress=False)
    with pytest.raises(PlanError, match="unknown quantization method 'obq'; choose one of: rtn, awq, gptq"):
        quantize_model(tiny, QuantPlan.uniform("int4"), method="obq", progress=False)
    with pytest.raises(PlanError, match="AWQ and GPTQ need calibration data"):
        quantize_model(tiny, QuantPlan.uniform("int4"), method="awq", progress=False)


def test_bits_per_weight_counts_scales_and_tied_weights_once(tiny):
    qm = quantize_model(tiny, QuantPlan.uniform("int8", keep_embeddings=None, group_size=32), progress=False)
    # every layer int8 with one float16 scale per 32 weights: 8 + 16/32 bits
    assert qm.bits_per_weight == pytest.approx(8.5)
    assert qm.parameters == sum(r.shape[0] * r.shape[1] for r in qm.layers if r.name != "lm_head")


def test_build_model_computes_the_quantized_weights_without_a_float_copy(lm):
    """QuantLinear layers give the logits of the dequantized float model; untouched tensors are shared."""
    import copy

    from workbench.quantize.layers import QuantLinear
    plan = QuantPlan.uniform("int4").with_override("*.v_proj", "int8").with_override("*.o_proj", "fp16")
    qm = quantize_model(lm, plan, progress=False)
    built = qm.build_model()
    applied = qm.apply_(copy.deepcopy(lm.model))
    ids = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(built(input_ids=ids).logits, applied(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert isinstance(built.get_submodule("model.layers.0.mlp.down_proj"), QuantLinear)
    source = dict(lm.model.named_parameters())
    shared = dict(built.named_parameters())
    assert shared["model.norm.weight"] is source["model.norm.weight"]  # not copied
    assert not any(isinstance(m, QuantLinear) for m in lm.model.modules())  # the source is left as it was


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_release_float_frees_each_integer_layers_weight_and_changes_no_result(tiny_model_dir, method):
    """`workbench quantize` lets each integer layer's float weight go once its codes exist (one float copy at most);
    the codes, the built model's logits, the saved bytes and the storage count are those of a kept source."""
    from workbench.model.calibrate import calibrate
    kept, freed = load_model(tiny_model_dir), load_model(tiny_model_dir)
    plan = QuantPlan.default_for("int4", group_size=32, method=method).with_override("*.o_proj", "fp16")
    cal = calibrate(kept, samples=4, seq_len=32, progress=False) if method == "awq" else None
    a = quantize_model(kept, plan, calibration=cal, progress=False)
    b = quantize_model(freed, plan, calibration=cal, progress=False, release_float=True)
    for name, qw in a.weights.items():
        assert torch.equal(qw.qweight, b.weights[name].qweight) and torch.equal(qw.scales, b.weights[name].scales)
    params = dict(freed.model.named_parameters())
    assert params["model.layers.0.mlp.down_proj.weight"].device.type == "meta"  # released
    o_proj = params["model.layers.0.self_attn.o_proj.weight"]  # fp16: rounded where it is, shared by build_model
    assert o_proj.device.type == "cpu" and torch.equal(o_proj, o_proj.half().float())
    assert b.build_model().get_parameter("model.layers.0.self_attn.o_proj.weight") is o_proj
    assert params["model.embed_tokens.weight"].device.type == "cpu"  # tied to lm_head: kept
    ids = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a.build_model()(input_ids=ids).logits, b.build_model()(input_ids=ids).logits)
    assert a.storage_bytes() == b.storage_bytes()


def test_storage_bytes_counts_what_layer_storage_holds(tiny):
    """Counted from codes and shapes, equal to the stored tensors' bytes (float layers at their stored width)."""
    from workbench.quantize.storage import layer_storage
    for plan in (QuantPlan.default_for("int4", group_size=32), QuantPlan.uniform("int8", keep_embeddings=None),
                 QuantPlan.uniform("int4", symmetric=False, group_size=32).with_override("*.o_proj", None),
                 QuantPlan.uniform("int4-lpbq", group_size=32).with_override("lm_head", "int8")):
        qm = quantize_model(tiny, plan, progress=False)
        assert qm.storage_bytes() == sum(t.numel() * t.element_size() for t in layer_storage(qm).values())


def test_rtn_weighs_the_scale_search_by_calibration_statistics(lm):
    """With statistics given, each input column's error counts by its mean squared activation (rms^2)."""
    from types import SimpleNamespace

    from workbench.quantize.model import activation_importance
    plan = QuantPlan.uniform("int4", group_size=32, scale_search=True, full_range=True)
    name = next(i.name for i in lm.layers if i.kind != "embedding" and not i.tied_to)
    w = dict(lm.model.named_modules())[name].weight.detach().float()
    g = torch.Generator().manual_seed(0)
    rms = torch.rand(w.shape[1], generator=g) ** 3 * 10
    stats = SimpleNamespace(layers={name: SimpleNamespace(rms=rms)})
    assert torch.equal(activation_importance(None, stats)[name], rms.square())
    assert activation_importance(None, None) == {}
    plain = quantize_model(lm, plan, progress=False).weights[name].dequantize()
    weighted = quantize_model(lm, plan, stats=stats, progress=False).weights[name].dequantize()
    werr = lambda wh: float(((w - wh).square() * rms.square()).sum())  # noqa: E731
    assert werr(weighted) < werr(plain)
    assert int(quantize_model(lm, plan, progress=False).weights[name].qweight.min()) == -8


def test_a_tied_embedding_is_weighed_by_the_output_layers_input_statistics(lm):
    """Tied, the embedding is the output layer too: its columns' errors count by lm_head's inputs."""
    from types import SimpleNamespace
    emb = next(i for i in lm.layers if i.kind == "embedding")
    head = next(i for i in lm.layers if i.tied_to == emb.name)
    plan = QuantPlan.uniform("int4", keep_embeddings="int4", group_size=32, scale_search=True, full_range=True)
    w = dict(lm.model.named_modules())[emb.name].weight.detach().float()
    rms = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) ** 3 * 10
    stats = SimpleNamespace(layers={head.name: SimpleNamespace(rms=rms)})
    plain = quantize_model(lm, plan, progress=False).weights[emb.name].dequantize()
    weighted = quantize_model(lm, plan, stats=stats, progress=False)
    assert weighted.weights[head.name] is weighted.weights[emb.name]  # still one tensor
    werr = lambda wh: float(((w - wh).square() * rms.square()).sum())  # noqa: E731
    assert werr(weighted.weights[emb.name].dequantize()) < werr(plain)
