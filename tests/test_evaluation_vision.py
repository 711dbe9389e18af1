"""Image-conditioned quality on a tiny random Qwen2.5-VL: answer KL / top-1, image-text matching, and the scorer
(``workbench.model.vision.answer_scorer``, the model's own image inputs) they are measured through."""
from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from workbench.assets import DEMO_MODEL_DIR
from workbench.errors import DataError
from workbench.evaluation.images import read_image_set
from workbench.evaluation.vision import (AnswerScores, VisionSample, answer_kl, answer_samples,
                                         capture_answer_reference, caption_samples, choose_distractors,
                                         image_text_matching, itm_paired_difference, paired_answer_difference)
from workbench.model.vision import VisionInputs, answer_scorer

IMAGE_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
PROMPT = "Name it:"
# two demo-tokenizer tokens each, so the training batch needs no padding; the words mean nothing to the model
CAPTIONS = ["white", "orange", "pink", "dog", "sun", "house"]
COLOURS = [(230, 30, 30), (30, 200, 40), (40, 40, 220), (240, 240, 20), (10, 10, 10), (200, 200, 200)]


@pytest.fixture(scope="module")
def parts():
    """A tiny Qwen2.5-VL (2 vision blocks of 32, 2 text layers of 64, patch 14, merge 2), its tokenizer and a
    56 x 56 image processor (4 image tokens per picture)."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tok = PreTrainedTokenizerFast(tokenizer_file=str(DEMO_MODEL_DIR / "tokenizer.json"))
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    start, image, end = tok.convert_tokens_to_ids(IMAGE_TOKENS)
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, window_size=56,
                           fullatt_block_indexes=[1]),
        text_config=dict(vocab_size=len(tok) + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        image_token_id=image, video_token_id=len(tok), vision_start_token_id=start, vision_end_token_id=end)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    ip = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                  temporal_patch_size=2)
    return SimpleNamespace(model=model, processor=SimpleNamespace(image_processor=ip, tokenizer=tok), tok=tok,
                           inputs=VisionInputs("qwen", ip, tok, cfg))


def scorer(model, parts):
    """The answer scorer over the plain prompt: the picture's tokens, then the prompt (no chat turns)."""
    return answer_scorer(model, parts.inputs, chat=False)


def images():
    return [Image.new("RGB", (56, 56), c) for c in COLOURS]


def samples(prompt=PROMPT):
    return [VisionSample(img, prompt, cap, f"image {i}") for i, (img, cap) in enumerate(zip(images(), CAPTIONS))]


@pytest.fixture(scope="module")
def trained(parts):
    """The tiny model taught which caption goes with which colour (a few dozen full-batch steps): a model for
    which the image decides the caption, so image-text matching has something to find."""
    model, tok, ip = copy.deepcopy(parts.model), parts.tok, parts.processor.image_processor
    start, image, end = tok.convert_tokens_to_ids(IMAGE_TOKENS)
    feats = ip(images=images(), return_tensors="pt")
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    rows = [[start] + [image] * 4 + [end] + prompt + tok(" " + c, add_special_tokens=False)["input_ids"] for c in CAPTIONS]
    ids = torch.tensor(rows)
    labels = ids.clone()
    labels[:, :-2] = -100  # only the caption's tokens are learnt
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(40):
        loss = model(input_ids=ids, pixel_values=feats["pixel_values"], image_grid_thw=feats["image_grid_thw"],
                     mm_token_type_ids=(ids == image).long(), labels=labels, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def perturbed(model, scale=0.05, seed=1):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.model.language_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())
    return other


# ---------------------------------------------------------------- the scorer

def test_scorer_matches_a_full_forward(parts):
    score = scorer(parts.model, parts)
    s = VisionSample(images()[0], PROMPT, "a red square")
    out = score(s)
    tok, ip = parts.tok, parts.processor.image_processor
    answer = tok(" a red square", add_special_tokens=False)["input_ids"]  # after "Name it:", one space
    assert out.targets.tolist() == answer and out.log_probs.shape == (len(answer), len(tok) + 1)
    start, image, end = tok.convert_tokens_to_ids(IMAGE_TOKENS)
    ids = [start] + [image] * 4 + [end] + tok(PROMPT, add_special_tokens=False)["input_ids"] + answer
    feats = ip(images=[images()[0]], return_tensors="pt")
    with torch.inference_mode():
        t = torch.tensor([ids])
        logits = parts.model(input_ids=t, pixel_values=feats["pixel_values"], image_grid_thw=feats["image_grid_thw"],
                             mm_token_type_ids=(t == image).long(), use_cache=False).logits[0]
    want = torch.log_softmax(logits[-len(answer) - 1:-1].float(), -1)
    assert torch.allclose(out.log_probs, want, atol=1e-5)
    assert math.isclose(out.total, float(want.gather(1, torch.tensor(answer)[:, None]).sum()), rel_tol=1e-5)
    # the image is read: another picture changes the answer's log-probabilities
    other = score(VisionSample(images()[2], PROMPT, "a red square"))
    assert not torch.allclose(out.log_probs, other.log_probs)


def test_scorer_reads_image_paths_and_refuses_bad_text(parts, tmp_path):
    score = scorer(parts.model, parts)
    p = tmp_path / "red.png"
    images()[0].save(p)
    from_path = score(VisionSample(p, PROMPT, "dog"))
    assert torch.allclose(from_path.log_probs, score(VisionSample(images()[0], PROMPT, "dog")).log_probs)
    with pytest.raises(DataError, match="image placeholder"):
        score(VisionSample(p, "look <|image_pad|>", "dog", "line 4"))
    with pytest.raises(DataError, match="answer is empty"):
        score(VisionSample(p, PROMPT, ""))


# ---------------------------------------------------------------- answer KL and top-1

def test_answer_kl_of_a_model_against_itself_is_zero(parts):
    score = scorer(parts.model, parts)
    report = answer_kl(score, samples(), reference=score)
    assert report.kl_divergence == 0.0 and report.top1_agreement == 1.0
    assert report.samples == 6 and report.tokens == 12
    assert report.nll == report.reference_nll and report.nll_difference["mean"] == 0.0
    assert report.kl_stderr == 0.0


def test_answer_kl_of_a_perturbed_copy(parts):
    ref = scorer(parts.model, parts)
    small = scorer(perturbed(parts.model, 0.05), parts)
    large = scorer(perturbed(parts.model, 0.5), parts)
    stored = capture_answer_reference(ref, samples())
    a, b = answer_kl(small, samples(), reference=stored), answer_kl(large, samples(), reference=ref)
    assert 0 < a.kl_divergence < b.kl_divergence
    assert a.kl_stderr > 0 and all(k >= 0 for k in a.sample_kl)
    assert 0 <= b.top1_agreement <= a.top1_agreement <= 1
    # by hand: the per-token mean of KL(ref || cand)
    ref_lp, cand_lp = ref(samples()[0]).log_probs, large(samples()[0]).log_probs
    assert math.isclose(b.sample_kl[0], float((ref_lp.exp() * (ref_lp - cand_lp)).sum()), rel_tol=1e-4)
    diff = paired_answer_difference(b, a, "kl")
    assert diff["mean"] == pytest.approx(b.kl_divergence - a.kl_divergence) and diff["stderr"] > 0
    assert set(a.to_dict()) >= {"kl_divergence", "kl_stderr", "top1_agreement", "nll_difference"}


def test_answer_kl_refuses_mismatched_scorers(parts):
    ref = scorer(parts.model, parts)

    def shifted(sample):  # scores one token fewer
        out = ref(sample)
        return out.log_probs[1:], out.targets[1:]

    with pytest.raises(ValueError, match="image 0: the reference and candidate scored different answer tokens"):
        answer_kl(shifted, samples(), reference=ref)
    with pytest.raises(ValueError, match="must return"):
        answer_kl(lambda s: (torch.zeros(3, 5), torch.zeros(2)), samples(), reference=ref)


# ---------------------------------------------------------------- image-text matching

def test_distractors_are_deterministic_and_never_the_true_caption():
    caps = [f"caption {i}" for i in range(20)] + ["caption 3"]
    a, b = choose_distractors(caps, 4, seed=7), choose_distractors(caps, 4, seed=7)
    assert a == b and len(a) == 21 and all(len(o) == 4 for o in a)
    assert choose_distractors(caps, 4, seed=8) != a
    for i, others in enumerate(a):
        assert len(set(others)) == 4 and all(caps[j] != caps[i] for j in others)
        assert 20 not in others  # a repeated caption counts once, at its first index
    assert choose_distractors(caps[:6], 2, seed=7)[:6] == choose_distractors(caps[:6], 2, seed=7)[:6]
    with pytest.raises(DataError, match="needs at least 5 distinct captions; the set has 3"):
        choose_distractors(["a", "b", "c", "a"], 4)


def test_itm_with_the_image_beats_a_broken_scorer(parts, trained):
    good = scorer(trained, parts)
    grey = Image.new("RGB", (56, 56), (128, 128, 128))

    def blind(sample):  # the deliberately broken scorer: every image replaced by the same grey picture
        return good(VisionSample(grey, sample.prompt, sample.answer))

    seen = image_text_matching(good, samples(), distractors=3, seed=0)
    broken = image_text_matching(blind, samples(), distractors=3, seed=0)
    assert seen.accuracy == 1.0 and seen.chance == 0.25 and all(m > 0 for m in seen.margins)
    assert broken.accuracy <= 2 / 6  # one grey picture ranks the same captions for every image
    assert seen.options == broken.options == choose_distractors(CAPTIONS, 3, 0)
    assert broken.stderr > 0 and math.isclose(broken.stderr, math.sqrt(
        broken.accuracy * (1 - broken.accuracy) / 5), rel_tol=1e-9)
    diff = itm_paired_difference(broken, seen)
    assert diff["mean"] == pytest.approx(broken.accuracy - 1.0) and diff["stderr"] > 0 and diff["agreement"] < 1
    assert itm_paired_difference(seen, seen) == {"mean": 0.0, "stderr": 0.0, "samples": 6, "agreement": 1.0}
    with pytest.raises(ValueError, match="different distractors"):
        itm_paired_difference(image_text_matching(good, samples(), distractors=3, seed=1), seen)


def test_itm_ties_count_as_misses():
    flat = image_text_matching(lambda s: AnswerScores(torch.zeros(1, 4), torch.tensor([0])), samples(),
                               distractors=2)
    assert flat.accuracy == 0.0 and flat.margins == [0.0] * 6


def test_samples_from_an_image_set(tmp_path):
    for i, c in enumerate(COLOURS[:3]):
        Image.new("RGB", (56, 56), c).save(tmp_path / f"{i}.png")
    rows = [{"image": "0.png", "text": "white"}, {"image": "1.png", "question": "Which?", "answer": "dog"},
            {"image": "2.png", "text": "sun", "question": "What?", "answer": "house"}]
    (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pairs = read_image_set(tmp_path)
    ans = answer_samples(pairs, caption_prompt="Say:")
    assert [(s.prompt, s.answer) for s in ans] == [("Say:", "white"), ("Which?", "dog"), ("What?", "house")]
    caps = caption_samples(pairs, prompt="Say:")
    assert [s.answer for s in caps] == ["white", "sun"] and caps[0].image == tmp_path.resolve() / "0.png"
    with pytest.raises(DataError, match="no captions"):
        caption_samples(pairs[1:2])
