"""Vision-language models: tiny Qwen2.5-VL, Qwen3-VL and SmolVLM checkpoints built from configs here (never
downloaded), loaded by ``load_model``, their parts and layer names, ``workbench info`` and ``generate --image``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from workbench.errors import DataError, ModelLoadError
from workbench.model.load import load_model

ROOT = Path(__file__).resolve().parents[1]
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]


def _tokenizer(extra: list[str]):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "assets" / "demo-model" / "tokenizer.json"),
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None)
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def _save(model, tok, path: Path) -> Path:
    torch.manual_seed(0)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    tok = _tokenizer(QWEN_TOKENS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, window_size=112,
                           fullatt_block_indexes=[1]),
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         eos_token_id=0, pad_token_id=0, bos_token_id=None),
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    torch.manual_seed(0)
    return _save(Qwen2_5_VLForConditionalGeneration(cfg), tok, tmp_path_factory.mktemp("qwen25vl"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    tok = _tokenizer(QWEN_TOKENS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    cfg = Qwen3VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    torch.manual_seed(0)
    return _save(Qwen3VLForConditionalGeneration(cfg), tok, tmp_path_factory.mktemp("qwen3vl"))


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    tok = _tokenizer(IDEFICS_TOKENS)
    cfg = SmolVLMConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0),
        image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2, pad_token_id=0)
    torch.manual_seed(0)
    return _save(SmolVLMForConditionalGeneration(cfg), tok, tmp_path_factory.mktemp("smolvlm"))


def _picture(colour: str, box=(10, 10, 40, 40)) -> Image.Image:
    img = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(img).ellipse(box, fill=colour)
    return img


def test_qwen25_vl_loads_with_its_parts_and_own_layer_names(qwen25_dir):
    lm = load_model(qwen25_dir)
    assert lm.is_vision and type(lm.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    names = [layer.name for layer in lm.layers]
    for name in ("model.visual.blocks.0.attn.qkv", "model.visual.blocks.1.mlp.down_proj", "model.visual.merger.mlp.0",
                 "model.language_model.layers.0.mlp.down_proj", "model.language_model.embed_tokens", "lm_head"):
        assert name in names
    assert lm.layer("model.visual.blocks.1.attn.proj").block == "visual.blocks.1"
    assert lm.layer("model.visual.merger.mlp.2").block == "visual.merger"
    assert lm.layer("model.language_model.layers.1.self_attn.q_proj").block == "layers.1"
    parts = {p.name: p for p in lm.parts()}
    assert list(parts) == ["vision encoder", "projector", "language model"]
    assert parts["projector"].prefixes == ("model.visual.merger",)
    # every parameter in exactly one part
    assert sum(p.parameters for p in parts.values()) == sum(p.numel() for p in lm.model.parameters())
    merger = sum(p.numel() for p in lm.model.model.visual.merger.parameters())
    assert parts["projector"].parameters == merger
    assert parts["vision encoder"].parameters == sum(p.numel() for p in lm.model.model.visual.parameters()) - merger
    assert parts["language model"].bytes == 4 * parts["language model"].parameters  # float32 as saved
    assert parts["vision encoder"].layers == 2 * 5  # qkv, proj, gate, up, down per block


def test_a_text_model_is_not_vision(tiny_model_dir):
    lm = load_model(tiny_model_dir)
    assert not lm.is_vision and lm.processor is None
    (part,) = lm.parts()  # the whole model is its language model
    assert part.name == "language model" and part.parameters == lm.parameters and part.layers == len(lm.layers)


def test_qwen3_vl_and_smolvlm_load_with_their_parts(qwen3_dir, smolvlm_dir):
    q3 = load_model(qwen3_dir)
    assert type(q3.model).__name__ == "Qwen3VLForConditionalGeneration"
    prefixes = {p.name: p.prefixes for p in q3.parts()}
    assert set(prefixes["projector"]) == {"model.visual.merger", "model.visual.deepstack_merger_list"}
    assert "model.visual.deepstack_merger_list.0.linear_fc1" in [layer.name for layer in q3.layers]
    smol = load_model(smolvlm_dir)
    parts = {p.name: p for p in smol.parts()}
    assert parts["vision encoder"].prefixes == ("model.vision_model",)
    assert parts["projector"].prefixes == ("model.connector",)
    assert parts["language model"].prefixes == ("model.text_model", "lm_head")
    assert smol.layer("model.vision_model.encoder.layers.0.self_attn.q_proj").block == "vision_model.encoder.layers.0"
    assert smol.layer("model.text_model.layers.0.self_attn.q_proj").block == "layers.0"


@pytest.mark.parametrize("fixture", ["qwen25_dir", "qwen3_dir", "smolvlm_dir"])
def test_generate_with_an_image_matches_transformers_generate(fixture, request):
    """The streamed greedy answer is what transformers' own generate gives, and it depends on the picture."""
    from workbench.run.generate import open_model
    lm = load_model(request.getfixturevalue(fixture))
    gen = open_model(lm)
    answers = []
    for colour in ("red", "blue"):
        pic = _picture(colour)
        got = gen.generate("What colour is the shape?", image=pic, max_new_tokens=6)
        inputs = lm.processor(pic, "What colour is the shape?")
        with torch.no_grad():
            ref = lm.model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
        assert got.tokens == ref[:len(got.tokens)]
        assert got.prompt_ids == inputs["input_ids"][0].tolist()
        answers.append(got.tokens)
    # an untrained model, but its logits still follow the pixels
    logits = [lm.model(**lm.processor(_picture(c), "What colour?")).logits[0, -1] for c in ("red", "blue")]
    assert not torch.allclose(logits[0], logits[1])


def test_image_prompt_holds_the_expanded_image_tokens(qwen25_dir):
    lm = load_model(qwen25_dir)
    inputs = lm.processor(_picture("red"), "What colour is the shape?")
    pad = lm.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert (inputs["input_ids"] == pad).sum() == 4  # 16 patches merged 2x2
    with pytest.raises(DataError, match="empty"):
        lm.processor(_picture("red"), "  ")


def test_vision_model_refusals(qwen25_dir, tmp_path):
    import shutil
    bad = tmp_path / "pickled"
    shutil.copytree(qwen25_dir, bad)
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        load_model(bad)
    with pytest.raises(ModelLoadError, match="own classes"):
        load_model(qwen25_dir, trust_remote_code=True)
    partial = tmp_path / "partial"
    shutil.copytree(qwen25_dir, partial)
    from safetensors.torch import load_file, save_file
    tensors = load_file(partial / "model.safetensors")
    del tensors[next(k for k in tensors if k.endswith("visual.merger.mlp.0.weight"))]  # as saved (may lack "model.")
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"do not match.*merger\.mlp\.0\.weight"):
        load_model(partial)
    other = tmp_path / "other"
    shutil.copytree(qwen25_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "llava"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(other)


def test_cli_info_json_names_the_parts(qwen25_dir, capsys):
    from workbench.cli import main
    assert main(["info", str(qwen25_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["vision"] is True and doc["model_type"] == "qwen2_5_vl"
    assert [p["name"] for p in doc["parts"]] == ["vision encoder", "projector", "language model"]
    assert all(p["parameters"] > 0 and p["bytes"] > 0 for p in doc["parts"])
    assert doc["num_hidden_layers"] == 2 and doc["hidden_size"] == 64
    assert "model.visual.blocks.0.attn.qkv" in [layer["name"] for layer in doc["layers"]]
    assert main(["info", str(qwen25_dir)]) == 0
    out = capsys.readouterr().out
    assert "vision encoder" in out and "model.visual.merger" in out


def test_cli_generate_image_on_a_text_model_is_one_line_exit_2(tiny_model_dir, tmp_path, capsys):
    from workbench.cli import main
    pic = tmp_path / "p.png"
    _picture("red").save(pic)
    assert main(["generate", str(tiny_model_dir), "--prompt", "What colour?", "--image", str(pic)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no vision encoder" in err and len(err.splitlines()) == 1


def test_cli_generate_missing_image(qwen25_dir, tmp_path, capsys):
    from workbench.cli import main
    assert main(["generate", str(qwen25_dir), "--prompt", "What?", "--image", str(tmp_path / "none.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a picture")
    assert main(["generate", str(qwen25_dir), "--prompt", "What?", "--image", str(bad)]) == 2
    assert "not an image" in capsys.readouterr().err


def test_a_plan_addresses_vision_layers_by_their_own_names(qwen25_dir):
    """Vision layers are quantizable layers like any other: a plan rule over ``model.visual.*`` reaches them."""
    from workbench.quantize.model import quantize_model
    from workbench.quantize.plan import QuantPlan
    lm = load_model(qwen25_dir)
    plan = QuantPlan(default=None, rules=[{"pattern": "model.visual.*", "precision": "int8"}])
    qm = quantize_model(lm, plan, method="rtn", progress=False)
    done = {r.name: r.precision for r in qm.layers}
    assert done["model.visual.blocks.0.attn.qkv"] == "int8" and done["model.visual.merger.mlp.0"] == "int8"
    assert done.get("model.language_model.layers.0.mlp.down_proj") is None
    inputs = lm.processor(_picture("red"), "What colour?")
    with torch.no_grad():
        ref = lm.model(**inputs).logits
        out = qm.build_model(lm.model)(**inputs).logits
    assert 0 < (out - ref).abs().max() < 0.1  # the vision side changed, a little
