"""The GGUF writer: llama.cpp's blocks packed from the plan's own codes, checked by the gguf package's dequantizer."""
import numpy as np
import pytest
import torch

from conftest import build_tiny_model
from workbench.errors import PlanError
from workbench.quantize.plan import QuantPlan, get_precision
from workbench.quantize import quantize_model
from workbench.quantize.rtn import quantize_weight
from workbench.targets.gguf_file import _permute_rows, check_gguf, ggml_type_of, pack_blocks, write_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402


def _weight(precision: str, group_size: int | None = 32, *, scale_search: bool = False, cols: int = 512):
    torch.manual_seed(1)
    p = get_precision(precision)
    w = torch.randn(6, cols) * torch.logspace(-2, 0, cols)  # groups of very different ranges
    return quantize_weight(w, p.bits, p.layer_group_size(group_size), True, scale_bits=p.sub_scales,
                           scale_search=scale_search, minimums=p.minimums and not p.two_level)


@pytest.mark.parametrize("precision,group_size,kind", [
    ("int4", 32, "Q4_0"), ("int5", 32, "Q5_0"), ("int8", 32, "Q8_0"), ("int4", 128, "Q4_0"), ("int8", None, "Q8_0"),
    ("int3-k", None, "Q3_K"), ("int6-k", None, "Q6_K"), ("int4-k", None, "Q4_K"), ("int5-k", None, "Q5_K"),
    ("int4-min", None, "Q4_1"), ("int5-min", None, "Q5_1")])
@pytest.mark.parametrize("scale_search", [False, True])
def test_blocks_dequantize_to_the_simulation_bit_for_bit(precision, group_size, kind, scale_search):
    qw = _weight(precision, group_size, scale_search=scale_search)
    got_kind, data = pack_blocks(qw)
    assert got_kind == kind and data.dtype == np.uint8
    got = dequantize(data, getattr(gguf.GGMLQuantizationType, kind)).reshape(qw.shape)
    assert np.array_equal(got, qw.dequantize().numpy())
    # the block sizes are llama.cpp's: the bytes a K layout's precision counts are the file's
    if kind.endswith(("_K", "_1")):
        p = get_precision(precision)
        assert data.nbytes == p.weight_bytes(*qw.shape) == qw.storage_bytes()


def test_every_code_and_sub_scale_value_survives_packing():
    """Extreme codes (-4 and 3, -32 and 31; 0 and 15, 0 and 31) and sub-scales / sub-minimums (1 or 0 and the
    largest) in every position of a block."""
    for precision, lo, hi in (("int3-k", -4, 3), ("int6-k", -32, 31), ("int4-k", 0, 15), ("int5-k", 0, 31)):
        qw = _weight(precision)
        codes = torch.arange(qw.qweight.numel()).remainder(hi - lo + 1).add(lo).view(qw.shape)
        top = qw.scale_max
        sub = torch.arange(qw.sub_scales.numel()).remainder(top).add(1).view(qw.sub_scales.shape)
        mins = {} if qw.mins is None else {
            "sub_mins": torch.arange(qw.sub_mins.numel()).mul(7).remainder(top + 1).view(qw.sub_mins.shape),
            "channel_mins": qw.channel_mins}
        qw = type(qw).two_level_weight(codes.to(torch.int8 if lo < 0 else torch.uint8), sub, qw.channel_scales,
                                       qw.bits, qw.group_size, qw.sub_layout, **mins)
        assert mins == {} or {int(qw.sub_mins.min()), int(qw.sub_mins.max())} == {0, top}
        kind, data = pack_blocks(qw)
        got = dequantize(data, getattr(gguf.GGMLQuantizationType, kind)).reshape(qw.shape)
        assert np.array_equal(got, qw.dequantize().numpy())


def test_float_minimums_of_either_sign_and_every_code_survive_packing():
    """Q4_1 / Q5_1: codes 0 and 15 (31) in every position, minimums below, at and above zero (llama.cpp adds
    ``m``, the workbench subtracts its minimum: the sign flips exactly)."""
    for precision, hi in (("int4-min", 15), ("int5-min", 31)):
        qw = _weight(precision)
        codes = torch.arange(qw.qweight.numel()).remainder(hi + 1).view(qw.shape).to(torch.uint8)
        mins = (torch.arange(qw.mins.numel()).remainder(5).sub(2).view(qw.mins.shape) * 0.125)
        qw = type(qw)(codes, qw.scales, None, qw.bits, qw.group_size, mins=mins)
        assert qw.float_minimums and not qw.symmetric
        kind, data = pack_blocks(qw)
        got = dequantize(data, getattr(gguf.GGMLQuantizationType, kind)).reshape(qw.shape)
        assert np.array_equal(got, qw.dequantize().numpy())


@pytest.mark.parametrize("make,match", [
    (lambda: quantize_weight(torch.randn(4, 64), 4, 32, False), "asymmetric zero points"),
    (lambda: _weight("int6", 32), "int6-k"),
    (lambda: _weight("int3", 32), "int3-k"),
    (lambda: _weight("int4-lpbq", 32), "no llama.cpp block layout"),
    (lambda: quantize_weight(torch.randn(4, 48), 4, 16, True), "32-weight blocks"),
    (lambda: quantize_weight(torch.randn(4, 128), 4, 64, True, minimums=True), "int4-min"),
    (lambda: quantize_weight(torch.randn(4, 64), 3, 32, True, minimums=True), "int5-min")])
def test_layouts_llamacpp_cannot_hold_are_refused(make, match):
    with pytest.raises(PlanError, match=match):
        ggml_type_of(make())


def test_llama_rotary_rows_are_interleaved_as_llamacpp_reads_them():
    rows = np.arange(16)[:, None]  # two heads of 8 dimensions: HF halves -> llama.cpp pairs
    assert _permute_rows(rows, 2)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_quantized_model_written_as_gguf_holds_exactly_its_weights(arch, tmp_path):
    from workbench.model.load import load_model
    lm = load_model(build_tiny_model(tmp_path / arch, arch, hidden=256, intermediate=512, layers=2))
    plan = QuantPlan.uniform("int4", keep_embeddings="int8", group_size=32) \
        .with_override("*.down_proj", "int3-k").with_override("*.v_proj", "int6-k") \
        .with_override("*.o_proj", "int5").with_override("model.layers.1.mlp.up_proj", "fp16") \
        .with_override("model.layers.0.mlp.up_proj", "int4-k").with_override("*.gate_proj", "int5-k")
    qm = quantize_model(lm, plan, method="rtn", progress=False)
    path = write_gguf(qm, tmp_path / "model.gguf")
    check = check_gguf(qm, path)
    unique = {id(qw): qw for qw in qm.weights.values()}.values()  # a tied lm_head shares the embedding's codes
    assert check["max_abs_diff"] == 0.0 and check["weights"] == sum(qw.qweight.numel() for qw in unique)
    assert check["types"] == {"Q8_0": 1, "Q4_0": 4, "Q3_K": 2, "Q6_K": 2, "Q5_0": 2, "Q4_K": 1, "Q5_K": 2}
    reader = gguf.GGUFReader(str(path))
    fields = {f.name: f for f in reader.fields.values()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == arch
    assert int(fields[f"{arch}.block_count"].parts[-1][0]) == 2
    assert int(fields[f"{arch}.attention.head_count_kv"].parts[-1][0]) == 2
    assert len(fields["tokenizer.ggml.tokens"].data) == lm.model.config.vocab_size
    names = {t.name: t for t in reader.tensors}
    assert "output.weight" not in names  # tied: llama.cpp reads token_embd
    assert names["blk.1.ffn_up.weight"].tensor_type.name == "F16"
    assert names["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    integer_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name.startswith("Q"))
    assert integer_bytes == sum(qw.storage_bytes() for qw in unique)  # the plan's bytes are the file's


def test_a_fixed_layout_that_does_not_fit_a_layer_is_refused_naming_it(lm):
    with pytest.raises(PlanError, match="layer 'model.layers.0.self_attn.q_proj': int3-k stores 256-weight blocks"):
        quantize_model(lm, QuantPlan.uniform("int3-k"), progress=False)
    from workbench.precision.sensitivity import sweep_precisions
    assert "int3-k" in sweep_precisions() and "int3-k" not in sweep_precisions(True, lm.layers)


def test_a_saved_quantized_model_converts_to_the_same_gguf(tmp_path):
    """From a `workbench quantize` directory (layers loaded as integer modules) the file is the same."""
    from workbench.model.load import load_model
    from workbench.model.load import load_quantized
    from workbench.quantize import save_quantized
    lm = load_model(build_tiny_model(tmp_path / "m", "qwen2", hidden=256, intermediate=512, layers=1))
    qm = quantize_model(lm, QuantPlan.uniform("int4", group_size=32).with_override("*.down_proj", "int6-k")
                        .with_override("*.up_proj", "int4-k").with_override("*.gate_proj", "int5-k")
                        .with_override("*.o_proj", "int4-min").with_override("*.v_proj", "int5-min"), progress=False)
    direct = write_gguf(qm, tmp_path / "direct.gguf")
    save_quantized(qm, tmp_path / "q")
    _, again = load_quantized(tmp_path / "q")
    reloaded = write_gguf(again, tmp_path / "reloaded.gguf")
    assert check_gguf(again, reloaded)["max_abs_diff"] == 0.0
    a, b = (gguf.GGUFReader(str(p)) for p in (direct, reloaded))
    assert [(t.name, t.tensor_type, bytes(t.data)) for t in a.tensors] == \
        [(t.name, t.tensor_type, bytes(t.data)) for t in b.tensors]


@pytest.mark.parametrize("embed,output,kinds", [("int4", "int6-k", ("Q4_0", "Q6_K")),
                                                ("int5", "int8", ("Q5_0", "Q8_0")),
                                                ("int6-k", "int4", ("Q6_K", "Q4_0"))])
def test_embedding_and_untied_output_are_quantized_and_written_at_their_types(embed, output, kinds, tmp_path):
    """The plan puts token_embd / output at integer types: lookups use the dequantized rows, the file holds them."""
    from workbench.model.load import load_model
    lm = load_model(build_tiny_model(tmp_path / "m", "qwen2", hidden=256, intermediate=512, layers=1, tie=False))
    plan = QuantPlan.uniform("int8", keep_embeddings=None, group_size=32) \
        .with_override("model.embed_tokens", embed).with_override("lm_head", output)
    qm = quantize_model(lm, plan, method="rtn", progress=False)
    ids = torch.tensor([[3, 17, 4000, 3]])
    model = qm.build_model()
    rows = qm.weights["model.embed_tokens"].dequantize()[ids[0]]
    assert torch.equal(model.get_input_embeddings()(ids)[0], rows)
    assert not torch.equal(rows, lm.model.get_input_embeddings().weight.detach()[ids[0]])  # really rounded
    path = write_gguf(qm, tmp_path / "model.gguf")
    assert check_gguf(qm, path)["max_abs_diff"] == 0.0
    names = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert (names["token_embd.weight"], names["output.weight"]) == kinds


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("low,high,kinds", [("int4-k", "int5-k", ("Q4_K", "Q5_K")),
                                            ("int4-min", "int5-min", ("Q4_1", "Q5_1"))])
def test_layouts_with_minimums_round_every_method_into_their_blocks(method, asymmetric, low, high, kinds, tmp_path):
    """int4-k / int5-k and int4-min / int5-min are asymmetric by their layout, in a symmetric plan (beside Q4_0)
    or an asymmetric one; GPTQ rounds them to the same grid, and all land in their blocks read back equal."""
    from workbench.model.load import load_model
    lm = load_model(build_tiny_model(tmp_path / "m", "qwen2", hidden=256, intermediate=512, layers=1))
    plan = QuantPlan.uniform(low, keep_embeddings="int8", group_size=32, symmetric=not asymmetric) \
        .with_override("*.down_proj", high)
    if asymmetric:  # the float16-scale layers need symmetric blocks for llama.cpp: keep them float
        plan = plan.with_override("model.embed_tokens", "fp16").with_override("lm_head", "fp16")
    samples = [torch.randint(0, 4096, (64,)) for _ in range(4)]
    qm = quantize_model(lm, plan, method=method, calibration=samples if method == "gptq" else None, progress=False)
    for name, qw in qm.weights.items():
        if name.endswith("proj"):
            assert qw.mins is not None and qw.qweight.dtype == torch.uint8 and 0 < qm.layer(name).weight_error < 0.2
    check = check_gguf(qm, write_gguf(qm, tmp_path / "model.gguf"))
    assert check["max_abs_diff"] == 0.0 and check["types"].get(kinds[0]) == 6 and check["types"][kinds[1]] == 1
