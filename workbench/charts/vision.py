"""Figures for vision-language models: what each plan costs on pictures.

    make_vision_quality_figure(rows)    # rows: {"label": ..., **VisionQuality.to_dict()} per plan

Left, the answer tokens' KL against the float model given the image (lower is better); right, image-text
matching accuracy of each quantized model beside the float model's on the same draws, with chance marked.
Error bars are one standard error over questions / images.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import lift_subplot_titles

__all__ = ["make_vision_quality_figure"]


def make_vision_quality_figure(rows: Sequence[Mapping]) -> go.Figure:
    labels = [r["label"] for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("answer KL given the image (nats / token)", "image-text matching accuracy"))
    fig.add_trace(go.Bar(x=labels, y=[r["answer_kl"] for r in rows], name="answer KL", showlegend=False,
                         error_y={"type": "data", "array": [r["answer_kl_stderr"] for r in rows]},
                         hovertext=[f"top-1 agreement {r['answer_top1']:.1%} over {r['answer_tokens']} answer tokens"
                                    for r in rows]), row=1, col=1)
    scored = [r for r in rows if r.get("itm_accuracy") is not None]
    if scored:
        fig.add_trace(go.Bar(x=[r["label"] for r in scored], y=[r["itm_accuracy"] for r in scored], name="quantized",
                             error_y={"type": "data", "array": [r["itm_accuracy_stderr"] for r in scored]}),
                      row=1, col=2)
        fig.add_trace(go.Bar(x=[r["label"] for r in scored], y=[r["reference_itm_accuracy"] for r in scored],
                             name="float model", opacity=0.5,
                             error_y={"type": "data", "array": [r["reference_itm_accuracy_stderr"] for r in scored]}),
                      row=1, col=2)
        fig.add_hline(y=scored[0]["itm_chance"], line_dash="dot", annotation_text="chance", row=1, col=2)
        fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=2)
    fig.update_layout(barmode="group", height=380, margin={"t": 60, "b": 40, "l": 50, "r": 20},
                      legend={"orientation": "h", "y": -0.15}, title=f"on {rows[0]['source']}" if rows else None)
    lift_subplot_titles(fig)
    return fig
