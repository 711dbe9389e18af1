"""The Export tab's "Compare on the devices" section: the session's plan on every device toolchain installed here.

    panel = DevicesGapPanel(session, max_tokens=512)
    panel.run()        # what Run does, in this thread; returns the DevicesGap
    panel.start()      # what the button does: the same in a background thread (the kernel stays free)

Checkboxes for the targets (those whose toolchain is not installed are disabled, with what to install), the
Snapdragon for the HTP from the device profiles, the token budget, how many targets run at once; Run measures them with
``workbench.run.devices_gap.measure_devices_gap`` (each target in a child process) and fills the table and the chart
target by target. The result is saved as ``devices_gap.json`` in ``session.devices_gap_dir``, where
``workbench report`` finds it. A target that fails is a row saying how; the rest still run.
"""
from __future__ import annotations

import html
import os
import threading
import time
import traceback

import ipywidgets as widgets

from ..charts.graph import make_device_gap_figure
from ..run.devices_gap import (GAP_RULE, HTP_WINDOWS, TABLE_HEADER, TARGET_TITLES, TARGETS, DevicesGap,
                           gap_advice, measure_devices_gap, table_cells, toolchains)
from ..errors import WorkbenchError
from ..targets.htp import DEFAULT_DEVICE, htp_soc, htp_socs
from ..model.sweep_backends import backend_for
from .base import StepPanel, metric_words_html, ruled_table

__all__ = ["DevicesGapPanel", "gap_table_html", "DEFAULT_TARGETS"]

DEFAULT_TARGETS = ("simulation", "ort-qdq")  # the cheapest pair; the others are one click
WINDOW = 128  # the HTP scores 128-token windows


def gap_table_html(rows: list[dict]) -> str:
    """The rows as an HTML table: a flagged gap in red, a failed target's row in red italics; under it, the rule a
    gap is flagged by."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in TABLE_HEADER)
    body = []
    for r in rows:
        cells = [html.escape(c) for c in table_cells(r)]
        if r["gap"]:
            cells[-1] = f"<span style='color:#c0392b;font-weight:bold'>GAP</span> {cells[-1]}"
        style = " style='color:#c0392b;font-style:italic'" if r.get("error") else (
            " style='color:#7f8c8d'" if r["runtime"] == "not run" else "")
        body.append(f"<tr class='gap-row' data-target='{html.escape(r['target'])}'{style}>"
                    + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (ruled_table("workbench-gap", head, "".join(body))
            + "<div class='gap-rule' style='font-size:12px;color:#566573'>" + html.escape(GAP_RULE) + "</div>"
            + metric_words_html("KL", "nats", "top-1"))


class DevicesGapPanel(StepPanel):
    """Targets, HTP SoC, token budget, Run (in the background) with progress; the table and the chart."""

    def __init__(self, session, *, max_tokens: int = 512, soc: str = DEFAULT_DEVICE,
                 targets: tuple[str, ...] = DEFAULT_TARGETS):
        self.session = session
        self.result: DevicesGap | None = None
        self.thread: threading.Thread | None = None
        self._setup(log_height="100px")
        missing = toolchains()
        self.checks = {t: widgets.Checkbox(value=t in targets and missing[t] is None, description=TARGET_TITLES[t],
                                           disabled=missing[t] is not None, indent=False,
                                           layout={"width": "auto", "margin": "0 14px 0 0"})
                       for t in TARGETS}
        self.missing = {t: why for t, why in missing.items() if why}
        self.missing_label = widgets.HTML(
            "" if not self.missing else "<div style='font-size:12px;color:#7f8c8d'>not installed here: " + "; ".join(
                f"<b>{html.escape(t)}</b>: {html.escape(why.split(': ', 1)[-1])}" for t, why in self.missing.items())
            + "</div>")
        socs = htp_socs()
        self.soc = widgets.Dropdown(options=[(s.label, key) for key, s in socs.items()],
                                    value=htp_soc(soc).device, description="HTP SoC", layout={"width": "420px"})
        self.tokens = widgets.BoundedIntText(value=max_tokens, min=WINDOW, max=10**7, step=WINDOW,
                                             description="tokens", tooltip="held-out tokens each target is scored on "
                                             "(the HTP: that many 128-token windows, at most 4)")
        self.workers = widgets.BoundedIntText(value=1, min=1, max=max(1, os.cpu_count() or 1),
                                              description="side by side", layout={"width": "190px"},
                                              style={"description_width": "90px"},
                                              tooltip="targets measured at once, each in its own process (1: one "
                                                      "after another, so each row's time and memory are its own)")
        self.run_button = widgets.Button(description="Compare on the devices", button_style="primary",
                                         icon="microchip", layout={"width": "auto"})
        self.run_button.on_click(lambda _: self.start())
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="", layout={"width": "300px",
                                                                                            "visibility": "hidden"})
        self.plan_label = widgets.HTML()
        self.table = widgets.HTML()
        self.advice = widgets.VBox(layout={"margin": "4px 0"})  # a flagged row's next step, with its button
        self.chart = _figure_widget([])
        self.chart_box = widgets.Box([self.chart], layout={"display": "none", "width": "100%"})  # once a row ran
        self.controls = [*self.checks.values(), self.soc, self.tokens, self.workers, self.run_button]
        super().__init__([
            widgets.HTML("<b>Compare on the devices</b>: the session's plan in the workbench's simulation beside "
                         "what each runtime and NPU toolchain installed here computes for it, each against the "
                         "float model (KL, top-1; prefill and decode), with its size, the runtime's own prefill / decode "
                         "tok/s where it times itself (MNN-LLM, ExecuTorch), time and peak memory; a gap from the "
                         "simulation is flagged"),
            widgets.HBox(list(self.checks.values())), self.missing_label,
            widgets.HBox([self.soc, self.tokens, self.workers, self.run_button]), widgets.HBox([self.progress, self.status]),
            self.plan_label, self.table, self.advice, self.chart_box, self.log_output])
        self.add_class("workbench-devices-gap")  # the section, for the browser test and a page's styles

    # -- what the run is of --------------------------------------------------------------------------
    def chosen(self) -> list[str]:
        return [t for t, c in self.checks.items() if c.value and t not in self.missing]

    def _subject(self) -> tuple[str, object, str]:
        """(model, plan or None, what to say): the session's quantized model when it is of the current plan (AWQ
        and all), else the float model with the session's plan."""
        s = self.session
        if s.lm is None or s.plan is None:
            raise WorkbenchError("load a model first")
        if s.quantized_is_current:
            return str(s.quantized_path), None, f"the quantized model {s.quantized_path.name} ({s.describe()})"
        return str(s.lm.path), s.plan, f"{s.lm.name} with {s.describe()} (round to nearest, not quantized yet)"

    def _freeze(self, frozen: bool) -> None:
        super()._freeze(frozen)
        for t in self.missing:  # a target without its toolchain stays off
            self.checks[t].disabled = True

    # -- actions -------------------------------------------------------------------------------------
    def start(self) -> threading.Thread | None:
        """Run in a background thread (the button): the table and the chart fill in as each target finishes."""
        if self.thread is not None and self.thread.is_alive():
            self._show_error("a comparison is already running")
            return None
        self.thread = threading.Thread(target=self.run, name="devices-gap", daemon=True)
        self.thread.start()
        return self.thread

    def run(self) -> DevicesGap | None:
        """Measure the chosen targets for the session's plan; a bad request is a red status line."""
        targets = self.chosen()  # before the controls are frozen (disabled)
        self._freeze(True)
        self.error = None
        t0 = time.perf_counter()
        try:
            if not targets:
                raise WorkbenchError("choose at least one target")
            model, plan, what = self._subject()
            self.plan_label.value = f"<span style='font-size:12px'>of {html.escape(what)}</span>"
            self.table.value = ""
            self.advice.children = ()
            self._draw([])
            self.progress.max, self.progress.value = len(targets), 0
            self.progress.layout.visibility = "visible"
            windows = max(1, min(HTP_WINDOWS, self.tokens.value // WINDOW))

            def say(message: str) -> None:
                self.status.value = html.escape(f"{message} ({time.perf_counter() - t0:.0f} s)")

            def on_row(gap: DevicesGap) -> None:
                self.progress.value = len(gap.rows)
                self.table.value = gap_table_html(gap.rows)
                self._draw(gap.rows)
                self._show_advice(gap.rows)

            gap = measure_devices_gap(model, plan=plan, targets=targets, soc=self.soc.value,
                                      max_tokens=self.tokens.value, windows=windows,
                                      work=self.session.devices_gap_dir, log=say, on_row=on_row,
                                      backend=backend_for(workers=self.workers.value))
        except WorkbenchError as e:
            self._show_error(e)
            return None
        except Exception as e:  # noqa: BLE001 - a background thread has nowhere else to say it
            self.log_output.append_stdout(traceback.format_exc())
            self._show_error(f"unexpected error: {type(e).__name__}: {e} (traceback in the log below)")
            return None
        finally:
            self._freeze(False)
        self.result = gap
        self.session.devices_gap = gap
        self.status_line.succeeded()  # another action's earlier error (a failed Convert) is done with
        flagged = [r["target"] for r in gap.flagged]
        failed = [r["target"] for r in gap.rows if r.get("error")]
        self.status.value = html.escape(
            f"{len(gap.rows)} target(s) in {gap.seconds:.0f} s; "
            + (f"gap flagged for {', '.join(flagged)}" if flagged else "no gap flagged")
            + f" ({GAP_RULE})"
            + (f"; failed: {', '.join(failed)}" if failed else "") + f"; saved in {gap.work_dir}")
        return gap

    def _show_advice(self, rows: list[dict]) -> None:
        """Under the table, each flagged row's next step (``gap_advice``) and, where it names layers, a button that
        sets them in the session's plan (every tab follows it; Compare again measures the new plan)."""
        s = self.session
        names = [info.name for info in s.lm.layers] if s.lm is not None else []
        lines = []
        for r in rows:
            advice = gap_advice(r, s.plan, names)
            if advice is None:
                continue
            text = widgets.HTML(f"<span style='font-size:12px'><b style='color:#c0392b'>{html.escape(r['target'])}"
                                f"</b>, what to try: {html.escape(advice.text)}</span>")
            if advice.layers and advice.precision:
                button = widgets.Button(description=f"set them to {advice.precision}", icon="wrench",
                                        layout={"width": "auto"}, tooltip=", ".join(advice.layers))
                button.on_click(lambda _, a=advice: self._apply(a))
                lines.append(widgets.HBox([text, button]))
            else:
                lines.append(text)
        self.advice.children = tuple(lines)

    def _apply(self, advice) -> None:
        """Set the layers a flag named in the session's plan; say what changed and what to do next."""
        s = self.session
        s.plan = advice.apply(s.plan)
        self.error = None
        self.status.value = html.escape(f"{len(advice.layers)} layer(s) set to {advice.precision} in the session's "
                                        "plan: press Compare on the devices to measure it")

    def _draw(self, rows: list[dict]) -> None:
        """The chart of ``rows`` (kept in ``figures`` for Download once it has any). A new figure widget each time,
        made while its box is shown: plotly.js lays out a figure when it is first drawn (in a hidden box it
        would keep an empty one), and the run is in a background thread, where a new widget arrives whole."""
        ran = any(r["prefill"] or r["decode"] for r in rows)
        self.chart_box.layout.display = "" if ran else "none"
        if not ran:
            self.figures.pop("devices-gap", None)
            return
        old, self.chart = self.chart, _figure_widget(rows)
        self.chart_box.children = [self.chart]
        old.close()
        self.figures["devices-gap"] = self.chart


def _figure_widget(rows: list[dict]):
    import plotly.graph_objects as go
    fig = go.FigureWidget(make_device_gap_figure(rows))
    fig.layout.height = 400
    return fig
