"""The quantization panel: method, bits, group size, symmetric; Run; the measured cost and per-layer errors.

    panel = QuantizePanel(lm, method="awq", bits=4, group_size=128)
    panel.run()            # what the Run button does; returns the QuantCost
    panel.qm, panel.cost, panel.rows
    display(panel)

Every run adds a row to the results table, so RTN and AWQ, INT8 and INT4 can be compared on the
same held-out windows (the reference is evaluated once per panel).
"""
from __future__ import annotations

import html
import time
from dataclasses import replace

import ipywidgets as widgets

from ..charts.quantize import make_cost_table_figure, make_layer_error_figure
from ..evaluate import DEFAULT_CTX
from ..models import LoadedModel, demo_text_path
from ..plan import QuantPlan
from ..quantize import heldout_ids, measure_cost, measure_reference, quantize_model
from ..workspace import Workspace
from .base import StepPanel

__all__ = ["QuantizePanel"]

GROUP_CHOICES = [("32", 32), ("64", 64), ("128", 128), ("256", 256), ("per-channel", None)]


class QuantizePanel(StepPanel):
    """Choose method, bits, group size and symmetry; Run quantizes, evaluates and shows the cost."""

    def __init__(self, lm: LoadedModel, *, method: str = "rtn", bits: int = 4, group_size: int | None = 128,
                 symmetric: bool = True, plan: QuantPlan | None = None, data=None, text=None, samples: int = 128,
                 seq_len: int = 512, ctx: int | None = None, workspace: Workspace | None = None):
        self.lm, self.base_plan, self.workspace = lm, plan, workspace
        max_pos = getattr(lm.model.config, "max_position_embeddings", None) or DEFAULT_CTX
        self.ctx = ctx or min(DEFAULT_CTX, max_pos)  # evaluation window: the model's context, at most 512
        self.samples_n, self.seq_len = samples, seq_len
        self.text_path = text
        self.baseline = None
        self.qm = self.cost = None
        self.rows: list[dict] = []
        self._setup()
        bit_options = [("INT4", 4), ("INT8", 8)] + ([("plan", "plan")] if plan is not None else [])
        self.method = widgets.Dropdown(options=[("round-to-nearest", "rtn"), ("AWQ", "awq")], value=method,
                                       description="method")
        self.bits = widgets.Dropdown(options=bit_options, value="plan" if plan is not None else bits,
                                     description="bits")
        self.group_size = widgets.Dropdown(options=GROUP_CHOICES, value=group_size, description="group size")
        self.symmetric = widgets.Checkbox(value=symmetric, description="symmetric", indent=False)
        self.data = widgets.Text(value=str(data or demo_text_path("calibration")), description="calibration",
                                 placeholder="used by AWQ", layout={"width": "640px"})
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.run_button.on_click(lambda _: self.run())
        self.table_plot, self.error_plot = widgets.Output(), widgets.Output()
        self.warnings = widgets.HTML()
        self.controls = [self.method, self.bits, self.group_size, self.symmetric, self.data, self.run_button]
        super().__init__([
            widgets.HTML(f"<b>Quantize</b> {html.escape(lm.name)}: weights to integers by plan, cost measured "
                         "against the unquantized model"),
            widgets.HBox([self.method, self.bits, self.group_size, self.symmetric]), self.data, self.run_button,
            self.status, self.log_output, self.warnings, self.table_plot, self.error_plot])

    def current_plan(self) -> QuantPlan:
        """The plan the controls describe (the given plan with these settings, or a uniform one)."""
        settings = {"group_size": self.group_size.value, "symmetric": self.symmetric.value,
                    "method": self.method.value}
        if self.bits.value == "plan":
            return replace(self.base_plan, **settings)
        return QuantPlan.uniform(f"int{self.bits.value}", **settings)

    def run(self):
        """Quantize by the current plan, evaluate against the float model, show the results."""
        ok, result = self._attempt("running...", self._quantize_and_measure)
        if not ok:
            return None
        plan, seconds = result
        label = (f"{'plan' if self.bits.value == 'plan' else f'INT{self.bits.value}'} {plan.method.upper()} "
                 f"g{plan.group_size or 'channel'}{'' if plan.symmetric else ' asym'}")
        self.rows.append({"label": label, **self.cost.to_dict(), "seconds": seconds})
        fallbacks = len(self.qm.fallbacks)
        self.status.value = (f"{label}: {len(self.qm.weights)} integer layers in {seconds:.1f} s; "
                             f"{self.cost.bits_per_weight:.2f} bits per weight"
                             + (f"; {fallbacks} layer(s) used a smaller group size" if fallbacks else ""))
        self.warnings.value = "".join(f"<p style='color:#c0392b'>warning: {html.escape(w)}</p>"
                                      for w in self.cost.warnings)
        self._plot("cost", make_cost_table_figure(self.rows), self.table_plot)
        self._plot("errors", make_layer_error_figure(self.qm.layers), self.error_plot)
        return self.cost

    def _quantize_and_measure(self):
        """The library calls behind Run: reference (once), calibration for AWQ, quantize, measure."""
        plan = self.current_plan()
        if self.baseline is None:
            self.baseline = measure_reference(self.lm.model, heldout_ids(self.lm, self.text_path),
                                              ctx=self.ctx)
            ref = self.baseline.report
            self.rows.append({"label": "float (reference)", "perplexity": ref.perplexity,
                              "bits_per_weight": 16.0, "seconds": None})
        calibration = workspace = None
        if plan.method == "awq":
            from ..calibrate import calibrate
            workspace = self.workspace or Workspace()  # statistics and the AWQ search are cached there
            calibration = calibrate(self.lm, self.data.value.strip() or None, samples=self.samples_n,
                                    seq_len=self.seq_len, workspace=workspace)
        t0 = time.perf_counter()
        self.qm = quantize_model(self.lm, plan, calibration=calibration, workspace=workspace)
        seconds = time.perf_counter() - t0
        self.cost = measure_cost(self.qm, self.baseline)
        return plan, seconds
