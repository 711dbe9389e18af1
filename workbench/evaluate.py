"""Honest evaluation: strided perplexity, and KL divergence / top-1 agreement against a reference.

Perplexity follows the standard sliding-window method (as in the Hugging Face perplexity guide
and llama.cpp): windows of ``ctx`` tokens start every ``stride`` tokens; each token is scored
once, from the window that first covers it with the most context. ``stride == ctx`` (the
default) gives non-overlapping windows. KL(reference || candidate) and top-1 agreement are
taken on exactly the tokens that perplexity scores.

    report = evaluate(candidate, ids, reference=reference_model, ctx=512)
    report.perplexity, report.kl_divergence, report.top1_agreement
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from .errors import DataError

__all__ = ["Window", "strided_windows", "encode_text", "EvalReport", "ReferenceOutputs", "capture_reference",
           "evaluate", "paired_difference", "DEFAULT_CTX"]

DEFAULT_CTX = 512  # llama.cpp's llama-perplexity default; the demo model's full context


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` go in; targets ``[score_from, end)`` are scored."""

    begin: int
    end: int
    score_from: int

    @property
    def scored(self) -> int:
        return self.end - self.score_from


def strided_windows(n_tokens: int, ctx: int, stride: int | None = None) -> list[Window]:
    """The standard strided windows over ``n_tokens`` (the first token is never a target)."""
    stride = stride or ctx
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2, got {ctx}")
    if not 0 < stride <= ctx:
        raise ValueError(f"stride must be between 1 and ctx ({ctx}), got {stride}")
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + ctx, n_tokens)
        score_from = max(prev_end, begin + 1)
        if end > score_from:
            windows.append(Window(begin, end, score_from))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def encode_text(tokenizer, text: str, *, source: str = "text") -> torch.Tensor:
    """Tokenize a whole text into one 1-D tensor of ids; an empty result is an error."""
    if not text or not text.strip():
        raise DataError(f"{source} is empty: give a text with at least a few sentences to evaluate on")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise DataError(f"{source} has only {len(ids)} token(s); at least 2 are needed to score anything")
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class EvalReport:
    """What evaluation measured; per-window sums allow paired comparisons with standard errors."""

    perplexity: float
    nll: float
    tokens: int
    windows: int
    ctx: int
    stride: int
    seconds: float
    tokens_per_second: float
    window_nll: list[float] = field(default_factory=list, repr=False)
    window_tokens: list[int] = field(default_factory=list, repr=False)
    kl_divergence: float | None = None
    top1_agreement: float | None = None
    reference_perplexity: float | None = None
    window_kl: list[float] = field(default_factory=list, repr=False)
    window_top1: list[int] = field(default_factory=list, repr=False)

    def to_dict(self, windows: bool = False) -> dict:
        d = asdict(self)
        if not windows:
            for k in ("window_nll", "window_tokens", "window_kl", "window_top1"):
                d.pop(k)
        return d


@dataclass
class ReferenceOutputs:
    """A reference model's log-probabilities at the scored positions, captured once and reused."""

    ctx: int
    stride: int
    n_tokens: int
    log_probs: list[torch.Tensor]  # one [scored, vocab] tensor per window


def _batches(windows: Sequence[Window], batch_size: int):
    """Consecutive windows of equal length, at most ``batch_size`` at a time."""
    i = 0
    while i < len(windows):
        j = i + 1
        length = windows[i].end - windows[i].begin
        while j < len(windows) and j - i < batch_size and windows[j].end - windows[j].begin == length:
            j += 1
        yield i, windows[i:j]
        i = j


def _window_logits(model: nn.Module, ids: torch.Tensor, batch: Sequence[Window]) -> list[torch.Tensor]:
    """Float32 logits at the scored positions of each window (position j predicts token j + 1)."""
    device = next(model.parameters()).device
    x = torch.stack([ids[w.begin:w.end] for w in batch]).to(device)
    logits = model(input_ids=x, use_cache=False).logits
    return [row[w.score_from - w.begin - 1: w.end - w.begin - 1].float() for row, w in zip(logits, batch)]


def _window_log_probs(model: nn.Module, ids: torch.Tensor, batch: Sequence[Window]) -> list[torch.Tensor]:
    return [torch.log_softmax(lg, dim=-1) for lg in _window_logits(model, ids, batch)]


@torch.inference_mode()
def capture_reference(model: nn.Module, ids: torch.Tensor, *, ctx: int = DEFAULT_CTX, stride: int | None = None,
                      batch_size: int = 4, progress: bool = True) -> ReferenceOutputs:
    """Run the reference once and keep its log-probs, for many comparisons on the same tokens."""
    from tqdm.auto import tqdm
    windows = strided_windows(len(ids), ctx, stride)
    lps: list[torch.Tensor] = []
    with tqdm(total=len(windows), desc="reference", unit="win", disable=not progress, leave=False) as bar:
        for _, batch in _batches(windows, batch_size):
            lps.extend(lp.cpu() for lp in _window_log_probs(model, ids, batch))
            bar.update(len(batch))
    return ReferenceOutputs(ctx, stride or ctx, len(ids), lps)


@torch.inference_mode()
def evaluate(model: nn.Module, ids: torch.Tensor, *, reference: nn.Module | ReferenceOutputs | None = None,
             ctx: int = DEFAULT_CTX, stride: int | None = None, batch_size: int = 4, progress: bool = True,
             desc: str = "evaluate") -> EvalReport:
    """Perplexity of ``model`` on ``ids``; with ``reference``, also KL and top-1 agreement."""
    from tqdm.auto import tqdm
    ids = ids.reshape(-1).long()
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_pos and ctx > max_pos:
        raise ValueError(f"ctx {ctx} exceeds the model's max_position_embeddings ({max_pos}); use --ctx {max_pos}")
    stride = stride or ctx
    windows = strided_windows(len(ids), ctx, stride)
    if isinstance(reference, ReferenceOutputs) and (reference.ctx, reference.stride, reference.n_tokens) != \
            (ctx, stride, len(ids)):
        raise ValueError("reference outputs were captured with another ctx/stride/text; capture them again")
    report = EvalReport(0.0, 0.0, 0, len(windows), ctx, stride, 0.0, 0.0)
    ref_nll = 0.0
    t0 = time.perf_counter()
    with tqdm(total=len(windows), desc=desc, unit="win", disable=not progress, leave=False) as bar:
        for start, batch in _batches(windows, batch_size):
            # without a reference, the fused cross-entropy is all that is needed (as fast as model.loss)
            lps = _window_log_probs(model, ids, batch) if reference is not None else _window_logits(model, ids, batch)
            if isinstance(reference, nn.Module):
                ref_lps = _window_log_probs(reference, ids, batch)
            elif reference is not None:
                ref_lps = reference.log_probs[start:start + len(batch)]
            for k, (lp, w) in enumerate(zip(lps, batch)):
                targets = ids[w.score_from:w.end].to(lp.device)
                if reference is None:
                    nll = torch.nn.functional.cross_entropy(lp, targets, reduction="sum").item()
                else:
                    nll = -lp.gather(1, targets[:, None]).sum().item()
                report.window_nll.append(nll)
                report.window_tokens.append(w.scored)
                if reference is not None:
                    rlp = ref_lps[k].to(lp.device)
                    kl = (rlp.exp() * (rlp - lp)).sum(-1).clamp_min(0).sum().item()
                    report.window_kl.append(kl)
                    report.window_top1.append(int((rlp.argmax(-1) == lp.argmax(-1)).sum().item()))
                    ref_nll += -rlp.gather(1, targets[:, None]).sum().item()
            bar.update(len(batch))
    report.seconds = time.perf_counter() - t0
    report.tokens = sum(report.window_tokens)
    report.nll = sum(report.window_nll) / report.tokens
    report.perplexity = math.exp(report.nll)
    report.tokens_per_second = report.tokens / report.seconds if report.seconds else float("inf")
    if reference is not None:
        report.kl_divergence = sum(report.window_kl) / report.tokens
        report.top1_agreement = sum(report.window_top1) / report.tokens
        report.reference_perplexity = math.exp(ref_nll / report.tokens)
    return report


def paired_difference(candidate: EvalReport, baseline: EvalReport, metric: str = "nll") -> dict:
    """Mean per-token difference candidate - baseline over the same windows, with its standard error.

    ``metric`` is ``nll`` (log-perplexity) or ``kl``. The standard error comes from the spread of
    per-window differences, so it says whether a gap is larger than the text's own noise.
    """
    key = {"nll": "window_nll", "kl": "window_kl"}[metric]
    a, b = getattr(candidate, key), getattr(baseline, key)
    if len(a) != len(b) or candidate.window_tokens != baseline.window_tokens:
        raise ValueError("reports were evaluated on different windows; use the same text, ctx and stride")
    n = len(a)
    diffs = [(x - y) / t for x, y, t in zip(a, b, candidate.window_tokens)]
    mean = sum((x - y) for x, y in zip(a, b)) / sum(candidate.window_tokens)
    if n < 2:
        return {"mean": mean, "stderr": float("nan"), "windows": n}
    m = sum(diffs) / n
    var = sum((d - m) ** 2 for d in diffs) / (n - 1)
    return {"mean": mean, "stderr": math.sqrt(var / n), "windows": n}


def read_text(path: str | Path) -> str:
    """Read a UTF-8 text file for evaluation, with a clear error when it is missing or empty."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"text file '{p}' does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"text file '{p}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise DataError(f"text file '{p}' is empty")
    return text


__all__.append("read_text")
