"""The bundled demo vision-language model must really look at the picture: it answers its held-out questions
well above chance, and two different pictures get different answers."""
import json

import pytest

from workbench.assets import DEMO_VL_DATA_DIR, DEMO_VL_MODEL_DIR
from workbench.model.load import load_model

MAX_BYTES = 8 * 1024 * 1024
# measured on the bundled build (BUILD.json: heldout.accuracy, by_kind); the floors leave room for float noise only
MIN_OVERALL = 0.60  # measured 0.654
MIN_COLOUR = 0.90  # measured 1.0


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
    colour = sum(by_kind["colour"]) / len(by_kind["colour"])
    assert overall >= MIN_OVERALL and colour >= MIN_COLOUR, (overall, {k: sum(v) / len(v) for k, v in by_kind.items()})
    build = json.loads((DEMO_VL_MODEL_DIR / "BUILD.json").read_text())["heldout"]
    assert abs(overall - build["accuracy"]) <= 0.03  # the workbench's loader computes what the build measured


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
