"""Figure for fine-tuning: training loss per step, the held-back windows' loss, the step merged.

    make_loss_figure(report)        # a FinetuneReport or its to_dict()
"""
from __future__ import annotations

from typing import Mapping

import plotly.graph_objects as go

__all__ = ["make_loss_figure"]


def make_loss_figure(report, *, title: str | None = None, y_title: str = "cross-entropy (nats/token)",
                     validation_name: str = "held-back windows") -> go.Figure:
    """Loss per step and its running mean, validation loss and the chosen step; the title carries perplexity
    before -> after (``title`` replaces it: distillation's losses are KL, not cross-entropy)."""
    r = report if isinstance(report, Mapping) else report.to_dict()
    losses = r["losses"]
    steps = list(range(1, len(losses) + 1))
    k = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]
    fig = go.Figure()
    fig.add_scatter(x=steps, y=losses, mode="lines", name="loss", line={"color": "#9ecae1"})
    fig.add_scatter(x=steps, y=smooth, mode="lines", name=f"mean of {k}", line={"color": "#08519c", "width": 2})
    if r.get("validation"):
        vs, vl = zip(*r["validation"])
        fig.add_scatter(x=list(vs), y=list(vl), mode="lines+markers", name=validation_name,
                        line={"color": "#9467bd"})
        if r.get("best_step") is not None:
            fig.add_vline(x=r["best_step"], line_dash="dot", line_color="#9467bd",
                          annotation_text=f"kept: step {r['best_step']}")
    if title is None:
        title = "LoRA fine-tuning: training loss"
    if r.get("perplexity_before") is not None and r.get("perplexity_after") is not None:
        title += (f" (held-out perplexity {r['perplexity_before']:.2f} -> {r['perplexity_after']:.2f} on "
                  f"{r['eval_tokens']:,} tokens)")
    fig.update_layout(title=title, xaxis_title="step", yaxis_title=y_title,
                      template="plotly_white", height=380)
    ys = [y for trace in fig.data for y in trace.y if y is not None and y == y]
    if ys:  # a margin around the data, so a flat line is not drawn on the axis
        low, high = min(ys), max(ys)
        pad = 0.08 * (high - low) or 0.05 * abs(high) or 0.05
        fig.update_yaxes(range=[low - pad, high + pad])
    return fig
