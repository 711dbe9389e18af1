"""What every chart shares so that it reads the same and does not mislead: axis spans, log ticks, colours.

    fig.update_yaxes(**log_axis(values))        # ticks at powers of ten only, written 10^-3, at least one decade
    fig.update_yaxes(range=linear_range(values))  # None, or a span that a near-constant series cannot zoom below

A one-point (or nearly constant) series left to plotly's autorange fills the plot: 0.00338 and 0.00356
then look far apart. A log axis over less than a decade gets minor labels ("5, 2, 0.001, 5, 2") unless
its ticks are pinned to the decades. ``workbench.charts.checks`` tests each figure for both.
"""
from __future__ import annotations

import math
import re
from typing import Iterable

__all__ = ["log_axis", "lift_subplot_titles", "linear_range", "EDGE_DECADES", "MIN_RELATIVE_SPAN", "KIND_COLOURS",
           "METRIC_WORDS", "JUDGEMENT_COLOURS", "PRECISION_COLOURS", "CATEGORY_COLOURS", "MEASURED_COLOUR",
           "precision_colour"]

# what the quality figures mean, in one line each: shown beside every table and chart of them (app and report), so a
# reader who does not know the terms is not left with "KL 3.4e-03 nats"
METRIC_WORDS = {
    "KL": "KL divergence: how far the model's next-token probabilities are from the float model's, averaged over "
          "the text (0: the same; below 0.01 is usually hard to notice)",
    "nats": "nats/token: the unit of KL (natural-log based, as perplexity's log is)",
    "top-1": "top-1 agreement: the share of tokens where the model's most likely next token is the float "
             "model's (1.000: always)",
    "perplexity": "perplexity: how surprised the model is by the text (lower is better); only comparable on the "
                  "same text and token count",
}

EDGE_DECADES = 0.08  # a log axis reaches this far past its first and last labelled decade
MIN_RELATIVE_SPAN = 0.2  # a linear axis spans at least this fraction of its largest value
# One meaning per colour across the tabs. Green / orange / red judge: least / middling / most damage (the
# Precisions bars), and red alone a problem (a GAP, a plan that does not fit, no vendor fit). Nothing else wears
# them: on one tab red meant "most sensitive layer" beside a red "custom plan" point, on the next "INT4".
JUDGEMENT_COLOURS = {"good": "#2ca02c", "middle": "#ff7f0e", "bad": "#d62728"}
# one colour per kind of point, the same in every chart that shows that kind (Precisions, Compress, Project)
KIND_COLOURS = {"uniform": "#1f77b4", "auto": "#17becf", "custom": "#e377c2", "pruned": "#9467bd",
                "quantized": "#8c564b", "float": "#7f7f7f"}
# a precision by its width, one blue ramp: the fewer bits, the darker (Quantize's per-layer error bars)
PRECISION_COLOURS = {"int2": "#08306b", "int3": "#08519c", "int4": "#2171b5", "int5": "#4292c6", "int6": "#6baed6",
                     "int8": "#9ecae1", "fp16": "#bcbddc", "fp32": "#756bb1"}
# categories with no order (plans on the Project charts), none of them a judgement colour
CATEGORY_COLOURS = ("#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#7f7f7f", "#393b79",
                    "#637939")
MEASURED_COLOUR = "#1f77b4"  # a measured speed beside its bound or its projection


def precision_colour(name: str | None) -> str:
    """``PRECISION_COLOURS[name]``; a precision named otherwise (a two-level or float-minimum layout) by its
    width's colour when the name carries one, else a grey; ``None`` (left unchanged) a light grey."""
    if name is None:
        return "#d9d9d9"
    if name in PRECISION_COLOURS:
        return PRECISION_COLOURS[name]
    width = re.search(r"(\d+)", name)
    return PRECISION_COLOURS.get(f"int{width.group(1)}", "#969696") if width else "#969696"


def log_axis(values: Iterable[float], pad: float = 0.15) -> dict:
    """Settings for a log axis over ``values`` (positive ones): ticks at each power of ten written as a power,
    a range of at least one whole decade around them (so at least two ticks show)."""
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    settings = {"type": "log", "dtick": 1, "exponentformat": "power", "minor": {"showgrid": False}}
    if not vals:
        return settings
    lo, hi = math.log10(min(vals)) - pad, math.log10(max(vals)) + pad
    lo, hi = math.floor(lo), max(math.ceil(hi), math.floor(lo) + 1)
    # the end decades' ticks sit a little inside the plot, so their labels (10 with a raised exponent) are not
    # cut by the plot's edge or run into a subplot title above it
    return {**settings, "range": [lo - EDGE_DECADES, hi + EDGE_DECADES]}


def lift_subplot_titles(fig, pixels: int = 12):
    """Raise ``make_subplots``' titles off their plots' top edge, where a top tick label would run into them."""
    for note in fig.layout.annotations or ():
        if note.yref == "paper" and note.yanchor == "bottom":
            note.yshift = pixels
    return fig


def linear_range(values: Iterable[float], min_relative_span: float = MIN_RELATIVE_SPAN) -> list[float] | None:
    """A range for a linear axis whose values sit closer together than ``min_relative_span`` of their size
    (None when they are spread enough for plotly's own autorange): centred on them, that span wide."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    lo, hi = min(vals), max(vals)
    size = max(abs(lo), abs(hi))
    need = min_relative_span * size if size > 0 else 1.0
    if hi - lo >= need:
        return None
    mid = (lo + hi) / 2
    return [mid - need / 2 - 0.05 * need, mid + need / 2 + 0.05 * need]
