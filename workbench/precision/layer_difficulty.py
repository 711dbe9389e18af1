"""Why a layer is hard to quantize: each layer's damage beside the traits that explain it.

    rows = layer_difficulty(lm, report, stats)        # report: a sensitivity sweep; stats: calibration statistics
    rows[0].why                                       # ["input outlier channels (max/median 212x)", "first block"]
    summary = difficulty_summary(rows)                # rank correlations, the share of damage by place
    make_difficulty_figure(rows)                      # damage by block, and against the input outliers

A sensitivity sweep says how much each layer's rounding costs; this says why. Per layer, from the float
weights and the calibration statistics of its input:

* input outliers: the largest input channel's abs-max over the median channel's (``max_to_median``): a few
  channels that carry huge activations make every weight in their columns matter more, and GPTQ / the
  importance weighting exist for them;
* heavy-tailed weights: the weight's largest magnitude over its RMS and its excess kurtosis: a group's scale is
  set by its largest weight, so the bulk loses levels;
* place: the first and last blocks (which a trained model leans on: they read raw embeddings and write the
  logits' basis), the embedding (one row per token, no averaging over inputs) and the output layer.

A trait is named in ``why`` where the layer's value is at least ``TRAIT_FACTOR`` times the model's median
for that trait (and for place, always), so the list reads as "what stands out here".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import torch

__all__ = ["LayerDifficulty", "layer_difficulty", "difficulty_summary", "TRAIT_FACTOR", "TRAITS"]

TRAIT_FACTOR = 2.0  # a trait is named when the layer's value is this many times the model's median
# trait -> (label, format of its value)
TRAITS = {
    "input_max_to_median": ("input outlier channels (max/median {:.0f}x)", "{:.1f}"),
    "weight_max_to_rms": ("heavy-tailed weights (max/RMS {:.0f})", "{:.1f}"),
    "weight_kurtosis": ("weight kurtosis {:.0f}", "{:.1f}"),
}


@dataclass
class LayerDifficulty:
    """One layer's damage at a precision and its traits (None where the statistics do not cover it)."""

    name: str
    role: str
    block: int | None  # decoder block index; None for the embedding and the output layer
    damage: float  # KL (nats/token) of this layer alone at ``precision`` (measured or estimated: the report's)
    share: float  # of the summed damage of every layer
    input_max_to_median: float | None
    weight_max_to_rms: float
    weight_kurtosis: float
    why: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _block_index(block: str) -> int | None:
    """The decoder block index of a layer's ``LayerInfo.block`` (``layers.3`` -> 3); None outside the blocks."""
    head, _, index = block.partition(".")
    return int(index) if head == "layers" and index.isdigit() else None


def _weight_traits(w: torch.Tensor) -> tuple[float, float]:
    """(max |w| / RMS, excess kurtosis) of a weight, in float64 over every element."""
    w = w.detach().to(torch.float64).reshape(-1)
    rms = float(w.square().mean().sqrt())
    centred = w - w.mean()
    var = float(centred.square().mean())
    kurt = float(centred.pow(4).mean()) / var ** 2 - 3.0 if var > 0 else 0.0
    return (float(w.abs().max()) / rms if rms > 0 else 0.0), kurt


def _median(values: Sequence[float]) -> float:
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return float("nan")
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


def layer_difficulty(lm, report, stats=None, precision: str = "int4") -> list[LayerDifficulty]:
    """Every layer of ``report`` (a ``SensitivityReport`` or its dict) with its damage at ``precision`` and the
    traits that explain it, hardest first. ``stats`` (``CalibrationStats``) adds the input outliers."""
    data = report if isinstance(report, Mapping) else report.to_dict()
    modules = dict(lm.model.named_modules())
    blocks = [b for b in (_block_index(x["block"]) for x in data["layers"]) if b is not None]
    last = max(blocks) if blocks else None
    rows = []
    for layer in data["layers"]:
        dmg = layer["damage"].get(precision)
        if dmg is None or layer.get("tied_to"):
            continue
        name = layer["name"]
        w = modules[name].weight
        wmax, wkurt = _weight_traits(w)
        s = stats.layers.get(name) if stats is not None else None
        ratio = s.max_to_median if s is not None and math.isfinite(s.max_to_median) else None
        rows.append(LayerDifficulty(name, layer["role"], _block_index(layer["block"]), float(dmg["kl"]), 0.0, ratio,
                                    wmax, wkurt))
    total = sum(max(r.damage, 0.0) for r in rows) or 1.0
    medians = {t: _median([getattr(r, t) for r in rows if r.block is not None]) for t in TRAITS}
    for r in rows:
        r.share = max(r.damage, 0.0) / total
        for trait, (label, _fmt) in TRAITS.items():
            v = getattr(r, trait)
            if v is not None and math.isfinite(medians[trait]) and medians[trait] > 0 and \
                    v >= TRAIT_FACTOR * medians[trait]:
                r.why.append(label.format(v))
        if r.block is None:
            r.why.append("the embedding: one row per token, read without averaging over inputs"
                         if "embed" in r.role else "the output layer: writes every logit")
        elif r.block == 0:
            r.why.append("first block")
        elif r.block == last:
            r.why.append("last block")
    return sorted(rows, key=lambda r: -r.damage)


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (``workbench.precision.proxy``'s); None for fewer than three pairs or a constant side."""
    from .proxy import spearman as rank_correlation
    if len(a) < 3:
        return None
    r = rank_correlation(a, b)
    return None if math.isnan(r) else r


def difficulty_summary(rows: Sequence[LayerDifficulty]) -> dict:
    """What the rows say as a whole: each trait's rank correlation with the damage over the block layers, the
    share of damage in the first and last blocks, the embedding and the output layer (against their share of
    the layers), and the damage by role."""
    inside = [r for r in rows if r.block is not None]
    out = {"layers": len(rows), "correlation": {}}
    for trait in TRAITS:
        pairs = [(getattr(r, trait), r.damage) for r in inside if getattr(r, trait) is not None]
        out["correlation"][trait] = spearman([p[0] for p in pairs], [p[1] for p in pairs])
    last = max((r.block for r in inside), default=None)
    places = {"first block": [r for r in inside if r.block == 0],
              "last block": [r for r in inside if r.block == last and last != 0],
              "embedding": [r for r in rows if r.block is None and "embed" in r.role],
              "output layer": [r for r in rows if r.block is None and "embed" not in r.role]}
    out["places"] = {k: {"share": sum(r.share for r in v), "layers": len(v)} for k, v in places.items() if v}
    roles: dict[str, float] = {}
    for r in inside:
        roles[r.role] = roles.get(r.role, 0.0) + r.share
    out["roles"] = dict(sorted(roles.items(), key=lambda kv: -kv[1]))
    return out
