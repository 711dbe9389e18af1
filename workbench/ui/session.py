"""The app's one session: model, plan, calibration, the quantized model and what was made from it.

Every tab of ``WorkbenchApp`` reads and writes this object (its traits are observed) instead of
keeping its own copy, so the plan edited in Precisions is the plan Quantize runs, the model Quantize
made (AWQ included) is exactly what Export converts, and Download packs that same run.

    session = AppSession(out_dir="workspace/app/run-1")
    session.load("demo")                          # plan: uniform INT4 until another is chosen
    session.plan = session.plan.with_override("*.0.mlp.down_proj", "fp16")
    session.set_quantized(qm, cost)               # saved under out_dir/quantized/<method>-<plan hash>/
    report = session.convert("ort-int4")          # converts session.quantized; conversion.json names the plan
    session.write_archive(figures)                # out_dir/<run>.zip: model, conversions, plan, report

Everything is written below ``out_dir`` (by default ``<workspace>/app/run-<time>``), never beside
the notebooks.
"""
from __future__ import annotations

import html
import json
import os
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Mapping, Sequence

import ipywidgets as widgets
import traitlets

from ..precision.autoplan import plan_footprint
from ..errors import PlanError, WorkbenchError, WorkspaceError
from ..model.load import LoadedModel, load_model
from ..quantize.plan import QuantPlan
from ..files.workspace import Workspace, atomic_write_json, atomic_write_text, library_versions, model_fingerprint, read_json_file
from ..charts.report import build_report
from ..precision.overrides import write_overrides
from ..quantize.storage import weight_file_bytes
from ..run.devices_gap import format_table, GAP_FILE
from ..targets.convert import convert, PreparedModels
from .vision import vision_sentences

__all__ = ["AppSession", "SessionLabel", "describe_plan", "default_run_dir", "run_model", "ARCHIVE_SEND_LIMIT", "RUN_FILE"]

ARCHIVE_SEND_LIMIT = 1 << 30  # bytes; a bigger archive stays on disk (its path is shown) instead of crossing the page
RUN_FILE = "run.json"  # in a run folder: the one model its files were made from (name, path, fingerprint)
OVERRIDE_FILES = (("llamacpp", "llamacpp-tensor-types.txt"), ("mnn", "mnn-quant-config.json"))


def plan_name(plan: QuantPlan, lm: LoadedModel | None = None) -> str:
    """``uniform INT4`` or ``mixed INT4 / INT8 / FP16``: a plan by what it does (its hash only tells plans apart)."""
    if lm is None:
        outside = {"*embed_tokens", "lm_head"}
        return (f"uniform {plan.default.upper()}" if all(r.pattern in outside for r in plan.rules)
                else f"mixed, {plan.default.upper()} by default")
    body = [p for info, p in zip(lm.layers, plan.resolve([i.name for i in lm.layers]).values())
            if info.kind == "linear" and info.name != "lm_head"]
    kinds = sorted({(p or "fp16").upper() for p in body})
    return f"uniform {kinds[0]}" if len(kinds) == 1 else "mixed " + " / ".join(kinds)


def _bits_why(plan: QuantPlan, lm: LoadedModel) -> str:
    """Why bits/weight reads above the plan's integer width: the layers kept float and their share of the weights."""
    total = sum(i.parameters for i in lm.layers) or 1
    kept = [(i.name.removeprefix("model."), i.parameters) for i, p in
            zip(lm.layers, plan.resolve([i.name for i in lm.layers]).values()) if p is None or p.startswith("fp")]
    share = sum(n for _, n in kept) / total
    if share < 0.05:
        return ""
    names = ", ".join(dict.fromkeys(n for n, _ in kept))
    return f": {names} kept at FP16 hold {share:.0%} of the weights"


def describe_plan(plan: QuantPlan, lm: LoadedModel | None = None) -> str:
    """``uniform INT4, plan 1a2b3c4d (AWQ, g128, 7.09 bits/w: embed_tokens, lm_head kept at FP16 hold 52% of the
    weights)``: what a tab shows to say which plan it means, by name first, and why its bits/weight are what they
    are."""
    parts = [plan.method.upper(), f"g{plan.group_size}" if plan.group_size else "per-channel"]
    if not plan.symmetric:
        parts.append("asym")
    if not plan.scale_search:
        parts.append("min/max ranges")
    if lm is not None:
        parts.append(f"{plan_footprint(lm, plan)['bits_per_weight']:.2f} bits/w" + _bits_why(plan, lm))
    return f"{plan_name(plan, lm)}, plan {plan.content_hash()} ({', '.join(parts)})"


def default_run_dir(workspace: Workspace | None = None) -> Path:
    """Where a new app session writes: ``<workspace>/app/run-<date>-<time>`` (absolute; ``-2``, ``-3``... when
    a run of that second exists already)."""
    ws = workspace or Workspace()
    base = ws.root.resolve() / "app" / time.strftime("run-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def run_model(run_dir: Path) -> dict | None:
    """The model a run folder's files were made from (its ``run.json``), or None for a folder not yet used."""
    path = Path(run_dir) / RUN_FILE
    return read_json_file(path, "run record", error=WorkspaceError) if path.is_file() else None


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


class AppSession(traitlets.HasTraits):
    """What every tab shares. Tabs observe the traits they show; actions here do the library calls."""

    lm = traitlets.Any(None, allow_none=True)  # LoadedModel
    plan = traitlets.Instance(QuantPlan, allow_none=True)
    calibration = traitlets.Any(None, allow_none=True)  # (CalibrationSet, CalibrationStats) of the Calibrate tab
    sensitivity = traitlets.Any(None, allow_none=True)  # SensitivityReport
    quantized = traitlets.Any(None, allow_none=True)  # the latest QuantizedModel
    quantized_path = traitlets.Instance(Path, allow_none=True)  # where it was saved
    cost = traitlets.Any(None, allow_none=True)  # its QuantCost, measured by the Quantize tab
    conversions = traitlets.List()  # ConversionReport of the latest quantized model, one per target
    profiles = traitlets.List()  # RuntimeProfile of what the conversions wrote
    host = traitlets.Dict(None, allow_none=True)  # this host's read bandwidth when they were timed (host_bandwidth)
    devices_gap = traitlets.Any(None, allow_none=True)  # the latest DevicesGap (Export tab, Compare on the devices)
    out_dir = traitlets.Instance(Path)
    fingerprint = traitlets.Unicode("")  # the loaded model's (``model_fingerprint``): a run folder holds one model's files
    archive_path = traitlets.Instance(Path, allow_none=True)
    image = traitlets.Instance(Path, allow_none=True)  # a vision-language model: the picture Generate asks about
    vision_quality = traitlets.Any(None, allow_none=True)  # its VisionQuality: the quantized model on pictures

    def __init__(self, *, out_dir: str | Path | None = None, workspace: Workspace | None = None):
        self.workspace = workspace or Workspace()
        super().__init__(out_dir=Path(out_dir).resolve() if out_dir else default_run_dir(self.workspace))
        self._prepared = None  # (quantized model, PreparedModels) for conversions

    # -- state changes ------------------------------------------------------------------------------
    def load(self, model: str | Path) -> LoadedModel:
        """Load a model and start over: uniform INT4 plan, nothing calibrated, quantized or converted."""
        lm = load_model(str(model).strip())
        self.set_model(lm)
        return lm

    def set_model(self, lm: LoadedModel) -> None:
        """Start over on ``lm``. A run folder describes one model: when it holds another model's files (one
        loaded before in this session, or a ``run.json`` naming another fingerprint), outputs move to a new
        run folder, so the report and the zip never mix two models."""
        fingerprint = model_fingerprint(lm.model)
        owner = run_model(self.out_dir)
        if (self.lm is not None and fingerprint != self.fingerprint) or \
                (owner is not None and owner.get("fingerprint") != fingerprint):
            self.out_dir = default_run_dir(self.workspace)
        self._prepared = None
        with self.hold_trait_notifications():
            self.fingerprint = fingerprint
            self.calibration = self.sensitivity = self.quantized = self.quantized_path = self.cost = None
            self.conversions, self.profiles, self.host = [], [], None
            self.archive_path = self.devices_gap = self.image = self.vision_quality = None
            self.plan = QuantPlan.uniform("int4")
            self.lm = lm
        self._claim_run_dir()

    def _claim_run_dir(self) -> None:
        """Write ``run.json`` (the loaded model's name, path and fingerprint) in the outputs folder."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.out_dir / RUN_FILE, {"model": self.lm.name, "path": str(self.lm.path),
                                                    "fingerprint": self.fingerprint})

    def set_quantized(self, qm, cost=None, vision=None) -> Path:
        """Make ``qm`` the session's quantized model: save it (with its measured cost, and a VLM's ``vision``
        quality on pictures) and drop older conversions."""
        if self.lm is None:
            raise PlanError("load a model first")
        path = self.out_dir / "quantized" / f"{qm.method}-{qm.plan.content_hash()}"
        report = {"plan": self.plan_info(qm.plan), **({"cost": cost.to_dict()} if cost is not None else {}),
                  **({"vision": vision.to_dict()} if vision is not None else {})}
        qm.save(path, report=_jsonable(report))
        if cost is not None and cost.size_bytes is None:
            cost.size_bytes = weight_file_bytes(path)  # measured before saving: the size on disk is known now
        self._prepared = None
        with self.hold_trait_notifications():
            self.quantized_path, self.cost, self.vision_quality = path, cost, vision
            self.conversions, self.profiles = [], []
            self.plan = qm.plan
            self.quantized = qm
        return path

    # -- what tabs show -----------------------------------------------------------------------------
    def plan_info(self, plan: QuantPlan | None = None) -> dict:
        plan = plan or self.plan
        info = {"hash": plan.content_hash(), "method": plan.method, "plan": plan.to_dict()}
        if self.lm is not None:
            info.update(plan_footprint(self.lm, plan))
        return info

    def describe(self, plan: QuantPlan | None = None) -> str:
        return describe_plan(plan or self.plan, self.lm)

    @property
    def quantized_is_current(self) -> bool:
        return self.quantized is not None and self.plan is not None and self.quantized.plan == self.plan

    @property
    def conversion_dir(self) -> Path:
        """Where the latest quantized model's conversions go (the Profile tab times what is there)."""
        name = self.quantized_path.name if self.quantized_path is not None else "not-quantized"
        return self.out_dir / "convert" / name

    @property
    def devices_gap_dir(self) -> Path:
        """Where the device comparison of the session's plan goes: ``devices-gap/<quantized model>`` when the
        quantized model is of the current plan, else ``devices-gap/plan-<hash>``; ``devices_gap.json`` in it."""
        name = self.quantized_path.name if self.quantized_is_current else f"plan-{self.plan.content_hash()}"
        return self.out_dir / "devices-gap" / name

    # -- actions ------------------------------------------------------------------------------------
    def prepared(self):
        """The float model and the session's quantized model, as ``workbench.targets.convert`` takes them (no reload)."""
        if self.quantized is None:
            raise PlanError("nothing to convert yet: quantize first (Quantize tab, Run)")
        if self._prepared is None or self._prepared[0] is not self.quantized:
            lm, qm = self.lm, self.quantized
            sim = LoadedModel(qm.build_model(lm.model), lm.tokenizer, lm.path, f"{lm.name} ({qm.method})", lm.layers)
            self._prepared = (qm, PreparedModels(lm, sim, qm, str(self.quantized_path)))
        return self._prepared[1]

    def convert(self, target: str, out_dir: str | Path | None = None, **kwargs):
        """Convert exactly the session's quantized model for ``target``; conversion.json names its plan."""
        prep = self.prepared()
        out = Path(out_dir) if out_dir else self.conversion_dir / target
        report = convert(str(self.quantized_path), target, out, prepared=prep, **kwargs)
        self.conversions = [r for r in self.conversions if r.target != report.target] + [report]
        return report

    def write_override_files(self, directory: Path) -> list[dict]:
        """The plan for converters that take per-layer precisions as a file (llama.cpp, MNN's llmexport)."""
        written = []
        for fmt, name in OVERRIDE_FILES:
            try:
                written.append(write_overrides(fmt, directory / name, self.lm, self.plan).to_dict())
            except WorkbenchError as e:
                written.append({"format": fmt, "path": None, "notes": [str(e)]})
        return written

    def report(self, points: Sequence = ()) -> dict:
        """What was measured in this session, as JSON: plan, calibration, sweep, evaluations, cost, conversions."""
        lm = self.lm
        doc: dict = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": library_versions(),
                     "model": None if lm is None else {"name": lm.name, "path": str(lm.path),
                                                        "parameters": lm.parameters, "layers": len(lm.layers),
                                                        "fingerprint": self.fingerprint,
                                                        **({"parts": [p.to_dict() for p in lm.parts()]}
                                                           if lm.is_vision else {})},
                     "plan": None if self.plan is None else self.plan_info()}
        if self.calibration is not None:
            calib_set, stats = self.calibration
            doc["calibration"] = {"summary": calib_set.report.summary_lines(), "tokens": stats.meta.get("tokens"),
                                  "layers": len(stats.layers)}
        if self.sensitivity is not None:
            s = self.sensitivity
            doc["sensitivity"] = {"tokens": s.tokens, "score": s.score, "reference_perplexity": s.reference_perplexity,
                                  "most_sensitive_int4": s.ranking("int4")[:5] if "int4" in s.precisions else []}
        doc["precision_evaluations"] = [p.to_dict() for p in points]
        if self.quantized is not None:
            doc["quantized"] = {"path": str(self.quantized_path), "method": self.quantized.method,
                                "plan": self.plan_info(self.quantized.plan),
                                "bits_per_weight": self.quantized.bits_per_weight,
                                "cost": self.cost.to_dict() if self.cost is not None else None,
                                **({"vision": self.vision_quality.to_dict()} if self.vision_quality is not None
                                   else {})}
        doc["conversions"] = [r.to_dict() for r in self.conversions]
        doc["profiles"] = [p.to_dict() for p in self.profiles]
        if self.host is not None:
            doc["host_bandwidth"] = self.host
        if self.devices_gap is not None:
            doc["devices_gap"] = self.devices_gap.to_dict()
        return _jsonable(doc)

    def write_archive(self, figures: Mapping[str, object] | None = None, points: Sequence = ()) -> Path:
        """Write plan, report (JSON, Markdown and the offline HTML page of ``workbench.charts.report``), figures and
        override files under ``out_dir``; pack them with the quantized model (``model/``, a directory
        ``workbench eval`` reads) and the conversions into one zip."""
        if self.lm is None or self.plan is None:
            raise PlanError("load a model first")
        out = self.out_dir
        owner = run_model(out)
        if owner is not None and owner.get("fingerprint") != self.fingerprint:
            raise WorkspaceError(f"the outputs folder {out} holds the run of another model ({owner.get('model')}); "
                                 "choose an empty folder or load that model")
        if owner is None:
            self._claim_run_dir()
        out.mkdir(parents=True, exist_ok=True)
        self.plan.save(out / "plan.json")
        overrides = self.write_override_files(out / "overrides")
        figure_files = _write_figures(figures or {}, out / "figures")
        report = self.report(points)
        report["overrides"], report["figures"] = overrides, figure_files
        report["archive"] = {"model": "model/" if self.quantized_path else None,
                             "conversions": "convert/" if self.conversions else None}
        atomic_write_json(out / "report.json", report)
        atomic_write_text(out / "report.md", report_markdown(report))
        atomic_write_text(out / "report.html", build_report(out).html)  # the page to send: opens offline
        members: list[tuple[Path, str]] = []
        if self.quantized_path is not None and self.quantized_path.is_dir():
            members += _tree(self.quantized_path, "model")
        if self.conversions and self.conversion_dir.is_dir():
            members += _tree(self.conversion_dir, "convert")
        for name in (RUN_FILE, "plan.json", "report.json", "report.md", "report.html"):
            members.append((out / name, name))
        for gap in sorted((out / "devices-gap").glob(f"*/{GAP_FILE}")):  # the rows, not the graphs they measured
            members.append((gap, gap.relative_to(out).as_posix()))
        for sub in ("overrides", "figures"):
            if (out / sub).is_dir():
                members += _tree(out / sub, sub)
        path = out / f"{out.name}.zip"
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".archive-", suffix=".zip")
        os.close(fd)
        try:
            from tqdm.auto import tqdm  # the app's status line shows this bar: packing a model takes seconds
            total = sum(src.stat().st_size for src, _ in members)
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z, \
                    tqdm(total=total, unit="B", unit_scale=True, desc="packing the run", leave=False) as bar:
                for src, arc in members:
                    z.write(src, f"{out.name}/{arc}")
                    bar.update(src.stat().st_size)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.archive_path = path
        return path


def _tree(root: Path, prefix: str) -> list[tuple[Path, str]]:
    return [(p, f"{prefix}/{p.relative_to(root).as_posix()}") for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")]


def _write_figures(figures: Mapping[str, object], directory: Path) -> list[str]:
    """Each figure as plotly JSON, and all of them in one page that opens offline (plotly.js inside once)."""
    import plotly.graph_objects as go
    import plotly.io as pio
    if not figures:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    names, parts = [], []
    for i, (name, fig) in enumerate(figures.items()):
        fig = go.Figure(fig)  # a FigureWidget too
        atomic_write_text(directory / f"{name}.json", pio.to_json(fig))
        names.append(f"{name}.json")
        parts.append(f"<h2>{html.escape(name)}</h2>" + pio.to_html(fig, full_html=False, include_plotlyjs=i == 0))
    atomic_write_text(directory / "figures.html", "<!doctype html><html><head><meta charset='utf-8'><title>workbench "
                      "figures</title></head><body>" + "".join(parts) + "</body></html>")
    return names + ["figures.html"]


def _fmt(v, spec: str = ".5f") -> str:
    return "-" if v is None else format(v, spec)


def report_markdown(report: dict) -> str:
    """The report as a page a person reads: what was chosen, what it cost, what the conversions measured."""
    lines = ["# workbench run", "", f"created {report['created']}", ""]
    if report.get("model"):
        m = report["model"]
        lines += [f"model: {m['name']} ({m['parameters']:,} parameters, {m['layers']} quantizable layers)", ""]
    if report.get("plan"):
        p = report["plan"]
        lines += [f"plan {p['hash']}: method {p['method']}, {p.get('bits_per_weight', 0):.2f} bits/weight, "
                  f"{p.get('size_bytes', 0):,} bytes (plan.json)", ""]
    if report.get("calibration"):
        lines += ["## Calibration", ""] + [f"- {s}" for s in report["calibration"]["summary"]] + [""]
    if report.get("precision_evaluations"):
        lines += ["## Plans evaluated (Precisions)", "", "| plan | bits/w | KL | perplexity | top-1 |",
                  "|---|---|---|---|---|"]
        lines += [f"| {p['label']} | {p['bits_per_weight']:.2f} | {p['kl_divergence']:.3e} | {p['perplexity']:.3f} | "
                  f"{p['top1_agreement']:.4f} |" for p in report["precision_evaluations"]] + [""]
    q = report.get("quantized")
    if q:
        lines += ["## Quantized model (model/)", "", f"{q['method']} by plan {q['plan']['hash']}, "
                  f"{q['bits_per_weight']:.2f} bits/weight"]
        c = q.get("cost")
        if c:
            lines += [f"perplexity {c['perplexity']:.3f} (float {c['reference_perplexity']:.3f}), KL "
                      f"{c['kl_divergence']:.5f} ± {c['kl_divergence_stderr']:.5f}, top-1 {c['top1_agreement']:.4f} "
                      f"on {c['tokens']:,} held-out tokens"]
        if q.get("vision"):
            lines += vision_sentences(q["vision"])
        lines.append("")
    if report.get("conversions"):
        lines += ["## Conversions (convert/)", "", "| target | KL | KL of simulation | top-1 vs simulation | gap |",
                  "|---|---|---|---|---|"]
        for r in report["conversions"]:
            sim = (r.get("simulation") or {}).get("kl_divergence")
            lines.append(f"| {r['target']} | {_fmt(r.get('kl_divergence'))} | {_fmt(sim)} | "
                         f"{_fmt(r.get('top1_agreement_vs_simulation'), '.4f')} | {r.get('gap') or ''} |")
        lines.append("")
    if report.get("devices_gap"):
        g = report["devices_gap"]
        lines += ["## On the devices (devices-gap/)", "", f"plan {g['plan_hash']}, {g['max_tokens'] or 'all'} tokens, "
                  f"HTP {g['soc']}; KL / top-1 against the float model", "", format_table(g["rows"]), ""]
    if report.get("profiles"):
        lines += ["## Profile (this machine's CPU)", "", "| model | runtime | MB | prefill ms | decode tok/s |",
                  "|---|---|---|---|---|"]
        for p in report["profiles"]:
            pre = ", ".join(f"{n}: {ms:.1f}" for n, ms in p["prefill_ms"].items())
            lines.append(f"| {p['name']} | {p['runtime']} | {p['size_bytes'] / 1e6:.2f} | {pre} | "
                         f"{_fmt(p.get('decode_tokens_per_second'), '.0f')} |")
        lines.append("")
    files = [o for o in report.get("overrides", []) if o.get("path")]
    if files:
        lines += ["## Override files (overrides/)", ""] + [f"- {Path(o['path']).name}: {o['format']}" for o in files]
    return "\n".join(lines) + "\n"


class SessionLabel(widgets.HTML):
    """One line on every tab: which plan it works with and which quantized model (and where it lies)."""

    def __init__(self, session: AppSession, **kwargs):
        super().__init__(**kwargs)
        self.session = session
        session.observe(self._refresh, names=["plan", "quantized", "quantized_path", "lm"])
        self._refresh()

    def _refresh(self, _change=None) -> None:
        s = self.session
        if s.lm is None or s.plan is None:
            self.value = "<span style='color:#999'>no model loaded</span>"
            return
        plan = f"<b>{html.escape(s.describe())}</b>"
        if s.quantized is None:
            q = "quantized model: <i>none yet</i> (Quantize tab)"
        else:
            q = (f"quantized model: <code>{html.escape(str(s.quantized_path))}</code> "
                 f"({html.escape(describe_plan(s.quantized.plan, s.lm))})")
            if not s.quantized_is_current:
                q += " <span style='color:#d68910'>is not of the current plan: Run in the Quantize tab</span>"
        self.value = (f"<div class='workbench-session' style='font-size:12px;color:#34495e'>{plan} &nbsp;|&nbsp; "
                      f"{q}</div>")

    def close(self):
        self.session.unobserve(self._refresh, names=["plan", "quantized", "quantized_path", "lm"])
        super().close()
