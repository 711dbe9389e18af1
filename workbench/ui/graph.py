"""Panels for the graph step: inspect an ONNX graph for a target (with Netron), and convert a model.

    panel = GraphPanel("out/onnx/decode.onnx", target="qnn", serve_netron=False)
    panel.run()            # what the Inspect button does; returns the GraphReport
    display(panel)         # "Open in Netron" serves the file on 127.0.0.1; closing the panel stops it

    convert_panel = ConvertPanel("demo", bits=4, out_dir="out/convert")
    convert_panel.run("ort-int4")   # what the Convert button does; returns the ConversionReport
"""
from __future__ import annotations

import html
import re
import socket
from pathlib import Path

import ipywidgets as widgets

from ..charts.graph import make_block_bytes_figure, make_conversion_figure, make_op_histogram_figure
from ..targets.convert import (CONVERT_TARGETS, GAP_KL_FLOOR, GAP_KL_RATIO, GAP_TOP1, ConversionReport, convert,
                       prepare_models)
from ..onnx.inspect import initializer_bytes_by_block
from ..errors import PlanError
from ..targets import TARGETS, GraphReport, inspect_graph
from ..targets.registry import get_target, plan_reach
from .base import StepPanel, metric_words_html, ruled_table
from .devices_gap import DevicesGapPanel
from .session import SessionLabel

__all__ = ["GraphPanel", "ConvertPanel", "NetronServer"]

# where a gap is judged, the rule is shown: the converted model is not what was evaluated when it is this far off
GAP_RULE = (f"gap (red): KL above {GAP_KL_RATIO:g} x the simulation's + {GAP_KL_FLOOR:g}, or top-1 agreement with "
            f"the simulation below {GAP_TOP1:g}")

SEVERITY_COLORS = {"error": "#c0392b", "warning": "#d68910", "info": "#5d6d7e"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NetronServer:
    """Netron serving one file on the loopback interface only; ``stop()`` is safe to call twice."""

    def __init__(self):
        self.address: tuple[str, int] | None = None

    def start(self, path: str | Path) -> tuple[str, int]:
        import netron
        self.stop()
        self.address = netron.start(str(path), address=("127.0.0.1", _free_port()), browse=False)
        return self.address

    @property
    def url(self) -> str | None:
        return f"http://{self.address[0]}:{self.address[1]}" if self.address else None

    def stop(self) -> None:
        if self.address is not None:
            import netron
            netron.stop(self.address)
            self.address = None


def _findings_html(report: GraphReport) -> str:
    if not report.findings:
        return f"<p>No problems found for {html.escape(report.title)}.</p>"
    rows = []
    for f in report.findings:
        nodes = ", ".join(html.escape(n) for n in f.nodes[:4]) + (" ..." if len(f.nodes) > 4 else "")
        rows.append(f"<tr><td style='color:{SEVERITY_COLORS[f.severity]};font-weight:bold'>{f.severity}</td>"
                    f"<td>{html.escape(f.rule)}</td><td>{html.escape(f.message)}<br><small>{nodes}</small></td>"
                    f"<td>{html.escape(f.fix)}</td></tr>")
    return ruled_table("workbench-findings", "<th>severity</th><th>rule</th><th>what</th><th>fix</th>", "".join(rows))


class GraphPanel(StepPanel):
    """ONNX file and target; Inspect shows findings, the op histogram and bytes per block; Netron on demand."""

    def __init__(self, path: str | Path | None = None, *, target: str = "qnn", serve_netron: bool = True):
        self.report: GraphReport | None = None
        self._setup(log_height="120px")
        self.netron = NetronServer()
        self.path = widgets.Text(value=str(path or ""), description="ONNX file", layout={"width": "640px"})
        self.target = widgets.Dropdown(options=list(TARGETS), value=target, description="target")
        self.inspect_button = widgets.Button(description="Inspect", button_style="primary", icon="search")
        self.inspect_button.on_click(lambda _: self.run())
        self.netron_button = widgets.Button(description="Open in Netron", icon="project-diagram",
                                            disabled=not serve_netron)
        self.netron_button.on_click(lambda _: self.open_netron())
        self.findings = widgets.HTML()
        self.histogram_plot, self.bytes_plot = widgets.Output(), widgets.Output()
        self.netron_view = widgets.HTML()
        self.controls = [self.path, self.target, self.inspect_button]
        super().__init__([
            widgets.HTML("<b>Inspect a graph</b>: operators, target compatibility, parameter bytes"),
            self.path, widgets.HBox([self.target, self.inspect_button, self.netron_button]), self.status_line,
            self.log_output, self.findings, widgets.HBox([self.histogram_plot, self.bytes_plot]), self.netron_view])

    def run(self) -> GraphReport | None:
        """Inspect the file for the chosen target and draw the results."""
        path = self.path.value.strip()
        ok, result = self._attempt("inspecting...", lambda: (inspect_graph(path, self.target.value),
                                                             initializer_bytes_by_block(path)))
        if not ok:
            return None
        self.report, blocks = result
        self.status.value = html.escape(self.report.summary())
        self.findings.value = _findings_html(self.report)
        bad = {f.op_type for f in self.report.findings if f.severity == "error" and f.op_type}
        self._plot("operators", make_op_histogram_figure(self.report.inventory, bad), self.histogram_plot)
        self._plot("bytes", make_block_bytes_figure(blocks), self.bytes_plot)
        return self.report


    def open_netron(self) -> str | None:
        """Serve the file with Netron on 127.0.0.1 and embed it (works where the browser runs on this host)."""
        try:
            with self.log_output:
                self.netron.start(self.path.value.strip())
        except Exception as e:  # a port clash or an unreadable file: say so in the panel
            self.status.value = f"<span style='color:#c0392b'>Netron: {html.escape(str(e))}</span>"
            return None
        self.netron_view.value = (f"<iframe src='{self.netron.url}' width='100%' height='640' "
                                  "style='border:1px solid #ddd'></iframe>")
        return self.netron.url

    def close(self):
        self.netron.stop()
        super().close()


def _conversion_rows(reports: list[ConversionReport]) -> str:
    head = ("<th>target</th><th>KL (converted)</th><th>KL (simulation)</th><th>top-1 vs float</th>"
            "<th>top-1 vs simulation</th><th title='every file written, MB = 10^6 bytes'>MB written</th>"
            "<th>seconds</th><th>gap</th>")
    rows = []
    for r in reports:
        mb = sum(f["bytes"] for f in r.files) / 1e6  # MB = 10^6 bytes, as everywhere in the app
        if r.runnable and r.kl_divergence is not None:
            cells = (f"<td>{r.kl_divergence:.5f}</td><td>{r.simulation['kl_divergence']:.5f}</td>"
                     f"<td>{r.top1_agreement:.4f}</td><td>{r.top1_agreement_vs_simulation:.4f}</td>")
        else:
            cells = "<td colspan=4>not runnable here: commands and inputs written</td>"
        gap = f"<span style='color:#c0392b'>{html.escape(r.gap)}</span>" if r.gap else ""
        rows.append(f"<tr><td>{r.target}</td>{cells}<td>{mb:.2f}</td><td>{r.seconds:.1f}</td><td>{gap}</td></tr>")
    return ruled_table("workbench-conversions", head, "".join(rows))


class ConvertPanel(StepPanel):
    """Target, output folder and options; Convert runs the converted model and compares it with the simulation.

    In the app (``session=``) it converts exactly the session's quantized model (the Quantize tab's
    result, AWQ included) into the session's output folder, and shows which plan and model that is.
    """

    def __init__(self, model=None, *, plan=None, bits: int | None = 4, out_dir: str | Path = "out/convert",
                 max_tokens: int | None = None, accuracy_level: int = 4, activation_bits: int = 16, session=None):
        self.model, self.session = model, session
        self.plan, self.bits = plan, (None if plan is not None else bits)
        self.prepared = None
        self.reports: list[ConversionReport] = []
        self.figure = None
        self._setup()
        self.target = widgets.Dropdown(options=list(CONVERT_TARGETS), value="ort-int4", description="target",
                                       layout={"width": "auto"})
        self.reach_note = widgets.HTML()  # the targets the plan cannot go to, greyed, each with why
        self.out_dir = widgets.Text(value=str(session.conversion_dir if session is not None else out_dir),
                                    description="output", layout={"width": "640px"})
        label = {"description_width": "initial"}  # the whole label, not "INT4 acc. ..."
        self.accuracy_level = widgets.Dropdown(options=[0, 4], value=accuracy_level, description="INT4 acc. level",
                                               style=label)
        self.activation_bits = widgets.Dropdown(options=[16, 8], value=activation_bits, description="QDQ act. bits",
                                                style=label)
        self.max_tokens = widgets.IntText(value=max_tokens or 0, description="tokens scored (0: all)",
                                          style={"description_width": "initial"}, layout={"width": "220px"},
                                          tooltip="held-out tokens the converted model is scored on; 0: the whole "
                                                  "evaluation text")
        self.convert_button = widgets.Button(description="Convert", button_style="primary", icon="cogs")
        self.convert_button.on_click(lambda _: self.run())
        self.table = widgets.HTML()
        self.plot = widgets.Output()
        self.controls = [self.target, self.out_dir, self.accuracy_level, self.activation_bits, self.max_tokens,
                         self.convert_button]
        self.gap_panel = None
        if session is not None:
            self.gap_panel = self._own(DevicesGapPanel(session, max_tokens=max_tokens or 512))
            head = [widgets.HTML("<b>Convert</b> the Quantize tab's model: run the converted model and compare it "
                                 "with the workbench's simulation of that same model"),
                    self._own(SessionLabel(session))]
            self._watch(session, self._on_session_quantized, ["quantized", "out_dir"])
            self._watch(session, lambda _: self._refresh_targets(), ["plan", "quantized", "lm"])
        else:
            head = [widgets.HTML(f"<b>Convert</b> {html.escape(str(model))}: run the converted model and compare it "
                                 "with the workbench's simulation")]
        super().__init__([
            *head, widgets.HBox([self.target, self.out_dir]), self.reach_note,
            widgets.HBox([self.accuracy_level, self.activation_bits, self.max_tokens, self.convert_button]),
            self.status_line, self.log_output, self.table, self.plot,
            *([widgets.HTML("<hr>"), self.gap_panel] if self.gap_panel is not None else [])])
        self._refresh_targets()

    def _plan_precisions(self):
        """``{layer: precision}`` of what Convert would convert: the session's quantized model's plan (else its
        current plan), or the plan / bits given; None when there is nothing to judge by yet."""
        s = self.session
        if s is not None:
            plan = s.quantized.plan if s.quantized is not None else s.plan
            return None if plan is None or s.lm is None else plan.resolve([i.name for i in s.lm.layers])
        if self.plan is not None:  # no model loaded here: the plan's own precisions
            return [self.plan.default, *(r.precision for r in self.plan.rules)]
        return [f"int{self.bits}"] if self.bits else None

    def _refresh_targets(self) -> None:
        """Offer the targets the plan can reach, each saying whether it runs here; grey the rest with why."""
        precisions = self._plan_precisions()
        reach = plan_reach(precisions or {}, CONVERT_TARGETS)
        for t in CONVERT_TARGETS:  # a toolchain not on this machine: one sentence, before anyone clicks
            missing = get_target(t).missing
            if reach[t] is None and missing is not None:
                reach[t] = missing()
        ok = [t for t, why in reach.items() if why is None]

        def label(t: str) -> str:
            return f"{t} ({'runs here' if get_target(t).runnable else 'files for the device; not run here'})"
        current = self.target.value
        self.target.options = [(label(t), t) for t in ok]
        if ok:
            self.target.value = current if current in ok else ("ort-int4" if "ort-int4" in ok else ok[0])
        greyed = {t: why for t, why in reach.items() if why}
        self.reach_note.value = "" if not greyed else (
            "<div style='font-size:12px;color:#7f8c8d'>not offered (the plan cannot go there, or this machine cannot "
            "convert for it): " + "; ".join(
                f"<b>{html.escape(t)}</b>: {html.escape(why)}" for t, why in greyed.items()) + "</div>")

    def _on_session_quantized(self, change) -> None:
        """A new quantized model (or output folder): its conversions go to their own folder; the table starts empty."""
        self.out_dir.value = str(self.session.conversion_dir)
        if change["name"] == "quantized" and self.reports:
            self.reports, self.figure = [], None
            self.figures.pop("conversions", None)
            self.table.value = ""
            self.plot.outputs = ()
            self.status.value = "a new quantized model: convert it again"

    def run(self, target: str | None = None) -> ConversionReport | None:
        """Convert for ``target`` (default: the dropdown) into ``<output>/<target>``; show the comparison."""
        if target is not None:
            if target not in [v for _, v in self.target.options]:
                why = (plan_reach(self._plan_precisions() or {}, [target])[target] if target in CONVERT_TARGETS
                       else f"unknown conversion target '{target}'; choose one of: {', '.join(CONVERT_TARGETS)}")
                self._show_error(f"not offered: {why}")
                return None
            self.target.value = target
        ok, report = self._attempt(f"converting for {self.target.value}...", self._convert)
        if not ok:
            return None
        self.reports = [r for r in self.reports if r.target != report.target] + [report]
        self.status.value = html.escape(report.summary()) + self._against_quantize_tab(report)
        self.table.value = _conversion_rows(self.reports) + metric_words_html("KL", "nats", "top-1")
        self.figure = make_conversion_figure([r.to_dict() for r in self.reports], gap_rule=GAP_RULE)
        self._plot("conversions", self.figure, self.plot)
        return report

    def _against_quantize_tab(self, report: ConversionReport) -> str:
        """The simulation measured here beside what the Quantize tab measured for the same model."""
        cost = self.session.cost if self.session is not None else None
        if cost is None or not report.runnable or not report.simulation:
            return ""
        return html.escape(f"; the Quantize tab measured this model at KL {cost.kl_divergence:.5f} on "
                           f"{cost.tokens:,} tokens (simulation here: {report.simulation['kl_divergence']:.5f} on "
                           f"{report.eval_tokens:,})")

    def _convert(self) -> ConversionReport:
        """The library calls behind Convert (a refusal's command-line example becomes what to do in the app)."""
        try:
            return self._convert_now()
        except PlanError as e:
            short = re.sub(r"\s*\(e\.g\. `workbench [^)]*\)", "", str(e))
            if short == str(e):
                raise
            raise PlanError(short + " (in the app: a layer's precision is set in Precisions, the group size in "
                                    "Quantize)") from None

    def _convert_now(self) -> ConversionReport:
        """The library calls behind Convert: prepare the float and simulated models once, then convert."""
        kwargs = dict(max_tokens=self.max_tokens.value or None, accuracy_level=self.accuracy_level.value,
                      activation_bits=self.activation_bits.value, progress=True, log=print)
        out = Path(self.out_dir.value.strip()) / self.target.value
        if self.session is not None:
            return self.session.convert(self.target.value, out, **kwargs)
        if self.prepared is None:
            self.prepared = prepare_models(self.model, plan=self.plan, bits=self.bits, progress=True)
        return convert(self.model, self.target.value, out, prepared=self.prepared, **kwargs)
