"""Figures for speed and memory bounds: this host's measured decode against its bound, candidate plans on devices,
and quality against size against projected speed.

    make_host_bound_figure(profiles, host["read_gbps"])     # RuntimeProfile objects or their to_dict()
    make_device_figure(project_plans(lm, ["8gen3", "rk3588"], {"int4": plan}))
    make_speed_pareto_figure(points, projections, device="RK3588")   # points: PlanPoint or dicts with label, KL, size

Every number comes from ``workbench.run.profile`` and ``workbench.devices.projection``: these functions only draw them.
"""
from __future__ import annotations

import html

import itertools
from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..errors import WorkbenchError
from ..run.profile import RuntimeProfile
from ..devices.projection import Projection
from .style import CATEGORY_COLOURS, JUDGEMENT_COLOURS, MEASURED_COLOUR, lift_subplot_titles, linear_range, log_axis
from ..devices.vendor_fit import VendorProjection

__all__ = ["make_host_bound_figure", "make_device_figure", "make_speed_pareto_figure", "make_vendor_fit_figure", "speed_of", "pareto_optimal",
           "PLAN_COLOURS"]

PLAN_COLOURS = CATEGORY_COLOURS
NO_FIT = JUDGEMENT_COLOURS["bad"]


def _profile(p) -> RuntimeProfile:
    return p if isinstance(p, RuntimeProfile) else RuntimeProfile(**p)


def _projection(p) -> Projection:
    if isinstance(p, Projection):
        return p
    vendor = p.get("vendor")
    return Projection(**{**p, "unsupported_layers": [tuple(x) for x in p.get("unsupported_layers", [])],
                         "vendor": VendorProjection(**vendor) if isinstance(vendor, Mapping) else vendor})


def _as_dict(obj) -> Mapping:
    return obj if isinstance(obj, Mapping) else obj.to_dict()


def make_host_bound_figure(profiles: Sequence, read_gbps: float, cache_bytes: int | None = None) -> go.Figure:
    """Per profiled model: measured decode tokens/s beside this host's bound (read bandwidth / bytes per step). A
    model whose decode graph fits in ``cache_bytes`` (the CPU's last-level cache) has no memory bound: it is read
    from the cache, and its bar says so rather than standing above a bound it is not held to."""
    rows = [p for p in map(_profile, profiles) if p.decode_tokens_per_second and p.decode_bytes]
    names = [p.name for p in rows]
    bounds = [p.decode_bound(read_gbps, cache_bytes) for p in rows]
    fracs = [p.fraction_of_bound(read_gbps, cache_bytes) for p in rows]
    text = [f"{f:.2f} of the bound" if f is not None else
            f"in cache ({p.decode_bytes / 1e6:.1f} MB): no memory bound" for p, f in zip(rows, fracs)]
    fig = go.Figure([
        go.Bar(name=f"bound ({read_gbps:.1f} GB/s / bytes per step)", x=names, y=bounds, marker_color="#d5dbdb",
               marker_line={"color": "#566573", "width": 1},
               hovertemplate="%{x}: bound %{y:,.0f} tok/s<extra></extra>"),
        go.Bar(name="measured", x=names, y=[p.decode_tokens_per_second for p in rows], marker_color=MEASURED_COLOUR,
               text=text, textposition="outside", customdata=[p.decode_bytes / 1e6 for p in rows],
               hovertemplate="%{x}: %{y:,.0f} tok/s measured<br>%{customdata:.2f} MB read per step<extra></extra>")])
    fig.update_layout(title="Decode on this host: measured against its memory bound", barmode="group",
                      yaxis_title="tokens/s", template="plotly_white", height=400)
    if not rows:
        fig.add_annotation(text="nothing decoded here yet: profile a conversion first", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def make_device_figure(projections: Mapping[str, Sequence]) -> go.Figure:
    """Two panels over the devices, one colour per plan: decode tokens/s projected (filled) inside its bandwidth
    bound (outline), with the layers the accelerator cannot run as text; memory needed against RAM and the NPU's
    limit (a bar hatched and outlined in red does not fit; it keeps its plan's colour)."""
    plans = {label: [_projection(p) for p in ps] for label, ps in projections.items()}
    if not plans:
        raise WorkbenchError("nothing to draw: project at least one plan onto one device")
    devices = list(dict.fromkeys(p.device for ps in plans.values() for p in ps))
    fig = lift_subplot_titles(make_subplots(rows=1, cols=2, subplot_titles=(
        "decode tokens/s: projected (filled) and bound (outline)", "memory needed: weights + KV cache + graph buffers")))
    for i, (label, ps) in enumerate(plans.items()):
        colour = PLAN_COLOURS[i % len(PLAN_COLOURS)]
        x = [p.device for p in ps]
        fig.add_bar(x=x, y=[p.decode_bound_tps for p in ps], offsetgroup=label, legendgroup=label, showlegend=False,
                    marker={"color": "rgba(0,0,0,0)", "line": {"color": colour, "width": 2}}, name=f"{label} bound",
                    hovertemplate="%{x}: bound %{y:,.1f} tok/s<extra>" + label + "</extra>", row=1, col=1)
        fig.add_bar(x=x, y=[p.projected_decode_tps for p in ps], offsetgroup=label, legendgroup=label, name=label,
                    marker_color=colour, text=[f"{len(p.unsupported_layers)} not on NPU" if p.unsupported_layers
                                               else "" for p in ps], textposition="inside",
                    customdata=[[p.efficiency or 0, p.bits_per_weight] for p in ps],
                    hovertemplate="%{x}: %{y:,.1f} tok/s projected (efficiency %{customdata[0]:.2f})<br>"
                                  "%{customdata[1]:.2f} bits/weight<extra>" + label + "</extra>", row=1, col=1)
        misfit = [p.fits_ram is False or p.fits_npu is False for p in ps]
        fig.add_bar(x=x, y=[p.total_bytes / 1e9 for p in ps], offsetgroup=label, legendgroup=label, showlegend=False,
                    name=label, marker={"color": colour,  # the plan's colour, as its legend entry says
                                        "pattern": {"shape": ["x" if m else "" for m in misfit], "fgcolor": NO_FIT,
                                                    "solidity": 0.5},
                                        "line": {"color": [NO_FIT if m else colour for m in misfit], "width": 2}},
                    text=["does not fit" if m else "" for m in misfit], textposition="inside",
                    customdata=[[p.weight_bytes / 1e9, p.kv_bytes / 1e9, p.buffer_bytes / 1e9, p.context] for p in ps],
                    hovertemplate="%{x}: %{y:.3f} GB<br>weights %{customdata[0]:.3f}, KV %{customdata[1]:.3f} at "
                                  "%{customdata[3]} tokens, buffers %{customdata[2]:.3f}<extra>" + label + "</extra>",
                    row=1, col=2)
    first = next(iter(plans.values()))
    for name, values, symbol in (("RAM", [p.ram_bytes for p in first], "line-ew"),
                                 ("NPU limit", [p.npu_limit_bytes for p in first], "triangle-down-open")):
        known = [(p.device, v / 1e9) for p, v in zip(first, values) if v]
        if known:
            fig.add_scatter(x=[d for d, _ in known], y=[v for _, v in known], mode="markers", name=name,
                            marker={"symbol": symbol, "size": 28 if symbol == "line-ew" else 11, "color": "#17202a",
                                    "line": {"width": 3 if symbol == "line-ew" else 1.5, "color": "#17202a"}},
                            hovertemplate="%{x}: " + name + " %{y:g} GB<extra></extra>", row=1, col=2)
    for d in devices:
        if all(p.decode_bound_tps is None for ps in plans.values() for p in ps if p.device == d):
            fig.add_annotation(x=d, y=0.05, xref="x", yref="y domain", text="bandwidth unknown", textangle=-90,
                               yanchor="bottom", showarrow=False, font={"color": "#7f8c8d"})
    fig.update_xaxes(categoryorder="array", categoryarray=devices)
    speeds = [v for ps in plans.values() for p in ps for v in (p.decode_bound_tps, p.projected_decode_tps)]
    sizes = [p.total_bytes / 1e9 for ps in plans.values() for p in ps] + \
        [v / 1e9 for p in first for v in (p.ram_bytes, p.npu_limit_bytes) if v]
    fig.update_yaxes(title_text="tokens/s", row=1, col=1, **log_axis(speeds))
    fig.update_yaxes(title_text="GB (1e9 bytes)", row=1, col=2, **log_axis(sizes))
    ctx = first[0].context
    fig.update_layout(barmode="group", template="plotly_white", height=460, legend_title="plan",
                      title=f"Candidate plans on each device ({ctx}-token context; hatched in red: does not fit)")
    return fig


def speed_of(p: Projection) -> float | None:
    """The speed a view ranks by: projected decode tokens/s (the bound times the fitted efficiency)."""
    return p.projected_decode_tps


def pareto_optimal(rows: Sequence[Mapping], keys: Sequence[tuple[str, int]]) -> list[bool]:
    """For each row, whether no other row is at least as good in every key and better in one.
    ``keys``: (field, +1 for higher is better, -1 for lower is better); rows missing a field are never optimal."""
    def vec(r):
        vals = [r.get(k) for k, _ in keys]
        return None if any(v is None for v in vals) else [v * s for v, (_, s) in zip(vals, keys)]
    vecs = [vec(r) for r in rows]
    out = []
    for i, a in enumerate(vecs):
        out.append(a is not None and not any(
            b is not None and j != i and all(y >= x for x, y in zip(a, b)) and any(y > x for x, y in zip(a, b))
            for j, b in enumerate(vecs)))
    return out


def make_speed_pareto_figure(points: Sequence, projections: Mapping[str, Sequence], device: str | None = None
                             ) -> go.Figure:
    """Quality against size against projected speed on one device, three panels: KL vs bits/weight, KL vs
    tokens/s, tokens/s vs bits/weight; colour is tokens/s, and the plans no other beats on all three are ringed.

    ``points``: measured plans (``PlanPoint`` or dicts with ``label``, ``kl_divergence``, ``bits_per_weight``);
    ``projections``: ``{label: [Projection per device]}`` for the same labels; ``device``: a device name in them
    (default: the first)."""
    rows = [dict(_as_dict(p)) for p in points]
    if not rows:
        raise WorkbenchError("no measured plans to place: evaluate plans first (Precisions tab, Evaluate)")
    per_plan = {label: [_projection(p) for p in ps] for label, ps in projections.items()}
    devices = list(dict.fromkeys(p.device for ps in per_plan.values() for p in ps))
    device = device or (devices[0] if devices else None)
    if device not in devices:
        raise WorkbenchError(f"device '{device}' was not projected; choose one of: {', '.join(devices) or 'none'}")
    for r in rows:
        p = next((p for p in per_plan.get(r["label"], []) if p.device == device), None)
        r["tokens_per_second"] = None if p is None else speed_of(p)
    if all(r["tokens_per_second"] is None for r in rows):
        raise WorkbenchError(f"no projected speed on {device} (its bandwidth is unknown, or no plan was projected "
                             "there): choose another device")
    best = pareto_optimal(rows, (("kl_divergence", -1), ("bits_per_weight", -1), ("tokens_per_second", 1)))
    speeds = [r["tokens_per_second"] for r in rows]
    lo, hi = min(s for s in speeds if s is not None), max(s for s in speeds if s is not None)
    # the colour scale spans at least a fifth of the speed, as a linear axis does: 429 and 437 tok/s are one colour
    # family, not its two ends
    span = linear_range([lo, hi])
    c_lo, c_hi = (span[0], span[1]) if span else (lo, hi)
    # each plan a number on its points, named once in a key under the panels: the names themselves collided
    # (near-equal speeds put "uniform int4", "auto 7.78 b/w" and the quantized model's name on one spot)
    number = {r["label"]: i + 1 for i, r in enumerate(sorted(rows, key=lambda r: r["bits_per_weight"]))}
    fig = lift_subplot_titles(make_subplots(rows=1, cols=3, subplot_titles=(
        "KL against bits/weight", "KL against projected tokens/s", "projected tokens/s against bits/weight")))
    panels = ((1, "bits_per_weight", "kl_divergence"), (2, "tokens_per_second", "kl_divergence"),
              (3, "bits_per_weight", "tokens_per_second"))
    for col, xk, yk in panels:
        sel = [(r, b) for r, b in zip(rows, best) if r.get(xk) is not None and r.get(yk) is not None]
        xs, ys = [r[xk] for r, _ in sel], [r[yk] for r, _ in sel]
        fig.update_xaxes(range=linear_range(xs), row=1, col=col)
        fig.update_yaxes(**(log_axis(ys) if yk == "kl_divergence" else {"range": linear_range(ys)}), row=1, col=col)
        fig.add_scatter(
            x=xs, y=ys, mode="markers+text", row=1, col=col, cliponaxis=False,
            # a number per plan (the key below names it), above the point, and its name in the hover
            text=_numbers_at_places(xs, ys, [number[r["label"]] for r, _ in sel]), textposition="top center",
            showlegend=False,
            name="plans",
            marker={"size": 12, "color": [r["tokens_per_second"] or lo for r, _ in sel], "colorscale": "Viridis",
                    "cmin": c_lo, "cmax": c_hi if c_hi > c_lo else c_lo + 1, "showscale": col == 3,
                    "colorbar": {"title": "tok/s"}, "line": {"width": [3 if b else 0 for _, b in sel],
                                                            "color": "#2c3e50"}},  # not red: red judges a problem
            customdata=[[r["label"], r["tokens_per_second"] or 0, r["kl_divergence"], r["bits_per_weight"]]
                        for r, _ in sel],
            hovertemplate="%{customdata[0]}<br>KL %{customdata[2]:.3g}, %{customdata[3]:.2f} bits/w<br>"
                          "%{customdata[1]:,.1f} tok/s projected<extra></extra>")
    fig.update_xaxes(title_text="bits per weight", row=1, col=1)
    fig.update_xaxes(title_text="tokens/s", row=1, col=2)
    fig.update_xaxes(title_text="bits per weight", row=1, col=3)
    fig.update_yaxes(title_text="KL (nats/token)", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", row=1, col=3)
    ringed = {r["label"]: b for r, b in zip(rows, best)}
    entries = [f"<b>{n}</b> {html.escape(label)}{'' if ringed[label] else ' (not ringed)'}"
               for label, n in number.items()]
    key = "<br>".join("   ".join(entries[i:i + 3]) for i in range(0, len(entries), 3))  # three a line
    fig.add_annotation(text=key, showarrow=False, xref="paper", yref="paper", x=0, y=-0.3, xanchor="left",
                       yanchor="top", align="left", font={"size": 11})
    fig.update_layout(title=f"Quality, size and projected speed on {device} (ringed: no other plan is better in all "
                            "three)", template="plotly_white", height=450 + 16 * (len(entries) // 3),
                      margin={"b": 100 + 16 * (len(entries) // 3)})
    return fig


def _numbers_at_places(xs: Sequence[float], ys: Sequence[float], numbers: Sequence[int]) -> list[str]:
    """The text over each point: its number, or for points drawn on one place (the quantized model and the plan it
    ran, at one size and one KL) all their numbers over the first ("2, 3") and nothing over the rest."""
    first: dict[tuple, int] = {}
    text = ["" for _ in numbers]
    for i, (x, y) in enumerate(zip(xs, ys)):
        j = first.setdefault((round(x, 6), f"{y:.4g}"), i)
        text[j] = f"{text[j]}, {numbers[i]}" if text[j] else str(numbers[i])
    return text


def make_vendor_fit_figure(projections: Mapping[str, Sequence]) -> go.Figure:
    """Per device, the vendor's measurements of its runtime (filled), what the fit projected for each with its model
    left out (open), and each plan's projection (a star, its bar the median held-out error): tokens/s against the
    bytes a decode step reads, so the fitted line and the plan sit on the same axes."""
    plans = {label: [_projection(p) for p in ps] for label, ps in projections.items()}
    fitted = [(label, p) for label, ps in plans.items() for p in ps if p.vendor is not None and p.vendor.points]
    fig = go.Figure()
    if not fitted:
        fig.add_annotation(text="no vendor measurement of these devices' runtimes to show", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5)
        fig.update_layout(template="plotly_white", height=300, title="Vendor measurements and the fitted projection")
        return fig
    shown: set = set()
    xs: list[float] = []  # every value drawn, for the axes' decades
    ys: list[float] = []
    for i, device in enumerate(dict.fromkeys(p.device for _, p in fitted)):
        colour = PLAN_COLOURS[i % len(PLAN_COLOURS)]
        first = next(p for _, p in fitted if p.device == device)
        v = first.vendor
        key = (v.points[0]["vendor_device"], v.runtime, v.precision)
        if key not in shown:  # one device's own measurements, once however many plans
            shown.add(key)
            pts = sorted(v.points, key=lambda q: q["bytes_gb"])
            xs.extend(q["bytes_gb"] for q in pts)
            ys.extend(q["decode_tps"] for q in pts)
            ys.extend(q["held_out_tps"] for q in pts if q.get("held_out_tps"))
            src = f"{key[0]}, {v.runtime} {v.precision}" + (" (measured on a similar chip)" if v.fallback else "")
            fig.add_scatter(x=[q["bytes_gb"] for q in pts], y=[q["decode_tps"] for q in pts], mode="markers",
                            name=f"{device}: measured ({src})", legendgroup=device,
                            marker={"color": colour, "size": 9},
                            customdata=[[q["model"], q["context"]] for q in pts],
                            hovertemplate="%{customdata[0]}, context %{customdata[1]}: %{y:.1f} tok/s measured<br>"
                                          "%{x:.3f} GB read per token<extra></extra>")
            held = [q for q in pts if q.get("held_out_tps")]
            families = sorted({q.get("family") for q in held}, key=str) if v.per_family else [None]
            for fam, dash in zip(families, itertools.cycle(("dot", "dash", "dashdot", "longdash"))):
                line = [q for q in held if fam is None or q.get("family") == fam]
                if not line:
                    continue
                fig.add_scatter(x=[q["bytes_gb"] for q in line], y=[q["held_out_tps"] for q in line],
                                mode="markers+lines", legendgroup=device,
                                name=f"{device}: fit, each model held out" + (f" ({fam} rate)" if fam else ""),
                                marker={"color": colour, "size": 9, "symbol": "circle-open"},
                                line={"color": colour, "width": 1, "dash": dash},
                                customdata=[[q["model"], q["decode_tps"]] for q in line],
                                hovertemplate="%{customdata[0]}: %{y:.1f} tok/s projected without it "
                                              "(measured %{customdata[1]:.1f})<extra></extra>")
        for label, p in ((lb, q) for lb, q in fitted if q.device == device):
            pv = p.vendor
            if pv.decode_tps is None:
                continue
            err = pv.decode_error or 0.0
            xs.append(pv.bytes_gb)
            ys.extend((pv.decode_tps * (1 - err), pv.decode_tps * (1 + err)))
            fig.add_scatter(x=[pv.bytes_gb], y=[pv.decode_tps], mode="markers", legendgroup=device,
                            name=f"{device}: {label}", marker={"color": colour, "size": 16, "symbol": "star",
                                                               "line": {"color": "#17202a", "width": 1}},
                            error_y={"type": "data", "symmetric": False, "array": [pv.decode_tps * err],
                                     "arrayminus": [pv.decode_tps * err], "color": colour},
                            hovertemplate=f"{label} on {device}: %{{y:.1f}} tok/s projected, within {err:.0%} held "
                                          f"out ({pv.decode_n})<extra></extra>")
    fig.update_xaxes(title_text="GB read per decoded token (weights + KV cache, the runtime's layout)", **log_axis(xs))
    fig.update_yaxes(title_text="decode tokens/s", **log_axis(ys))
    fig.update_layout(template="plotly_white", height=480,
                      title="Vendor measurements and the fitted projection (open: each model held out of the fit)")
    return fig
