"""Reads a figure's traces and layout and says where it would mislead a reader (what the chart tests assert on).

    figure_problems(fig)   # [] or e.g. ["legend 'custom' is #636efa but its markers are #EF553B, #d62728"]

Checked: a legend entry's colour is the colour of every trace it stands for (plotly colours traces that
set no colour by their index, so the same name in two subplots can differ); a trace shown in the legend
has one colour (the legend draws its first); a linear axis whose values sit closer than
``MIN_RELATIVE_SPAN`` of their size has a range set (``style.linear_range``), so one point or two near
ones are not zoomed apart; a log axis has ticks at powers of ten and a range of at least one decade
(``style.log_axis``); a point's label is short enough not to be cut at the plot's edge.
"""
from __future__ import annotations

import math

from .style import MIN_RELATIVE_SPAN

__all__ = ["figure_problems", "check_figures", "MAX_POINT_LABEL"]

MAX_POINT_LABEL = 24  # characters; longer names belong in the hover text
_DEFAULT_COLORWAY = ("#636efa", "#EF553B", "#00cc96", "#ab63fa", "#FFA15A", "#19d3f3", "#FF6692", "#B6E880",
                     "#FF97FF", "#FECB52")


def _colorway(fig) -> tuple:
    way = fig.layout.colorway or (fig.layout.template.layout.colorway if fig.layout.template else None)
    return tuple(way) if way else _DEFAULT_COLORWAY


def _colours(trace, default: str) -> list[str]:
    """The colours a trace draws its points (markers or bars) in."""
    marker = getattr(trace, "marker", None)
    colour = getattr(marker, "color", None) if marker is not None else None
    if colour is None and getattr(trace, "line", None) is not None:
        colour = trace.line.color
    if colour is None:
        return [default]
    if isinstance(colour, str) and colour.replace(" ", "").endswith(",0)") and marker.line.color is not None:
        colour = marker.line.color  # a hollow marker or bar shows its outline's colour
    if isinstance(colour, str):
        return [colour]
    return [str(c) for c in colour]


def _numbers(values) -> list[float]:
    out = []
    for v in values if values is not None else ():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _axis(fig, ref: str):
    """The layout axis a trace's ``xaxis`` / ``yaxis`` reference (``x2`` -> ``layout.xaxis2``)."""
    return fig.layout[ref[0] + "axis" + ref[1:]]


def _legend_problems(fig) -> list[str]:
    way = _colorway(fig)
    entries: dict[str, list[str]] = {}
    shown: dict[str, str] = {}
    problems = []
    for i, trace in enumerate(fig.data):
        if trace.type in ("table", "heatmap", "indicator") or not trace.name:
            continue
        colours = _colours(trace, way[i % len(way)])
        key = trace.legendgroup or trace.name
        if "predicted" in (trace.name or "") and trace.legendgroup:  # a prediction's entry is its own
            key = trace.legendgroup
        entries.setdefault(key, []).extend(colours)
        if trace.showlegend is not False and key not in shown:
            shown[key] = colours[0]
            if len(set(c.lower() for c in colours)) > 1:
                problems.append(f"legend '{trace.name}' shows one colour ({colours[0]}) for points of several "
                                f"({', '.join(sorted(set(colours)))})")
    for key, colour in shown.items():
        others = sorted({c for c in entries[key] if c.lower() != colour.lower()})
        if others:
            problems.append(f"legend '{key}' is {colour} but its points are also {', '.join(others)}")
    return problems


def _span_problems(fig) -> list[str]:
    """Linear axes zoomed below a sensible span; log axes with minor-tick labels or less than a decade."""
    values: dict[str, list[float]] = {}
    for trace in fig.data:
        if trace.type not in ("scatter", "bar", "scattergl"):
            continue
        for letter in "xy":
            vals = _numbers(getattr(trace, letter, None))
            if trace.type == "bar" and letter == ("x" if trace.orientation == "h" else "y"):
                vals = vals + [0.0]  # a bar starts at zero: plotly includes it
            ref = getattr(trace, letter + "axis", None) or letter
            values.setdefault(ref, []).extend(vals)
    problems = []
    for ref, vals in values.items():
        if not vals:
            continue
        axis = _axis(fig, ref)
        name = ref[0] + "axis" + ref[1:]
        if axis.type == "log":
            positive = [v for v in vals if v > 0]
            if axis.dtick not in (1, "1") or axis.exponentformat not in ("power", "e", "E"):
                problems.append(f"{name} is logarithmic without ticks at each power of ten (dtick 1, exponentformat "
                                "'power'): its minor ticks read '5, 2, 0.001'")
            rng = axis.range
            if rng is None and positive and math.log10(max(positive)) - math.log10(min(positive)) < 1:
                problems.append(f"{name} spans less than a decade ({min(positive):.3g} to {max(positive):.3g}) "
                                "with no range set: it shows no labelled tick")
            elif rng is not None and rng[1] - rng[0] < 1:
                problems.append(f"{name}'s range {list(rng)} is less than a decade")
            continue
        if axis.type in ("category", "date") or axis.range is not None or axis.autorange is False:
            continue
        lo, hi = min(vals), max(vals)
        size = max(abs(lo), abs(hi))
        if size > 0 and hi - lo < MIN_RELATIVE_SPAN * size and not all(isinstance(v, str) for v in vals):
            problems.append(f"{name} is zoomed to {lo:.4g}..{hi:.4g}, less than {MIN_RELATIVE_SPAN:.0%} of its "
                            "values: near-equal points look far apart (set a range: charts.style.linear_range)")
    return problems


def _label_problems(fig) -> list[str]:
    problems = []
    for trace in fig.data:
        if trace.type != "scatter" or "text" not in (trace.mode or ""):
            continue
        texts = trace.text if isinstance(trace.text, (list, tuple)) else [trace.text] if trace.text else []
        long = [t for t in texts if t and len(str(t)) > MAX_POINT_LABEL]
        if long:
            problems.append(f"trace '{trace.name}' labels points with text up to {max(len(str(t)) for t in long)} "
                            f"characters ('{long[0]}'): more than {MAX_POINT_LABEL} is cut at the edge or overlaps")
    return problems


def figure_problems(fig) -> list[str]:
    """Every way ``fig`` (a plotly Figure or FigureWidget) would mislead, one line each; [] when none."""
    import plotly.graph_objects as go
    fig = go.Figure(fig)
    return _legend_problems(fig) + _span_problems(fig) + _label_problems(fig)


def check_figures(figures: dict) -> dict[str, list[str]]:
    """``figure_problems`` of each named figure that has any."""
    out = {name: figure_problems(fig) for name, fig in figures.items()}
    return {name: p for name, p in out.items() if p}
