"""Plans of a vision-language model measured on pictures: the answer tokens' KL given the image, against the
float model, for the sensitivity sweep, the auto plan's refinement and its final measurement.

    ev = VisionPlanEvaluator(lm, LayerVariants(lm), vision_eval_set(), questions=32)
    ev.evaluate_assignments({"model.visual.merger.mlp.0": "int4"}).kl_divergence   # nats per answer token

Text perplexity says nothing about whether a model still reads its pictures, and a text window never runs the
vision encoder or the projector at all: a sweep on text would find their layers harmless whatever their
precision. Here every trial answers the same held-out questions about the same pictures (``vision_eval_set``:
the bundled demo-vl set or any captioned folder), with the float model's answer distributions captured once.
Each plan's ``evaluation.vision.VisionKLReport`` reads like the text ``EvalReport`` where the sweep and the auto
plan read it (``kl_divergence``, ``perplexity``: exp of the mean answer-token NLL, ``nll``, ``top1_agreement``,
``tokens``).
"""
from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from torch import nn

from ..errors import DataError, PlanError
from ..evaluation.images import read_image
from ..evaluation.vision import VisionKLReport, answer_kl, capture_answer_reference
from ..model.vision import answer_scorer
from ..model.vision_quality import VisionEvalSet, vision_eval_set

__all__ = ["VisionPlanEvaluator", "DEFAULT_SWEEP_QUESTIONS"]

DEFAULT_SWEEP_QUESTIONS = 32  # questions per trial: 0.1-0.3 s a trial on the demo VLM, enough to rank its layers


class VisionPlanEvaluator:
    """``PlanEvaluator``'s counterpart for a VLM: layers swapped in by ``variants`` (a ``LayerVariants``), each plan
    scored on the answers to the first ``questions`` questions of ``images`` (default: the bundled demo-vl set).

    Pictures are decoded once; the float model's answer distributions are captured once (``reference``)."""

    ctx, batch_size, ids = 0, 1, None  # what a text evaluator's callers read; a trial here is one question each

    def __init__(self, lm, variants, images: VisionEvalSet | None = None, *,
                 questions: int = DEFAULT_SWEEP_QUESTIONS, progress: bool = False):
        if not getattr(lm, "is_vision", False) or lm.processor is None:
            raise DataError(f"'{lm.path}' is not a vision-language model: measure it on text (drop --images)")
        if questions < 1:
            raise PlanError(f"questions must be at least 1, got {questions}")
        images = images or vision_eval_set()
        self.lm, self.variants, self.progress = lm, variants, progress
        self.source = images.source
        chosen = images.questions[:questions]
        self.questions = [replace(s, image=read_image(s.image)) if isinstance(s.image, (str, Path)) else s
                          for s in chosen]
        h = hashlib.sha256()
        for s in self.questions:  # the pixels themselves, the prompt and the answer: what a trial depends on
            h.update(s.image.tobytes() + b"|" + s.prompt.encode() + b"|" + s.answer.encode() + b"|")
        self.fingerprint = h.hexdigest()[:16]
        self._reference = None
        self.baseline: VisionKLReport | None = None

    def describe(self) -> str:
        return f"{len(self.questions)} questions about pictures from {self.source}"

    @property
    def reference(self) -> list:
        if self._reference is None:
            self._reference = capture_answer_reference(answer_scorer(self.lm.model, self.lm.processor), self.questions)
        return self._reference

    def evaluate_model(self, model: nn.Module, *, progress: bool = False, desc: str = "") -> VisionKLReport:
        """``model`` (the float one with layers swapped, or a quantized one built from it) on the questions."""
        return answer_kl(answer_scorer(model, self.lm.processor), self.questions, reference=self.reference)

    def evaluate_baseline(self) -> VisionKLReport:
        """The float model itself (KL 0): the anchor every damage is relative to."""
        if self.baseline is None:
            self.baseline = self.evaluate_model(self.lm.model)
        return self.baseline

    def evaluate_assignments(self, assignments: Mapping[str, str | None], *, desc: str = "evaluate") -> VisionKLReport:
        with self.variants.swapped(assignments) as model:
            return self.evaluate_model(model, desc=desc)

    def evaluate(self, plan) -> VisionKLReport:
        if not self.variants.matches(plan):
            raise PlanError(f"this evaluator caches weights made with {self.variants.describe()}; make a new one "
                            "for the plan's rounding settings")
        return self.evaluate_assignments(self.variants.assignments(plan))
