"""Honest evaluation: strided perplexity, and KL divergence / top-1 agreement against a reference.

Perplexity follows the standard sliding-window method (as in the Hugging Face perplexity guide
and llama.cpp): windows of ``ctx`` tokens start every ``stride`` tokens; each token is scored
once, from the window that first covers it with the most context. ``stride == ctx`` (the
default) gives non-overlapping windows. KL(reference || candidate) and top-1 agreement are
taken on exactly the tokens that perplexity scores.

``scheme="llama.cpp"`` reproduces ``llama-perplexity``'s own windows instead, so figures can be set
beside its output: whole chunks of ``ctx`` tokens, the first half of each only as context, the
second half scored (``llamacpp_windows``).

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

from ..errors import DataError
from ..numerics.logits import final_hidden, head_logits, head_vocab
from .textio import check_text_path, tokenize_bounded

__all__ = ["mean_stderr", "Window", "strided_windows", "llamacpp_windows", "eval_windows", "SCHEMES", "encode_text", "EvalReport",
           "ReferenceOutputs", "capture_reference",
           "evaluate", "paired_difference", "DEFAULT_CTX", "default_token_budget", "reference_report",
           "EVAL_BUDGET"]

DEFAULT_CTX = 512  # llama.cpp's llama-perplexity default; the demo model's full context


def mean_stderr(values) -> float:
    """Standard error of the mean of ``values`` (nan with fewer than two): the spread of per-window or
    per-sample figures that every measured difference here is quoted with."""
    values = list(values)
    n = len(values)
    if n < 2:
        return float("nan")
    m = sum(values) / n
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)


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


def llamacpp_windows(n_tokens: int, ctx: int) -> list[Window]:
    """``llama-perplexity``'s windows: whole non-overlapping chunks of ``ctx``, scoring tokens after the first half.

    In chunk ``[b, b + ctx)`` the logits at positions ``ctx // 2 .. ctx - 2`` predict tokens
    ``b + ctx // 2 + 1 .. b + ctx - 1``: ``ctx - 1 - ctx // 2`` scored tokens per chunk; a partial last
    chunk is dropped, as llama.cpp does.
    """
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4 for llama.cpp's half-chunk scoring, got {ctx}")
    if n_tokens < ctx:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one chunk of {ctx}; use a longer text or "
                         "a smaller --ctx")
    first = ctx // 2
    return [Window(b, b + ctx, b + first + 1) for b in range(0, n_tokens - ctx + 1, ctx)]


SCHEMES = ("strided", "llama.cpp")


def eval_windows(n_tokens: int, ctx: int, stride: int | None = None, scheme: str = "strided") -> list[Window]:
    """The windows of one evaluation scheme (``SCHEMES``)."""
    if scheme == "strided":
        return strided_windows(n_tokens, ctx, stride)
    if scheme == "llama.cpp":
        if stride not in (None, ctx):
            raise ValueError("llama.cpp's scheme has no stride: its chunks never overlap; drop --stride")
        return llamacpp_windows(n_tokens, ctx)
    raise ValueError(f"unknown evaluation scheme '{scheme}'; choose one of {', '.join(SCHEMES)}")


def encode_text(tokenizer, text: str, *, source: str = "text") -> torch.Tensor:
    """Tokenize a whole text into one 1-D tensor of ids; an empty result is an error."""
    if not text or not text.strip():
        raise DataError(f"{source} is empty: give a text with at least a few sentences to evaluate on")
    ids = tokenize_bounded(tokenizer, text)  # in pieces: one long line is never tokenized whole
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
    scheme: str = "strided"

    def _window_stderr(self, sums: list[float]) -> float:
        """Standard error of the per-token mean from the spread of per-window means (nan with one window)."""
        per = [x / t for x, t in zip(sums, self.window_tokens)]
        n = len(per)
        if n < 2:
            return float("nan")
        m = sum(per) / n
        return math.sqrt(sum((v - m) ** 2 for v in per) / (n - 1) / n)

    @property
    def perplexity_stderr(self) -> float:
        """Delta method on exp(mean NLL): the text's own sampling noise at this budget."""
        return self.perplexity * self._window_stderr(self.window_nll)

    @property
    def kl_stderr(self) -> float | None:
        return self._window_stderr(self.window_kl) if self.window_kl else None

    def to_dict(self, windows: bool = False) -> dict:
        d = asdict(self)
        d["perplexity_stderr"], d["kl_stderr"] = self.perplexity_stderr, self.kl_stderr
        if not windows:
            for k in ("window_nll", "window_tokens", "window_kl", "window_top1"):
                d.pop(k)
        return d


@dataclass
class ReferenceOutputs:
    """A reference model's outputs on the scored positions, compact enough to keep for many comparisons.

    Not its log-probabilities (tokens x vocabulary: 14 GB for 23 k tokens of a Qwen vocabulary)
    but what they are computed from: the final hidden state of every scored token and the output
    layer's weight. Log-probabilities are rebuilt exactly, a chunk of tokens at a time.
    """

    ctx: int
    stride: int
    n_tokens: int
    hidden: list[torch.Tensor]  # one float32 [scored, hidden_size] tensor per window
    # the reference's own output layer, shared, not copied (steps that quantize build new modules and
    # never write into it); None when ``hidden`` holds logits
    head: nn.Module | None
    scheme: str = "strided"
    # bytes of log-probabilities kept between comparisons (``keep_log_probs``); 0: rebuilt every time
    keep_bytes: int = field(default=0, compare=False)
    _kept: dict = field(default_factory=dict, repr=False, compare=False)

    def logits(self, k: int, rows: slice = slice(None)) -> torch.Tensor:
        """Float32 logits of window ``k`` (the given rows of its scored tokens)."""
        return _logits(self.head, self.hidden[k][rows])

    def keep_log_probs(self, max_bytes: int) -> bool:
        """Keep the log-probabilities ``chunk_log_probs`` builds when all of them fit in ``max_bytes``.

        Many comparisons against one reference (a sweep's trials, a plan search's candidates) then
        pay for one output layer per evaluation, the candidate's, instead of two: a trial at the Qwen2.5-0.5B
        shape on 256 tokens takes 2.5 s instead of 3.0 on two threads, 3.7 s instead of 4.9 on one.
        Returns whether they are kept."""
        vocab = self._vocab()
        scored = sum(h.shape[0] for h in self.hidden)
        self.keep_bytes = max_bytes if vocab and scored * vocab * 4 <= max_bytes else 0
        return self.keep_bytes > 0

    def _vocab(self) -> int | None:
        if self.head is None:
            return self.hidden[0].shape[-1] if self.hidden else None
        return head_vocab(self.head)

    def chunk_log_probs(self, k: int, rows: slice) -> torch.Tensor:
        """Float32 log-probabilities of window ``k``'s ``rows``: the same every call, kept once built when
        ``keep_log_probs`` allowed it. Read-only: a kept tensor is handed to every caller."""
        key = (k, rows.start, rows.stop)
        kept = self._kept.get(key)
        if kept is not None:
            return kept
        lp = torch.log_softmax(self.logits(k, rows), dim=-1)
        if self.keep_bytes:  # keep_log_probs checked that every chunk together fits
            self._kept[key] = lp
        return lp

    def window_log_probs(self, k: int) -> torch.Tensor:
        """Log-probabilities of window ``k`` ([scored, vocab]); materialises one window, for small models."""
        return torch.log_softmax(self.logits(k), dim=-1)

    @property
    def log_probs(self) -> list[torch.Tensor]:
        return [self.window_log_probs(k) for k in range(len(self.hidden))]

    @property
    def nbytes(self) -> int:
        kept = sum(t.numel() * 4 for t in self._kept.values())
        return sum(h.numel() * 4 for h in self.hidden) + kept  # the head is the model's own tensor


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


# Architectures whose logits are exactly ``lm_head(final hidden state)``; others are checked once.
PLAIN_HEAD_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "phi3", "olmo2"})
HEAD_CHUNK_TOKENS = 256  # tokens x vocabulary float32 held at once: 156 MB for a 151,936-token vocabulary


def _logits(head: nn.Module | None, rows: torch.Tensor) -> torch.Tensor:
    """Float32 logits of hidden ``rows`` through ``head`` (a 16-bit or quantized head a slice at a time)."""
    return rows.float() if head is None else head_logits(head, rows)  # no head: the rows are logits already


class _PinnedHead(nn.Module):
    """A float output layer's weight and bias as they were at capture: a trial that reassigns the
    model's ``lm_head.weight`` cannot change the reference (the tensors are shared, not copied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()


def _pinned_head(head: nn.Module | None) -> nn.Module | None:
    if isinstance(head, nn.Linear):
        return _PinnedHead(head.weight, head.bias)
    return head  # a quantized head's codes are never reassigned in place


def _head(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError("the model has no output layer (get_output_embeddings() is None); it is not a causal LM")
    return head


def check_plain_head(model: nn.Module, ids: torch.Tensor) -> bool:
    """Whether ``model(ids).logits == lm_head(hidden)`` (no logit scaling or soft-capping)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PLAIN_HEAD_TYPES:
        return True
    device = next(model.parameters()).device
    x = ids[: min(8, len(ids))][None].to(device)
    full = model(input_ids=x, use_cache=False).logits.float()
    mine = _logits(_head(model), final_hidden(model, x)[0])[None]
    return bool(torch.allclose(full, mine, rtol=1e-4, atol=1e-4))


def _window_hidden(model: nn.Module, ids: torch.Tensor, batch: Sequence[Window]) -> list[torch.Tensor]:
    """Float32 final hidden states at the scored positions of each window (position j predicts j + 1)."""
    device = next(model.parameters()).device
    x = torch.stack([ids[w.begin:w.end] for w in batch]).to(device)
    h = final_hidden(model, x)
    return [row[w.score_from - w.begin - 1: w.end - w.begin - 1] for row, w in zip(h, batch)]


def _window_logits_full(model: nn.Module, ids: torch.Tensor, batch: Sequence[Window]) -> list[torch.Tensor]:
    """Float32 logits from the model's own forward (for heads that are not a plain linear layer)."""
    device = next(model.parameters()).device
    x = torch.stack([ids[w.begin:w.end] for w in batch]).to(device)
    logits = model(input_ids=x, use_cache=False).logits
    return [row[w.score_from - w.begin - 1: w.end - w.begin - 1].float() for row, w in zip(logits, batch)]


class _Scorer:
    """Per-token log-probabilities of one model, chunk by chunk: from hidden states and the head, or full logits."""

    def __init__(self, model: nn.Module, ids: torch.Tensor):
        self.model = model
        self.plain = check_plain_head(model, ids)
        self.head = _head(model) if self.plain else None

    def windows(self, ids, batch) -> list[torch.Tensor]:
        """Hidden states (plain head) or logits, one tensor per window."""
        return _window_hidden(self.model, ids, batch) if self.plain else _window_logits_full(self.model, ids, batch)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        return _logits(self.head, rows)


@torch.inference_mode()
def capture_reference(model: nn.Module, ids: torch.Tensor, *, ctx: int = DEFAULT_CTX, stride: int | None = None,
                      batch_size: int = 4, progress: bool = True, scheme: str = "strided") -> ReferenceOutputs:
    """Run the reference once and keep its final hidden states and output layer, for many comparisons."""
    from tqdm.auto import tqdm
    windows = eval_windows(len(ids), ctx, stride, scheme)
    scorer = _Scorer(model, ids)
    # logits that are not lm_head(hidden) are kept whole (head_weight None); only small models have such heads here

    hidden: list[torch.Tensor] = []
    with tqdm(total=len(windows), desc="reference", unit="win", disable=not progress, leave=False) as bar:
        for _, batch in _batches(windows, batch_size):
            hidden.extend(h.cpu().clone() for h in scorer.windows(ids, batch))
            bar.update(len(batch))
    return ReferenceOutputs(ctx, stride or ctx, len(ids), hidden, _pinned_head(scorer.head), scheme)


@torch.inference_mode()
def reference_report(reference: ReferenceOutputs, ids: torch.Tensor) -> EvalReport:
    """The reference's own per-window report (KL 0, top-1 1), read off its stored outputs without a forward pass."""
    ids = ids.reshape(-1).long()
    windows = eval_windows(len(ids), reference.ctx, reference.stride, reference.scheme)
    report = EvalReport(0.0, 0.0, 0, len(windows), reference.ctx, reference.stride, 0.0, 0.0, scheme=reference.scheme)
    t0 = time.perf_counter()
    for k, w in enumerate(windows):
        targets = ids[w.score_from:w.end]
        nll = 0.0
        for c in range(0, w.scored, HEAD_CHUNK_TOKENS):
            logits = reference.logits(k, slice(c, c + HEAD_CHUNK_TOKENS))
            nll += torch.nn.functional.cross_entropy(logits, targets[c:c + HEAD_CHUNK_TOKENS], reduction="sum").item()
        report.window_nll.append(nll)
        report.window_tokens.append(w.scored)
        report.window_kl.append(0.0)
        report.window_top1.append(w.scored)
    report.tokens = sum(report.window_tokens)
    report.nll = sum(report.window_nll) / report.tokens
    report.perplexity = report.reference_perplexity = math.exp(report.nll)
    report.kl_divergence, report.top1_agreement = 0.0, 1.0
    report.seconds = time.perf_counter() - t0
    report.tokens_per_second = report.tokens / report.seconds if report.seconds else float("inf")
    return report


def default_token_budget(model: nn.Module, n_tokens: int, ctx: int = DEFAULT_CTX) -> int:
    """Tokens to evaluate by default: the whole text on small models, a few whole windows on big ones.

    ``EVAL_BUDGET`` parameter-tokens (forward cost grows with both) rounded up to whole windows, never
    fewer than ``MIN_EVAL_WINDOWS`` windows: enough for the standard error that comes with every figure.
    """
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    budget = max(MIN_EVAL_WINDOWS * ctx, -(-int(EVAL_BUDGET // max(params, 1)) // ctx) * ctx)
    return min(n_tokens, budget + 1)  # + 1: the first token is never scored


EVAL_BUDGET = 1e12  # parameter-tokens: 2,048 tokens (4 windows) of a 0.5 B model, all 23 k bundled tokens of the demo
MIN_EVAL_WINDOWS = 4


@torch.inference_mode()
def evaluate(model: nn.Module, ids: torch.Tensor, *, reference: nn.Module | ReferenceOutputs | None = None,
             ctx: int = DEFAULT_CTX, stride: int | None = None, batch_size: int = 4, progress: bool = True,
             desc: str = "evaluate", scheme: str = "strided") -> EvalReport:
    """Perplexity of ``model`` on ``ids``; with ``reference``, also KL and top-1 agreement.

    Streams: per window the final hidden states, then the output layer a chunk of
    ``HEAD_CHUNK_TOKENS`` tokens at a time, so tokens x vocabulary is never held for the whole text.
    """
    from tqdm.auto import tqdm
    ids = ids.reshape(-1).long()
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_pos and ctx > max_pos:
        raise ValueError(f"ctx {ctx} exceeds the model's max_position_embeddings ({max_pos}); use --ctx {max_pos}")
    windows = eval_windows(len(ids), ctx, stride, scheme)
    stride = stride or ctx
    if isinstance(reference, ReferenceOutputs) and \
            (reference.ctx, reference.stride, reference.n_tokens, reference.scheme) != (ctx, stride, len(ids), scheme):
        raise ValueError("reference outputs were captured with another ctx/stride/scheme/text; capture them again")
    report = EvalReport(0.0, 0.0, 0, len(windows), ctx, stride, 0.0, 0.0, scheme=scheme)
    ref_nll = 0.0
    t0 = time.perf_counter()
    stored = reference if isinstance(reference, ReferenceOutputs) else None
    scorer = _Scorer(model, ids)
    ref_scorer = _Scorer(reference, ids) if isinstance(reference, nn.Module) else None
    with tqdm(total=len(windows), desc=desc, unit="win", disable=not progress, leave=False) as bar:
        for start, batch in _batches(windows, batch_size):
            rows = scorer.windows(ids, batch)
            if ref_scorer is not None:
                ref_rows = ref_scorer.windows(ids, batch)
            elif stored is not None:
                ref_rows = stored.hidden[start:start + len(batch)]
            for k, (row, w) in enumerate(zip(rows, batch)):
                targets_all = ids[w.score_from:w.end].to(row.device)
                nll = kl = 0.0
                top1 = 0
                for c in range(0, w.scored, HEAD_CHUNK_TOKENS):
                    sl = slice(c, c + HEAD_CHUNK_TOKENS)
                    logits, targets = scorer.logits(row[sl]), targets_all[sl]
                    if reference is None:
                        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
                        continue
                    lp = torch.log_softmax(logits, dim=-1)
                    del logits  # at most three chunk-sized tensors are alive at once
                    nll += -lp.gather(1, targets[:, None]).sum().item()
                    if ref_scorer is not None:
                        rlp = torch.log_softmax(ref_scorer.logits(ref_rows[k][sl]), dim=-1)
                    else:
                        rlp = stored.chunk_log_probs(start + k, sl)  # read-only: it may be kept
                    top1 += int((rlp.argmax(-1) == lp.argmax(-1)).sum().item())
                    ref_nll += -rlp.gather(1, targets[:, None]).sum().item()
                    diff = lp.neg_().add_(rlp)  # log p_ref - log p, in place
                    kl += diff.mul_(rlp.exp()).sum(-1).clamp_min(0).sum().item()
                    del lp, rlp, diff
                report.window_nll.append(nll)
                report.window_tokens.append(w.scored)
                if reference is not None:
                    report.window_kl.append(kl)
                    report.window_top1.append(top1)
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
    p = check_text_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"text file '{p}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise DataError(f"text file '{p}' is empty")
    return text


__all__.append("read_text")
