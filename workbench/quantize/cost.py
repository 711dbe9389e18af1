"""What quantization cost: perplexity and its change, KL and top-1 against the unquantized model.

    baseline = measure_reference(lm.model, ids)          # once per model and text
    cost = measure_cost(qm, baseline, saved_dir="out/demo-int4")
    cost.perplexity_change, cost.kl_divergence, cost.warnings

Every difference comes with the standard error of its per-window values (the same windows are
scored for both models), so a gap can be told apart from the text's own noise. Sizes come from
the saved files; bits per weight from the tensors as stored.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..evaluation.evaluate import (DEFAULT_CTX, EvalReport, ReferenceOutputs, capture_reference, default_token_budget,
                                   evaluate, mean_stderr, paired_difference, reference_report)
from ..evaluation.textio import text_token_ids
from .storage import weight_file_bytes
from ..assets import demo_text_path

__all__ = ["Baseline", "QuantCost", "measure_reference", "measure_cost", "heldout_ids", "check_ctx", "likely_causes",
           "DEFAULT_PPL_THRESHOLD"]

# a relative rise: practitioners' rule is 0.5 at perplexity ~10 (INT8 raises it 0.1-0.3; above 0.5, look for a
# cause), which an absolute threshold would misjudge at perplexity 4 or 4,000
DEFAULT_PPL_THRESHOLD = 0.05


def check_ctx(lm, ctx: int | None) -> int:
    """The evaluation window: ``ctx``, or DEFAULT_CTX capped at the model's positions when None.

    Refuses a window the model cannot take before any heavy work is spent.
    """
    max_pos = getattr(getattr(lm.model, "config", None), "max_position_embeddings", None)
    if ctx is None:
        return min(DEFAULT_CTX, max_pos) if max_pos else DEFAULT_CTX
    if ctx < 2 or (max_pos and ctx > max_pos):
        raise ValueError(f"--ctx {ctx} is out of range for this model: use 2 to {max_pos} (its "
                         "max_position_embeddings)" if max_pos else f"--ctx must be at least 2, got {ctx}")
    return ctx


def heldout_ids(lm, path: str | Path | None = None, max_tokens: int | str | None = None,
                ctx: int = DEFAULT_CTX) -> torch.Tensor:
    """Token ids of an evaluation text (default: the bundled held-out text of the demo model).

    ``max_tokens``: None for the whole text, a number, or ``"auto"`` for ``default_token_budget``
    (the whole text on small models, a few thousand tokens on 0.5 B and larger).
    """
    p = Path(path) if path else demo_text_path("heldout")
    if max_tokens == "auto":
        max_tokens = default_token_budget(lm.model, sys.maxsize, ctx)
    if max_tokens is not None and int(max_tokens) < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}")
    # read only as far as the budget: a text far larger than it is never read whole
    return text_token_ids(lm.tokenizer, p, None if max_tokens is None else int(max_tokens))


@dataclass
class Baseline:
    """The unquantized model's log-probs and its own per-window report on one text."""

    outputs: ReferenceOutputs
    report: EvalReport
    ids: torch.Tensor


def measure_reference(model: nn.Module, ids: torch.Tensor, *, ctx: int = DEFAULT_CTX, progress: bool = True,
                      scheme: str = "strided") -> Baseline:
    """Run the reference once; every candidate is then compared on exactly these windows.

    The reference's own per-window report is read off its captured outputs (no second pass).
    """
    t0 = time.perf_counter()
    outputs = capture_reference(model, ids, ctx=ctx, progress=progress, scheme=scheme)
    report = reference_report(outputs, ids)
    report.seconds = time.perf_counter() - t0
    report.tokens_per_second = report.tokens / report.seconds if report.seconds else float("inf")
    return Baseline(outputs, report, ids)


@dataclass
class QuantCost:
    """Measured cost of one quantized model against its reference."""

    perplexity: float
    reference_perplexity: float
    perplexity_change: float
    perplexity_change_relative: float
    perplexity_change_stderr: float
    nll_difference: float  # mean per-token log-perplexity difference (candidate - reference)
    nll_difference_stderr: float
    kl_divergence: float
    kl_divergence_stderr: float
    top1_agreement: float
    top1_agreement_stderr: float
    bits_per_weight: float
    weight_bytes: int  # layer weights as stored
    size_bytes: int | None  # weight files on disk, when saved
    tokens: int
    windows: int
    ctx: int
    warnings: list[str] = field(default_factory=list)
    report: EvalReport | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("report")
        return d


def likely_causes(qm, cost: "QuantCost") -> list[str]:
    """Specific reasons a quantized model may have lost more than the threshold, worst first."""
    causes = []
    int4 = [r for r in qm.layers if r.precision == "int4"]
    worst = sorted((r for r in qm.layers if r.weight_error is not None), key=lambda r: -r.weight_error)[:3]
    if worst:
        causes.append("layers with the largest weight error: " + ", ".join(
            f"{r.name} ({r.precision}, {r.weight_error:.3f})" for r in worst) + "; keep them at int8 or fp16")
    if any(r.kind == "embedding" or r.name.endswith("lm_head") for r in qm.layers if r.name in qm.weights):
        causes.append("the embedding / lm_head is quantized; these are often the most sensitive: keep them fp16")
    if int4 and qm.method == "rtn":
        causes.append("4-bit round-to-nearest: try method 'gptq' or 'awq' with a calibration set from the real inputs")
    if int4 and qm.method != "rtn":
        causes.append(f"{qm.method.upper()} calibration may not match the evaluation text (domain, language mix); check its coverage")
    if qm.plan.group_size is None or (qm.plan.group_size or 0) > 128:
        causes.append(f"group size {qm.plan.group_size or 'per-channel'} is coarse: try 128 or 64")
    per_channel = [r.name for r in qm.layers if r.fallback and r.group_size is None]
    if per_channel:
        causes.append(f"{len(per_channel)} layer(s) fell back to per-channel scales (e.g. {per_channel[0]})")
    if cost.top1_agreement < 0.9:
        causes.append(f"top-1 agreement is only {cost.top1_agreement:.1%}: the model's predictions changed, "
                      "not only its confidence")
    return causes


def measure_cost(qm, baseline: Baseline, *, candidate: nn.Module | None = None, saved_dir: str | Path | None = None,
                 threshold: float = DEFAULT_PPL_THRESHOLD, progress: bool = True) -> QuantCost:
    """Evaluate the quantized model against ``baseline`` on the same text and windows; a warning naming likely causes
    when perplexity rose by more than ``threshold`` (a fraction of the float model's).

    ``candidate`` is a model computing the quantized weights; by default ``qm.build_model()``, which
    shares the source's unchanged tensors and holds integer layers as codes (no second float copy).
    """
    if candidate is None:
        candidate = qm.build_model()
    ref = baseline.report
    rep = evaluate(candidate, baseline.ids, reference=baseline.outputs, ctx=ref.ctx, stride=ref.stride,
                   progress=progress, desc="quantized", scheme=ref.scheme)
    d_nll = paired_difference(rep, ref, "nll")
    d_kl = paired_difference(rep, ref, "kl")
    top1 = [t / n for t, n in zip(rep.window_top1, rep.window_tokens)]
    ref_ppl = ref.perplexity
    cost = QuantCost(
        perplexity=rep.perplexity, reference_perplexity=ref_ppl,
        perplexity_change=rep.perplexity - ref_ppl, perplexity_change_relative=rep.perplexity / ref_ppl - 1,
        perplexity_change_stderr=rep.perplexity * d_nll["stderr"],  # delta method on exp(mean nll)
        nll_difference=d_nll["mean"], nll_difference_stderr=d_nll["stderr"],
        kl_divergence=rep.kl_divergence, kl_divergence_stderr=d_kl["stderr"],
        top1_agreement=rep.top1_agreement, top1_agreement_stderr=mean_stderr(top1),
        bits_per_weight=qm.bits_per_weight, weight_bytes=qm.storage_bytes(),
        size_bytes=weight_file_bytes(saved_dir) if saved_dir else None,
        tokens=rep.tokens, windows=rep.windows, ctx=rep.ctx, report=rep)
    if cost.perplexity_change_relative > threshold:
        cost.warnings.append(f"perplexity rose by {cost.perplexity_change:.3f} ({cost.perplexity_change_relative:+.1%} "
                             f"of the float model's {ref_ppl:.3f} on {rep.tokens:,} tokens), above the {threshold:.0%} "
                             "threshold. Likely causes: " + "; ".join(likely_causes(qm, cost)))
    return cost
