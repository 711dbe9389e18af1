"""The bundled demo vision-language model must really look at the picture: it answers its held-out questions
well above chance, picks each picture's own caption among others', and two different pictures get different
answers."""
import json

import pytest
import torch

from workbench.assets import DEMO_VL_DATA_DIR, DEMO_VL_MODEL_DIR
from workbench.model.load import load_model

MAX_BYTES = 8 * 1024 * 1024
# measured on the bundled build (BUILD.json: heldout.accuracy, by_kind); the floors leave room for float noise only
MIN_OVERALL = 0.60  # measured 0.647
MIN_BY_KIND = {"colour": 0.25, "shape": 0.55, "count": 0.80, "position": 0.90}  # measured 0.333, 0.625, 0.896, 1.0
MIN_ITM = 0.80  # measured 0.875 (BUILD.json: image_text_matching.accuracy; chance 0.25)


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DEMO_VL_DATA_DIR / name).read_text(encoding="utf-8").splitlines()]


def test_demo_vl_files():
    assert (DEMO_VL_MODEL_DIR / "model.safetensors").stat().st_size <= MAX_BYTES
    cfg = json.loads((DEMO_VL_MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    for name in ("tokenizer.json", "preprocessor_config.json", "BUILD.json"):
        assert (DEMO_VL_MODEL_DIR / name).is_file(), name
    questions, captions, calibration = _rows("questions.jsonl"), _rows("captions.jsonl"), _rows("calibration.jsonl")
    assert len(captions) >= 32 and len(calibration) >= 64 and len(questions) >= 3 * len(captions)
    assert {q["image"] for q in questions} == {c["image"] for c in captions}
    assert not {c["image"] for c in calibration} & {c["image"] for c in captions}
    for row in questions + captions + calibration:
        assert (DEMO_VL_DATA_DIR / row["image"]).is_file()


@pytest.fixture(scope="module")
def demo_vl():
    return load_model("demo-vl")


def test_demo_vl_loads_with_parts(demo_vl):
    assert demo_vl.is_vision and demo_vl.processor is not None
    parts = {p.name: p for p in demo_vl.parts()}
    assert list(parts) == ["vision encoder", "projector", "language model"]
    assert sum(p.parameters for p in parts.values()) == demo_vl.parameters
    assert demo_vl.layer("model.visual.merger.mlp.0").kind == "linear"


@pytest.fixture(scope="module")
def heldout_answers(demo_vl):
    from workbench.run.generate import open_model
    gen = open_model(demo_vl)
    out = []
    for row in _rows("questions.jsonl"):
        got = gen.generate(row["question"], image=DEMO_VL_DATA_DIR / row["image"], max_new_tokens=6).text.strip()
        out.append((row, got))
    return out


def test_demo_vl_answers_heldout_questions(heldout_answers):
    by_kind: dict[str, list[bool]] = {}
    for row, got in heldout_answers:
        by_kind.setdefault(row["kind"], []).append(got == row["answer"])
    overall = sum(map(sum, by_kind.values())) / sum(map(len, by_kind.values()))
    accuracy = {k: sum(v) / len(v) for k, v in by_kind.items()}
    assert overall >= MIN_OVERALL and all(accuracy[k] >= v for k, v in MIN_BY_KIND.items()), (overall, accuracy)
    build = json.loads((DEMO_VL_MODEL_DIR / "BUILD.json").read_text())["heldout"]
    assert abs(overall - build["accuracy"]) <= 0.03  # the workbench's loader computes what the build measured


def test_demo_vl_image_text_matching(demo_vl):
    """The library's image-text matching (3 distractors, chance 25%), scored in the format the demo trained on:
    the prompt through the chat template, then " " + caption."""
    from workbench.evaluation.vision import CAPTION_PROMPT, VisionSample, image_text_matching
    tok = demo_vl.processor.tokenizer

    def score(sample):
        inputs = demo_vl.processor(sample.image, sample.prompt)
        answer = tok(" " + sample.answer, add_special_tokens=False)["input_ids"]
        n = inputs["input_ids"].shape[1]
        ids = torch.cat([inputs["input_ids"], torch.tensor([answer])], 1)
        inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                      mm_token_type_ids=torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(answer))))
        with torch.no_grad():
            logits = demo_vl.model(**inputs).logits[0, n - 1:-1]
        return logits, torch.tensor(answer)

    samples = [VisionSample(DEMO_VL_DATA_DIR / r["image"], CAPTION_PROMPT, r["caption"], r["image"])
               for r in _rows("captions.jsonl")]
    itm = image_text_matching(score, samples, distractors=3, seed=0)
    build = json.loads((DEMO_VL_MODEL_DIR / "BUILD.json").read_text())["image_text_matching"]
    assert itm.accuracy >= MIN_ITM, itm.accuracy
    assert abs(itm.accuracy - build["accuracy"]) <= 0.05  # float16 here, float32 in the build


def test_two_pictures_get_different_answers(heldout_answers):
    """Same question, pictures of different colours: the answers differ and follow the pictures."""
    colour = [(row, got) for row, got in heldout_answers if row["kind"] == "colour"]
    right = {row["answer"]: row for row, got in colour if got == row["answer"]}
    assert len(right) >= 3  # correct answers for at least three different colours
    answers = {got for _, got in colour}
    assert len(answers) >= 3


def test_cli_generate_demo_vl_image(capsys):
    from workbench.cli import main
    rows = [r for r in _rows("questions.jsonl") if r["kind"] == "colour"]
    a = next(r for r in rows if r["answer"] == "red")
    b = next(r for r in rows if r["answer"] == "blue")
    texts = []
    for row in (a, b):
        assert main(["generate", "demo-vl", "--image", str(DEMO_VL_DATA_DIR / row["image"]),
                     "--prompt", row["question"], "--max-new-tokens", "6", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["image"].endswith(row["image"])
        texts.append(doc["text"].strip())
    assert texts[0] != texts[1]


def test_cli_info_demo_vl(capsys):
    from workbench.cli import main
    assert main(["info", "demo-vl", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    parts = {p["name"]: p for p in doc["parts"]}
    assert parts["projector"]["prefixes"] == ["model.visual.merger"]
    assert all(p["bytes"] == 2 * p["parameters"] for p in parts.values())  # stored in float16
    assert sum(p["parameters"] for p in parts.values()) == doc["parameters"]
