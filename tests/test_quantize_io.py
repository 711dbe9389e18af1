"""Save and reload: same logits, same perplexity, compressed-tensors packing on disk, refusal of any directory
whose tensors do not cover its model, and transformers loading the same logits (or refusing loudly)."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from workbench.errors import ModelLoadError, WorkspaceError
from workbench.evaluation.evaluate import evaluate
from workbench.model.load import load_model, load_quantized
from workbench.quantize.plan import QuantPlan
from workbench.quantize import pack_int4, quantize_model
from workbench.quantize.storage import pack_int32, unpack_int32, write_manifest
from workbench.quantize.layers import QuantEmbedding, QuantLinear


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import build_tiny_model
    return load_model(build_tiny_model(tmp_path_factory.mktemp("io") / "m"))


def _ids(n=300, seed=0):
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))


def _rewrite(out, edit):
    """Change the tensors of a saved directory and refresh its manifest, as a careless copy tool would."""
    meta = json.loads((out / "quantization.json").read_text())
    path = out / meta["weights_file"]
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    write_manifest(out, {"method": meta["method"], "source": meta["source"]})


@pytest.mark.parametrize("symmetric", [True, False])
def test_reload_gives_the_same_logits_and_perplexity(tiny, tmp_path, symmetric):
    plan = (QuantPlan.uniform("int4", group_size=32, symmetric=symmetric)
            .with_override("*.mlp.down_proj", "int8").with_override("model.embed_tokens", "int8"))
    qm = quantize_model(tiny, plan, progress=False)
    simulated = qm.apply_(copy.deepcopy(tiny.model))
    out = qm.save(tmp_path / "q")
    lm2, qm2 = load_quantized(out)
    assert qm2.precisions == qm.precisions and lm2.quantized is qm2 and qm2.source is lm2
    ids = _ids()
    with torch.no_grad():
        a = simulated(input_ids=ids[None, :128]).logits
        b = lm2.model(input_ids=ids[None, :128]).logits
        c = qm.build_model()(input_ids=ids[None, :128]).logits
    assert torch.equal(a, b) and torch.equal(b, c)
    ra = evaluate(simulated, ids, ctx=128, progress=False)
    rb = evaluate(lm2.model, ids, ctx=128, progress=False)
    assert ra.perplexity == rb.perplexity
    assert not lm2.model.config.tie_word_embeddings  # the plan untied lm_head (fp16) from the int8 embedding
    assert lm2.tokenizer is not None


def test_loaded_model_computes_from_the_codes_in_the_stored_dtype(make_tiny_model, tmp_path):
    """No float copy of an integer layer; float tensors in the checkpoint's dtype, computing in float32."""
    from transformers import AutoModelForCausalLM

    from workbench.numerics.compute import float32_compute_enabled
    src = make_tiny_model("qwen2", tie=False)  # q/k/v biases, untied head
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(src)
    lm = load_model(src)
    qm = quantize_model(lm, QuantPlan.uniform("int4", group_size=32).with_override("lm_head", "int8"), progress=False)
    out = qm.save(tmp_path / "q")
    lm2 = load_model(out)
    assert lm2.quantized is not None and float32_compute_enabled(lm2.model)
    q_proj = lm2.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear) and q_proj.bias.dtype == torch.bfloat16
    assert isinstance(lm2.model.lm_head, QuantLinear) and lm2.model.lm_head.bits == 8
    assert lm2.model.model.embed_tokens.weight.dtype == torch.float16  # an fp16 layer, as stored: no second copy
    assert {p.dtype for n, p in lm2.model.named_parameters() if "embed" not in n} == {torch.bfloat16}
    float_bytes = sum(p.numel() * p.element_size() for p in lm2.model.parameters())
    assert float_bytes < 0.6 * sum(p.numel() * p.element_size() for p in lm.model.parameters())
    assert [(i.name, i.kind, i.shape, i.tied_to) for i in lm2.layers] == \
        [(i.name, i.kind, i.shape, i.tied_to) for i in lm.layers]
    assert lm2.parameters == lm.parameters
    ids = _ids()[None, :96]
    with torch.no_grad():
        assert torch.equal(lm2.model(input_ids=ids).logits, qm.build_model()(input_ids=ids).logits)


def test_files_hold_compressed_tensors_packing_and_a_manifest(tiny, tmp_path):
    qm = quantize_model(tiny, QuantPlan.uniform("int4", group_size=32, symmetric=False), progress=False)
    out = qm.save(tmp_path / "q", report={"note": "x"})
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors", "plan.json", "quantization.json", "report.json",
            "manifest.json"} == names - {"tokenizer_config.json"}
    t = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj"  # [128, 64]: 2 groups of 32
    assert t[f"{name}.weight_packed"].dtype == torch.int32 and tuple(t[f"{name}.weight_packed"].shape) == (128, 8)
    assert t[f"{name}.weight_scale"].dtype == torch.float16 and tuple(t[f"{name}.weight_scale"].shape) == (128, 2)
    assert tuple(t[f"{name}.weight_zero_point"].shape) == (16, 2)  # packed along the output axis
    assert t[f"{name}.weight_shape"].tolist() == [128, 64]
    assert f"{name}.weight" not in t and "model.norm.weight" in t and "lm_head.weight" not in t  # tied: once
    qw = qm.weights[name]
    assert torch.equal(unpack_int32(t[f"{name}.weight_packed"], 4, 64), qw.storage_codes())
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    (group,) = config["config_groups"].values()
    assert group["weights"] == {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                "group_size": 32, "dynamic": False}
    assert len(group["targets"]) == 14 and name in group["targets"]
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["version"] == 2 and meta["weights_file"] == "model.safetensors" and meta["transformers"]["loads"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"]["model.safetensors"]["size"] == (out / "model.safetensors").stat().st_size
    assert QuantPlan.load(out / "plan.json") == qm.plan
    # integer bytes on disk match the accounting: packed codes + float16 scales + packed zeros
    integer = [k for k in t if k.rsplit(".", 1)[1] in ("weight_packed", "weight_scale", "weight_zero_point")]
    assert sum(t[k].numel() * t[k].element_size() for k in integer) == sum(w.storage_bytes() for w in qm.weights.values()
                                                                          if w is not qm.weights.get("lm_head"))


@pytest.mark.parametrize("bits,shape", [(4, (5, 37)), (4, (3, 64)), (8, (4, 30)), (8, (2, 8))])
def test_int32_packing_round_trips_and_matches_int4_byte_packing(bits, shape):
    codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_int32(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], -(-shape[1] * bits // 32))
    assert torch.equal(unpack_int32(packed, bits, shape[1]), codes)
    assert torch.equal(unpack_int32(pack_int32(codes.t(), bits).t().contiguous().t(), bits, shape[0]), codes.t())
    if bits == 4 and shape[1] % 8 == 0:  # the first code in the lowest bits: the int4 byte packing, four bytes a word
        assert torch.equal(packed.flatten().view(torch.uint8).view(shape[0], -1), pack_int4(codes))


def test_packing_matches_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (6, 45), dtype=torch.uint8)
        signed = (codes.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
        assert torch.equal(pack_int32(codes, bits), helpers.pack_to_int32(signed, bits))
        assert torch.equal(pack_int32(codes.t(), bits).t(), helpers.pack_to_int32(signed, bits, packed_dim=0))


@pytest.mark.parametrize("plan", [QuantPlan.uniform("int4", group_size=32),
                                  QuantPlan.uniform("int8", group_size=None, symmetric=False)
                                  .with_override("lm_head", "int4").with_override("*.v_proj", "fp16")],
                         ids=["int4", "mixed-untied"])
def test_transformers_loads_the_same_logits_or_fails_loudly(tiny, tmp_path, plan):
    """With compressed-tensors installed, plain transformers gives the workbench's logits; without it, an ImportError."""
    from transformers import AutoModelForCausalLM
    qm = quantize_model(tiny, plan, progress=False)
    out = qm.save(tmp_path / "q")
    ids = _ids()[None, :64]
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="compressed-tensors"):
            AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        return
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ours = load_model(out).model(input_ids=ids).logits
        theirs = model(input_ids=ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_integer_embeddings_are_kept_out_of_transformers_reach(tiny, tmp_path):
    """transformers cannot build a pack-quantized embedding: it finds no weights file and says so."""
    from transformers import AutoModelForCausalLM
    qm = quantize_model(tiny, QuantPlan.uniform("int8", keep_embeddings=None, group_size=32), progress=False)
    out = qm.save(tmp_path / "q")
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["weights_file"] == "workbench.safetensors" and not meta["transformers"]["loads"]
    assert "Embedding" in meta["transformers"]["why_not"]
    assert not (out / "model.safetensors").exists()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    with pytest.raises(OSError, match="no file named model.safetensors"):
        AutoModelForCausalLM.from_pretrained(out)
    lm2 = load_model(out)
    assert isinstance(lm2.model.model.embed_tokens, QuantEmbedding) and isinstance(lm2.model.lm_head, QuantLinear)
    assert lm2.layer("lm_head").tied_to == "model.embed_tokens"
    ids = _ids()[None, :64]
    with torch.no_grad():
        assert torch.equal(lm2.model(input_ids=ids).logits, qm.build_model()(input_ids=ids).logits)


def test_saving_replaces_an_earlier_result_but_not_a_foreign_directory(tiny, tmp_path):
    qm = quantize_model(tiny, QuantPlan.uniform("int8", group_size=32), progress=False)
    out = qm.save(tmp_path / "q")
    qm.save(out)  # replacing an earlier quantized model is fine
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "readme.txt").write_text("mine")
    with pytest.raises(WorkspaceError, match="is not empty and has no workbench manifest.json"):
        qm.save(foreign)
    assert (foreign / "readme.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_a_loaded_quantized_model_saves_again_to_the_same_files(tiny, tmp_path):
    qm = quantize_model(tiny, QuantPlan.uniform("int4", group_size=32), progress=False)
    first = qm.save(tmp_path / "a")
    _, qm2 = load_quantized(first)
    second = qm2.save(tmp_path / "b")
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_broken_directories_give_clear_errors(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_quantized(tmp_path / "missing")
    qm = quantize_model(tiny, QuantPlan.uniform("int8", group_size=32), progress=False)
    out = qm.save(tmp_path / "q")
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="model.safetensors' is missing or differs from the manifest"):
        load_quantized(out)
    with pytest.raises(ModelLoadError, match="model.safetensors' is missing or differs from the manifest"):
        load_model(out)
    (out / "plan.json").unlink()
    with pytest.raises(ModelLoadError, match="has no plan.json: not a complete quantized model"):
        load_quantized(out)


def test_missing_extra_or_reshaped_tensors_are_refused_by_name(tiny, tmp_path):
    """A tensor gone, added or reshaped (manifest refreshed, so only the tensors tell) is refused, never random."""
    qm = quantize_model(tiny, QuantPlan.uniform("int4", group_size=32), progress=False)
    cases = {
        "missing": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"),
                    r"1 missing \(model\.layers\.1\.mlp\.up_proj\.weight_scale\)"),
        "missing-float": (lambda t: t.pop("model.norm.weight"), r"1 missing \(model\.norm\.weight\)"),
        "unexpected": (lambda t: t.update({"model.layers.0.extra": torch.zeros(2)}),
                       r"1 unexpected \(model\.layers\.0\.extra\)"),
        "reshaped": (lambda t: t.update({"model.layers.0.input_layernorm.weight": torch.ones(32)}),
                     r"with another shape \(model\.layers\.0\.input_layernorm\.weight \[32\] vs \[64\]\)"),
        "repacked": (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_packed": torch.zeros(64, 8,
                                                                                                   dtype=torch.int32)}),
                     r"model\.layers\.0\.mlp\.down_proj\.weight_packed \[64, 8\] vs \[64, 16\]"),
    }
    for case, (edit, message) in cases.items():
        out = qm.save(tmp_path / case)
        _rewrite(out, edit)
        with pytest.raises(ModelLoadError, match="do not match the model its config.json describes: .*" + message):
            load_model(out)
        with pytest.raises(ModelLoadError, match=message):
            load_quantized(out, verify=False)


def test_a_config_that_does_not_match_the_quantized_weights_is_refused(tiny, tmp_path):
    qm = quantize_model(tiny, QuantPlan.uniform("int4", group_size=32), progress=False)
    out = qm.save(tmp_path / "q")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    write_manifest(out, {})
    with pytest.raises(ModelLoadError, match=r"6 with another shape \(model\.layers\.0\.mlp\.down_proj\.weight "
                                             r"\[64, 128\] vs \[64, 96\]"):
        load_model(out)
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1, "layer_types": cfg["layer_types"][:1]}))
    write_manifest(out, {})
    # a layer count the weights contradict is refused from the safetensors headers, before anything is built
    with pytest.raises(ModelLoadError, match=r"gives num_hidden_layers 1 but the weights in .* hold 2 "
                                             r"\(layers\.0 to layers\.1\); fix config\.json"):
        load_model(out)
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    write_manifest(out, {})
    with pytest.raises(ModelLoadError, match="gives num_hidden_layers 1 but the weights"):
        load_model(out)


def test_version_1_directories_still_load(tiny, tmp_path):
    """The earlier layout: float model.safetensors beside quantized.safetensors (qweight / scales / zeros)."""
    qm = quantize_model(tiny, QuantPlan.uniform("int4", group_size=32, symmetric=False)
                        .with_override("*.down_proj", "int8"), progress=False)
    out = qm.save(tmp_path / "q")
    t = load_file(out / "model.safetensors")
    floats = {k: v for k, v in t.items() if not k.rsplit(".", 1)[1].startswith("weight_")}
    quant = {}
    for name, qw in qm.weights.items():
        if name == "lm_head":
            continue
        codes = qw.storage_codes()
        quant[f"{name}.qweight"] = pack_int4(codes) if qw.bits == 4 else qw.qweight.clone()
        quant[f"{name}.scales"] = qw.scales.to(torch.float16)
        quant[f"{name}.zeros"] = pack_int4(qw.zeros) if qw.bits == 4 else qw.zeros.clone()
    save_file(floats, out / "model.safetensors", metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in quant.items()}, out / "quantized.safetensors", metadata={"format": "x"})
    meta = json.loads((out / "quantization.json").read_text())
    meta.update(version=1)
    del meta["weights_file"], meta["transformers"]
    (out / "quantization.json").write_text(json.dumps(meta))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    write_manifest(out, {})
    lm2 = load_model(out)
    ids = _ids()[None, :64]
    with torch.no_grad():
        assert torch.equal(lm2.model(input_ids=ids).logits, qm.build_model()(input_ids=ids).logits)


@pytest.mark.parametrize("plan", [QuantPlan.uniform("int4-lpbq", group_size=32), QuantPlan.uniform("int3"),
                                  QuantPlan.uniform("int6", group_size=32, symmetric=False),
                                  QuantPlan.uniform("int2", keep_embeddings="int8-lpbq")])
def test_new_widths_and_two_level_scales_are_stored_as_counted_and_load_back_exactly(tiny, tmp_path, plan):
    qm = quantize_model(tiny, plan, progress=False)
    out = qm.save(tmp_path / "q")
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["version"] == 3 and meta["weights_file"] == "workbench.safetensors"
    assert not meta["transformers"]["loads"] and meta["transformers"]["why_not"]
    t = load_file(out / "workbench.safetensors")
    stored = [r for r in qm.layers if r.name in qm.weights and not (r.tied_to and not r.untied)]
    for r in stored:
        qw = qm.weights[r.name]
        names = [k for k in t if k.startswith(r.name + ".weight_") and not k.endswith("weight_shape")]
        assert sum(t[k].numel() * t[k].element_size() for k in names) == qw.storage_bytes()
        assert (f"{r.name}.weight_sub_scale" in t) == qw.two_level and (f"{r.name}.weight_scale" in t) != qw.two_level
    assert 8 * qm.storage_bytes() / qm.parameters == pytest.approx(qm.bits_per_weight, rel=1e-12)
    lm2, qm2 = load_quantized(out)
    for name, qw in qm.weights.items():
        back = qm2.weights[name]
        assert (back.bits, back.two_level) == (qw.bits, qw.two_level)
        assert torch.equal(back.dequantize(), qw.dequantize())
    ids = _ids()[None]
    with torch.no_grad():
        assert torch.allclose(lm2.model(ids).logits, qm.build_model()(ids).logits, atol=1e-5)


def test_the_loader_imports_model_and_model_never_imports_the_loader():
    """model.load (the loader of quantized directories) imports quantize.model at the top; quantize.model and
    quantize.storage never import the loader, at the top or in a function (test_check_imports checks the layers)."""
    import ast
    from pathlib import Path

    import workbench.model.load as loader
    import workbench.quantize.model as model_module
    import workbench.quantize.storage as storage_module

    def imported(module, top_only: bool = False) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text())
        nodes = tree.body if top_only else list(ast.walk(tree))
        return {"." * n.level + (n.module or "") for n in nodes if isinstance(n, ast.ImportFrom)}

    assert "..quantize.model" in imported(loader, top_only=True)
    assert not any(m.endswith(("model.load", "model")) and "quantize" not in m and m != ".model"
                   for m in imported(model_module) | imported(storage_module))
