"""The calibration panel: choose a calibration set, run it, see coverage and activation statistics.

    panel = CalibratePanel(lm, samples=128, seq_len=512)   # data: the demo calibration text by default
    panel.run()                                            # what the Run button does; returns the stats
    panel.calib_set.report, panel.stats.layers
    display(panel)

Results are cached in the workspace (see ``workbench.model.calibrate.calibrate``), so a second run with
the same model, text and settings reads them back. In the app (``session=``) the result becomes the
session's calibration, which AWQ in the Quantize tab uses.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from ..model.calibrate import CalibrationStats, calibrate
from ..charts.calibration import (make_channel_magnitude_figure, make_layer_overview_figure,
                                  make_stat_heatmap_figure, make_token_length_figure)
from ..assets import demo_text_path
from ..evaluation.data import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, CalibrationSet
from ..model.load import LoadedModel
from ..files.workspace import Workspace
from .base import StepPanel, placeholder_html
from .session import SessionLabel

__all__ = ["CalibratePanel"]

SORT_CHOICES = [("outlier ratio", "outlier_ratio"), ("max / median", "max_to_median"), ("kurtosis", "kurtosis"),
                ("abs-max", "abs_max"), ("near-zero fraction", "near_zero_fraction"), ("module order", "order")]


class CalibratePanel(StepPanel):
    """Data file, samples, sequence length; Run; coverage summary and the calibration charts."""

    def __init__(self, lm: LoadedModel, *, data=None, samples: int = DEFAULT_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN,
                 seed: int = 0, bilingual: bool = False, workspace: Workspace | None = None, session=None):
        self.lm, self.session = lm, session
        self.workspace = workspace if workspace is not None or session is None else session.workspace
        self.calib_set: CalibrationSet | None = None
        self.stats: CalibrationStats | None = None
        self._setup()  # figures on show: coverage, overview, channels, heatmap
        max_len = getattr(lm.model.config, "max_position_embeddings", None) or 1 << 20
        self.data = widgets.Text(value=str(data or demo_text_path("calibration")), description="data",
                                 placeholder="plain text, .jsonl or Alpaca .json", layout={"width": "640px"})
        self.samples = widgets.BoundedIntText(value=samples, min=1, max=100_000, description="samples")
        self.seq_len = widgets.BoundedIntText(value=min(seq_len, max_len), min=2, max=max_len, description="seq len")
        self.seed = widgets.IntText(value=seed, description="seed")
        self.bilingual = widgets.Checkbox(value=bilingual, description="bilingual (zh/en) model", indent=False)
        self.run_button = widgets.Button(description="Run calibration", button_style="primary", icon="play")
        self.run_button.on_click(lambda _: self.run())
        self.coverage = widgets.HTML()
        self.sort_by = widgets.Dropdown(options=SORT_CHOICES, value="outlier_ratio", description="sort by")
        self.sort_by.observe(lambda _: self._draw_overview(), names="value")
        self.layer = widgets.Dropdown(options=[], description="layer", layout={"width": "520px"})
        self.layer.observe(lambda _: self._draw_channels(), names="value")
        self.coverage_plot, self.overview_plot, self.channel_plot, self.heatmap_plot = (
            widgets.Output() for _ in range(4))
        # what each sub-tab will show, until Run calibration draws it
        self.waiting = {which: widgets.HTML(placeholder_html(f"after Run calibration: {what}")) for which, what in (
            ("coverage", "how much of the text became samples, and the token length of every piece"),
            ("overview", "one row per layer: how its input values spread, and its share of outlier channels"),
            ("channels", "one layer's input channels: largest and mean |x|, the outliers marked"),
            ("heatmap", "every layer against each statistic of its input, in numbers and colour"))}
        tabs = widgets.Tab(children=[
            widgets.VBox([self.waiting["coverage"], self.coverage, self.coverage_plot]),
            widgets.VBox([self.sort_by, self.waiting["overview"], self.overview_plot]),
            widgets.VBox([self.layer, self.waiting["channels"], self.channel_plot]),
            widgets.VBox([self.waiting["heatmap"], self.heatmap_plot])])
        for i, title in enumerate(("Coverage", "Layers", "Channels", "Heat map")):
            tabs.set_title(i, title)
        self.controls = [self.data, self.samples, self.seq_len, self.seed, self.bilingual, self.run_button]
        head = [widgets.HTML(f"<b>Calibrate</b> {html.escape(lm.name)}: activation statistics of every linear "
                             "layer's input" + (" (AWQ in the Quantize tab uses this calibration)" if session else ""))]
        if session is not None:
            head.append(self._own(SessionLabel(session)))
        super().__init__([
            *head, self.data, widgets.HBox([self.samples, self.seq_len, self.seed]),
            widgets.HBox([self.bilingual, self.run_button]), self.status_line, self.log_output, tabs])

    def run(self) -> CalibrationStats | None:
        """Load the calibration set and compute (or read back) the statistics; show the results."""
        ok, result = self._attempt("running...", lambda: calibrate(
            self.lm, self.data.value.strip() or None, samples=self.samples.value, seq_len=self.seq_len.value,
            workspace=self.workspace, seed=self.seed.value, bilingual=self.bilingual.value, progress=True))
        if not ok:
            return None
        self.calib_set, self.stats = result
        if self.session is not None:
            self.session.calibration = result
        meta = self.stats.meta
        how = "read back from the workspace" if self.stats.cached else f"computed in {meta['seconds']:.1f} s"
        self.status.value = (f"{len(self.stats.layers)} layers over {meta['tokens']:,} tokens, {how}"
                             + (f" ({html.escape(str(self.stats.artifact.path))})" if self.stats.artifact else ""))
        self._show_results()
        return self.stats

    def _show_results(self) -> None:
        lines = self.calib_set.report.summary_lines()
        self.coverage.value = "<ul>" + "".join(
            f"<li style='color:{'#c0392b' if line.startswith('warning') else 'inherit'}'>{html.escape(line)}</li>"
            for line in lines) + "</ul>"
        self._plot("coverage", make_token_length_figure(self.calib_set.report))
        self._plot("heatmap", make_stat_heatmap_figure(self.stats))
        self._draw_overview()
        names = list(self.stats.layers)
        worst = max(names, key=lambda n: self.stats.layers[n].max_to_median)
        self.layer.options = names
        self.layer.value = worst  # start on the layer whose channels stick out most
        self._draw_channels()

    def _draw_overview(self) -> None:
        if self.stats is not None:
            self._plot("overview", make_layer_overview_figure(self.stats, sort_by=self.sort_by.value))

    def _draw_channels(self) -> None:
        if self.stats is not None and self.layer.value in self.stats.layers:
            self._plot("channels", make_channel_magnitude_figure(self.stats.layers[self.layer.value]))

    def _plot(self, which: str, fig) -> None:
        out = {"coverage": self.coverage_plot, "overview": self.overview_plot, "channels": self.channel_plot,
               "heatmap": self.heatmap_plot}[which]
        self.waiting[which].value = ""
        super()._plot(which, fig, out)
