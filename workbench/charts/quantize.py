"""Figures for quantization results: per-layer weight error by precision, and the cost table.

    make_layer_error_figure(qm.layers)            # one bar per layer, coloured by precision
    make_cost_table_figure(rows)                  # rows: dicts with label + QuantCost.to_dict() fields
"""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

from .style import PRECISION_COLOURS, precision_colour

__all__ = ["make_layer_error_figure", "make_cost_table_figure", "PRECISION_COLOURS"]


def _as_dict(obj) -> Mapping:
    return obj if isinstance(obj, Mapping) else obj.to_dict()


def make_layer_error_figure(layers: Sequence) -> go.Figure:
    """Relative weight error ``||W - Q(W)|| / ||W||`` of every quantized layer, coloured by precision.

    Float layers are listed with zero height so the plan's whole shape stays visible; the hover
    shows the group size actually used and any fallback note.
    """
    rows = [_as_dict(r) for r in layers]
    fig = go.Figure()
    for prec in dict.fromkeys(r["precision"] for r in rows):
        sel = [r for r in rows if r["precision"] == prec]
        fig.add_bar(
            name=prec or "unchanged", x=[r["name"] for r in sel], y=[r.get("weight_error") or 0.0 for r in sel],
            marker_color=precision_colour(prec),
            customdata=[[r.get("group_size") or ("per-channel" if r.get("weight_error") is not None else "-"),
                         r.get("fallback") or ""] for r in sel],
            hovertemplate="%{x}<br>relative error %{y:.4f}<br>group %{customdata[0]}<br>%{customdata[1]}"
                          "<extra></extra>")
    fig.update_layout(title="Relative weight error per layer", xaxis_title="layer",
                      yaxis_title="||W - Q(W)|| / ||W||", legend_title="precision", template="plotly_white",
                      height=420, barmode="overlay")
    fig.update_xaxes(tickangle=-60, categoryorder="array", categoryarray=[r["name"] for r in rows])
    return fig


def _pm(value, err, fmt: str) -> str:
    if value is None:
        return "-"
    if err is None or err != err:  # NaN: one window, no spread
        return format(value, fmt)
    return f"{format(value, fmt)} ± {format(err, fmt.lstrip('+'))}"


def make_cost_table_figure(rows: Sequence[Mapping]) -> go.Figure:
    """A table: label, perplexity (change ± s.e.), KL (± s.e.), top-1, bits/weight, size, seconds."""
    header = ["", "perplexity", "change", "KL", "top-1", "bits/weight", "size (MB)", "seconds"]
    cells = [[], [], [], [], [], [], [], []]
    for r in rows:
        cells[0].append(r.get("label", ""))
        cells[1].append(_pm(r.get("perplexity"), None, ".3f"))
        cells[2].append(_pm(r.get("perplexity_change"), r.get("perplexity_change_stderr"), "+.3f")
                        if r.get("perplexity_change") is not None else "-")
        cells[3].append(_pm(r.get("kl_divergence"), r.get("kl_divergence_stderr"), ".5f"))
        cells[4].append("-" if r.get("top1_agreement") is None else f"{r['top1_agreement']:.2%}")
        cells[5].append("-" if r.get("bits_per_weight") is None else f"{r['bits_per_weight']:.2f}")
        cells[6].append("-" if r.get("size_bytes") is None else f"{r['size_bytes'] / 1e6:.2f}")
        cells[7].append("-" if r.get("seconds") is None else f"{r['seconds']:.1f}")
    fig = go.Figure(go.Table(header={"values": header, "fill_color": "#eee", "align": "left"},
                             cells={"values": cells, "align": "left"}))
    tokens = sorted({r["tokens"] for r in rows if r.get("tokens")})
    on = (f"the same {tokens[0]:,} held-out tokens" if len(tokens) == 1 else
          f"{', '.join(f'{t:,}' for t in tokens)} held-out tokens (compare rows of one count)" if tokens else
          "the same windows")
    fig.update_layout(title=f"What quantization cost (against the unquantized model, {on})",
                      height=120 + 30 * max(1, len(rows)), margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig
