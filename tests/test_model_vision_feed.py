"""A target's image embeddings scored against the model's own and fed to its language model."""
from __future__ import annotations

import numpy as np
import pytest

from workbench import load_model
from workbench.errors import PlanError
from workbench.evaluation.images import read_image
from workbench.evaluation.vision import answer_kl, capture_answer_reference
from workbench.model.vision import answer_scorer
from workbench.model.vision_feed import embedding_error, fed_answer_scorer, image_features
from workbench.model.vision_quality import vision_eval_set


def test_embedding_error():
    want = np.array([[1.0, 0.0], [0.0, 2.0]])
    e = embedding_error(want, want)
    assert e["cosine"] == pytest.approx(1.0) and e["relative_error"] == 0.0 and e["max_abs_diff"] == 0.0
    e = embedding_error(np.array([[0.0, 1.0], [0.0, 2.0]]), want)
    assert e["cosine"] == pytest.approx(0.5) and e["cosine_min"] == pytest.approx(0.0)
    assert e["relative_error"] == pytest.approx(np.sqrt(2) / np.sqrt(5))
    with pytest.raises(PlanError, match="different number of tokens"):
        embedding_error(np.zeros((3, 2)), want)


def test_embedding_error_over_pictures():
    """Pictures pooled: cosine over all their tokens, relative error over all, the worst picture's beside it."""
    a = [np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([[3.0, 0.0]])]
    same = embedding_error(a, a)
    assert same["cosine"] == pytest.approx(1.0) and same["relative_error"] == 0.0
    assert same["tokens"] == 3 and same["pictures"] == 2
    off = embedding_error([np.array([[0.0, 1.0], [0.0, 2.0]]), a[1]], a)
    assert off["cosine_min"] == pytest.approx(0.0) and off["cosine"] == pytest.approx(2 / 3)
    assert off["relative_error"] == pytest.approx(np.sqrt(2 / 14))
    assert off["relative_error_max"] == pytest.approx(np.sqrt(2 / 5))
    with pytest.raises(PlanError, match="one per picture"):
        embedding_error(a[:1], a)


def test_fed_embeddings_reach_the_language_model():
    """The model fed its own image features answers exactly as itself (KL 0); fed other features, it does not."""
    vl = load_model("demo-vl")
    samples = vision_eval_set(max_questions=6).questions  # three questions on each of two pictures
    own = {str(s.image): image_features(vl.model, vl.processor(read_image(s.image), s.prompt)) for s in samples}
    assert next(iter(own.values())).shape == (4, 128)  # 56 x 56 pixels: 2 x 2 merged tokens of the LM's width
    reference = capture_answer_reference(answer_scorer(vl.model, vl.processor), samples)
    same = answer_kl(fed_answer_scorer(vl.model, vl.processor, own), samples, reference=reference)
    assert same.kl_divergence == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    a, b = own  # the two pictures' features swapped: each question is asked of the other picture
    assert a != b
    other = {a: own[b], b: own[a]}
    changed = answer_kl(fed_answer_scorer(vl.model, vl.processor, other), samples, reference=reference)
    assert changed.kl_divergence > 0.1 and changed.top1_agreement < 1.0
    assert "get_image_features" not in vl.model.model.__dict__  # the model is itself again
    with pytest.raises(PlanError, match="no target image embeddings"):
        answer_kl(fed_answer_scorer(vl.model, vl.processor, {}), samples, reference=reference)
