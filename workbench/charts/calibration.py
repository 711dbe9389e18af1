"""Figures for calibration: what the activations look like, and what the calibration set covered.

    make_layer_overview_figure(stats, sort_by="outlier_ratio")   # one row per layer
    make_channel_magnitude_figure(stats["model.layers.0.mlp.down_proj"])
    make_stat_heatmap_figure(stats)                              # layer x statistic
    make_token_length_figure(calib_set.report)                   # coverage histogram
    make_near_zero_figure(stats, parts=layer_parts(lm))          # near-zero inputs per layer, by VLM part

Pure functions: statistics in, ``plotly.graph_objects.Figure`` out.
"""
from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..model.calibrate import NEAR_ZERO_DIVISOR

__all__ = ["make_layer_overview_figure", "make_channel_magnitude_figure", "make_stat_heatmap_figure",
           "make_token_length_figure", "make_near_zero_figure", "PART_COLORS", "SORT_KEYS", "HEATMAP_STATISTICS",
           "STAT_WORDS", "layer_order"]

# sort key -> (label, value of a LayerStats); larger values come first
SORT_KEYS = {
    "outlier_ratio": ("outlier channels (%)", lambda s: s.outlier_ratio),
    "max_to_median": ("max / median channel", lambda s: s.max_to_median),
    "kurtosis": ("kurtosis", lambda s: s.kurtosis),
    "abs_max": ("abs-max", lambda s: s.abs_max_value),
    "near_zero_fraction": ("near-zero fraction", lambda s: s.near_zero_fraction),
}
HEATMAP_STATISTICS = ("abs_max", "p99.9", "p99", "mean_abs", "std", "kurtosis", "max_to_median", "outlier_ratio",
                      "near_zero_fraction")
# the heat map's column headings in words (the field names read "abs_max", "max_to_median", "near_zero_fraction")
STAT_WORDS = {"abs_max": "largest |x|", "p99.9": "|x| at 99.9%", "p99": "|x| at 99%", "p50": "median |x|",
              "mean_abs": "mean |x|", "std": "spread (std)", "kurtosis": "kurtosis (tails)",
              "max_to_median": "max / median channel", "outlier_ratio": "outlier channels",
              "near_zero_fraction": "near-zero share"}
FATE_COLORS = {"sampled": "#2a9d8f", "unused": "#a8dadc", "too_short": "#f4a261", "too_long": "#e76f51",
               "empty": "#6c757d"}
PART_COLORS = {"vision encoder": "#2a9d8f", "projector": "#e9c46a", "language model": "#264653"}
NEAR_ZERO_RULE = f"|x| < abs-max / {NEAR_ZERO_DIVISOR:g}"  # what per-tensor symmetric INT8 rounds to 0
FATE_LABELS = {"sampled": "sampled", "unused": "usable, not drawn", "too_short": "dropped: too short",
               "too_long": "dropped: too long", "empty": "dropped: empty"}


def _short(name: str) -> str:
    return name.removeprefix("model.").replace("self_attn.", "attn.")


def layer_order(stats, sort_by: str = "outlier_ratio") -> list[str]:
    """Layer names in display order: by ``sort_by`` descending (ties in module order), or module order."""
    names = list(stats.layers)
    if sort_by in ("order", "name", None):
        return names
    if sort_by not in SORT_KEYS:
        raise ValueError(f"unknown sort key {sort_by!r}; use one of {', '.join(['order', *SORT_KEYS])}")
    key = SORT_KEYS[sort_by][1]
    return sorted(names, key=lambda n: (-key(stats.layers[n]), names.index(n)))


def _stat_value(s, name: str) -> float:
    if name in s.percentiles:
        return s.percentiles[name]
    if name == "abs_max":
        return s.abs_max_value
    if name == "mean_abs":
        return float(s.mean_abs.mean())
    return float(getattr(s, name))


def make_layer_overview_figure(stats, sort_by: str = "outlier_ratio") -> go.Figure:
    """One row per layer: the distribution of log10 |x| (share of values per bin) and its outlier ratio."""
    order = layer_order(stats, sort_by)
    edges = stats.hist_edges
    centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    z, hover = [], []
    for n in order:
        counts = stats.layers[n].hist_counts.double()
        total = float(counts.sum()) or 1.0
        z.append((counts / total).tolist())
    labels = [_short(n) for n in order]
    ratios = [100 * stats.layers[n].outlier_ratio for n in order]
    for n in order:
        s = stats.layers[n]
        hover.append(f"{n}<br>outlier channels {len(s.outlier_channels)}/{s.in_features}<br>max/median "
                     f"{s.max_to_median:.1f}<br>kurtosis {s.kurtosis:.2f}<br>abs-max {s.abs_max_value:.3g}"
                     f"<br>near zero ({NEAR_ZERO_RULE}) {s.near_zero_fraction:.1%}")
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.75, 0.25], horizontal_spacing=0.02,
                        subplot_titles=("distribution of |x| (share of values)", "outlier channels (%)"))
    fig.add_trace(go.Heatmap(z=z, x=centers, y=labels, colorscale="Viridis", colorbar=dict(title={"text": "share of<br>values", "side": "top"},
                                                                    x=1.02, thickness=14),
                             hovertemplate="%{y}<br>|x| ~ 10^%{x:.2f}<br>share %{z:.3f}<extra></extra>"), 1, 1)
    fig.add_trace(go.Bar(x=ratios, y=labels, orientation="h", marker_color="#e76f51", hovertext=hover,
                         hoverinfo="text", name="outlier channels"), 1, 2)
    if not any(ratios):  # an empty panel on a -1..1 axis read as broken: say there are none
        fig.update_xaxes(range=[0, 1], row=1, col=2)
        fig.add_annotation(text=f"no outlier channels<br>in any of {len(order)} layers", showarrow=False,
                           xref="x2 domain", yref="y2 domain", x=0.5, y=0.5, font={"color": "#5d6d7e"})
    tick_vals = [v for v in range(math.ceil(edges[0]), math.floor(edges[-1]) + 1)]
    fig.update_xaxes(tickvals=tick_vals, ticktext=[f"1e{v}" for v in tick_vals], title_text="|x|", row=1, col=1)
    fig.update_xaxes(title_text="% of input channels", row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    sort_label = SORT_KEYS[sort_by][0] if sort_by in SORT_KEYS else "module order"
    fig.update_layout(title=f"Linear-layer inputs over the calibration set, sorted by {sort_label}",
                      height=160 + 18 * len(order), showlegend=False, margin=dict(l=10, r=90, t=70, b=40))
    return fig


def make_channel_magnitude_figure(layer) -> go.Figure:
    """Per input channel of one layer: abs-max and mean |x|, the median and the outlier threshold."""
    n = layer.in_features
    channels = list(range(n))
    abs_max = layer.abs_max.tolist()
    med = layer.median_channel_max
    threshold = layer.outlier_factor * med
    outliers = layer.outlier_channels
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=channels, y=abs_max, mode="lines", name="abs-max", line=dict(color="#264653")))
    fig.add_trace(go.Scatter(x=channels, y=layer.mean_abs.tolist(), mode="lines", name="mean |x|",
                             line=dict(color="#2a9d8f")))
    fig.add_trace(go.Scatter(x=outliers, y=[abs_max[c] for c in outliers], mode="markers", name="outlier channel",
                             marker=dict(color="#e76f51", size=8)))
    fig.add_hline(y=med, line_dash="dot", line_color="#6c757d", annotation_text=f"median abs-max {med:.3g}")
    fig.add_hline(y=threshold, line_dash="dash", line_color="#e76f51",
                  annotation_text=f"outlier threshold {layer.outlier_factor:g} x median")
    fig.update_layout(title=f"{layer.name}: {len(outliers)} outlier channel(s) of {n}, max/median "
                            f"{layer.max_to_median:.1f}", xaxis_title="input channel", yaxis_title="|x|",
                      yaxis_type="log" if layer.max_to_median > 20 else "linear", height=380,
                      margin=dict(l=10, r=10, t=60, b=40))
    return fig


def make_stat_heatmap_figure(stats, statistics=HEATMAP_STATISTICS, sort_by: str = "order") -> go.Figure:
    """Layer x statistic; colour is the value relative to that statistic's range, the text is the value."""
    order = layer_order(stats, sort_by)
    raw = [[_stat_value(stats.layers[n], c) for c in statistics] for n in order]
    z = [[0.0] * len(statistics) for _ in order]
    for j in range(len(statistics)):
        col = [row[j] for row in raw if math.isfinite(row[j])]
        lo, hi = (min(col), max(col)) if col else (0.0, 1.0)
        for i, row in enumerate(raw):
            v = row[j]
            z[i][j] = (v - lo) / (hi - lo) if hi > lo and math.isfinite(v) else 0.0
    text = [[f"{v:.3g}" for v in row] for row in raw]
    fig = go.Figure(go.Heatmap(z=z, x=[STAT_WORDS.get(c, c) for c in statistics], y=[_short(n) for n in order], text=text,
                               texttemplate="%{text}", colorscale="Blues", zmin=0, zmax=1,
                               colorbar=dict(title="within<br>column"),
                               hovertemplate="%{y}<br>%{x} = %{text}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title="Activation statistics per layer (colour: relative to the column's range)",
                      height=160 + 18 * len(order), margin=dict(l=10, r=10, t=60, b=40))
    return fig


def make_near_zero_figure(stats, parts: dict[str, str] | None = None, sort_by: str = "order") -> go.Figure:
    """Per layer, the share of its inputs near zero (``NEAR_ZERO_RULE``: what symmetric INT8 rounds to 0), one
    bar each, coloured by the part it belongs to (``parts``: layer -> vision encoder / projector / language model,
    ``workbench.model.vision_quality.layer_parts``; one colour without it). Sparse inputs (after a GELU or a gated
    SiLU) are where a per-tensor activation grid wastes its levels."""
    order = layer_order(stats, sort_by)
    parts = parts or {}
    fig = go.Figure()
    groups = list(dict.fromkeys(parts.get(n, "layers") for n in order))
    for group in groups:
        names = [n for n in order if parts.get(n, "layers") == group]
        fig.add_trace(go.Bar(
            x=[100 * stats.layers[n].near_zero_fraction for n in names], y=[_short(n) for n in names],
            orientation="h", name=group, marker_color=PART_COLORS.get(group, "#e76f51"),
            hovertext=[f"{n}<br>{group}<br>near zero {stats.layers[n].near_zero_fraction:.1%} of "
                       f"{stats.layers[n].tokens:,} rows x {stats.layers[n].in_features} inputs" for n in names],
            hoverinfo="text"))
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=[_short(n) for n in order])
    fig.update_xaxes(title_text=f"% of inputs near zero ({NEAR_ZERO_RULE})", range=[0, 100])
    fig.update_layout(title="Near-zero inputs per layer" + (" by part" if parts else ""), barmode="overlay",
                      height=160 + 18 * len(order), showlegend=len(groups) > 1, margin=dict(l=10, r=10, t=60, b=40))
    return fig


def make_token_length_figure(report, bins: int = 16) -> go.Figure:
    """Token lengths of every piece of the calibration text, stacked by what became of it."""
    d = report.to_dict() if hasattr(report, "to_dict") else report  # a CoverageReport or its to_dict()
    hist = report.histogram(bins) if hasattr(report, "histogram") else d["histogram"]
    edges = hist["edges"]
    labels = [f"{a}-{b - 1}" for a, b in zip(edges[:-1], edges[1:])] + [f"> {hist['overflow_from']}"]
    fig = go.Figure()
    for fate, counts in hist["counts"].items():
        fig.add_trace(go.Bar(x=labels, y=counts, name=FATE_LABELS.get(fate, fate),
                             marker_color=FATE_COLORS.get(fate)))
    dropped = sum(x["pieces"] for x in d["dropped"].values())
    fig.update_layout(barmode="stack", xaxis_title="tokens per piece", yaxis_title="pieces",
                      title=f"Calibration coverage: {d['samples']} samples, {d['tokens']:,} tokens kept, "
                            f"{dropped} piece(s) dropped",
                      height=360, margin=dict(l=10, r=10, t=60, b=40))
    return fig
