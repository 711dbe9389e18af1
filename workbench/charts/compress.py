"""Figures for compression: importance of every head and MLP channel per layer, distillation losses, the table.

    make_head_importance_figure(importance, score="kl")       # layers x KV groups (or query heads)
    make_channel_importance_figure(importance, kept=result.kept)
    make_distill_figure(report)                              # losses, held-back KL, the step kept
    make_pareto_figure(points, x="size_bytes")               # charts.precision: pruned points are stars
"""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .finetune import make_loss_figure
from ..units import format_bytes
from .style import lift_subplot_titles, log_axis

__all__ = ["make_head_importance_figure", "make_channel_importance_figure", "make_distill_figure",
           "make_compress_table_figure"]


def _as_dict(obj) -> Mapping:
    return obj if isinstance(obj, Mapping) else obj.to_dict()


def _head_table(imp: Mapping, score: str, unit: str) -> tuple[list[list[float]], str]:
    g = imp["geometry"]["heads"] // imp["geometry"]["kv_heads"]
    if score == "kl":
        table = imp["kl_groups"] if unit == "group" else imp["kl_heads"]
        if table is None:
            raise ValueError("this importance was computed without measured KL; choose score 'taylor' or 'activation'")
        return table, "KL with the unit masked (nats/token)"
    per_head = imp["activation_heads" if score == "activation" else "taylor_heads"]
    if unit == "query":
        return per_head, f"{score} score"
    return [[sum(row[k * g:(k + 1) * g]) for k in range(len(row) // g)] for row in per_head], f"{score} score"


def make_head_importance_figure(importance, score: str = "taylor", unit: str = "group",
                                kept: Sequence[Sequence[int]] | None = None) -> go.Figure:
    """A heatmap: one row per layer, one column per KV group (or query head); kept units marked with a dot."""
    imp = _as_dict(importance)
    table, label = _head_table(imp, score, unit)
    cols = [f"{'group' if unit == 'group' else 'head'} {j}" for j in range(len(table[0]))]
    rows = [f"layer {i}" for i in range(len(table))]
    fig = go.Figure(go.Heatmap(z=table, x=cols, y=rows, colorscale="Viridis", colorbar={"title": label},
                               hovertemplate="%{y}, %{x}: %{z:.4g}<extra></extra>"))
    if kept is not None:
        xs = [cols[j] for i, ks in enumerate(kept) for j in ks]
        ys = [rows[i] for i, ks in enumerate(kept) for _ in ks]
        fig.add_scatter(x=xs, y=ys, mode="markers", name="kept", marker={"color": "white", "size": 9,
                                                                         "line": {"color": "black", "width": 1}})
    what = "KV groups" if unit == "group" else "query heads"
    fig.update_layout(title=f"Attention {what} per layer: {label}"
                      + (f" (white dots: the {what} Prune kept; none: removed)" if kept is not None else ""),
                      template="plotly_white", height=max(260, 40 * len(rows) + 140), yaxis={"autorange": "reversed"})
    return fig


def make_channel_importance_figure(importance, score: str = "taylor",
                                   kept: Sequence[Sequence[int]] | None = None,
                                   removed_by: str = "Prune") -> go.Figure:
    """One panel per layer: its MLP channels' scores sorted high to low, the kept ones in colour, the removed
    ones grey (``removed_by``: "Prune", or "these settings" for what the sliders would remove)."""
    imp = _as_dict(importance)
    table = imp["activation_mlp" if score == "activation" else "taylor_mlp"]
    n = len(table)
    cols = min(4, n)
    nrows = -(-n // cols)
    fig = lift_subplot_titles(make_subplots(rows=nrows, cols=cols, subplot_titles=[f"layer {i}" for i in range(n)],
                                            shared_yaxes=True))
    for i, row in enumerate(table):
        order = sorted(range(len(row)), key=lambda j: -row[j])
        keep = set(kept[i]) if kept is not None else set(order)
        colours = ["#08519c" if j in keep else "#d9d9d9" for j in order]
        fig.add_trace(go.Bar(x=list(range(len(row))), y=[row[j] for j in order], marker={"color": colours,
                                                                                          "line": {"width": 0}},
                             showlegend=False, hovertext=[f"channel {j}" for j in order]),
                      row=i // cols + 1, col=i % cols + 1)
    values = [v for row in table for v in row]
    fig.update_yaxes(**log_axis(values))
    kept_n = [len(k) for k in kept] if kept is not None else None
    note = (f"blue: kept, grey: removed by {removed_by} (kept per layer: {', '.join(map(str, kept_n))})"
            if kept_n is not None else "none removed yet")
    fig.update_layout(title=f"MLP channels per layer, most important first ({score} score; {note})",
                      template="plotly_white", height=260 * nrows + 80, bargap=0)
    return fig


def make_distill_figure(report) -> go.Figure:
    """The distillation loss per step, the held-back KL to the teacher and the step kept."""
    r = _as_dict(report)
    b, a = r.get("student_before") or {}, r.get("student_after") or {}
    title = "Distillation: training loss"
    if b and a:
        title += (f" (held-out perplexity {b['perplexity']:.2f} -> {a['perplexity']:.2f}, teacher "
                  f"{r['teacher_perplexity']:.2f}; KL {b['kl']:.4f} -> {a['kl']:.4f})")
    return make_loss_figure({k: v for k, v in r.items() if k not in ("perplexity_before", "perplexity_after")},
                            title=title, y_title="loss (nats/token)", validation_name="held-back KL to the teacher")


def make_compress_table_figure(rows: Sequence[Mapping]) -> go.Figure:
    """The size / perplexity / KL table, one row per model, with standard errors, and the precision plan each
    quantized row was rounded by (``plan`` of the row; the float rows show "-")."""
    head = ["model", "size", "bits/w", "perplexity", "KL vs float", "top-1", "precision plan"]
    cells = [[r["label"] for r in rows], [format_bytes(r["size_bytes"]) for r in rows],
             [f"{r['bits_per_weight']:.2f}" if r.get("bits_per_weight") is not None else "" for r in rows],
             [f"{r['perplexity']:.2f} ± {r['perplexity_stderr']:.2f}" for r in rows],
             [f"{r['kl_divergence']:.4f} ± {r['kl_stderr']:.4f}" if r.get("kl_stderr") is not None else
              f"{r['kl_divergence']:.4f}" for r in rows],
             [f"{r['top1_agreement']:.3f}" for r in rows], [r.get("plan") or "-" for r in rows]]
    fig = go.Figure(go.Table(header={"values": head, "align": "left"}, cells={"values": cells, "align": "left"},
                             columnwidth=[3, 1.5, 1, 1.7, 1.7, 1, 3.2]))
    fig.update_layout(height=60 + 30 * len(rows), margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig
