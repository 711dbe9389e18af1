"""A VLM's vision encoder for Hexagon: QDQ by the plan, scored on the CPU and on onnxruntime-qnn's HTP emulator, its
embeddings injected where the image tokens are; `convert --target qnn` of the demo VLM; bad input in one line."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from workbench.cli import main
from workbench.errors import DataError
from workbench.model.vision import answer_scorer
from workbench.model.vision_quality import VisionEvalSet, vision_eval_set
from workbench.onnx.vision_export import export_vision_encoder
from workbench.targets.convert import prepare_models
from workbench.targets.htp import INSTALL, htp_soc, qnn_available
from workbench.model.vision_feed import injected_encoder
from workbench.targets.htp_vision import (_Encoder, calibration_feeds, measure_vision_encoder, vision_qdq,
                                          vision_quantized)

needs_qnn = pytest.mark.skipif(not qnn_available(), reason=f"onnxruntime-qnn is not installed: {INSTALL}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The demo VLM at int4 with its encoder and projector at int8 (the qnn preset), its encoder graph and QDQ twin
    calibrated on eight pictures."""
    d = tmp_path_factory.mktemp("vision")
    prep = prepare_models("demo-vl", bits=4, target="qnn", importance=False)
    vx = export_vision_encoder(prep.float_lm, d)
    feeds = calibration_feeds(prep.float_lm, vx, samples=8)
    qdq = vision_qdq(vx, prep.qm, feeds, d / "vision_encoder.qdq.onnx")
    return prep, vx, qdq, d


def small_set(questions: int):
    """The first held-out questions and five captioned pictures (image-text matching needs distractors + 1)."""
    full = vision_eval_set()
    return VisionEvalSet(full.questions[:questions], full.captions[:5], full.source)


def test_qdq_weights_read_back_equal_to_the_plan(built):
    """Per-channel layers keep the plan's own codes and scales: the QDQ weight dequantizes to the simulation's."""
    prep, vx, qdq, _ = built
    view = vision_quantized(prep.qm, vx)
    assert {r.name for r in view.layers} == set(vx.weight_names) and set(view.precisions.values()) == {"int8"}
    inits = {i.name: i for i in onnx.load(str(qdq)).graph.initializer}
    checked = 0
    for name, qw in view.weights.items():
        if qw.n_groups != 1:
            continue  # group-wise: onnxruntime's per-channel scales (said in the notes)
        t = vx.weight_names[name]
        codes = numpy_helper.to_array(inits[t + "_quantized"]).astype(np.int64)
        scale = numpy_helper.to_array(inits[t + "_scale"]).astype(np.float64)
        zero = numpy_helper.to_array(inits[t + "_zero_point"]).astype(np.int64)
        assert np.array_equal(codes.T - zero[:, None], qw.qweight.numpy().astype(np.int64) - (
            0 if qw.symmetric else qw.zeros.numpy().astype(np.int64).reshape(-1, 1)))
        np.testing.assert_allclose((codes - zero) * scale, qw.dequantize().double().numpy().T, rtol=1e-6, atol=1e-9)
        checked += 1
    assert checked >= 10  # qkv, proj, gate_proj, up_proj of each block: one scale per output channel


def test_injected_embeddings_replace_the_encoder(built):
    """PyTorch's own embeddings injected give the model's own answers; other embeddings change them; the encoder
    is back afterwards."""
    prep, vx, _, _ = built
    lm = prep.float_lm
    sample = vision_eval_set(max_questions=1).questions[0]
    score = answer_scorer(lm.model, lm.processor)
    own = score(sample).log_probs
    with injected_encoder(lm.model, lambda px, grid: _torch_embeddings(lm, px, grid)):
        assert (score(sample).log_probs - own).abs().max() < 1e-3  # the model's own, through float32 and back
    with injected_encoder(lm.model, lambda px, grid: np.zeros(vx.output_shape, np.float32)):
        assert (score(sample).log_probs - own).abs().max() > 0.1
    assert torch.equal(score(sample).log_probs, own)


def _torch_embeddings(lm, pixels, grid):
    visual = lm.model.model.visual
    with torch.no_grad():
        return type(visual).forward(visual, torch.from_numpy(pixels).to(visual.dtype),
                                    grid_thw=torch.tensor([list(grid)])).pooler_output.float().numpy()


def test_cpu_qdq_encoder_scored_against_float(built):
    prep, vx, qdq, _ = built
    info = measure_vision_encoder(prep, vx, qdq, images=small_set(6))
    emb = info["qdq"]["embeddings"]["vs_float"]
    assert 0.99 < emb["cosine"] <= 1.0 + 1e-9 and 0 < emb["relative_error"] < 0.1
    assert emb["tokens"] == info["pictures"] * vx.output_shape[0]
    whole = info["qdq"]["answers"]["whole_model"]
    assert whole["questions"] == 6 and 0 <= whole["answer_kl"] < 0.05 and whole["answer_tokens"] > 0
    assert info["qdq"]["time"]["median_ms"] > 0 and "htp" not in info


def test_a_grid_other_than_the_graphs_is_refused_by_name(built):
    _, vx, _, _ = built
    enc = _Encoder(None, vx)
    with pytest.raises(DataError, match="6x6 patch grid reached the encoder graph built for 4x4"):
        enc(np.zeros((36, 1176), np.float32), (1, 6, 6))


@needs_qnn
def test_encoder_context_binary_on_the_htp_emulator(built):
    prep, vx, qdq, d = built
    info = measure_vision_encoder(prep, vx, qdq, soc=htp_soc("8gen3"), out_dir=d / "htp",
                                  images=small_set(4))
    h = info["htp"]
    assert (d / "htp" / "vision_encoder_ctx.onnx").is_file() and h["bytes"] > 0
    assert h["embeddings"]["vs_simulation"]["relative_error"] < 0.05  # the HTP computes what the QDQ graph does
    assert h["embeddings"]["vs_float"]["cosine"] > 0.99
    assert 0 <= h["answers"]["whole_model"]["answer_kl"] < 0.05 and h["time"]["median_ms"] > 0


@pytest.mark.slow
def test_convert_demo_vl_for_qnn_reports_encoder_beside_language_model(tmp_path, capsys):
    out = tmp_path / "qnn"
    args = ["convert", "demo-vl", "--bits", "4", "--target", "qnn", "--out", str(out), "--json", "--max-tokens",
            "256", "--static", "32,64"] + (["--soc", "8gen3"] if qnn_available() else [])
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    v = report["details"]["vision_encoder"]
    assert v["image_size"] == [56, 56] and v["layer_precisions"] == {"int8": 17}
    assert report["kl_divergence"] is not None  # the language model's, through the text path
    assert (out / "vision" / "vision_encoder.onnx").is_file() and (out / "quant_overrides_vision_encoder.json").is_file()
    assert "vision_encoder" in (out / "commands.sh").read_text()
    if qnn_available():
        assert v["htp"]["embeddings"]["vs_simulation"]["relative_error"] < 0.05
        assert "measurement" in report["details"]["htp"]


def test_a_vl_folder_missing_its_visual_part_refused_in_one_line(tmp_path, capsys):
    import shutil
    from safetensors.torch import load_file, save_file
    from workbench.assets import DEMO_VL_MODEL_DIR
    src = tmp_path / "novis"
    shutil.copytree(DEMO_VL_MODEL_DIR, src)
    f = src / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if "visual" not in k}, f, metadata={"format": "pt"})
    assert main(["convert", str(src), "--bits", "4", "--target", "qnn", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.visual." in err and "missing" in err, err
