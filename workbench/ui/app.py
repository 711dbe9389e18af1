"""The click-through app: the step panels in tabs, one model, one per-layer plan.

Tabs: Calibrate, Precisions (sensitivity and per-layer choices), Quantize, Export (convert and
compare), Profile (speed and size of what Export wrote).

    app = WorkbenchApp("demo")      # any local Hugging Face model directory
    app.load()                      # what the Load button does
    app.run_sensitivity()           # fills the Precisions tab's sensitivity bars
    app.use_plan()                  # Quantize and Export take the plan from the Precisions tab
    display(app)

``notebooks/app.ipynb`` shows it; ``make voila`` serves that notebook as a page on 127.0.0.1 for
people who never open a notebook. The app holds no library logic: each tab is the same panel the
step notebooks display, and the plan edited in Precisions is the one Quantize and Export use.
"""
from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as widgets

from ..models import LoadedModel, load_model
from ..plan import QuantPlan
from ..sensitivity import run_sensitivity
from ..workspace import Workspace
from .base import StepPanel
from .calibrate import CalibratePanel
from .graph import ConvertPanel
from .overrides import OverridePanel
from .profile import ProfilePanel
from .quantize import QuantizePanel

__all__ = ["WorkbenchApp", "TAB_TITLES"]

TAB_TITLES = ("Calibrate", "Precisions", "Quantize", "Export", "Profile")


class WorkbenchApp(StepPanel):
    """Model chooser and Load; then tabs Calibrate, Precisions, Quantize, Export."""

    def __init__(self, model: str = "demo", *, samples: int = 64, seq_len: int = 256, sweep_tokens: int = 256,
                 out_dir: str | Path = "out/app", workspace: Workspace | None = None):
        self.lm: LoadedModel | None = None
        self.samples, self.seq_len, self.sweep_tokens = samples, seq_len, sweep_tokens
        self.out_dir = Path(out_dir)
        self.workspace = workspace or Workspace()
        self.sensitivity = None
        self.calibrate_panel = self.override_panel = self.quantize_panel = self.convert_panel = None
        self.profile_panel = None
        self._setup()
        self.model_path = widgets.Text(value=str(model), description="model", layout={"width": "560px"},
                                       placeholder="demo, or a local Hugging Face model directory")
        self.load_button = widgets.Button(description="Load", button_style="primary", icon="upload")
        self.load_button.on_click(lambda _: self.load())
        self.sweep_button = widgets.Button(description="Run sensitivity sweep", icon="chart-bar",
                                           tooltip="each layer alone at INT8 and INT4: how much it hurts",
                                           layout={"width": "auto"})
        self.sweep_button.on_click(lambda _: self.run_sensitivity())
        self.use_plan_button = widgets.Button(description="Use this plan", icon="arrow-right",
                                              tooltip="Quantize and Export take the per-layer plan shown here",
                                              layout={"width": "auto"})
        self.use_plan_button.on_click(lambda _: self.use_plan())
        self.plan_label = widgets.HTML()
        self.precisions_box = widgets.VBox()
        self.tabs = widgets.Tab()
        self.controls = [self.model_path, self.load_button, self.sweep_button, self.use_plan_button]
        super().__init__([
            widgets.HTML("<p>Choose per-layer INT4 / INT8 / FP16, see what it costs in perplexity, KL divergence "
                         "and size, and export for a target.</p>"),
            widgets.HBox([self.model_path, self.load_button]), self.status, self.log_output, self.tabs])

    # -- actions (the buttons call these) ------------------------------------------------------------
    def load(self, model: str | None = None) -> LoadedModel | None:
        """Load the model and build every tab; a bad path becomes a red status line."""
        if model is not None:
            self.model_path.value = str(model)
        ok, lm = self._attempt(f"loading {self.model_path.value}...", lambda: load_model(self.model_path.value.strip()))
        if not ok:
            return None
        self.lm, self.sensitivity = lm, None
        self.calibrate_panel = CalibratePanel(lm, samples=self.samples, seq_len=self.seq_len, workspace=self.workspace)
        self.override_panel = OverridePanel(lm, tokens=self.sweep_tokens)
        self.precisions_box.children = [widgets.HBox([self.sweep_button, self.use_plan_button, self.plan_label]),
                                        self.override_panel]
        self.quantize_panel = QuantizePanel(lm, samples=self.samples, seq_len=self.seq_len, workspace=self.workspace)
        self.convert_panel = self._convert_panel(None)
        self.profile_panel = ProfilePanel(self.out_dir / "convert")
        self._show_tabs()
        self.plan_label.value = "Quantize and Export use uniform INT4 until you press <i>Use this plan</i>"
        self.status.value = html.escape(f"loaded {lm.name}: {len(lm.layers)} quantizable layers")
        return lm

    def run_sensitivity(self):
        """Sweep every layer at INT8 and INT4 (cached in the workspace); the Precisions tab shows the bars."""
        if self._require_model():
            ok, report = self._attempt("sweeping layer sensitivity...", lambda: run_sensitivity(
                self.lm, tokens=self.sweep_tokens, workspace=self.workspace, progress=True))
            if ok:
                self.sensitivity = report
                self.override_panel = OverridePanel(self.lm, sensitivity=report, plan=self.override_panel.plan,
                                                    tokens=self.sweep_tokens)
                self.precisions_box.children = [self.precisions_box.children[0], self.override_panel]
                self.status.value = html.escape(f"sensitivity of {len(report.layers)} layers measured on "
                                                f"{self.sweep_tokens} tokens")
                return report
        return None

    def use_plan(self) -> QuantPlan | None:
        """Hand the Precisions tab's plan to the Quantize and Export tabs."""
        if not self._require_model():
            return None
        plan = self.override_panel.plan
        self.quantize_panel = QuantizePanel(self.lm, plan=plan, samples=self.samples, seq_len=self.seq_len,
                                            workspace=self.workspace)
        self.convert_panel = self._convert_panel(plan)
        self._show_tabs()
        totals = self.override_panel.totals
        self.plan_label.value = html.escape(f"Quantize and Export use this plan ({totals['bits_per_weight']:.2f} "
                                            f"bits/weight, {totals['size_bytes'] / 1e6:.2f} MB)")
        return plan

    # -- helpers -------------------------------------------------------------------------------------
    def _show_tabs(self) -> None:
        self.tabs.children = [self.calibrate_panel, self.precisions_box, self.quantize_panel, self.convert_panel,
                              self.profile_panel]
        for i, title in enumerate(TAB_TITLES):
            self.tabs.set_title(i, title)

    def _convert_panel(self, plan: QuantPlan | None) -> ConvertPanel:
        return ConvertPanel(str(self.lm.path), plan=plan, bits=None if plan is not None else 4,
                            out_dir=self.out_dir / "convert", max_tokens=2048)

    def _require_model(self) -> bool:
        if self.lm is None:
            self._show_error("load a model first")
            return False
        return True
