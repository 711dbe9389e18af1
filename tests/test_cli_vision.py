"""The command line with a vision-language model: quantize scored on pictures, generate with any picture a user
has, and every bad picture or image set refused in one line with exit status 2 before any work."""
from __future__ import annotations

import json
import resource
import shutil

import pytest
from PIL import Image

from test_evaluation_images import bomb_png
from workbench.assets import DEMO_VL_DATA_DIR
from workbench.cli import main

QUESTION = "What colour is the shape?"


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    """Eight held-out pictures of the bundled set with their captions and colour questions."""
    d = tmp_path_factory.mktemp("set")
    caps = [json.loads(line) for line in (DEMO_VL_DATA_DIR / "captions.jsonl").read_text().splitlines()][:8]
    qs = [json.loads(line) for line in (DEMO_VL_DATA_DIR / "questions.jsonl").read_text().splitlines()]
    (d / "images").mkdir()
    rows = []
    for c in caps:
        shutil.copy(DEMO_VL_DATA_DIR / c["image"], d / c["image"])
        rows.append({"image": c["image"], "text": c["caption"]})
        rows += [{"image": q["image"], "question": q["question"], "answer": q["answer"]} for q in qs
                 if q["image"] == c["image"] and q["kind"] == "colour"]
    (d / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def one_line_exit_2(args, capsys, match: str) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    return err


def test_quantize_a_vlm_reports_answer_kl_top1_and_image_text_matching(small_set, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "demo-vl", "--bits", "4", "--out", str(out), "--images", str(small_set),
                 "--no-importance", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    v = r["vision"]
    assert v["questions"] == 8 and v["captions"] == 8 and v["distractors"] == 3 and v["itm_chance"] == 0.25
    assert 0 < v["answer_kl"] < 1 and 0 < v["answer_top1"] <= 1 and v["answer_kl_stderr"] > 0
    assert 0 <= v["itm_accuracy"] <= 1 and 0 <= v["reference_itm_accuracy"] <= 1
    assert v["itm_difference"] == pytest.approx(v["itm_accuracy"] - v["reference_itm_accuracy"])
    assert [p["name"] for p in r["parts"]] == ["vision encoder", "projector", "language model"]
    by_name = {layer["name"]: layer["precision"] for layer in r["layers"]}
    assert by_name["model.visual.blocks.0.attn.qkv"] == "int8"  # the vision encoder at --vision-bits' default
    assert by_name["model.visual.merger.mlp.0"] == "int8"
    assert by_name["model.language_model.layers.0.mlp.down_proj"] == "int4"
    assert "perplexity" not in r  # a VLM is scored on pictures unless --text is given
    # the quantized model loads back and still reads the picture
    assert main(["generate", str(out), "--image", str(small_set / "images" / "heldout-001.png"), "--prompt", QUESTION,
                 "--max-new-tokens", "3"]) == 0


def test_projector_and_vision_bits_reach_their_layers(small_set, tmp_path, capsys):
    assert main(["quantize", "demo-vl", "--bits", "8", "--vision-bits", "16", "--projector-bits", "4",
                 "--out", str(tmp_path / "q"), "--images", str(small_set), "--no-importance", "--json"]) == 0
    layers = {layer["name"]: layer["precision"] for layer in json.loads(capsys.readouterr().out)["layers"]}
    assert layers["model.visual.blocks.0.attn.qkv"] is None and layers["model.visual.merger.mlp.2"] == "int4"


def test_two_pictures_two_answers(capsys):
    answers = []
    for name in ("heldout-000.png", "heldout-001.png"):
        assert main(["generate", "demo-vl", "--image", str(DEMO_VL_DATA_DIR / "images" / name), "--prompt",
                     QUESTION, "--max-new-tokens", "3", "--json"]) == 0
        answers.append(json.loads(capsys.readouterr().out)["text"])
    assert answers[0] != answers[1]


def test_pictures_in_other_modes_are_converted(tmp_path, capsys):
    src = Image.open(DEMO_VL_DATA_DIR / "images" / "heldout-001.png").convert("RGB")
    for mode, name in (("CMYK", "c.jpg"), ("P", "p.png"), ("RGBA", "a.png"), ("I;16", "g.png"), ("LA", "la.png")):
        pic = tmp_path / name
        (src.convert("L").convert("I").point(lambda v: v * 256).convert("I;16") if mode == "I;16"
         else src.convert(mode)).save(pic)
        assert main(["generate", "demo-vl", "--image", str(pic), "--prompt", QUESTION, "--max-new-tokens", "2"]) == 0, mode
        capsys.readouterr()


def test_bad_pictures_are_one_line_and_exit_2(tmp_path, capsys):
    args = ["generate", "demo-vl", "--prompt", QUESTION, "--image"]
    not_image = tmp_path / "notes.png"
    not_image.write_text("these are notes, not a picture")
    one_line_exit_2(args + [str(not_image)], capsys, str(not_image))
    good = (DEMO_VL_DATA_DIR / "images" / "heldout-001.png").read_bytes()
    cut = tmp_path / "cut.png"
    cut.write_bytes(good[: len(good) // 2])
    one_line_exit_2(args + [str(cut)], capsys, "cut.png")
    src = Image.open(DEMO_VL_DATA_DIR / "images" / "heldout-001.png").convert("RGB")
    src.resize((400, 400)).save(tmp_path / "big.jpg", quality=90)
    cut_jpeg = tmp_path / "cut.jpg"
    cut_jpeg.write_bytes((tmp_path / "big.jpg").read_bytes()[:3000])
    one_line_exit_2(args + [str(cut_jpeg)], capsys, "cut.jpg")
    one_line_exit_2(args + [str(tmp_path / "missing.png")], capsys, "missing.png")
    bomb = tmp_path / "bomb.png"
    bomb_png(bomb)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    one_line_exit_2(args + [str(bomb)], capsys, "bomb.png")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KB: nothing decoded
    pic = tmp_path / "p.png"
    src.save(pic)
    one_line_exit_2(["generate", "demo", "--prompt", QUESTION, "--image", str(pic)], capsys, "no vision encoder")


def test_bad_image_sets_are_refused_before_quantizing(small_set, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(small_set, broken)
    (broken / "images" / "heldout-003.png").unlink()
    err = one_line_exit_2(["quantize", "demo-vl", "--out", str(tmp_path / "q"), "--images", str(broken)], capsys,
                          "heldout-003.png")
    assert "not in" in err and not (tmp_path / "q").exists()
    one_line_exit_2(["quantize", "demo", "--out", str(tmp_path / "q2"), "--images", str(small_set)], capsys,
                    "text model")


def test_eval_a_quantized_vlm_against_its_float_model_on_pictures(small_set, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "demo-vl", "--bits", "4", "--out", str(out), "--images", str(small_set),
                 "--no-importance", "--json"]) == 0
    vision = json.loads(capsys.readouterr().out)["vision"]
    assert main(["eval", str(out), "--ref", "demo-vl", "--images", str(small_set), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    # the saved model, loaded back, scores what the quantize step measured in memory
    assert again["answer_kl"] == pytest.approx(vision["answer_kl"], rel=1e-3, abs=1e-6)
    assert again["itm_accuracy"] == vision["itm_accuracy"]
    one_line_exit_2(["eval", str(out), "--images", str(small_set)], capsys, "--ref")
    one_line_exit_2(["eval", "demo", "--ref", "demo", "--images", "default"], capsys, "text model")
