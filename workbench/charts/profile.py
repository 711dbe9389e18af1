"""Figure for runtime profiles: decode speed, prefill latency and size side by side, one bar per model.

    make_profile_figure(profiles)       # RuntimeProfile objects or their to_dict()
"""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import MEASURED_COLOUR

__all__ = ["make_profile_figure"]


def make_profile_figure(profiles: Sequence) -> go.Figure:
    """Three panels: decode tokens/s (higher is better), prefill ms at the longest prompt, size in MB."""
    rows = [p if isinstance(p, Mapping) else p.to_dict() for p in profiles]
    names = [r["name"] for r in rows]
    longest = max((int(n) for r in rows for n in r["prefill_ms"]), default=None)
    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        "decode tokens/s (higher is better)", f"prefill ms, {longest}-token prompt", "size on disk, MB"))
    fig.add_bar(x=names, y=[r["decode_tokens_per_second"] for r in rows], marker_color=MEASURED_COLOUR, row=1, col=1,
                name="decode")
    fig.add_bar(x=names, y=[r["prefill_ms"].get(longest, r["prefill_ms"].get(str(longest))) for r in rows],
                marker_color="#17becf", row=1, col=2, name="prefill")
    fig.add_bar(x=names, y=[r["size_bytes"] / 1e6 for r in rows], marker_color="#7f7f7f", row=1, col=3, name="size")
    fig.update_layout(title="What each model costs to run (this CPU)", showlegend=False, template="plotly_white",
                      height=380)
    return fig
