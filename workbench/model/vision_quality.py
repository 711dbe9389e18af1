"""What quantizing a vision-language model costs, measured on pictures, and the per-part plans that recipes use.

    images = vision_eval_set()                              # the bundled demo-vl held-out set, or a folder / file
    vq = measure_vision_quality(lm, candidate, images)      # candidate: e.g. qm.build_model()
    vq.answer_kl, vq.answer_top1, vq.itm_accuracy, vq.reference_itm_accuracy
    plan = part_plan(lm, QuantPlan.default_for("int4"), vision="int8")   # the language model at int4, vision int8

Two measures, each against the float model on the same samples:
* the answer tokens given the image: KL(float || quantized) and top-1 agreement per token, averaged over
  questions (``workbench.evaluation.vision.answer_kl``), with standard errors over questions;
* image-text matching: how often each model ranks an image's own caption above ``distractors`` captions of
  other images by likelihood given the picture, for both models on the same draws, with the paired difference.
Text perplexity says nothing about whether a model still reads its pictures; these do.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from torch import nn

from ..assets import DEMO_VL_DATA_DIR
from ..errors import DataError, PlanError
from ..evaluation.images import read_image_set
from ..evaluation.vision import (answer_kl, answer_samples, capture_answer_reference, caption_samples,
                                 image_text_matching, itm_paired_difference)
from ..quantize.plan import QuantPlan, VisionRecipe
from .vision import PART_PREFIXES, answer_scorer, model_parts, part_of

__all__ = ["VisionEvalSet", "VisionQuality", "VisionBaseline", "vision_eval_set", "measure_vision_baseline",
           "measure_vision_quality", "part_plan", "part_prefixes", "layer_parts", "part_layers",
           "recipe_part_plan", "DEFAULT_DISTRACTORS"]

DEFAULT_DISTRACTORS = 3  # four captions per image: chance 25 %


@dataclass
class VisionEvalSet:
    """Questions with answers (for the answer-token KL) and captioned images (for image-text matching)."""

    questions: list
    captions: list
    source: str

    def describe(self) -> str:
        return f"{len(self.questions)} questions, {len(self.captions)} captioned images from {self.source}"


def vision_eval_set(path: str | Path | None = None, *, max_questions: int | None = None) -> VisionEvalSet:
    """The pictures a VLM is scored on: ``path`` (an image set folder or records file, see
    ``workbench.evaluation.images.read_image_set``), else the bundled demo-vl held-out questions and captions."""
    if path is None:
        questions = answer_samples(read_image_set(DEMO_VL_DATA_DIR / "questions.jsonl"))
        captions = caption_samples(read_image_set(DEMO_VL_DATA_DIR / "captions.jsonl"))
        source = "the bundled demo-vl held-out set"
    else:
        pairs = read_image_set(path)
        questions = answer_samples([p for p in pairs if p.answer is not None]) if any(
            p.answer is not None for p in pairs) else answer_samples(pairs)
        captions = caption_samples(pairs) if any(p.text is not None for p in pairs) else []
        source = f"'{path}'"
    if max_questions is not None:
        questions = questions[:max_questions]
    if not questions:
        raise DataError(f"{source} holds no question or caption to score: add records with 'question' and "
                        "'answer', or 'text'")
    return VisionEvalSet(questions, captions, source)


@dataclass
class VisionQuality:
    """The quantized model against the float one on pictures; every difference with its standard error."""

    questions: int
    answer_tokens: int
    answer_kl: float
    answer_kl_stderr: float
    answer_top1: float
    answer_top1_stderr: float
    answer_nll: float
    reference_answer_nll: float
    captions: int
    distractors: int
    itm_chance: float | None
    itm_accuracy: float | None
    itm_accuracy_stderr: float | None
    reference_itm_accuracy: float | None
    reference_itm_accuracy_stderr: float | None
    itm_difference: float | None
    itm_difference_stderr: float | None
    source: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """Two lines a person reads: the answers' KL and top-1, and image-text matching of both models."""
        lines = [f"answers given the image: KL {self.answer_kl:.5f} ± {self.answer_kl_stderr:.5f}, top-1 agreement "
                 f"{self.answer_top1:.2%} ± {self.answer_top1_stderr:.2%} ({self.questions} questions, "
                 f"{self.answer_tokens} answer tokens)"]
        if self.itm_accuracy is not None:
            lines.append(f"image-text matching: {self.itm_accuracy:.2%} ± {self.itm_accuracy_stderr:.2%} quantized, "
                         f"{self.reference_itm_accuracy:.2%} ± {self.reference_itm_accuracy_stderr:.2%} float "
                         f"(difference {self.itm_difference:+.2%} ± {self.itm_difference_stderr:.2%}; "
                         f"{self.captions} images, {self.distractors} distractors each, chance {self.itm_chance:.0%})")
        return "\n".join(lines) + f"\n(on {self.source})"


@dataclass
class VisionBaseline:
    """The float model's side of every comparison on one set, computed once: its answer scores and its matching."""

    images: VisionEvalSet
    answers: list
    matching: object | None  # ITMReport, or None when the set has too few captions
    distractors: int


def measure_vision_baseline(lm, images: VisionEvalSet | None = None, *, distractors: int = DEFAULT_DISTRACTORS,
                            reference: nn.Module | None = None) -> VisionBaseline:
    """Score the float model (``reference``, default ``lm.model``) once, for any number of candidates."""
    if not getattr(lm, "is_vision", False) or lm.processor is None:
        raise DataError(f"'{lm.path}' is not a vision-language model: score it on text (drop --images)")
    images = images or vision_eval_set()
    score = answer_scorer(reference if reference is not None else lm.model, lm.processor)
    matching = image_text_matching(score, images.captions, distractors=distractors) \
        if len(images.captions) > distractors else None
    return VisionBaseline(images, capture_answer_reference(score, images.questions), matching, distractors)


def measure_vision_quality(lm, candidate: nn.Module, images: VisionEvalSet | None = None, *,
                           distractors: int = DEFAULT_DISTRACTORS, reference: nn.Module | None = None,
                           baseline: VisionBaseline | None = None, progress: bool = False) -> VisionQuality:
    """Score ``candidate`` (a model built from ``lm``'s) against the float model (``reference``, default
    ``lm.model``; or a ``baseline`` measured once) on ``images`` (default: ``vision_eval_set()``), through ``lm``'s
    own image preprocessing and chat template."""
    t0 = time.perf_counter()
    if baseline is None:
        if progress:
            print(f"scoring the float model on {(images or vision_eval_set()).describe()}", flush=True)
        baseline = measure_vision_baseline(lm, images, distractors=distractors, reference=reference)
    images, distractors = baseline.images, baseline.distractors
    cand_score = answer_scorer(candidate, lm.processor)
    if progress:
        print(f"scoring the quantized model on {images.describe()}", flush=True)
    kl = answer_kl(cand_score, images.questions, reference=baseline.answers)
    itm = diff = None
    ref_itm = baseline.matching
    if ref_itm is not None:
        itm = image_text_matching(cand_score, images.captions, distractors=distractors)
        diff = itm_paired_difference(itm, ref_itm)
    return VisionQuality(
        questions=len(images.questions), answer_tokens=kl.tokens, answer_kl=kl.kl_divergence,
        answer_kl_stderr=kl.kl_stderr, answer_top1=kl.top1_agreement, answer_top1_stderr=kl.top1_stderr,
        answer_nll=kl.nll, reference_answer_nll=kl.reference_nll,
        captions=len(images.captions) if itm else 0, distractors=distractors if itm else 0,
        itm_chance=itm.chance if itm else None, itm_accuracy=itm.accuracy if itm else None,
        itm_accuracy_stderr=itm.stderr if itm else None,
        reference_itm_accuracy=ref_itm.accuracy if ref_itm else None,
        reference_itm_accuracy_stderr=ref_itm.stderr if ref_itm else None,
        itm_difference=diff["mean"] if diff else None, itm_difference_stderr=diff["stderr"] if diff else None,
        source=images.source, seconds=time.perf_counter() - t0)


def part_prefixes(lm, part: str) -> list[str]:
    """The module prefixes of one part (``vision encoder``, ``projector``, ``language model``) present in ``lm``."""
    if part not in PART_PREFIXES:
        raise PlanError(f"unknown part '{part}'; parts: {', '.join(PART_PREFIXES)}")
    for p in model_parts(lm.model, [layer.name for layer in lm.layers]):
        if p.name == part:
            return list(p.prefixes)
    return []


def layer_parts(lm) -> dict[str, str]:
    """Each quantizable layer's part (``vision encoder``, ``projector``, ``language model``), in layer order; a
    text model's layers are all the language model's."""
    names = [layer.name for layer in lm.layers]
    if not getattr(lm, "is_vision", False):
        return {n: "language model" for n in names}
    parts = model_parts(lm.model, names)
    return {n: part_of(n, parts) or "language model" for n in names}


def part_layers(lm) -> dict[str, list[str]]:
    """Each part's quantizable layers by their checkpoint names, parts in ``lm.parts()`` order (a text model: one
    part, the language model, holding every layer)."""
    parts = lm.parts()
    if not getattr(lm, "is_vision", False):
        return {parts[0].name: [layer.name for layer in lm.layers]}
    out: dict[str, list[str]] = {part.name: [] for part in parts}
    for layer in lm.layers:
        part = part_of(layer.name, parts)
        if part is not None:
            out[part].append(layer.name)
    return out


def part_plan(lm, plan: QuantPlan, *, vision: str | None = "keep", projector: str | None = "keep") -> QuantPlan:
    """``plan`` with the vision encoder and the projector at their own precisions (``"keep"``: as ``plan`` has
    them; ``None``: left unquantized), the projector's rule added last so it wins inside the vision tower.
    A text model has no such parts: asking for them is a PlanError."""
    if not getattr(lm, "is_vision", False):
        if vision != "keep" or projector != "keep":
            raise PlanError(f"'{lm.path}' has no vision encoder or projector: drop the vision / projector precision")
        return plan
    for part, precision in (("vision encoder", vision), ("projector", projector)):
        if precision == "keep":
            continue
        for prefix in part_prefixes(lm, part):
            plan = plan.with_override(f"{prefix}.*", precision)
    return plan


def recipe_part_plan(lm, plan: QuantPlan, recipe: VisionRecipe) -> QuantPlan:
    """``plan`` with the vision encoder and projector as ``recipe`` (``quantize.plan.vision_recipe``) ships them, the
    recipe named in the plan's meta (``vision_recipe``)."""
    out = part_plan(lm, plan, vision=recipe.vision, projector=recipe.projector)
    return replace(out, meta={**out.meta, "vision_recipe": recipe.to_dict()})

