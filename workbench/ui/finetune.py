"""The fine-tuning panel: training text, LoRA settings, Run with a progress bar, the loss curve.

    panel = FinetunePanel("demo", out_dir="out/tuned", steps=40)
    panel.run()                      # what the Run button does; returns the FinetuneReport
    display(panel)

The merged model lands in the output directory as an ordinary model, which the later steps load.
"""
from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as widgets

from ..assets import demo_text_path
from ..charts.finetune import make_loss_figure
from ..compress.finetune import FinetuneConfig, FinetuneReport, finetune_lora
from .base import StepPanel

__all__ = ["FinetunePanel"]


class FinetunePanel(StepPanel):
    """Data, output folder, steps, rank, learning rate; Run; perplexity before -> after and the loss curve."""

    def __init__(self, model="demo", *, data=None, out_dir: str | Path = "out/finetuned", steps: int = 200,
                 rank: int = 8, lr: float = 1e-3, batch_size: int = 8, seq_len: int = 256, overwrite: bool = True):
        self.model = model
        self.report: FinetuneReport | None = None
        self._setup()
        self.data = widgets.Text(value=str(data or demo_text_path("calibration")), description="data",
                                 placeholder="plain text, .jsonl or Alpaca .json", layout={"width": "640px"})
        self.out_dir = widgets.Text(value=str(out_dir), description="output", layout={"width": "640px"})
        self.steps = widgets.BoundedIntText(value=steps, min=1, max=1_000_000, description="steps")
        self.rank = widgets.Dropdown(options=[4, 8, 16, 32, 64], value=rank, description="LoRA rank")
        self.lr = widgets.FloatLogSlider(value=lr, base=10, min=-5, max=-2, step=0.25, description="learning rate",
                                         readout_format=".1e", style={"description_width": "initial"})
        self.batch_size = widgets.BoundedIntText(value=batch_size, min=1, max=1024, description="batch")
        self.seq_len = widgets.BoundedIntText(value=seq_len, min=8, max=1 << 16, description="seq len")
        self.overwrite = overwrite
        self.run_button = widgets.Button(description="Fine-tune", button_style="primary", icon="play")
        self.run_button.on_click(lambda _: self.run())
        self.plot = widgets.Output()
        self.controls = [self.data, self.out_dir, self.steps, self.rank, self.lr, self.batch_size, self.seq_len,
                         self.run_button]
        super().__init__([
            widgets.HTML(f"<b>Fine-tune</b> (optional) {html.escape(str(model))} with LoRA; the adapters are merged into an "
                         "ordinary model that the later steps load"),
            self.data, self.out_dir, widgets.HBox([self.steps, self.rank, self.lr]),
            widgets.HBox([self.batch_size, self.seq_len, self.run_button]),
            self.status_line, self.log_output, self.plot])

    def config(self) -> FinetuneConfig:
        return FinetuneConfig(steps=self.steps.value, rank=self.rank.value, lr=self.lr.value,
                              batch_size=self.batch_size.value, seq_len=self.seq_len.value)

    def run(self) -> FinetuneReport | None:
        """Train, merge and save; show perplexity before -> after and the loss curve."""
        # the steps are counted by the status line's bar (the library's "fine-tune" bar drives it): a bar of the
        # panel's own beside it made two bars at once
        def on_step(step: int, loss: float) -> None:
            self.status.value = f"step {step}/{self.steps.value}, loss {loss:.3f}"

        ok, report = self._attempt("fine-tuning...", lambda: finetune_lora(
            self.model, self.data.value.strip() or None, self.out_dir.value, self.config(), overwrite=self.overwrite,
            progress=True, on_step=on_step))
        if not ok:
            return None
        self.report = report
        self.status.value = html.escape(report.summary())
        self._plot("loss", make_loss_figure(report), self.plot)
        return report
