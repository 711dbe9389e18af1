"""Calibration of a vision-language model on image + text pairs: the vision encoder and projector get statistics
as the language model does, near-zero fractions by the stated rule, importance for every part, bad input refused."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import linear_inputs

from workbench.charts.calibration import make_near_zero_figure
from workbench.cli import main
from workbench.errors import DataError
from workbench.files.workspace import Workspace
from workbench.model.calibrate import (NEAR_ZERO_DIVISOR, ImageCalibrationSet, calibrate, importance_statistics,
                                       load_image_calibration_set, run_calibration)
from workbench.model.load import load_model
from workbench.model.vision_quality import layer_parts, part_plan
from workbench.quantize import quantize_model
from workbench.quantize.awq import capture_block_inputs, find_decoder_blocks
from workbench.quantize.model import activation_importance
from workbench.quantize.plan import QuantPlan


@pytest.fixture(scope="module")
def vl():
    return load_model("demo-vl")


@pytest.fixture(scope="module")
def pairs(vl):
    return load_image_calibration_set(vl, samples=6, seed=1)


def test_every_part_gets_statistics_that_match_a_direct_computation(vl, pairs):
    assert len(pairs) == 6 and pairs.image_tokens > 0 and pairs.tokens > pairs.image_tokens
    stats = run_calibration(vl.model, pairs, progress=False, sample_budget=1 << 20)
    parts = layer_parts(vl)
    linear = [layer.name for layer in vl.layers if layer.kind == "linear"]
    assert set(stats.layers) == set(linear)
    assert {parts[n] for n in stats.layers} == {"vision encoder", "projector", "language model"}
    direct = linear_inputs(vl.model, pairs.batches())
    for name in ("model.visual.blocks.0.attn.qkv", "model.visual.merger.mlp.2",
                 "model.language_model.layers.0.mlp.down_proj"):
        x = direct[name]
        s = stats[name]
        assert s.tokens == x.shape[0]  # image patches (vision), merged patches (projector), tokens (language)
        torch.testing.assert_close(s.abs_max.double(), x.abs().amax(0), rtol=1e-5, atol=1e-6)
        near = float((x.abs() < x.abs().max() / NEAR_ZERO_DIVISOR).double().mean())
        assert abs(s.near_zero_fraction - near) < 0.02  # from a random subsample of the values
    # patches outnumber merged patches by the merge (2 x 2), and the language model sees every token
    assert stats["model.visual.blocks.0.attn.qkv"].tokens == 4 * stats["model.visual.merger.mlp.0"].tokens
    assert stats["lm_head"].tokens == pairs.tokens
    assert stats.meta["images"] == 6 and stats.meta["image_tokens"] == pairs.image_tokens


def test_a_vlm_calibrates_on_pictures_by_default_and_caches(vl, tmp_path):
    ws = Workspace(tmp_path / "ws")
    cs, stats = calibrate(vl, samples=4, seq_len=256, workspace=ws, progress=False)
    assert isinstance(cs, ImageCalibrationSet) and "model.visual.merger.mlp.0" in stats.layers
    assert not stats.cached
    again = calibrate(vl, samples=4, seq_len=256, workspace=ws, progress=False)[1]
    assert again.cached and again.artifact.key == stats.artifact.key
    other = calibrate(vl, samples=4, seq_len=256, workspace=ws, progress=False, seed=3)[1]
    assert other.artifact.key != stats.artifact.key  # other pictures drawn: other statistics


def _picture_set(folder, n=3, **record):
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        Image.new("RGB", (56, 56), (40 * i, 200, 90)).save(folder / f"p{i}.png")
        rows.append({"image": f"p{i}.png", "text": "a green square" + " on grass" * i, **record})
    (folder / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return folder


def test_any_folder_of_captioned_pictures(vl, tmp_path):
    cs = load_image_calibration_set(vl, _picture_set(tmp_path / "set"), samples=8)
    assert len(cs) == 3 and cs.report.samples == 3 and cs.report.records == 3
    stats = run_calibration(vl.model, cs, progress=False)
    assert stats["model.visual.blocks.0.mlp.down_proj"].tokens > 0


def test_pairs_longer_than_seq_len_are_dropped_and_reported(vl, tmp_path):
    folder = _picture_set(tmp_path / "set")
    with pytest.raises(DataError, match="fits 8 tokens"):
        load_image_calibration_set(vl, folder, seq_len=8)
    longest = max(int(x["input_ids"].shape[-1]) for x in load_image_calibration_set(vl, folder).inputs)
    cs = load_image_calibration_set(vl, folder, seq_len=longest - 1)
    assert len(cs) < 3 and cs.report.dropped["too_long"]["pieces"] == 3 - len(cs)


def test_bad_image_input_is_refused(vl, lm, tmp_path):
    with pytest.raises(DataError, match="text model"):
        calibrate(lm, images=tmp_path, workspace=Workspace(tmp_path / "ws"), progress=False)
    with pytest.raises(DataError, match="not both"):
        calibrate(vl, "x.txt", images=tmp_path, workspace=Workspace(tmp_path / "ws"), progress=False)
    folder = _picture_set(tmp_path / "gone")
    (folder / "p1.png").unlink()
    with pytest.raises(DataError, match="not in"):
        load_image_calibration_set(vl, folder)


def test_importance_covers_the_vision_layers_and_the_rounding_reads_it(vl, tmp_path):
    ws = Workspace(tmp_path / "ws")
    calibration, how = importance_statistics(vl, workspace=ws, progress=False)
    assert "image + text pairs" in how and "every part" in how
    importance = activation_importance(calibration, None)
    assert {"model.visual.blocks.0.attn.qkv", "model.visual.merger.mlp.0"} <= set(importance)
    plan = part_plan(vl, QuantPlan.default_for("int4"), vision="int4", projector="int4")
    weighed = quantize_model(vl, plan, calibration=calibration, progress=False)
    plain = quantize_model(vl, plan, progress=False)
    changed = [n for n in ("model.visual.blocks.0.attn.qkv", "model.visual.blocks.1.mlp.down_proj",
                           "model.visual.merger.mlp.2")
               if not torch.equal(weighed.weights[n].dequantize(), plain.weights[n].dequantize())]
    assert changed  # the scale search weighed the vision layers' errors by their inputs


def test_awq_captures_the_language_blocks_inputs_with_the_picture(vl, pairs):
    _, blocks = find_decoder_blocks(vl.model)
    units, tokens = capture_block_inputs(vl.model, blocks, pairs.samples[:2], max_tokens=10_000)
    assert len(units) == 2 and tokens == sum(int(x["input_ids"].shape[-1]) for x in pairs.samples[:2])
    assert units[0][0].shape[1] == pairs.samples[0]["input_ids"].shape[-1]


def test_near_zero_figure_groups_the_parts(vl, pairs):
    stats = run_calibration(vl.model, pairs, progress=False)
    fig = make_near_zero_figure(stats, parts=layer_parts(vl))
    assert [t.name for t in fig.data] == ["vision encoder", "projector", "language model"]
    assert sum(len(t.x) for t in fig.data) == len(stats.layers)
    down = stats["model.visual.blocks.1.mlp.down_proj"]
    bar = fig.data[0]
    assert bar.x[list(bar.y).index("visual.blocks.1.mlp.down_proj")] == pytest.approx(100 * down.near_zero_fraction)
    assert "254" in fig.layout.xaxis.title.text


def test_cli_calibrate_a_vlm(tmp_path, capsys):
    assert main(["calibrate", "demo-vl", "--samples", "4", "--seq-len", "256", "--workspace", str(tmp_path / "ws"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["near_zero_rule"] == "|x| < abs_max / 254" and out["meta"]["images"] == 4
    by_part = {layer["part"] for layer in out["layers"]}
    assert by_part == {"vision encoder", "projector", "language model"}
    assert main(["calibrate", "demo-vl", "--samples", "4", "--seq-len", "256", "--workspace",
                 str(tmp_path / "ws")]) == 0
    text = capsys.readouterr().out
    assert "4 pictures" in text and "projector: 2 layers, median near-0" in text


def test_cli_images_on_a_text_model_is_one_line_exit_2(tiny_model_dir, tmp_path, capsys):
    assert main(["calibrate", str(tiny_model_dir), "--images", str(_picture_set(tmp_path / "set")),
                 "--workspace", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "text model" in err
