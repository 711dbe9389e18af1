"""What quantization costs a vision-language model where it matters: answers conditioned on an image.

Written against plain callables, so this layer needs no model code: a *scorer* takes one
``VisionSample`` (an image, a prompt, an answer) and returns the model's log-probabilities at the
positions that predict the answer's tokens, with those tokens (``AnswerScores``). Logits are fine too:
they are normalised here. ``workbench.model.vision.answer_scorer`` builds one from a loaded VLM, through the
same image inputs and chat template that ``generate`` uses.

* ``answer_kl``: KL(reference || candidate) and top-1 agreement over the answer tokens given the image,
  per sample, with standard errors from the spread of per-sample means (as the text metrics use
  per-window means), and the answer's NLL under both models with a paired standard error.
* ``image_text_matching``: for each image, the model's total log-likelihood of its own caption against
  ``distractors`` captions of other images (chosen by a seeded draw, the same for every model); accuracy
  is the fraction where the true caption scores strictly highest. ``itm_paired_difference`` compares two
  models on the same draws: the accuracy gap with its paired standard error, and how often they agree.

    ref = answer_scorer(lm.model, lm.processor)            # workbench.model.vision
    cand = answer_scorer(quantized_model, lm.processor)
    samples = answer_samples(read_image_set("set/"))
    kl = answer_kl(cand, samples, reference=ref)
    itm_f = image_text_matching(ref, caption_samples(pairs)); itm_q = image_text_matching(cand, ...)
    itm_paired_difference(itm_q, itm_f)
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import DataError
from .evaluate import mean_stderr
from .images import DEFAULT_MAX_PIXELS, ImageTextPair, read_image

__all__ = ["VisionSample", "AnswerScores", "Scorer", "CAPTION_PROMPT", "answer_samples", "caption_samples",
           "score_sample", "capture_answer_reference", "VisionKLReport", "answer_kl", "paired_answer_difference",
           "choose_distractors", "ITMReport", "image_text_matching", "itm_paired_difference"]

CAPTION_PROMPT = "Describe this image in one sentence."


@dataclass(frozen=True)
class VisionSample:
    """One image-conditioned answer to score: ``image`` is a PIL image or a path (read with ``read_image``)."""

    image: Any
    prompt: str
    answer: str
    where: str = ""


@dataclass
class AnswerScores:
    """A model's float32 log-probabilities ``[answer tokens, vocab]`` at the positions predicting each answer
    token, and those tokens ``[answer tokens]``."""

    log_probs: torch.Tensor
    targets: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def total(self) -> float:
        """The answer's total log-likelihood (what image-text matching ranks by)."""
        return float(self.log_probs.gather(1, self.targets[:, None]).sum())


Scorer = Callable[[VisionSample], "AnswerScores | tuple[torch.Tensor, torch.Tensor]"]


def _where(sample: VisionSample, i: int) -> str:
    return sample.where or f"sample {i}"


def score_sample(scorer: Scorer, sample: VisionSample, i: int = 0) -> AnswerScores:
    """``scorer(sample)`` as float32 CPU log-probabilities (logits are normalised), shapes checked."""
    out = scorer(sample)
    lp, targets = (out.log_probs, out.targets) if isinstance(out, AnswerScores) else out
    lp, targets = torch.as_tensor(lp).detach(), torch.as_tensor(targets).detach().reshape(-1).long().cpu()
    if lp.dim() == 3 and lp.shape[0] == 1:
        lp = lp[0]
    if lp.dim() != 2 or lp.shape[0] != targets.numel() or targets.numel() == 0:
        raise ValueError(f"the scorer returned log-probabilities of shape {tuple(lp.shape)} for "
                         f"{targets.numel()} answer token(s) on {_where(sample, i)}; it must return "
                         "[answer tokens, vocab] and the answer's token ids, at least one")
    return AnswerScores(torch.log_softmax(lp.float().cpu(), dim=-1), targets)


def _image(image, max_pixels: int = DEFAULT_MAX_PIXELS):
    return read_image(image, max_pixels=max_pixels) if isinstance(image, (str, Path)) else image


def answer_samples(pairs: Sequence[ImageTextPair], *, caption_prompt: str = CAPTION_PROMPT) -> list[VisionSample]:
    """One sample per record: its question and answer where it has them, else ``caption_prompt`` and its caption.

    Images stay paths, read when scored, so a large set is never held decoded."""
    return [VisionSample(p.image, p.question, p.answer, p.where) if p.answer is not None
            else VisionSample(p.image, caption_prompt, p.text, p.where) for p in pairs]


def caption_samples(pairs: Sequence[ImageTextPair], *, prompt: str = CAPTION_PROMPT) -> list[VisionSample]:
    """The captioned records (``text``) as samples for image-text matching; DataError when none has a caption."""
    out = [VisionSample(p.image, prompt, p.text, p.where) for p in pairs if p.text is not None]
    if not out:
        raise DataError("the image set has no captions ('text' fields), only questions and answers; "
                        "image-text matching needs a caption per image")
    return out


# ---------------------------------------------------------------- answer KL and top-1

def capture_answer_reference(reference: Scorer, samples: Sequence[VisionSample]) -> list[AnswerScores]:
    """The reference's scores on every sample, once, for comparing many candidates against it.

    Holds answer tokens x vocabulary float32 per sample (12 MB for 20 tokens of a 152 k vocabulary)."""
    return [score_sample(reference, s, i) for i, s in enumerate(samples)]


@dataclass
class VisionKLReport:
    """KL(reference || candidate), top-1 agreement and answer NLL over the answer tokens, with per-sample sums."""

    samples: int
    tokens: int
    kl_divergence: float  # nats per answer token
    top1_agreement: float
    nll: float  # the candidate's mean NLL per answer token
    reference_nll: float
    seconds: float
    sample_tokens: list[int] = field(default_factory=list, repr=False)
    sample_kl: list[float] = field(default_factory=list, repr=False)
    sample_top1: list[int] = field(default_factory=list, repr=False)
    sample_nll: list[float] = field(default_factory=list, repr=False)
    reference_sample_nll: list[float] = field(default_factory=list, repr=False)

    def _stderr(self, sums: Sequence[float]) -> float:
        return mean_stderr([x / t for x, t in zip(sums, self.sample_tokens)])

    @property
    def perplexity(self) -> float:
        """exp of the candidate's mean answer-token NLL: read where a text ``EvalReport`` is (the sweep, auto plan)."""
        return math.exp(self.nll)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(self.reference_nll)

    @property
    def kl_stderr(self) -> float:
        return self._stderr(self.sample_kl)

    @property
    def top1_stderr(self) -> float:
        return self._stderr(self.sample_top1)

    @property
    def nll_difference(self) -> dict:
        """Candidate - reference NLL per answer token, with the paired standard error over samples."""
        return _paired(self.sample_nll, self.reference_sample_nll, self.sample_tokens)

    def to_dict(self, samples: bool = False) -> dict:
        d = asdict(self)
        d["kl_stderr"], d["top1_stderr"], d["nll_difference"] = self.kl_stderr, self.top1_stderr, self.nll_difference
        if not samples:
            for k in ("sample_tokens", "sample_kl", "sample_top1", "sample_nll", "reference_sample_nll"):
                d.pop(k)
        return d


def _paired(a: Sequence[float], b: Sequence[float], tokens: Sequence[int]) -> dict:
    """Mean per-token difference of per-sample sums ``a - b``, and the standard error of per-sample differences."""
    mean = (sum(a) - sum(b)) / sum(tokens)
    return {"mean": mean, "stderr": mean_stderr([(x - y) / t for x, y, t in zip(a, b, tokens)]),
            "samples": len(tokens)}


@torch.inference_mode()
def answer_kl(candidate: Scorer, samples: Sequence[VisionSample], *,
              reference: Scorer | Sequence[AnswerScores]) -> VisionKLReport:
    """KL(reference || candidate) and top-1 agreement over each sample's answer tokens, given its image.

    ``reference`` is a scorer or its ``capture_answer_reference`` output on the same samples. Both must
    tokenize each answer identically (ValueError naming the sample otherwise).
    """
    if not samples:
        raise DataError("no samples to evaluate: the image set is empty")
    stored = None if callable(reference) else list(reference)
    if stored is not None and len(stored) != len(samples):
        raise ValueError(f"the reference was captured on {len(stored)} samples, not these {len(samples)}; capture "
                         "it again")
    report = VisionKLReport(len(samples), 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    t0 = time.perf_counter()
    for i, s in enumerate(samples):
        ref = stored[i] if stored is not None else score_sample(reference, s, i)
        cand = score_sample(candidate, s, i)
        if not torch.equal(ref.targets, cand.targets) or ref.log_probs.shape != cand.log_probs.shape:
            raise ValueError(f"{_where(s, i)}: the reference and candidate scored different answer tokens or "
                             f"vocabularies ({tuple(ref.log_probs.shape)} vs {tuple(cand.log_probs.shape)}); "
                             "use one tokenizer and template for both")
        rlp, lp = ref.log_probs, cand.log_probs
        kl = (rlp.exp() * (rlp - lp)).sum(-1).clamp_min(0).sum().item()
        report.sample_tokens.append(ref.tokens)
        report.sample_kl.append(kl)
        report.sample_top1.append(int((rlp.argmax(-1) == lp.argmax(-1)).sum()))
        report.sample_nll.append(-cand.total)
        report.reference_sample_nll.append(-ref.total)
    report.seconds = time.perf_counter() - t0
    report.tokens = sum(report.sample_tokens)
    report.kl_divergence = sum(report.sample_kl) / report.tokens
    report.top1_agreement = sum(report.sample_top1) / report.tokens
    report.nll = sum(report.sample_nll) / report.tokens
    report.reference_nll = sum(report.reference_sample_nll) / report.tokens
    return report


def paired_answer_difference(candidate: VisionKLReport, baseline: VisionKLReport, metric: str = "kl") -> dict:
    """Mean per-token difference candidate - baseline (``kl``, ``top1`` or ``nll``) over the same samples,
    with the standard error of per-sample differences: whether one quantization beats another beyond noise."""
    key = {"kl": "sample_kl", "top1": "sample_top1", "nll": "sample_nll"}[metric]
    if candidate.sample_tokens != baseline.sample_tokens:
        raise ValueError("the reports were measured on different samples; use the same image set and template")
    return _paired(getattr(candidate, key), getattr(baseline, key), candidate.sample_tokens)


# ---------------------------------------------------------------- image-text matching

def choose_distractors(captions: Sequence[str], k: int, seed: int = 0) -> list[list[int]]:
    """For each caption, the indices of ``k`` others with a different text, drawn from a generator seeded by
    ``seed`` and the caption's index: the same on every run and for every model compared.

    Each distinct text counts once (its first index), so a repeated caption is never its own distractor."""
    if k < 1:
        raise ValueError(f"distractors must be at least 1, got {k}")
    first: dict[str, int] = {}
    for j, t in enumerate(captions):
        first.setdefault(t, j)
    if len(first) < k + 1:
        raise DataError(f"image-text matching with {k} distractors needs at least {k + 1} distinct captions; the "
                        f"set has {len(first)}; add images or lower the number of distractors")
    pool = sorted(first.values())
    out = []
    for i, t in enumerate(captions):
        rng = random.Random(f"{seed}:{i}")  # str seeds hash with SHA-512: stable across runs and platforms
        out.append(rng.sample([j for j in pool if captions[j] != t], k))
    return out


@dataclass
class ITMReport:
    """Image-text matching: per image, whether its own caption out-scored every distractor."""

    accuracy: float
    samples: int
    distractors: int
    seed: int
    chance: float  # 1 / (distractors + 1): what a model blind to the image scores on average
    seconds: float
    correct: list[int] = field(default_factory=list, repr=False)
    chosen: list[int] = field(default_factory=list, repr=False)  # caption index the model ranked first
    margins: list[float] = field(default_factory=list, repr=False)  # true caption's score - best distractor's
    options: list[list[int]] = field(default_factory=list, repr=False)  # distractor caption indices

    @property
    def stderr(self) -> float:
        return mean_stderr(self.correct)

    def to_dict(self, samples: bool = False) -> dict:
        d = asdict(self)
        d["stderr"] = self.stderr
        if not samples:
            for k in ("correct", "chosen", "margins", "options"):
                d.pop(k)
        return d


@torch.inference_mode()
def image_text_matching(scorer: Scorer, samples: Sequence[VisionSample], *, distractors: int = 3, seed: int = 0,
                        max_pixels: int = DEFAULT_MAX_PIXELS) -> ITMReport:
    """Accuracy at picking each image's own caption (``sample.answer``) among ``distractors`` others by total
    log-likelihood given the image and ``sample.prompt``. A tie counts as a miss, so a scorer blind to the
    image (the same score for every caption) gets 0, not chance.

    Total log-likelihood favours short captions; captions of similar length keep that out of the ranking.
    """
    if not samples:
        raise DataError("no samples for image-text matching: the image set is empty")
    captions = [s.answer for s in samples]
    options = choose_distractors(captions, distractors, seed)
    report = ITMReport(0.0, len(samples), distractors, seed, 1.0 / (distractors + 1), 0.0, options=options)
    t0 = time.perf_counter()
    for i, (s, others) in enumerate(zip(samples, options)):
        image = _image(s.image, max_pixels)  # decoded once for all its captions
        scores = [score_sample(scorer, VisionSample(image, s.prompt, captions[j], s.where), i).total
                  for j in [i] + others]
        best_other = max(range(len(others)), key=lambda m: scores[m + 1])
        report.margins.append(scores[0] - scores[best_other + 1])
        report.correct.append(int(report.margins[-1] > 0))
        report.chosen.append(i if report.correct[-1] else others[best_other])
    report.seconds = time.perf_counter() - t0
    report.accuracy = sum(report.correct) / len(report.correct)
    return report


def itm_paired_difference(candidate: ITMReport, baseline: ITMReport) -> dict:
    """Accuracy candidate - baseline on the same draws, with the paired standard error over images, and the
    fraction of images where both ranked the same caption first."""
    if candidate.options != baseline.options:
        raise ValueError("the two matchings drew different distractors; use the same samples, distractors and seed")
    n = candidate.samples
    diffs = [a - b for a, b in zip(candidate.correct, baseline.correct)]
    return {"mean": sum(diffs) / n, "stderr": mean_stderr(diffs), "samples": n,
            "agreement": sum(a == b for a, b in zip(candidate.chosen, baseline.chosen)) / n}


# ---------------------------------------------------------------- a scorer for Qwen2.5-VL (and Qwen2-VL)
