"""LoRA fine-tuning: it learns, merges into a loadable model, resumes exactly, and refuses bad input."""
import json

import pytest
import torch

from conftest import Interrupted, interrupt_at
from workbench.errors import DataError, WorkbenchError
from workbench.evaluation.evaluate import encode_text, evaluate, read_text
from workbench.compress.finetune import CHECKPOINT, FinetuneConfig, finetune_lora, training_windows
from workbench.assets import demo_text_path
from workbench.model.load import load_model

CFG = FinetuneConfig(steps=12, batch_size=4, seq_len=32, lr=5e-3, warmup=2, checkpoint_every=5, eval_every=10)


@pytest.fixture(scope="module")
def tuned(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ft") / "tuned"
    return out, finetune_lora(tiny_model_dir, None, out, CFG, eval_tokens=256, progress=False)


def test_training_lowers_the_loss_and_the_merged_model_loads(tuned, tiny_model_dir):
    out, report = tuned
    assert len(report.losses) == CFG.steps
    assert sum(report.losses[-3:]) / 3 < sum(report.losses[:3]) / 3  # a random tiny model learns the text quickly
    steps = [s for s, _ in report.validation]
    assert steps == [0, 10, 12] and report.validation_windows > 0  # the start, every eval_every, the end
    assert report.best_step == min(report.validation, key=lambda v: v[1])[0] == 12
    assert 0 < report.trainable_parameters < report.total_parameters
    assert not out.with_name(out.name + ".partial").exists() and not (out / CHECKPOINT).exists()
    saved = json.loads((out / "finetune.json").read_text())
    assert saved["perplexity_after"] == report.perplexity_after
    lm, base = load_model(out), load_model(tiny_model_dir)
    ids = encode_text(lm.tokenizer, read_text(demo_text_path("heldout")))[:256]
    assert evaluate(lm.model, ids, ctx=32, progress=False).perplexity == pytest.approx(report.perplexity_after, rel=1e-6)
    assert [i.name for i in lm.layers] == [i.name for i in base.layers]  # merged: no LoRA modules left
    assert not torch.equal(lm.model.model.layers[0].mlp.up_proj.weight, base.model.model.layers[0].mlp.up_proj.weight)


def test_the_callers_model_is_not_changed(tiny_model_dir, tmp_path):
    lm = load_model(tiny_model_dir)
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    finetune_lora(lm, None, tmp_path / "t", FinetuneConfig(steps=2, batch_size=2, seq_len=16), eval_tokens=64,
                  progress=False)
    assert all(torch.equal(before[k], v) for k, v in lm.model.state_dict().items())


def test_an_interrupted_run_resumes_to_the_same_result(tuned, tiny_model_dir, tmp_path):
    _, full = tuned
    out = tmp_path / "resumed"

    with pytest.raises(Interrupted):
        finetune_lora(tiny_model_dir, None, out, CFG, eval_tokens=256, progress=False, on_step=interrupt_at(7))
    assert (out.with_name("resumed.partial") / CHECKPOINT).is_file() and not out.exists()
    report = finetune_lora(tiny_model_dir, None, out, CFG, eval_tokens=256, progress=False)
    assert report.resumed_from_step == 5  # the last checkpoint before the interruption
    assert report.losses == pytest.approx(full.losses, rel=1e-5)
    assert report.perplexity_after == pytest.approx(full.perplexity_after, rel=1e-5)


def test_bad_input_is_refused_with_what_to_do(tiny_model_dir, tmp_path):
    lm = load_model(tiny_model_dir)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="training file .*empty.txt' is empty"):
        training_windows(lm, empty, 32)
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    with pytest.raises(DataError, match="fewer than one window of 512; give more text or a smaller --seq-len"):
        training_windows(lm, short, 512)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "no text field"}\n')
    with pytest.raises(DataError, match="bad.jsonl' line 1: missing field 'text'"):
        training_windows(lm, bad, 32)
    with pytest.raises(WorkbenchError, match="rank must be at least 1"):
        finetune_lora(lm, None, tmp_path / "x", FinetuneConfig(rank=0), progress=False)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    for overwrite in (False, True):  # overwrite replaces an earlier fine-tuned model, never a user's files
        with pytest.raises(WorkbenchError, match="is not empty and has no workbench manifest.json"):
            finetune_lora(lm, None, occupied, CFG, overwrite=overwrite, progress=False)
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"]


def test_windows_cover_the_text_in_order(tiny_model_dir):
    lm = load_model(tiny_model_dir)
    w = training_windows(lm, demo_text_path("calibration"), 64)
    assert w.shape[1] == 64 and w.shape[0] > 10 and w.dtype == torch.long


@pytest.mark.slow
def test_a_run_that_only_hurts_leaves_the_model_as_it_came(tmp_path):
    """The trained demo model at a far too high rate: every step is worse on the held-back windows."""
    cfg = FinetuneConfig(steps=4, batch_size=4, seq_len=64, lr=0.5, warmup=1, eval_every=2)
    report = finetune_lora("demo", None, tmp_path / "t", cfg, eval_tokens=128, progress=False)
    assert report.best_step == 0 and all(v > report.validation[0][1] for _, v in report.validation[1:])
    assert "the model unchanged" in report.summary()
    tuned, base = load_model(tmp_path / "t"), load_model("demo")
    assert all(torch.equal(a, b) for a, b in zip(tuned.model.state_dict().values(), base.model.state_dict().values()))


def test_training_text_without_newlines_is_read_only_as_far_as_the_steps_need(tmp_path):
    """A one-line training text far larger than the run needs is read in pieces, up to the token budget."""
    import types

    from conftest import workbench_notes

    from transformers import AutoTokenizer

    from workbench.compress.finetune import FinetuneConfig, training_token_budget, training_windows
    from workbench.assets import DEMO_MODEL_DIR
    lm = types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(DEMO_MODEL_DIR))
    p = tmp_path / "train.txt"
    p.write_text("the model learns from this sentence and the next one " * 400_000, encoding="utf-8")  # 21 MB
    with workbench_notes() as notes:
        windows = training_windows(lm, p, 64, max_tokens=64 * 100)
    assert windows.shape == (100, 64)
    assert len(notes) == 1 and notes[0].startswith("read only the first") and "enough for 6,400 training tokens" in notes[0]
    cfg = FinetuneConfig(steps=10, batch_size=2, seq_len=64)
    assert training_token_budget(cfg) >= 10 * 2 * 64
