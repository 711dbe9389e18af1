"""Figures for graphs and conversions: the operator histogram, bytes per block, agreement per target.

    make_op_histogram_figure(operator_inventory("out/onnx/decode.onnx"))
    make_block_bytes_figure(initializer_bytes_by_block("out/onnx/decode.onnx"))
    make_conversion_figure([report.to_dict() for report in reports])
    make_device_gap_figure(rows)  # workbench.run.devices_gap: prefill and decode KL per target

Pure functions: data in, ``plotly.graph_objects.Figure`` out.
"""
from __future__ import annotations

import plotly.graph_objects as go

from .style import log_axis

__all__ = ["make_op_histogram_figure", "make_block_bytes_figure", "make_conversion_figure", "make_device_gap_figure",
           "DOMAIN_COLORS"]

DOMAIN_COLORS = {"ai.onnx": "#457b9d", "com.microsoft": "#e76f51"}
PROBLEM_COLOR = "#c0392b"


def make_op_histogram_figure(inventory, problem_ops=(), title: str = "Operators in the graph") -> go.Figure:
    """One bar per op type (count), coloured by domain; ops a target rejects in red."""
    rows = sorted(inventory, key=lambda r: r.count)
    bad = set(problem_ops)
    colors = [PROBLEM_COLOR if r.op_type in bad else DOMAIN_COLORS.get(r.domain, "#8d99ae") for r in rows]
    fig = go.Figure(go.Bar(
        x=[r.count for r in rows], y=[r.op_type for r in rows], orientation="h", marker_color=colors,
        customdata=[[r.domain, r.opset] for r in rows],
        hovertemplate="%{y}: %{x} node(s)<br>domain %{customdata[0]}, opset %{customdata[1]}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="nodes", height=max(300, 18 * len(rows) + 120),
                      margin=dict(l=10, r=10, t=50, b=40))
    return fig


def make_block_bytes_figure(block_bytes: dict[str, int], title: str = "Parameter bytes per block") -> go.Figure:
    """Bars of initializer bytes per block, in model order, labelled in MB (10^6 bytes)."""
    names = list(block_bytes)
    mb = [block_bytes[n] / 1e6 for n in names]
    fig = go.Figure(go.Bar(x=names, y=mb, marker_color="#2a9d8f", text=[f"{v:.2f}" for v in mb],
                           textposition="outside", hovertemplate="%{x}: %{y:.3f} MB<extra></extra>"))
    fig.update_layout(title=title, yaxis_title="MB as stored (10^6 bytes)", margin=dict(l=10, r=10, t=50, b=40))
    return fig


def make_conversion_figure(reports: list[dict], title: str = "Converted models against the simulation",
                           gap_rule: str = "") -> go.Figure:
    """Grouped bars per target: KL to the float model (converted vs simulation); top-1 vs simulation as text.

    A converted bar with a gap keeps the legend's colour, outlined and labelled in red (a red fill would make
    the legend's "converted" colour wrong); ``gap_rule`` says under the title when a gap is flagged."""
    runnable = [r for r in reports if r.get("kl_divergence") is not None]
    targets = [r["target"] for r in runnable]
    flagged = [bool(r.get("gap")) for r in runnable]
    fig = go.Figure([
        go.Bar(name="simulation", x=targets, y=[r["simulation"]["kl_divergence"] for r in runnable],
               marker_color="#a8dadc"),
        go.Bar(name="converted", x=targets, y=[r["kl_divergence"] for r in runnable], marker_color="#457b9d",
               marker_line_color=[PROBLEM_COLOR if f else "#457b9d" for f in flagged],
               marker_line_width=[3 if f else 0 for f in flagged],
               text=[("GAP, " if f else "") + f"top-1 vs sim {r['top1_agreement_vs_simulation']:.3f}"
                     for r, f in zip(runnable, flagged)],
               textfont_color=[PROBLEM_COLOR if f else "#17202a" for f in flagged], textposition="outside")])
    kls = [r["kl_divergence"] for r in runnable] + [r["simulation"]["kl_divergence"] for r in runnable]
    axis = log_axis(kls)
    if "range" in axis:
        axis["range"] = [axis["range"][0], axis["range"][1] + 0.3]  # room for the labels above the bars
    full = title + (f"<br><sup>{gap_rule}</sup>" if gap_rule else "")
    fig.update_layout(title=full, barmode="group", margin=dict(l=10, r=10, t=70 if gap_rule else 50, b=40))
    fig.update_yaxes(title_text="KL divergence to the float model (nats/token)", **axis)
    return fig


def make_device_gap_figure(rows: list[dict], title: str = "The simulation against the devices") -> go.Figure:
    """Grouped bars per target (``workbench.run.devices_gap`` rows): KL to the float model for prefill and decode, log
    scale from the decade below the smallest (a log bar starts at the axis' foot: a foot just under the bars would
    make 6e-3 look a tenth of 9e-3). Each bar's label shows what the gap rule judges: a flagged graph, outlined in
    red, the quantity that failed (``gap_label``); the others their top-1 against the simulation (the float model
    for the simulation itself). A bar scored on other tokens than the simulation's says so on the bar: its height is
    not comparable with theirs. The legend keeps each graph's own colour; targets that did not run are left out."""
    import math
    from ..run.devices_gap import gap_label
    ran = [r for r in rows if r.get("prefill") or r.get("decode")]
    sim = next((r for r in ran if r["target"] == "simulation" and r.get("prefill")), None)
    sim_tokens = sim["prefill"].get("positions") if sim else None
    bars, legend, other_tokens = [], [], []

    def label(r: dict, graph: str, flagged: bool) -> str:
        g = r[graph]
        if flagged:
            text = gap_label(g) or "GAP: " + next((part.split(": ", 1)[1] for part in (r.get("gap") or "").split("; ")
                                                   if part.startswith(graph + ":")), "")
        elif g.get("top1_vs_sim") is not None:
            text = f"top-1 vs sim {g['top1_vs_sim']:.3f}"
        else:
            text = f"top-1 {g['top1']:.3f}" + (" vs float" if r["target"] == "simulation" else "")
        tokens = g.get("positions")
        # prefill against the simulation's prefill (decode is teacher-forced at fewer positions by design)
        if graph == "prefill" and sim_tokens and tokens and abs(tokens - sim_tokens) > 0.05 * sim_tokens \
                and r is not sim:
            other_tokens.append(r["target"])
            text += f"<br>{tokens:,} tokens, sim {sim_tokens:,}"
        return text

    for graph, color in (("prefill", "#457b9d"), ("decode", "#a8dadc")):
        got = [r for r in ran if r.get(graph)]
        flagged = [graph in (r.get("gap") or "") for r in got]
        texts = [label(r, graph, f) for r, f in zip(got, flagged)]
        bars.append(go.Bar(
            name=graph, x=[r["target"] for r in got], y=[r[graph]["kl"] for r in got], marker_color=color,
            marker_line_color=[PROBLEM_COLOR if f else color for f in flagged],
            marker_line_width=[3 if f else 0 for f in flagged], showlegend=False, legendgroup=graph,
            text=texts, textfont_color=[PROBLEM_COLOR if f else "#17202a" for f in flagged], textposition="outside",
            hovertemplate="%{x} " + graph + ": KL %{y:.2e}, %{text}<extra></extra>"))
        # the legend's swatch: the graph's colour alone (a bar trace's swatch takes its first bar's red outline)
        legend.append(go.Scatter(x=[None], y=[None], mode="markers", name=graph, legendgroup=graph,
                                 marker={"symbol": "square", "size": 12, "color": color}))
    fig = go.Figure(bars + legend)
    kls = [r[g]["kl"] for r in ran for g in ("prefill", "decode") if r.get(g) and r[g]["kl"] > 0]
    yaxis = {**log_axis(kls), "title": "KL divergence to the float model (nats/token)"}
    if kls:
        lo = math.floor(math.log10(min(kls))) - (min(kls) == 10 ** math.floor(math.log10(min(kls))))
        yaxis["range"] = [lo, max(math.log10(max(kls)) + 0.45, lo + 1)]  # room for the labels above the tallest bar
    if other_tokens:
        slow = [t for t in dict.fromkeys(other_tokens) if t in ("htp", "rknn")]
        title += (f"<br><span style='font-size:11px'>{', '.join(dict.fromkeys(other_tokens))}: scored on other tokens "
                  "than the simulation" + (f" ({' and '.join(slow)}: a few windows, slow emulators)" if slow else "")
                  + ": heights not comparable</span>")
    fig.update_layout(title=title, barmode="group", yaxis=yaxis, margin=dict(l=10, r=10, t=70, b=40),
                      uniformtext_minsize=10, uniformtext_mode="show")  # labels stay legible over narrow bars
    return fig
