"""mnn-llm for a VLM: visual.mnn beside llm.mnn, read by MNN's own engine with the picture in the prompt."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

try:
    import MNN.llm  # noqa: F401  (the engine)
    import _tools  # noqa: F401  (the converter extension)
except ImportError:
    pytest.skip("MNN is not installed: pip install -c constraints.txt MNN", allow_module_level=True)

from workbench.cli import main
from workbench.errors import ModelLoadError, WorkbenchError
from workbench.model.vision_quality import vision_eval_set
from workbench.targets.convert import ConversionReport, prepare_models
from workbench.targets.mnn import convert_to_mnn
from workbench.targets.mnn_llm import MnnLlm, check_mnn_llm_folder, read_mnn_weights, write_mnn_llm_folder
from workbench.targets.mnn_vision import (EngineQuestion, export_visual_onnx, run_visual_mnn, score_vision,
                                          visual_inputs)

HELD_OUT = Path(__file__).resolve().parents[1] / "assets" / "demo-vl" / "images"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The demo VLM at int4 with MNN's vision recipe (int4 visual.mnn for Qwen2.5-VL; no importance statistics) as an
    mnn-llm folder."""
    prep = prepare_models("demo-vl", bits=4, importance=False, target="mnn-llm")
    out = tmp_path_factory.mktemp("mnn-llm-vl")
    info = write_mnn_llm_folder(prep.sim_lm, prep.qm, out, tmp_path_factory.mktemp("work"),
                                processor=prep.float_lm.processor)
    return prep, out, info


def _picture(prep, name="heldout-000.png", question="What colour is the shape?", tmp=None, answer=None):
    return EngineQuestion(prep.float_lm.processor, HELD_OUT / name, question, 56, tmp, answer)


def test_visual_graph_is_the_float_encoder_in_onnx_and_mnn(folder, tmp_path):
    """The engine's four inputs built from transformers' patches give transformers' image embeddings."""
    prep = folder[0]
    vlm = prep.float_lm.model
    q = _picture(prep, tmp=tmp_path)
    pv, grid = q.feats["pixel_values"], q.feats["image_grid_thw"]
    with torch.no_grad():
        ref = vlm.model.visual(pv, grid_thw=grid).pooler_output.float().numpy()
    path = export_visual_onnx(vlm, tmp_path / "v" / "visual.onnx")
    convert_to_mnn(path, tmp_path / "visual.mnn")
    got = run_visual_mnn(tmp_path / "visual.mnn", pv.numpy(), grid.numpy())
    assert got.shape == ref.shape == (4, 128)  # a 56 x 56 picture: 16 patches merged 2 x 2
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max()
    patches, pos, mask, order = visual_inputs(pv.numpy(), grid.numpy())
    assert pos.shape == (2, 16) and mask.shape == (2, 1, 16, 16) and sorted(order) == [0, 1, 2, 3]


def test_windowed_blocks_and_a_non_square_picture_match_transformers(tmp_path):
    """Qwen2.5-VL's windowed blocks (the demo VLM's are all full) on a 168 x 224 picture, whose 6 x 8 merged grid
    leaves partial 4 x 4 windows: the window index and masks built as MNN's engine builds them give transformers'
    embeddings (a random model of the demo VLM's shape, blocks 0 and 2 windowed)."""
    from PIL import Image
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    cfg = AutoConfig.from_pretrained(Path(__file__).resolve().parents[1] / "assets" / "demo-vl-model")
    cfg.vision_config.fullatt_block_indexes = [1]
    torch.manual_seed(0)
    vlm = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    ip = Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=168 * 224,
                                  max_pixels=168 * 224)
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (168, 224, 3), dtype=np.uint8))
    pix = ip([picture], return_tensors="pt")
    pv, grid = pix["pixel_values"], pix["image_grid_thw"]
    assert grid.tolist() == [[1, 12, 16]]
    with torch.no_grad():
        ref = vlm.model.visual(pv, grid_thw=grid).pooler_output.float().numpy()
    convert_to_mnn(export_visual_onnx(vlm, tmp_path / "v" / "visual.onnx"), tmp_path / "visual.mnn")
    got = run_visual_mnn(tmp_path / "visual.mnn", pv.numpy(), grid.numpy())
    assert got.shape == ref.shape == (48, 128)
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()


def test_folder_holds_both_graphs_with_the_plan_integers(folder, tmp_path):
    prep, out, info = folder
    cfg = json.loads((out / "config.json").read_text())
    llm_cfg = json.loads((out / "llm_config.json").read_text())
    assert cfg["visual_model"] == "visual.mnn" and cfg["async"] is False
    assert llm_cfg["is_visual"] and llm_cfg["image_size"] == 56
    assert (llm_cfg["vision_start"], llm_cfg["vision_end"], llm_cfg["image_pad"]) == (4096, 4097, 4098)
    assert np.allclose(llm_cfg["image_mean"], [122.7709383, 116.7460125, 104.09373615])
    visual = info["visual"]
    assert (visual["weight_bits"], visual["plan_codes_written"], visual["read_back_layers"]) == (4, 17, 17)
    assert visual["read_back_max_abs_error"] == 0.0
    assert info["plan_codes_written"] == 14  # the language model's 14 linear layers, in llm.mnn
    back = read_mnn_weights(out / "llm.mnn", tmp_path)
    for name, qw in prep.qm.weights.items():
        if name.startswith("model.language_model."):
            np.testing.assert_array_equal(back[name].reshape(qw.shape), qw.dequantize().float().numpy())
    assert set(check_mnn_llm_folder(out)) >= {"visual_model", "visual_weight"}


def test_engine_reads_the_picture_as_the_simulation_does(folder, tmp_path):
    """MNN's engine reads, encodes and places the picture itself (its tokenizer, its 3-D positions): its ids are
    transformers', its logits the simulation's; another picture changes the answer."""
    prep, out, _ = folder
    runner = MnnLlm(out, threads=1)
    try:
        q = _picture(prep, tmp=tmp_path, answer="green")
        ids, logits = runner.image_logits(q.text)
        assert ids == q.ids and logits.shape == (len(ids), 4100)
        feats = dict(q.feats, input_ids=torch.tensor([q.ids]), attention_mask=torch.ones(1, len(q.ids)))
        feats["mm_token_type_ids"] = (feats["input_ids"] == 4098).long()
        with torch.inference_mode():
            ref = prep.sim_lm.model(**feats).logits[0].float().numpy()
        assert np.abs(logits - ref).max() < 1e-3 * np.abs(ref).max()
        other = _picture(prep, "heldout-005.png", tmp=tmp_path)
        first = runner.image_logits(_picture(prep, tmp=tmp_path).text)[1][-1]
        assert np.abs(runner.image_logits(other.text)[1][-1] - first).max() > 0.1
        ctx = runner.image_generate(q.text, 4)
        assert ctx.vision_us > 0 and ctx.prompt_len == len(q.ids) and ctx.tokens
    finally:
        runner.close()


def test_picture_path_scored_and_timed_in_the_engine(folder, tmp_path):
    prep, out, _ = folder
    runner = MnnLlm(out, threads=1)
    report = ConversionReport("mnn-llm", out, [], 0.0, runnable=True)
    job = SimpleNamespace(prep=prep, report=report, out=out, work=tmp_path, say=lambda m: None, greedy_steps=4)
    try:
        got = score_vision(job, runner, images=vision_eval_set(max_questions=12))
    finally:
        runner.close()
    assert got["questions"] == 12 and got["answer_tokens"] >= 12
    assert got["answer_kl_vs_simulation"] < 1e-5 and got["answer_top1_vs_simulation"] == 1.0
    assert got["answer_kl"] < 0.05 and got["answer_top1"] >= 0.9
    assert got["itm_accuracy"] == pytest.approx(got["reference_itm_accuracy"], abs=0.1)
    emb = got["embeddings_vs_float"]
    assert emb["pictures"] >= 4 and emb["cosine"] > 0.99 and 0 < emb["relative_error"] < 0.2
    assert got["embeddings_vs_simulation"]["relative_error"] < 1e-3
    assert got["greedy_vs_simulation"]["same_answer"] >= 0.9
    after = got["decode_after_picture"]  # the engine's decode positions after a picture: close, not equal
    assert after["steps"] >= 12 and after["kl_vs_prefill"] < 1e-3 and after["top1_vs_prefill"] >= 0.9
    speed = got["speed"]
    assert speed["encoder_ms"] > 0 and speed["prefill_ms"] > 0 and speed["decode_tokens_per_second"] > 0
    assert report.details["mnn_llm_vision"] is got and "picture path in MNN's engine" in report.notes[-1]


def test_profile_prints_the_engine_encoder_and_decode_times(folder, capsys):
    _, out, _ = folder
    assert main(["profile", str(out), "--repeats", "1", "--decode-steps", "4"]) == 0
    text = capsys.readouterr().out
    assert "with a 56x56 picture: encoder" in text and "decode" in text and "context.vision_us" in text


def _copy(out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    (dst / "manifest.json").unlink(missing_ok=True)
    return dst


def test_missing_visual_part_refused_in_one_line(folder, tmp_path, capsys):
    _, out, _ = folder
    bad = _copy(out, tmp_path)
    (bad / "visual.mnn").unlink()
    with pytest.raises(ModelLoadError, match="visual.mnn.*is missing"):
        MnnLlm(bad)
    for argv in (["profile", str(bad)], ["generate", str(bad), "--prompt", "Hi", "--source", "demo-vl"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "visual.mnn" in err, err


def test_damaged_visual_files_and_image_keys_refused(folder, tmp_path):
    _, out, _ = folder
    bad = _copy(out, tmp_path)
    weight = bad / "visual.mnn.weight"
    weight.write_bytes(weight.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="visual.mnn.weight' holds 1,000 bytes"):
        check_mnn_llm_folder(bad)
    shutil.copy(out / "visual.mnn.weight", weight)
    cfg = json.loads((bad / "llm_config.json").read_text())
    for key, value, why in (("image_size", 0, "image_size 0"), ("image_pad", 99999, "image_pad 99999")):
        (bad / "llm_config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelLoadError, match=why):
            check_mnn_llm_folder(bad)
    (bad / "llm_config.json").write_text(json.dumps(cfg))
    (bad / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()),
                                                 "visual_model": "../visual.mnn"}))
    with pytest.raises(ModelLoadError):
        check_mnn_llm_folder(bad)


def test_a_vlm_without_its_image_processor_is_refused(folder, tmp_path):
    prep = folder[0]
    with pytest.raises(WorkbenchError, match="image processor"):
        write_mnn_llm_folder(prep.sim_lm, prep.qm, tmp_path / "o", tmp_path / "w")


def test_generate_asks_the_engine_about_the_picture(folder, tmp_path, capsys):
    """`workbench generate Y --image IMG`: the engine reads the picture at the first step and decodes through its KV
    cache; its answer is the engine's own generate's, and another picture gets another answer."""
    prep, out, _ = folder
    texts = []
    for name in ("heldout-000.png", "heldout-010.png"):
        argv = ["generate", str(out), "--source", "demo-vl", "--image", str(HELD_OUT / name), "--prompt",
                "What colour is the shape?", "--max-new-tokens", "4", "--json"]
        assert main(argv) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["runtime"] == "MNN-LLM" and doc["prompt_tokens"] == 21
        runner = MnnLlm(out, threads=1)
        try:
            own = runner.image_generate(_picture(prep, name, tmp=tmp_path).text, 4).tokens
        finally:
            runner.close()
        assert doc["tokens"] == own[:len(doc["tokens"])]
        texts.append(doc["text"])
    assert texts[0] != texts[1], texts


def test_a_vlm_of_another_family_is_refused_by_name():
    from workbench.targets.mnn_vision import text_view
    vlm = SimpleNamespace(config=SimpleNamespace(vision_config=object(), model_type="smolvlm"))
    with pytest.raises(WorkbenchError, match="vision part of qwen2_5_vl models, not 'smolvlm'"):
        text_view(vlm)
