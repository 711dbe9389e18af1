"""The bundled demo model must be a real language model, not a placeholder."""
import json
import math

import pytest
import torch

from workbench import encode_text, evaluate, load_model, read_text
from workbench.assets import DEMO_MODEL_DIR, demo_text_path

MAX_BYTES = 12 * 1024 * 1024


def test_demo_model_files_and_shape():
    weights = DEMO_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= MAX_BYTES
    cfg = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["hidden_size"] % 256 == 0 and cfg["intermediate_size"] % 256 == 0
    for name in ("tokenizer.json", "heldout.txt", "calibration.txt", "unigram_counts.json"):
        assert (DEMO_MODEL_DIR / name).is_file(), name


@pytest.fixture(scope="module")
def demo():
    lm = load_model("demo")
    ids = encode_text(lm.tokenizer, read_text(demo_text_path("heldout")))
    return lm, ids, evaluate(lm.model, ids, ctx=512, progress=False)


def test_demo_model_beats_vocab_quarter_and_unigram(demo):
    lm, ids, report = demo
    assert report.tokens > 10_000
    assert report.perplexity <= lm.config.vocab_size / 4
    counts = json.loads((DEMO_MODEL_DIR / "unigram_counts.json").read_text())["counts"]
    total = sum(counts) + len(counts)
    logp = torch.tensor([math.log((c + 1) / total) for c in counts])
    unigram = math.exp(-logp[ids[1:]].mean().item())
    assert report.perplexity <= unigram / 2, (report.perplexity, unigram)


def test_heldout_text_is_not_in_training_split():
    held = read_text(demo_text_path("heldout"))
    calib = read_text(demo_text_path("calibration"))
    assert len(held) > 20_000 and len(calib) > 20_000
    assert held[:2000] not in calib
