"""The demo VLM as llama.cpp loads it: the language model's GGUF (qwen2vl) and the mmproj GGUF of the vision encoder
and projector, both read back by the gguf package equal to the plan; llama.cpp's multimodal CLI where it is built."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from workbench import QuantPlan, load_model  # noqa: E402
from workbench.errors import PlanError  # noqa: E402
from workbench.model.vision_quality import part_plan  # noqa: E402
from workbench.quantize import quantize_model  # noqa: E402
from workbench.targets.gguf_file import check_gguf, write_gguf  # noqa: E402
from workbench.targets.gguf_mmproj import check_mmproj, mmproj_tensor_names, write_mmproj  # noqa: E402
from workbench.targets.llamacpp_mtmd import (find_mtmd_cli, image_token_bounds, parse_mtmd_times,  # noqa: E402
                                             run_mtmd)


@pytest.fixture(scope="module")
def vl():
    return load_model("demo-vl")


def _quantized(vl, vision):
    plan = part_plan(vl, QuantPlan.uniform("int4", group_size=32), vision=vision, projector=vision)
    return quantize_model(vl, plan, progress=False)


@pytest.fixture(scope="module")
def q8(vl):
    return _quantized(vl, "int8")


def _fields(path):
    r = gguf.GGUFReader(str(path))
    return r, {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}


def test_mmproj_names_are_llama_cpp_clip_names():
    assert mmproj_tensor_names("model.visual.blocks.2.attn.qkv.weight") == [
        "v.blk.2.attn_q.weight", "v.blk.2.attn_k.weight", "v.blk.2.attn_v.weight"]
    assert mmproj_tensor_names("model.visual.blocks.0.mlp.gate_proj.bias") == ["v.blk.0.ffn_gate.bias"]
    assert mmproj_tensor_names("model.visual.patch_embed.proj.weight") == ["v.patch_embd.weight",
                                                                          "v.patch_embd.weight.1"]
    assert mmproj_tensor_names("model.visual.merger.mlp.2.weight") == ["mm.2.weight"]
    assert mmproj_tensor_names("model.visual.merger.ln_q.weight") == ["v.post_ln.weight"]
    assert mmproj_tensor_names("model.language_model.layers.0.mlp.up_proj.weight") is None


def test_q8_0_mmproj_and_q4_0_model_read_back_equal_to_the_plan(vl, q8, tmp_path):
    model = write_gguf(q8, tmp_path / "model.gguf")
    mmproj = write_mmproj(q8, tmp_path / "mmproj.gguf")
    text, vision = check_gguf(q8, model), check_mmproj(q8, mmproj)
    assert text["max_abs_diff"] == 0.0 and text["types"] == {"Q4_0": 14}
    assert vision["max_abs_diff"] == 0.0 and vision["integer_layers"] == 17
    assert vision["types"]["Q8_0"] == 3 * 7 + 2  # 3 blocks: q, k, v, out, gate, up, down; mm.0, mm.2
    r, f = _fields(model)
    assert f["general.architecture"] == "qwen2vl" and f["qwen2vl.rope.dimension_sections"] == [4, 6, 6, 0]
    assert not any(t.name.startswith(("v.", "mm.")) for t in r.tensors)  # the vision part is only in the mmproj
    r, f = _fields(mmproj)
    assert f["general.architecture"] == "clip" and f["general.type"] == "mmproj"
    assert f["clip.projector_type"] == "qwen2.5vl_merger"
    assert f["clip.vision.n_wa_pattern"] == 0  # every block attends to the whole picture: no windows
    assert f["clip.vision.projection_dim"] == 128 and f["clip.vision.block_count"] == 3
    assert f["clip.vision.patch_size"] == 14 and f["clip.vision.spatial_merge_size"] == 2
    assert np.allclose(f["clip.vision.image_mean"], vl.processor.image_processor.image_mean)
    by = {t.name: t for t in r.tensors}
    assert by["v.patch_embd.weight"].tensor_type.name == "F32"  # beside integer layers, as llama.cpp's converter
    assert by["v.blk.0.ln1.weight"].tensor_type.name == "F32" and by["mm.0.bias"].tensor_type.name == "F32"
    # the fused qkv's rows split in three, blocks untouched: q | k | v stacked again is the simulated weight
    from gguf.quants import dequantize
    parts = [dequantize(np.asarray(by[f"v.blk.1.attn_{x}.weight"].data), by[f"v.blk.1.attn_{x}.weight"].tensor_type)
             for x in "qkv"]
    want = q8.weights["model.visual.blocks.1.attn.qkv"].dequantize().numpy()
    assert np.array_equal(np.concatenate(parts).reshape(want.shape), want)


def test_float_vision_part_is_an_f16_mmproj(vl, tmp_path):
    qm = _quantized(vl, None)
    path = write_mmproj(qm, tmp_path / "mmproj.gguf")
    check = check_mmproj(qm, path)
    assert check["max_abs_diff"] == 0.0 and check["integer_layers"] == 0
    r, f = _fields(path)
    assert f["general.file_type"] == 1
    by = {t.name: t.tensor_type.name for t in r.tensors}
    assert by["v.patch_embd.weight.1"] == "F16" and by["mm.2.weight"] == "F16" and by["v.blk.2.attn_v.weight"] == "F16"
    assert by["v.blk.2.attn_v.bias"] == "F32"


def test_vision_layer_no_llama_cpp_block_holds_is_refused_by_name(vl, tmp_path):
    plan = part_plan(vl, QuantPlan.uniform("int4", group_size=32), vision="int8", projector="int8")
    qm = quantize_model(vl, plan.with_override("model.visual.blocks.0.mlp.down_proj", "int6"), progress=False)
    with pytest.raises(PlanError, match=r"model\.visual\.blocks\.0\.mlp\.down_proj.*Q6_K"):
        write_mmproj(qm, tmp_path / "mmproj.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_image_token_bounds_follow_the_image_processor(vl):
    assert image_token_bounds(vl.processor.image_processor) == (4, 4)  # 56 x 56 pixels: 2 x 2 merged tokens


def test_mtmd_times_parsed_from_its_log():
    log = ("encoding mtmd batch, n_chunks = 1 (done = 1, total = 3)\nmtmd batch encoding done in 37 ms\n"
           "decoding image batch 1/1, n_tokens_batch = 6\n"
           "image decoded (batch 1/1) in 3 ms\n\n"
           "llama_perf_context_print: prompt eval time =       5.10 ms /    14 tokens (    0.36 ms per token,  2745.10 "
           "tokens per second)\n"
           "llama_perf_context_print:        eval time =       4.00 ms /     5 runs   (    0.80 ms per token,  1250.00 "
           "tokens per second)\n")
    t = parse_mtmd_times(log)
    assert t == {"encode_ms": 37.0, "encodes_ms": [37.0], "image_decode_ms": 3.0, "prompt_tokens_per_second": 2745.10,
                 "decode_tokens_per_second": 1250.0, "decode_tokens": 5}
    older = parse_mtmd_times("image slice encoded in 12 ms\nimage slice encoded in 4 ms\n"
                             "llama_perf_context_print:        eval time =       0.00 ms /     1 runs   "
                             "(    0.00 ms per token,      inf tokens per second)\n")
    assert older["encodes_ms"] == [12.0, 4.0] and older["encode_ms"] == 4.0
    assert older["decode_tokens_per_second"] is None


def test_find_mtmd_cli(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    assert find_mtmd_cli() is None
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))
    assert find_mtmd_cli() is None
    cli = tmp_path / "build" / "bin" / "llama-mtmd-cli"
    cli.parent.mkdir(parents=True)
    cli.write_text("#!/bin/sh\n")
    cli.chmod(cli.stat().st_mode | stat.S_IXUSR)
    assert find_mtmd_cli() == cli


@pytest.mark.skipif(find_mtmd_cli() is None, reason="llama-mtmd-cli not built (LLAMA_CPP_DIR)")
def test_llama_cpp_answers_from_the_two_ggufs(vl, q8, tmp_path):
    """llama.cpp's own multimodal code loads both files and encodes the picture as the workbench does."""
    from workbench.evaluation.images import read_image
    from workbench.model.vision_feed import embedding_error, image_features
    from workbench.model.vision_quality import vision_eval_set
    model, mmproj = write_gguf(q8, tmp_path / "model.gguf"), write_mmproj(q8, tmp_path / "mmproj.gguf")
    sample = vision_eval_set(max_questions=1).questions[0]
    a = run_mtmd(find_mtmd_cli(), model, mmproj, sample.image, sample.prompt, max_tokens=4, embeddings=True,
                 image_tokens=image_token_bounds(vl.processor.image_processor))
    assert a.text and a.encode_ms is not None and a.decode_tokens >= 1
    sim = q8.build_model(vl.model)
    err = embedding_error(a.embeddings, image_features(sim, vl.processor(read_image(sample.image), sample.prompt)))
    assert err["cosine"] > 0.999 and err["relative_error"] < 0.02, err


def test_convert_demo_vl_writes_both_ggufs(vl, tmp_path, monkeypatch):
    """`workbench convert demo-vl --bits 4 --target llama.cpp`: the language model at 4 bits, the vision encoder and
    projector as llama.cpp's recipe ships them (an f16 mmproj), both files checked against the plan."""
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    from workbench.targets.convert import convert
    report = convert("demo-vl", "llama.cpp", tmp_path / "z", bits=4, evaluate_outputs=False)
    names = {os.path.basename(f["path"]) for f in report.files}
    assert {"model.gguf", "mmproj.gguf", "commands.sh", "conversion.json"} <= names
    d = report.details
    assert d["gguf_check"]["max_abs_diff"] == 0.0 and d["gguf_check"]["types"] == {"Q4_0": 14}
    assert d["mmproj_check"]["max_abs_diff"] == 0.0 and d["mmproj_check"]["types"].get("F16") == 25
    assert "Q8_0" not in d["mmproj_check"]["types"]
    assert any("llama-mtmd-cli not found" in n for n in report.notes)
    assert "llama-mtmd-cli\" -m model.gguf --mmproj mmproj.gguf" in (tmp_path / "z" / "commands.sh").read_text()


@pytest.mark.skipif(find_mtmd_cli() is None, reason="llama-mtmd-cli not built (LLAMA_CPP_DIR)")
def test_convert_demo_vl_runs_llama_cpp(vl, tmp_path):
    """With llama.cpp built, convert asks its multimodal CLI the held-out questions and scores its vision output."""
    from workbench.targets.convert import convert
    m = convert("demo-vl", "llama.cpp", tmp_path / "z", bits=4, evaluate_outputs=False).details["mtmd"]
    assert m["questions"] == 6 and m["first_word_agreement"] >= 4  # near-tied answers may flip on 8-bit activations
    assert m["median_embedding_cosine_vs_float"] > 0.999 and m["median_embedding_relative_error_vs_float"] < 0.02
    assert m["answer_kl_llama_cpp_vision"] < m["answer_kl_simulation"] + 0.01
    assert m["warm_encode_ms"] is not None and m["decode_tokens_per_second"] > 0


def test_vl_folder_missing_its_visual_part_is_refused(vl, tmp_path):
    """A VLM folder whose weights lack the vision tower: refused in one line naming the missing tensors, no output."""
    import shutil

    from safetensors.torch import load_file, save_file

    from workbench.errors import ModelLoadError
    from workbench.targets.convert import convert
    src = tmp_path / "novis"
    shutil.copytree(vl.path, src)
    weights = load_file(src / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.startswith(("visual.", "model.visual."))}
    save_file(kept, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing \(model\.visual\."):
        convert(src, "llama.cpp", tmp_path / "z", bits=4, evaluate_outputs=False)
    assert not (tmp_path / "z").exists()
