"""Figures for per-layer precision: sensitivity bars and the size-vs-damage Pareto chart.

    make_sensitivity_figure(report, precision="int4", by="block")   # bars per block, one colour per layer type
    make_sensitivity_figure(report, precision="int4", by="role")    # bars per layer type, one colour per block
    make_pareto_figure(points)                                      # KL and perplexity against bits/weight
    make_difficulty_figure(layer_difficulty(lm, report, stats))     # why: damage by block, against input outliers
"""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..units import format_bytes
from .style import CATEGORY_COLOURS, KIND_COLOURS, lift_subplot_titles, linear_range, log_axis

__all__ = ["make_sensitivity_figure", "make_pareto_figure", "make_difficulty_figure", "point_kind", "evaluation_of"]

_PALETTE = CATEGORY_COLOURS  # one colour per layer type, none of them a judgement colour
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


def point_kind(label: str) -> str:
    """The kind of a Pareto point by its label: float (the unquantized model), uniform, auto, pruned or custom
    (a plan chosen by hand)."""
    if label == "float" or label.startswith("float "):
        return "float"
    for kind in ("uniform", "auto", "pruned"):
        if label.startswith(kind):
            return kind
    return "custom"


def evaluation_of(point: Mapping) -> str | None:
    """What a measured point was scored on (``evaluation``, else its token count), None when it does not say:
    points scored on different texts or token counts cannot share an axis (their perplexities differ by the text,
    not by the plan)."""
    if point.get("evaluation"):
        return str(point["evaluation"])
    return f"{point['tokens']:,} tokens" if point.get("tokens") else None


def make_pareto_figure(points: Sequence, x: str = "bits_per_weight") -> go.Figure:
    """KL divergence and perplexity against size (``bits_per_weight`` or ``size_bytes``), measured and predicted.

    One colour per kind of plan in both panels and in its prediction (an open circle); a point's name is in
    its hover text (long names on the plot overlap and are cut at its edge); axes never zoom two near-equal
    points apart (``style``). Every point must come from one evaluation (the same text and token count), which
    the title says; points from two are refused (ValueError). The float model is drawn as itself, a grey cross
    on the perplexity panel (its KL to itself is 0, off a log axis)."""
    if x not in ("bits_per_weight", "size_bytes"):
        raise ValueError(f"x must be 'bits_per_weight' or 'size_bytes', not {x!r}")
    rows = [_as_dict(p) for p in points]
    evaluations = list(dict.fromkeys(e for e in map(evaluation_of, rows) if e is not None))
    if len(evaluations) > 1:
        raise ValueError("these points were scored on different evaluations (" + "; ".join(evaluations)
                         + "): measure them on one text and token count before drawing them on one axis")
    fig = lift_subplot_titles(make_subplots(
        rows=1, cols=2, horizontal_spacing=0.12,
        subplot_titles=("KL divergence to the float model (lower is better)", "perplexity (lower is better)")))
    kinds: dict[str, list] = {}
    for r in rows:
        kinds.setdefault(point_kind(r.get("label", "")), []).append(r)
    symbols = {"uniform": "square", "auto": "circle", "custom": "diamond", "pruned": "star", "float": "x-thin-open"}
    # sizes in MB (10^6 bytes, ``workbench.units``) as everywhere else in the app, not 8,394,240 bytes
    scale = 1.0 if x == "bits_per_weight" else 1e6
    kl_values, ppl_values, x_values = [], [], []
    for kind, rs in kinds.items():
        rs = sorted(rs, key=lambda r: r[x])
        xs = [r[x] / scale for r in rs]
        colour = KIND_COLOURS[kind]
        hover = [f"{r.get('label', '')}<br>" + (f"{r[x]:.2f} bits/weight" if x == "bits_per_weight"
                                               else format_bytes(r[x])) for r in rs]
        mode = "lines+markers" if kind == "auto" else "markers"
        x_values += xs
        for col, key in ((1, "kl_divergence"), (2, "perplexity")):
            if kind == "float" and col == 1:
                continue  # KL of the float model to itself: 0, which a log axis cannot place
            ys = [r[key] for r in rs]
            (kl_values if col == 1 else ppl_values).extend(ys)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode=mode, name="float model" if kind == "float" else kind,
                                     legendgroup=kind, showlegend=col == 1 or kind == "float",
                                     hovertext=hover, hovertemplate="%{hovertext}<br>%{y:.4g}<extra></extra>",
                                     line={"color": colour},
                                     marker={"symbol": symbols[kind], "size": 12 if kind == "float" else 10,
                                             "color": colour, "line": {"width": 2, "color": colour}}),
                          row=1, col=col)
        pred = [(r[x], r.get("predicted_kl"), r.get("predicted_perplexity"), r.get("label", "")) for r in rs
                if r.get("predicted_kl") is not None]
        if pred and kind != "uniform":
            for col, idx in ((1, 1), (2, 2)):
                ys = [p[idx] for p in pred]
                (kl_values if col == 1 else ppl_values).extend(v for v in ys if v is not None)
                fig.add_trace(go.Scatter(x=[p[0] / scale for p in pred], y=ys, mode="markers",
                                         name=f"{kind} (predicted)", legendgroup=f"{kind}-pred", showlegend=col == 1,
                                         hovertext=[f"{p[3]}, predicted" for p in pred],
                                         hovertemplate="%{hovertext}<br>%{y:.4g}<extra></extra>",
                                         marker={"symbol": "circle-open", "size": 13, "color": colour,
                                                 "line": {"width": 2, "color": colour}}), row=1, col=col)
    title_x = "bits per weight" if x == "bits_per_weight" else "size (MB = 10^6 bytes)"
    fig.update_xaxes(title_text=title_x, range=linear_range(x_values))
    fig.update_yaxes(title_text="KL (nats/token)", row=1, col=1, **log_axis(kl_values))
    fig.update_yaxes(title_text="perplexity", row=1, col=2, range=linear_range(ppl_values))
    on = f" (every point scored on the same {evaluations[0]})" if evaluations else ""
    fig.update_layout(title=f"Size against damage{on}", template="plotly_white", height=420,
                      legend={"title": "plan"})
    return fig


def make_difficulty_figure(rows: Sequence, precision: str = "int4", score_label: str = "measured KL") -> go.Figure:
    """Why layers are hard (``workbench.precision.layer_difficulty`` rows): left, each layer's damage by block, one line per
    layer type (the first and last blocks, the embedding and output layer at the ends); right, damage against
    the input's outlier channels (max / median channel abs-max), log-log, one colour per layer type.
    ``score_label``: how the damages were obtained (the sensitivity report's ``score_label``)."""
    rows = [_as_dict(r) for r in rows]
    fig = lift_subplot_titles(make_subplots(rows=1, cols=2, subplot_titles=(
        "damage by block (embedding left, output right)", "damage against input outlier channels")))
    blocks = [r["block"] for r in rows if r["block"] is not None]
    last = max(blocks) if blocks else 0

    def where(r):
        return r["block"] if r["block"] is not None else (-1 if "embed" in r["role"] else last + 1)

    roles = list(dict.fromkeys(r["role"] for r in sorted(rows, key=where)))
    for i, role in enumerate(roles):
        mine = sorted((r for r in rows if r["role"] == role), key=where)
        colour = _PALETTE[i % len(_PALETTE)]
        text = [f"{r['name']}<br>{'; '.join(r['why']) or 'nothing stands out'}" for r in mine]
        fig.add_scatter(x=[where(r) for r in mine], y=[max(r["damage"], 1e-12) for r in mine], name=role,
                        mode="lines+markers" if len(mine) > 1 else "markers", line={"color": colour},
                        marker={"color": colour}, text=text, legendgroup=role,
                        hovertemplate="%{text}<br>KL %{y:.3g}<extra></extra>", row=1, col=1)
        pts = [r for r in mine if r.get("input_max_to_median")]
        if pts:
            fig.add_scatter(x=[r["input_max_to_median"] for r in pts], y=[max(r["damage"], 1e-12) for r in pts],
                            name=role, mode="markers", marker={"color": colour}, legendgroup=role,
                            showlegend=False, text=[f"{r['name']}<br>{'; '.join(r['why'])}" for r in pts],
                            hovertemplate="%{text}<br>max/median %{x:.0f}x, KL %{y:.3g}<extra></extra>",
                            row=1, col=2)
    fig.update_yaxes(type="log", title_text=f"{score_label} at {precision}, layer alone (nats/token)", row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_xaxes(title_text="block", row=1, col=1)
    fig.update_xaxes(type="log", title_text="input max / median channel abs-max", row=1, col=2)
    fig.update_layout(title=f"Why layers are hard at {precision}", template="plotly_white", height=440,
                      legend_title="layer type")
    return fig
