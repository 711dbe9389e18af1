"""One self-contained HTML page about a run, to send to someone who has none of its files.

    report = build_report("workspace")            # the newest app run, or an app run folder, or a folder of
    report.html, report.figures, report.record    #   `workbench quantize` / `convert` outputs
    write_report("workspace/app/run-20261130-210100", "report.html")

The page gathers what the run wrote (the app's ``report.json``, ``plan.json``, quantized models with their
``manifest.json``, ``conversion.json`` of every conversion, profiles, this host's read bandwidth, and the
``devices_gap.json`` of every comparison on the devices (``workbench.run.devices_gap``: the app's Export tab writes
it in ``devices-gap/<model or plan>/``, bench/devices_gap.py in its work folder)), projects
the run's plans onto the device profiles, and draws every figure with plotly.js inlined once: it opens in a
browser with no network. Every string from the run is escaped; every figure's JSON is kept from closing its
script element.
"""
from __future__ import annotations

import html
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ..run.devices_gap import GAP_FILE, GAP_RULE, table_cells, TABLE_HEADER
from ..run.vl_gap import VL_TABLE_HEADER, vl_table_cells
from ..errors import WorkbenchError
from ..model.load import is_quantized_dir
from ..files.workspace import atomic_write_text, file_sha256, library_versions, Workspace
from ..devices.profiles import load_devices
from ..devices.projection import DEFAULT_CONTEXT, project_plans
from ..quantize.plan import QuantPlan
from ..run.profile import BANDWIDTH_STEP, RuntimeProfile
from ..units import format_bytes
from .style import METRIC_WORDS

__all__ = ["Report", "RunNotFound", "Candidates", "find_run", "gather_run", "candidate_plans", "build_report",
           "write_report", "projection_table_html", "projection_summary_html", "html_table"]

PROFILE_FILE = "profile.json"  # `workbench profile DIR --json > RUN/profile.json`


class RunNotFound(WorkbenchError):
    """The path holds no run the report can describe."""


# -- finding and reading a run -------------------------------------------------------------------------
def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


SEARCH_DEPTH = 3  # an app run keeps conversions at convert/<model>/<target>/conversion.json


def _below(d: Path, name: str, depth: int = SEARCH_DEPTH) -> list[Path]:
    """Files called ``name`` in ``d`` and up to ``depth`` folders below it (not every folder of a large tree)."""
    found, level = [], [d]
    for _ in range(depth + 1):
        found += [x / name for x in level if (x / name).is_file()]
        level = [c for x in level for c in sorted(x.iterdir())
                 if c.is_dir() and not c.is_symlink() and not c.name.startswith(".")]  # a link may lead to /
    return sorted(found)


def _quantized_below(d: Path) -> list[Path]:
    return sorted({m.parent for m in _below(d, "manifest.json") if is_quantized_dir(m.parent)})


def _has_run(d: Path) -> bool:
    """Whether ``d`` holds anything a report describes (a plan, a quantized model, a conversion, an app report)."""
    if (d / "plan.json").is_file() or (d / "report.json").is_file() or is_quantized_dir(d):
        return True
    return bool(_below(d, "conversion.json") or _quantized_below(d) or _below(d, GAP_FILE))


def find_run(path: str | Path) -> Path:
    """The run folder ``path`` names: itself, or in a workspace the newest ``app/run-*`` with something in it."""
    p = Path(path).expanduser()
    if not p.exists():
        raise RunNotFound(f"'{p}' does not exist; pass a workspace or an app run folder (<workspace>/app/run-*)")
    if not p.is_dir():
        raise RunNotFound(f"'{p}' is a file; pass a workspace or an app run folder (<workspace>/app/run-*)")
    app = p / "app"
    if app.is_dir():
        runs = sorted((d for d in app.iterdir() if d.is_dir() and _has_run(d)), key=lambda d: d.stat().st_mtime)
        if runs:
            return runs[-1].resolve()
    if _has_run(p):
        return p.resolve()
    raise RunNotFound(f"'{p}' holds no workbench run (no plan.json, report.json, quantized model or conversion.json "
                      "below it, nor an app/run-* folder with one); pass an app run folder (<workspace>/app/run-*), "
                      "a workspace with one, or a folder of `workbench quantize` / `convert` outputs")


def _workspace_of(run: Path, given: Path) -> Path | None:
    """The workspace a run belongs to: the one passed, or the folder above ``app/`` for an app run."""
    if (given / "app").is_dir():
        return given
    return run.parent.parent if run.parent.name == "app" else None


def _host_from_workspace(root: Path | None) -> dict | None:
    """The newest cached host read bandwidth (``host-bandwidth/`` in the workspace), or None."""
    if root is None or not (root / BANDWIDTH_STEP).is_dir():
        return None
    arts = Workspace(root).list(BANDWIDTH_STEP)
    if not arts:
        return None
    a = max(arts, key=lambda a: a.manifest.get("created", ""))
    return {**a.manifest.get("inputs", {}), **a.result, "artifact": str(a.path)}


def _files_with_hashes(directory: Path, manifest: Mapping | None = None) -> list[dict]:
    """Every file below ``directory`` with size and SHA-256 (the manifest's, where it lists the file)."""
    listed = (manifest or {}).get("files", {})
    out = []
    root = directory.resolve()
    for f in sorted(directory.rglob("*")):  # rglob does not descend into linked folders
        if f.name.startswith("."):
            continue
        rel = f.relative_to(directory).as_posix()
        if f.is_symlink() and root not in f.resolve().parents:
            out.append({"file": rel, "bytes": None, "sha256": "a link out of the folder: not followed",
                        "hash_from": "skipped"})
            continue
        if not f.is_file():
            continue
        meta = listed.get(rel)
        if meta and meta.get("size") == f.stat().st_size and meta.get("sha256"):
            out.append({"file": rel, "bytes": meta["size"], "sha256": meta["sha256"], "hash_from": "manifest"})
        else:
            out.append({"file": rel, "bytes": f.stat().st_size, "sha256": file_sha256(f), "hash_from": "computed"})
    return out


def gather_run(path: str | Path) -> dict:
    """Everything the report shows, as JSON-able data read from the run's own files (nothing is re-measured)."""
    given = Path(path).expanduser()
    run = find_run(given)
    app_report = None
    if not is_quantized_dir(run):
        doc = _read_json(run / "report.json")
        app_report = doc if isinstance(doc, dict) and "versions" in doc else None
    quantized = []
    dirs = [run] if is_quantized_dir(run) else _quantized_below(run)
    for d in dirs:
        manifest = _read_json(d / "manifest.json")
        qreport = _read_json(d / "report.json") or {}
        qinfo = _read_json(d / "quantization.json") or {}
        quantized.append({
            "name": d.name, "path": str(d), "method": manifest.get("method"), "source": manifest.get("source"),
            "plan": _read_json(d / "plan.json"), "bits_per_weight": qinfo.get("bits_per_weight"),
            "cost": qreport.get("cost") or (qreport if "kl_divergence" in qreport else None),  # app / CLI
            "layers": qinfo.get("layers", []), "created": qinfo.get("created"),
            "versions": manifest.get("versions", {}), "files": _files_with_hashes(d, manifest),
            "manifest_sha256": file_sha256(d / "manifest.json")})
    quantized.sort(key=lambda q: (q.get("created") or "", q["path"]))
    gaps = []
    for g in _below(run, GAP_FILE):
        doc = _read_json(g)
        if isinstance(doc, dict) and isinstance(doc.get("rows"), list):
            gaps.append({**doc, "file": str(g)})
    gap_dirs = {Path(g["file"]).parent for g in gaps}
    conversions = []
    for c in _below(run, "conversion.json"):
        if c.parent.parent in gap_dirs:  # measured for a comparison on the devices: shown in its table
            continue
        doc = _read_json(c)
        if isinstance(doc, dict) and "target" in doc:
            doc["files"] = _files_with_hashes(c.parent)
            doc["folder"] = str(c.parent)
            conversions.append(doc)
    profiles, host = [], None
    if app_report:
        profiles, host = app_report.get("profiles") or [], app_report.get("host_bandwidth")
    prof_doc = _read_json(run / PROFILE_FILE) if (run / PROFILE_FILE).is_file() else None
    if isinstance(prof_doc, dict):
        profiles = profiles or [{k: v for k, v in p.items() if k not in ("decode_bound_tps", "fraction_of_bound")}
                                for p in prof_doc.get("profiles", [])]
        host = host or prof_doc.get("host_bandwidth")
    host = host or _host_from_workspace(_workspace_of(run, given))
    plan = _read_json(run / "plan.json") if (run / "plan.json").is_file() else None
    if plan is None and app_report and app_report.get("plan"):
        plan = app_report["plan"]["plan"]
    if plan is None and quantized:
        plan = quantized[-1]["plan"]
    model = (app_report or {}).get("model")
    if model is None and quantized:
        model = {"name": Path(quantized[-1]["source"] or quantized[-1]["path"]).name, "path": quantized[-1]["source"]}
    return {"run": str(run), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": model, "plan": plan,
            "app_report": app_report, "quantized": quantized, "conversions": conversions, "devices_gaps": gaps,
            "profiles": profiles,
            "host_bandwidth": host,
            "plan_sha256": file_sha256(run / "plan.json") if (run / "plan.json").is_file() else None,
            "versions": {"report": library_versions(), "run": (app_report or {}).get("versions")
                         or (quantized[-1]["versions"] if quantized else None)}}


# -- projections of the run's plans ---------------------------------------------------------------------
def _shape_source(record: Mapping):
    """What the model's shapes are read from: a quantized model's folder in the run, else the model's path."""
    for q in reversed(record["quantized"]):
        if (Path(q["path"]) / "config.json").is_file():
            return q["path"]
    path = (record.get("model") or {}).get("path")
    return path if path and (Path(path) / "config.json").is_file() else None


class Candidates:
    """Plans to project, each once whatever it is called (by content, ``QuantPlan.content_hash``), and the
    measured ones' KL and bits/weight under the label the plan was first given: the rows of the quality / size /
    speed chart."""

    def __init__(self):
        self.plans: dict = {}
        self.rows: list[dict] = []
        self._labels: dict = {}  # plan hash -> label

    def add(self, label: str, plan, kl: float | None = None, bits: float | None = None) -> str:
        plan = plan if isinstance(plan, QuantPlan) else QuantPlan.from_dict(plan)
        h = plan.content_hash()
        if h in self._labels:
            label = self._labels[h]
        else:
            base, n = label, 2
            while label in self.plans:
                label, n = f"{base} ({n})", n + 1
            self.plans[label], self._labels[h] = plan, label
        if kl is not None and bits is not None and not any(r["label"] == label for r in self.rows):
            self.rows.append({"label": label, "kl_divergence": kl, "bits_per_weight": bits})
        return label


def candidate_plans(record: Mapping) -> Candidates:
    """The run's quantized models' plans (with their measured KL), the Precisions tab's evaluated plans, and the
    run's plan."""
    c = Candidates()
    for q in record["quantized"]:
        if q.get("plan"):
            cost = q.get("cost") or {}
            c.add(q["name"], q["plan"], cost.get("kl_divergence"), q.get("bits_per_weight"))
    for p in (record.get("app_report") or {}).get("precision_evaluations", []):
        if p.get("plan"):
            c.add(p["label"], p["plan"], p.get("kl_divergence"), p.get("bits_per_weight"))
    if record.get("plan"):
        c.add("run plan", record["plan"])
    return c


# -- HTML -----------------------------------------------------------------------------------------------
def _e(x) -> str:
    return html.escape("" if x is None else str(x))


def html_table(header: Sequence[str], rows: Sequence[Sequence], cls: str = "") -> str:
    """A table of escaped cells (pass ``Markup``-free plain values; numbers formatted by the caller)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='{_e(cls)}'><tr>{head}</tr>{body}</table>"


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _pm(v, err, spec: str) -> str:
    if v is None:
        return "-"
    if err is None or err != err:
        return format(v, spec)
    return f"{format(v, spec)} ± {format(err, spec.lstrip('+'))}"


def _yes(x) -> str:
    return "unknown" if x is None else ("yes" if x else "NO")


def projection_rows(projections: Mapping[str, Sequence]) -> list[list[str]]:
    """Per plan and device: the figures a person compares (what ``projection_table_html`` shows)."""
    rows = []
    for label, ps in projections.items():
        for p in ps:
            v = p.vendor
            fitted = v is not None and v.decode_tps is not None
            held = "" if not fitted else f" held out by {v.held_out_by}, {v.decode_n}"
            err = (f" (±{p.efficiency_error:.0%}{held}"
                   + (f"; no {v.family} model measured" if fitted and not v.family_measured else "")
                   + ("; extrapolated" if fitted and v.extrapolated else "") + ")" if p.efficiency_error else "")
            proj = f"{p.projected_decode_tps:,.1f}{err}" if p.projected_decode_tps is not None else "-"
            near = v.nearest if v is not None else None
            nearest = (f"{near['model']} {near['precision']}, {near['vendor_device']}, ctx {near['context']}: "
                       f"{near['decode_tps']:.1f} tok/s ({near['source'].split(',')[0]})" if near else "-")
            first = (f"{v.ttft_ms:,.0f} (±{v.ttft_error:.0%})" if v is not None and v.ttft_ms is not None
                     and v.ttft_error is not None else "-")
            runtime = (f"{p.runtime}" + (f" {v.precision}" if v is not None else "")
                       + ((" (measured on a similar chip)" if fitted else " (no vendor fit)")
                          if v is not None and v.fallback else "")
                       ) if p.runtime else "none: practitioners' efficiency"
            bad = p.unsupported_layers
            npu = "none" if not bad else f"{len(bad)}: " + ", ".join(n for n, _ in bad[:3]) + (
                " ..." if len(bad) > 3 else "") + f" ({', '.join(sorted({q for _, q in bad}))})"
            rows.append([label, p.device, runtime, f"{p.bits_per_weight:.2f}", format_bytes(p.total_bytes),
                         _fits_cell(p), _yes(p.fits_npu),
                         _fmt(p.decode_bound_tps, ",.1f"), proj, first, _fmt(p.prefill_bound_ms, ",.1f"), nearest,
                         npu])
    return rows


PROJECTION_HEADER = ("plan", "device", "runtime", "bits/w", "memory", "fits RAM", "fits NPU limit",
                     "decode bound tok/s", "projected tok/s (fit error)", "first token ms (held out)",
                     "prefill bound ms", "nearest vendor measurement", "layers the NPU cannot run")


def projection_table_html(projections: Mapping[str, Sequence]) -> str:
    return html_table(PROJECTION_HEADER, projection_rows(projections), "projection")


SUMMARY_HEADER = ("plan", "device", "tokens/s", "first token", "fits in memory")


def _fits_cell(p) -> str:
    """Whether weights + KV cache + buffers fit the device's RAM, with both sizes, or why that is unknown."""
    if p.fits_ram is None:
        return f"unknown: {p.ram_why or 'no RAM figure for this device'}"
    return f"{'yes' if p.fits_ram else 'NO'}: {format_bytes(p.total_bytes)} of {format_bytes(p.ram_bytes)}"


def projection_summary_rows(projections: Mapping[str, Sequence]) -> list[list[str]]:
    """The answer a person looks for first, per plan and device: decode speed with its error, time to first
    token, whether it fits; a figure that is not projected says why."""
    rows = []
    for label, ps in projections.items():
        for p in ps:
            v = p.vendor
            if p.projected_decode_tps is None:
                why = (v.basis if v is not None and v.decode_tps is None else
                       next((n for n in p.notes if n.startswith("no decode bound")), "no bandwidth or fit"))
                tps = f"not projected: {why}"
            else:
                tps = f"{p.projected_decode_tps:,.0f}" + (f" (±{p.efficiency_error:.0%})" if p.efficiency_error
                                                          else "")
            if v is not None and v.ttft_ms is not None:
                first = f"{v.ttft_ms:,.0f} ms" + (f" (±{v.ttft_error:.0%})" if v.ttft_error is not None else "")
            elif p.prefill_bound_ms is not None:
                first = f"at least {p.prefill_bound_ms:,.1f} ms (bound; no vendor fit)"
            else:
                first = "not projected: no compute or bandwidth figure"
            rows.append([label, p.device, tps, first, _fits_cell(p)])
    return rows


def projection_summary_html(projections: Mapping[str, Sequence]) -> str:
    """The summary table (tokens/s, first token, fits), and every other column behind a "details" fold."""
    return (html_table(SUMMARY_HEADER, projection_summary_rows(projections), "projection")
            + "<details><summary>details: runtime, bits per weight, bounds, the nearest vendor measurement, layers "
            "the NPU cannot run</summary>" + projection_table_html(projections) + "</details>")


def _figure_div(i: int, name: str, fig) -> str:
    """One figure as a div and the script that draws it; its JSON cannot end the script element early."""
    spec = fig.to_plotly_json()
    data = json.dumps(spec.get("data", []), default=_json_default).replace("</", "<\\/")
    layout = json.dumps(spec.get("layout", {}), default=_json_default).replace("</", "<\\/")
    div = f"figure-{i}"
    return (f"<div class='figure' data-name='{_e(name)}'><div id='{div}' class='workbench-figure'></div>"
            f"<script>Plotly.newPlot('{div}', {data}, {layout}, "
            "{\"displaylogo\": false, \"responsive\": true});</script></div>")


def _json_default(o):
    import numpy as np
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    return str(o)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1300px;color:#17202a}
h1{font-size:22px} h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;margin:8px 0;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top} th{background:#f4f6f7} .note{color:#5d6d7e;font-size:13px}
code{font-size:12px} .gap{color:#c0392b;font-weight:bold} .figure{margin:12px 0}
"""


@dataclass
class Report:
    """The page, the figures on it (by name, in order) and the data it was made from."""

    html: str
    figures: dict = field(default_factory=dict)
    record: dict = field(default_factory=dict)
    projections: dict = field(default_factory=dict)


def build_report(path: str | Path, *, devices: Sequence[str] | None = None, context: int | None = None,
                 pareto_device: str | None = None) -> Report:
    """Gather a run (see :func:`gather_run`), project its plans onto ``devices`` (default: every profile) and
    render the page."""
    from .graph import make_conversion_figure, make_device_gap_figure
    from .precision import make_pareto_figure
    from .profile import make_profile_figure
    from .projection import (make_device_figure, make_host_bound_figure, make_speed_pareto_figure,
                                    make_vendor_fit_figure)
    from .quantize import make_layer_error_figure

    record = gather_run(path)
    context = DEFAULT_CONTEXT if context is None else context
    figures: dict = {}
    notes: list[str] = []
    app = record.get("app_report") or {}
    points = app.get("precision_evaluations") or []
    if points:
        figures["Precisions: size against damage"] = make_pareto_figure(points)
    latest = record["quantized"][-1] if record["quantized"] else None
    if latest and latest["layers"]:
        fig = make_layer_error_figure(latest["layers"])
        fig.update_layout(title=f"Relative weight error per layer ({latest['name']})")
        figures["Quantized model: weight error per layer"] = fig
    if any(c.get("kl_divergence") is not None for c in record["conversions"]):
        figures["Conversions against the simulation"] = make_conversion_figure(record["conversions"])
    for g in record["devices_gaps"]:
        if any(r.get("prefill") or r.get("decode") for r in g["rows"]):
            figures[f"On the devices: plan {g.get('plan_hash')}"] = make_device_gap_figure(
                g["rows"], title=f"The simulation against the devices (plan {g.get('plan_hash')})")
    profiles = [RuntimeProfile(**p) for p in record["profiles"]]
    if profiles:
        figures["Profile on this host"] = make_profile_figure(profiles)
    host = record.get("host_bandwidth")
    if profiles and host and any(p.decode_tokens_per_second and p.decode_bytes for p in profiles):
        figures["Host decode against its bound"] = make_host_bound_figure(profiles, host["read_gbps"])

    projections: dict = {}
    shape = _shape_source(record)
    cands = candidate_plans(record)
    plans, rows = cands.plans, cands.rows
    if shape is None:
        notes.append("no projection: the run holds no model config (quantize a model, or keep the model folder)")
    elif not plans:
        notes.append("no projection: the run holds no plan")
    else:
        names = list(devices) if devices else list(load_devices())
        projections = project_plans(shape, names, plans, context=context)
        figures["Plans on devices"] = make_device_figure(projections)
        if any(p.vendor is not None and p.vendor.points for ps in projections.values() for p in ps):
            figures["Vendor measurements and the fit"] = make_vendor_fit_figure(projections)
        speeds = [p.device for p in next(iter(projections.values())) if p.projected_decode_tps is not None]
        if rows and speeds:
            figures["Quality, size and projected speed"] = make_speed_pareto_figure(
                rows, projections, pareto_device or speeds[0])
    page = _render(record, figures, projections, context, notes)
    return Report(page, figures, record, projections)


def _render(record: Mapping, figures: Mapping, projections: Mapping, context: int, notes: list[str]) -> str:
    from plotly.offline import get_plotlyjs
    app = record.get("app_report") or {}
    parts = [f"<h1>workbench run report</h1><p class='note'>run <code>{_e(record['run'])}</code>; report made "
             f"{_e(record['created'])}</p>", _words_html()]  # what the quality figures below mean
    # model and plan
    m = record.get("model") or {}
    parts.append("<h2>Model and plan</h2>")
    if m:
        params = f", {m['parameters']:,} parameters" if m.get("parameters") else ""
        layers = f", {m['layers']} quantizable layers" if m.get("layers") else ""
        parts.append(f"<p>model <b>{_e(m.get('name'))}</b> (<code>{_e(m.get('path'))}</code>{_e(params)}"
                     f"{_e(layers)})</p>")
    plan = record.get("plan")
    if plan:
        info = app.get("plan") or {}
        head = (f"plan {_e(info.get('hash'))}: " if info.get("hash") else "plan: ") + (
            f"{_e(plan.get('method', 'rtn'))}, default {_e(plan.get('default'))}, group size "
            f"{_e(plan.get('group_size') or 'per-channel')}, "
            f"{'symmetric' if plan.get('symmetric', True) else 'asymmetric'}")
        if info.get("bits_per_weight") is not None:
            head += f", {info['bits_per_weight']:.2f} bits/weight, {format_bytes(info.get('size_bytes', 0))}"
        parts.append(f"<p>{head}</p>")
        rules = plan.get("rules") or []
        if rules:
            parts.append(html_table(("pattern", "precision"), [(r.get("pattern"), r.get("precision") or "unchanged")
                                                               for r in rules]))
    # quality
    parts.append("<h2>Quality</h2><p class='note'>against the float model on the same held-out windows; ± is the "
                 "standard error over windows</p>")
    qrows = []
    for q in record["quantized"]:
        c = q.get("cost") or {}
        if c:
            qrows.append([q["name"], q.get("method"), _fmt(c.get("reference_perplexity"), ".3f"),
                          _fmt(c.get("perplexity"), ".3f"),
                          _pm(c.get("perplexity_change"), c.get("perplexity_change_stderr"), "+.3f"),
                          _pm(c.get("kl_divergence"), c.get("kl_divergence_stderr"), ".5f"),
                          _pm(c.get("top1_agreement"), c.get("top1_agreement_stderr"), ".4f"),
                          _fmt(q.get("bits_per_weight"), ".2f"), _fmt(c.get("tokens"), ",")])
        else:
            qrows.append([q["name"], q.get("method"), "-", "-", "-", "-", "-", _fmt(q.get("bits_per_weight"), ".2f"),
                          "not evaluated"])
    if qrows:
        parts.append(html_table(("quantized model", "method", "float perplexity", "perplexity", "change", "KL",
                                 "top-1", "bits/w", "tokens"), qrows))
    points = app.get("precision_evaluations") or []
    if points:
        parts.append("<p>Plans evaluated in Precisions (round to nearest, on the sweep's tokens):</p>")
        parts.append(html_table(("plan", "bits/w", "size", "KL", "perplexity", "top-1", "tokens"), [
            (p["label"], f"{p['bits_per_weight']:.2f}", format_bytes(p['size_bytes']), f"{p['kl_divergence']:.3e}",
             f"{p['perplexity']:.3f}", f"{p['top1_agreement']:.4f}", f"{p['tokens']:,}") for p in points]))
    if not qrows and not points:
        parts.append("<p class='note'>nothing was evaluated in this run</p>")
    # conversions
    parts.append("<h2>Conversions and their gaps</h2>")
    if record["conversions"]:
        crow = []
        for c in record["conversions"]:
            sim = (c.get("simulation") or {}).get("kl_divergence")
            crow.append([c["target"], _fmt(c.get("kl_divergence"), ".5f"), _fmt(sim, ".5f"),
                         _fmt(c.get("top1_agreement"), ".4f"), _fmt(c.get("top1_agreement_vs_simulation"), ".4f"),
                         _fmt(c.get("eval_tokens"), ","), c.get("gap") or ("none" if c.get("runnable") else
                                                                           "not runnable here: SDK commands written")])
        parts.append(html_table(("target", "KL (converted)", "KL (simulation)", "top-1 vs float",
                                 "top-1 vs simulation", "tokens", "gap"), crow))
        for c in record["conversions"]:
            for n in c.get("notes", []):
                parts.append(f"<p class='note'>{_e(c['target'])}: {_e(n)}</p>")
    else:
        parts.append("<p class='note'>no conversion in this run</p>")
    # the plan on the devices
    parts.append("<h2>On the devices</h2>")
    if record["devices_gaps"]:
        parts.append(_devices_gaps_html(record["devices_gaps"]))
    else:
        parts.append("<p class='note'>not compared on the devices (the app's Export tab, Compare on the devices, or "
                     "bench/devices_gap.py writes devices_gap.json)</p>")
    # host
    parts.append("<h2>Host profile</h2>")
    host = record.get("host_bandwidth")
    if host:
        parts.append(f"<p>read bandwidth <b>{host['read_gbps']:.1f} GB/s</b> on {_e(host.get('cpu'))} "
                     f"(host {_e(host.get('host'))}, measured {_e(host.get('measured'))}; "
                     f"{_e(host.get('method'))})</p>")
    else:
        parts.append("<p class='note'>this host's read bandwidth was not measured for this run (`workbench profile` "
                     "measures and caches it)</p>")
    if record["profiles"]:
        prow = []
        for d in record["profiles"]:
            p = RuntimeProfile(**d)
            bound = p.decode_bound(host["read_gbps"]) if host else None
            frac = p.fraction_of_bound(host["read_gbps"]) if host else None
            prow.append([p.name, p.runtime, f"{p.size_bytes / 1e6:.2f}",
                         ", ".join(f"{n}: {ms:.1f}" for n, ms in p.prefill_ms.items()),
                         _fmt(p.decode_tokens_per_second, ",.0f"), _fmt(bound, ",.0f"), _fmt(frac, ".2f"),
                         _fmt(p.rss_added_mb, ".0f")])
        parts.append(html_table(("model", "runtime", "MB", "prefill ms by prompt", "decode tok/s", "bound tok/s",
                                 "share of the bound", "memory added (MB)"), prow))
    else:
        parts.append("<p class='note'>nothing was profiled in this run</p>")
    # projections
    parts.append(f"<h2>Projected to devices</h2><p class='note'>{context}-token KV cache; decode bound = bandwidth / "
                 "bytes read per token, projected = bound x the efficiency fitted to published measurements of the "
                 "device's class (its fit error in brackets); memory = weights + KV cache + graph buffers, not the "
                 "runtime's code</p>")
    if projections:
        parts.append(projection_summary_html(projections))
    for n in notes:
        parts.append(f"<p class='note'>{_e(n)}</p>")
    # figures
    parts.append("<h2>Charts</h2>")
    parts += [_figure_div(i, name, fig) for i, (name, fig) in enumerate(figures.items())]
    # provenance
    parts.append("<h2>Provenance</h2>")
    versions = record.get("versions") or {}
    for what, v in (("run made with", versions.get("run")), ("report made with", versions.get("report"))):
        if v:
            parts.append(f"<p>{what}: " + ", ".join(f"{_e(k)} {_e(x)}" for k, x in v.items()) + "</p>")
    if record.get("plan_sha256"):
        parts.append(f"<p>plan.json sha256 <code>{_e(record['plan_sha256'])}</code></p>")
    for q in record["quantized"]:
        parts.append(f"<p>quantized model <code>{_e(q['path'])}</code> from <code>{_e(q.get('source'))}</code>; "
                     f"manifest.json sha256 <code>{_e(q['manifest_sha256'])}</code></p>")
        parts.append(_files_table(q["files"]))
    for c in record["conversions"]:
        qm = c.get("quantized_model") or {}
        up = c.get("upstream") or {}
        parts.append(f"<p>{_e(c['target'])} conversion <code>{_e(c['folder'])}</code>"
                     + (f" of <code>{_e(qm.get('path'))}</code> (manifest sha256 <code>{_e(qm.get('manifest_sha256'))}"
                        "</code>)" if qm else "")
                     + ("; workspace keys upstream: " + ", ".join(f"{_e(k)} {_e(v)}" for k, v in up.items())
                        if up else "") + "</p>")
        parts.append(_files_table(c["files"]))
    if host and host.get("artifact"):
        parts.append(f"<p>host bandwidth cached in <code>{_e(host['artifact'])}</code></p>")
    body = "\n".join(parts)
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>workbench run report</title>"
            f"<style>{CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head>"
            f"<body>{body}</body></html>\n")


def _words_html() -> str:
    """What KL, nats, top-1 and perplexity mean, one line each (``style.METRIC_WORDS``), hover text included."""
    return "<p class='note'>" + "<br>".join(f"<span title='{_e(w)}'>{_e(w)}</span>" for w in METRIC_WORDS.values()) \
        + "</p>"


def _devices_gaps_html(gaps: Sequence[Mapping]) -> str:
    """Each comparison's table (``workbench.run.devices_gap.table_cells``), its flagged gaps in red."""
    parts = []
    for g in gaps:
        parts.append(f"<p>plan {_e(g.get('plan_hash'))} of <code>{_e(g.get('model'))}</code>, "
                     f"{_e(_fmt(g.get('max_tokens'), ',', 'all'))} held-out tokens, HTP {_e(g.get('soc'))}"
                     f"{'' if g.get('complete') else ' (incomplete: the run stopped before every target)'}; KL / "
                     f"top-1 against the float model; tok/s: the runtime's own where it times itself; "
                     f"<code>{_e(g['file'])}</code></p>")
        head = "".join(f"<th>{_e(h)}</th>" for h in TABLE_HEADER)
        body = []
        for r in g["rows"]:
            cells = [_e(c) for c in table_cells(r)]
            if r.get("gap"):
                cells[-1] = f"<span class='gap'>GAP</span> {cells[-1]}"
            body.append("<tr class='gap-row'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        if g["rows"]:
            parts.append(f"<table class='devices-gap'><tr>{head}</tr>{''.join(body)}</table>"
                         f"<p class='gap-rule'>{_e(GAP_RULE)}</p>" + _words_html())
        if g.get("vl_rows"):  # a VLM: each target's vision path against the float model
            parts.append("<p>vision-language rows: image-embedding error, answer-token KL / top-1 and image-text "
                         "matching against the float model on the held-out pictures</p>"
                         + html_table(VL_TABLE_HEADER, [vl_table_cells(r) for r in g["vl_rows"]], "devices-gap-vl"))
    return "".join(parts)


def _files_table(files: list[dict]) -> str:
    return html_table(("file", "bytes", "sha256", "hash from"),
                      [(f["file"], "" if f["bytes"] is None else f"{f['bytes']:,}", f["sha256"], f["hash_from"])
                       for f in files], "files")


def write_report(path: str | Path, out: str | Path, **kwargs) -> Report:
    """Build the report of ``path`` and write it to ``out`` atomically (a killed run leaves no half page)."""
    out = Path(out)
    if out.is_dir():
        raise WorkbenchError(f"--out '{out}' is a directory; name the HTML file to write, e.g. {out / 'report.html'}")
    report = build_report(path, **kwargs)
    atomic_write_text(out, report.html)
    return report
