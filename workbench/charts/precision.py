"""Figures for per-layer precision: sensitivity bars and the size-vs-damage Pareto chart.

    make_sensitivity_figure(report, precision="int4", by="block")   # bars per block, one colour per layer type
    make_sensitivity_figure(report, precision="int4", by="role")    # bars per layer type, one colour per block
    make_pareto_figure(points)                                      # KL and perplexity against bits/weight
"""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["make_sensitivity_figure", "make_pareto_figure"]

_METRIC_TITLES = {"kl": "KL divergence to the float model (nats/token)", "ppl_delta": "perplexity change",
                  "nll_delta": "log-perplexity change"}


def _as_dict(obj) -> Mapping:
    return obj if isinstance(obj, Mapping) else obj.to_dict()


def make_sensitivity_figure(report, precision: str = "int4", metric: str = "kl", by: str = "block",
                            log_y: bool = True) -> go.Figure:
    """Damage of each layer quantized alone, grouped by ``block`` (colour = layer type) or by ``role``."""
    data = _as_dict(report)
    if by not in ("block", "role"):
        raise ValueError(f"by must be 'block' or 'role', not {by!r}")
    other = "role" if by == "block" else "block"
    layers = data["layers"]
    groups: list[str] = []
    series: dict[str, dict[str, float]] = {}
    names: dict[str, dict[str, str]] = {}
    for layer in layers:
        dmg = layer["damage"].get(precision)
        if dmg is None:
            continue
        x, colour = layer[by], layer[other]
        if x not in groups:
            groups.append(x)
        series.setdefault(colour, {})[x] = max(float(dmg[metric]), 1e-12) if log_y else float(dmg[metric])
        names.setdefault(colour, {})[x] = layer["name"]
    fig = go.Figure()
    for colour, values in series.items():
        xs = [g for g in groups if g in values]
        fig.add_bar(name=colour, x=xs, y=[values[g] for g in xs], customdata=[names[colour][g] for g in xs],
                    hovertemplate="%{customdata}<br>%{y:.3g}<extra></extra>")
    estimated = data.get("score", "kl") == "proxy"  # damages estimated in one pass, not measured per layer
    how = "estimated by the Fisher proxy" if estimated else "measured"
    y_title = _METRIC_TITLES.get(metric, metric)
    fig.update_layout(barmode="group", title=f"Sensitivity at {precision}: each layer quantized alone, {how} "
                      f"({data.get('tokens', '?')} tokens)", xaxis_title=by,
                      yaxis_title=f"estimated {y_title}" if estimated else y_title,
                      legend_title=other, template="plotly_white", height=420)
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def make_pareto_figure(points: Sequence, x: str = "bits_per_weight") -> go.Figure:
    """KL divergence and perplexity against size (``bits_per_weight`` or ``size_bytes``), measured and predicted."""
    if x not in ("bits_per_weight", "size_bytes"):
        raise ValueError(f"x must be 'bits_per_weight' or 'size_bytes', not {x!r}")
    rows = [_as_dict(p) for p in points]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KL divergence (lower is better)", "perplexity"))
    kinds = {}
    for r in rows:
        label = r.get("label", "")
        kind = "uniform" if label.startswith("uniform") else "auto" if label.startswith("auto") else \
            "pruned" if label.startswith("pruned") else "custom"
        kinds.setdefault(kind, []).append(r)
    symbols = {"uniform": "square", "auto": "circle", "custom": "diamond", "pruned": "star"}
    for kind, rs in kinds.items():
        rs = sorted(rs, key=lambda r: r[x])
        xs = [r[x] for r in rs]
        text = [r.get("label", "") for r in rs]
        mode = "lines+markers+text" if kind == "auto" else "markers+text"
        for col, key in ((1, "kl_divergence"), (2, "perplexity")):
            fig.add_trace(go.Scatter(x=xs, y=[r[key] for r in rs], mode=mode, name=kind, legendgroup=kind,
                                     showlegend=col == 1, text=text, textposition="top center",
                                     marker={"symbol": symbols[kind], "size": 10}), row=1, col=col)
        pred = [(r[x], r.get("predicted_kl"), r.get("predicted_perplexity")) for r in rs
                if r.get("predicted_kl") is not None]
        if pred and kind != "uniform":
            for col, idx in ((1, 1), (2, 2)):
                fig.add_trace(go.Scatter(x=[p[0] for p in pred], y=[p[idx] for p in pred], mode="markers",
                                         name=f"{kind} (predicted)", legendgroup=f"{kind}-pred", showlegend=col == 1,
                                         marker={"symbol": "circle-open", "size": 12}), row=1, col=col)
    title_x = "bits per weight" if x == "bits_per_weight" else "size (bytes)"
    fig.update_xaxes(title_text=title_x)
    fig.update_yaxes(title_text="KL (nats/token)", type="log", row=1, col=1)
    fig.update_yaxes(title_text="perplexity", row=1, col=2)
    fig.update_layout(title="Size against damage: uniform plans and automatic plans", template="plotly_white",
                      height=420)
    return fig
