"""The click-through app: the step panels in tabs around one session (model, plan, quantized model).

Tabs: Fine-tune (optional LoRA), Calibrate, Precisions (sensitivity and per-layer choices),
Quantize, Export (convert and compare), Profile (speed and size of what Export wrote), Generate (what
Export wrote continues a prompt, streamed with its tokens/s, the float model beside it), Project (the plans on
device profiles: tokens/s bound and projected, memory fit, layers the accelerator cannot run). Download packs
the run into one zip: the quantized model, the converted files, override files, the plan, the figures
and a report of what was measured.

    app = WorkbenchApp("demo")      # any local Hugging Face model directory
    app.load()                      # what the Load button does
    app.run_sensitivity()           # fills the Precisions tab's sensitivity bars
    app.use_plan()                  # the Precisions tab's plan becomes the session's plan
    app.quantize_panel.run(); app.convert_panel.run("ort-int4"); app.generate_panel.run(); app.download()
    display(app)

Every tab reads and writes ``app.session`` (``workbench.ui.session.AppSession``): the plan edited in
Precisions is the plan Quantize runs (with its method, group size and symmetry), the model Quantize
makes is what Export converts, and each tab says which plan and which quantized model it shows.
Outputs go to the session's folder (``<workspace>/app/run-<time>`` unless chosen in the app), never
beside the notebooks. ``notebooks/app.ipynb`` shows the app; ``make voila`` serves it on 127.0.0.1.
"""
from __future__ import annotations

import html
import os
from pathlib import Path

import ipywidgets as widgets

from ..model.load import LoadedModel
from ..quantize.plan import QuantPlan
from ..precision.sensitivity import run_sensitivity
from ..model.sweep_backends import backend_for, default_workers
from ..files.workspace import Workspace
from ..units import format_bytes
from .base import FileDownload, StatusGroup, StatusLine, StepPanel
from .calibrate import CalibratePanel
from .compress import CompressPanel
from .finetune import FinetunePanel
from .generate import GeneratePanel
from .graph import ConvertPanel
from .overrides import OverridePanel
from .profile import ProfilePanel
from .project import ProjectPanel
from .quantize import QuantizePanel
from .session import ARCHIVE_SEND_LIMIT, AppSession, SessionLabel, run_model
from .vision import VisionPanel, model_words

__all__ = ["WorkbenchApp", "TAB_TITLES", "SENSITIVITY_CHOICES", "SWEEP_PRECISIONS", "EVERY_PRECISION"]

# how the Precisions tab scores layers: the Fisher proxy answers in seconds, the measured sweep takes minutes
SENSITIVITY_CHOICES = (("Quick estimate (Fisher proxy, seconds)", "proxy"), ("Measured sweep (thorough, minutes)", "kl"))
# "every": every registered integer precision (run_sensitivity's precisions=None); not None itself, which a
# dropdown takes for "nothing chosen" and shows blank
EVERY_PRECISION = "every"
SWEEP_PRECISIONS = (("INT8 and INT4", ("int8", "int4")), ("INT2 to INT8", ("int8", "int6", "int5", "int4", "int3", "int2")),
                    ("every precision", EVERY_PRECISION))

# ipywidgets gives every box ``overflow: auto``: a row a pixel taller than its box (each layer row of Precisions)
# showed a tiny scrollbar, a row wider than the page a horizontal one. In the app a row wraps instead and never
# scrolls; a box that should scroll (the logs) sets its own overflow on its layout, which wins over this.
APP_STYLE = ("<style>.workbench-app .widget-hbox, .workbench-app .jupyter-widget-hbox {overflow: visible; "
             "flex-wrap: wrap} .workbench-app .widget-vbox, .workbench-app .jupyter-widget-vbox "
             "{overflow: visible}</style>")

TAB_TITLES = ("Fine-tune", "Calibrate", "Precisions", "Quantize", "Export", "Profile", "Generate", "Project",
              "Compress")


class WorkbenchApp(StepPanel):
    """Model chooser, Load, output folder and Download; then the tabs, all on ``self.session``."""

    def __init__(self, model: str = "demo", *, samples: int = 64, seq_len: int = 256, sweep_tokens: int = 256,
                 eval_tokens: int | None = None, finetune_steps: int = 100, out_dir: str | Path | None = None,
                 workspace: Workspace | None = None):
        self.session = AppSession(out_dir=out_dir, workspace=workspace)
        self.samples, self.seq_len, self.sweep_tokens = samples, seq_len, sweep_tokens
        self.eval_tokens, self.finetune_steps = eval_tokens, finetune_steps
        self.finetune_panel = self.calibrate_panel = self.override_panel = self.quantize_panel = None
        self.convert_panel = self.profile_panel = self.generate_panel = self.project_panel = None
        self.compress_panel = self.vision_panel = None
        self.vision_box = widgets.VBox()  # a vision-language model: its parts and the picture (ui.vision)
        self._setup()
        self.model_path = widgets.Text(value=str(model), description="model", layout={"width": "560px"},
                                       placeholder="demo, or a local Hugging Face model directory")
        self.load_button = widgets.Button(description="Load", button_style="primary", icon="upload")
        self.load_button.on_click(lambda _: self.load())
        self.out_dir_text = widgets.Text(value=str(self.session.out_dir), description="outputs",
                                         continuous_update=False, layout={"width": "560px"},
                                         tooltip="every file this app writes goes below this folder")
        self.out_dir_text.observe(self._on_out_dir, names="value")
        self.download_button = widgets.Button(description="Download run (zip)", icon="download",
                                              tooltip="quantized model, converted files, override files, plan, "
                                                      "figures and a report of what was measured",
                                              layout={"width": "auto"})
        self.download_button.on_click(lambda _: self.download())
        self.download_link = FileDownload()
        self.sweep_how = widgets.ToggleButtons(options=SENSITIVITY_CHOICES, value="proxy", style={"button_width": "auto"},
                                               tooltips=["estimated KL of each layer alone, from one forward and "
                                                         "one backward pass", "KL of each layer alone measured, "
                                                         "one forward pass per layer and precision"])
        self.sweep_precisions = widgets.Dropdown(options=SWEEP_PRECISIONS, value=SWEEP_PRECISIONS[0][1],
                                                 description="precisions", layout={"width": "260px"})
        self.sweep_workers = widgets.BoundedIntText(value=default_workers(), min=1, max=max(1, os.cpu_count() or 1),
                                                    description="workers", layout={"width": "150px"},
                                                    tooltip="processes the measured sweep runs on, each with the "
                                                            "model shared (no copy); the bar counts finished "
                                                            "layers from all of them")
        self.sweep_button = widgets.Button(description="Run sensitivity", icon="chart-bar", button_style="primary",
                                           tooltip="each layer alone at the chosen precisions: how much it hurts; then "
                                                   "uniform and automatic plans are measured for the chart",
                                           layout={"width": "auto"})
        self.sweep_button.on_click(lambda _: self.run_sensitivity())
        self.status_group = StatusGroup()  # a message lasts until another action succeeds
        self.status_group.add(self.status_line)  # under Load
        self.download_line = self.status_group.add(StatusLine())
        self.sweep_line = self.status_group.add(StatusLine())
        self.use_plan_button = widgets.Button(description="Use this plan", icon="arrow-right",
                                              tooltip="Quantize and Export take the per-layer plan shown here",
                                              layout={"width": "auto"})
        self.use_plan_button.on_click(lambda _: self.use_plan())
        self.continue_button = widgets.Button(description="Continue with the fine-tuned model", icon="arrow-right",
                                              tooltip="load the merged model in every tab", layout={"width": "auto"})
        self.continue_button.on_click(lambda _: self.use_finetuned())
        self.plan_label = widgets.HTML()
        self.finetune_box, self.precisions_box = widgets.VBox(), widgets.VBox()
        self.finetune_label, self.precisions_label = SessionLabel(self.session), SessionLabel(self.session)
        self.tabs = widgets.Tab()
        self.controls = [self.model_path, self.load_button, self.out_dir_text, self.download_button,
                         self.sweep_how, self.sweep_precisions, self.sweep_workers, self.sweep_button, self.use_plan_button,
                         self.continue_button]
        self.session.observe(self._on_plan, names="plan")
        self.session.observe(self._on_session_out_dir, names="out_dir")
        super().__init__([
            widgets.HTML(APP_STYLE + "<p>Choose per-layer INT4 / INT8 / FP16, see what it costs in perplexity, KL "
                         "divergence and size, and export for a target.</p>"),
            widgets.HBox([self.model_path, self.load_button]), self.status_line, self.vision_box,
            widgets.HBox([self.out_dir_text, self.download_button, self.download_link]), self.download_line,
            self.log_output, self.tabs])
        self.add_class("workbench-app")

    # -- what the session holds, under the names the app has always used -----------------------------
    @property
    def lm(self) -> LoadedModel | None:
        return self.session.lm

    @property
    def workspace(self) -> Workspace:
        return self.session.workspace

    @property
    def out_dir(self) -> Path:
        return self.session.out_dir

    @property
    def sensitivity(self):
        return self.session.sensitivity

    # -- actions (the buttons call these) ------------------------------------------------------------
    def load(self, model: str | None = None) -> LoadedModel | None:
        """Load the model into the session and build every tab; a bad path becomes a red status line."""
        if model is not None:
            self.model_path.value = str(model)
        before = self.session.out_dir
        # whatever Load gives, the last run's download is not this one's: no "downloading" line, no "save again" link
        self.download_line.clear()
        if self.download_link.sent:
            self.download_link.forget()
        ok, lm = self._attempt(f"loading {self.model_path.value}...", lambda: self.session.load(self.model_path.value))
        if not ok:
            return None
        for panel in (self.finetune_panel, self.calibrate_panel, self.quantize_panel, self.convert_panel,
                      self.profile_panel, self.generate_panel, self.project_panel, self.compress_panel,
                      self.vision_panel):
            if panel is not None:
                panel.close()  # they stop observing the session
        s = self.session
        self.vision_panel = VisionPanel(s) if lm.is_vision else None
        self.vision_box.children = [self.vision_panel] if self.vision_panel is not None else []
        self.finetune_panel = FinetunePanel(str(lm.path), out_dir=s.out_dir / "finetuned", steps=self.finetune_steps)
        self.finetune_box.children = [self.finetune_label, self.finetune_panel, self.continue_button]
        self.calibrate_panel = CalibratePanel(lm, samples=self.samples, seq_len=self.seq_len, session=s)
        self._set_override_panel(OverridePanel(lm, plan=s.plan, tokens=self.sweep_tokens))
        self.quantize_panel = QuantizePanel(lm, samples=self.samples, seq_len=self.seq_len, max_tokens=self.eval_tokens,
                                            session=s)
        self.convert_panel = ConvertPanel(session=s, max_tokens=self.eval_tokens)
        self.profile_panel = ProfilePanel(session=s)
        self.generate_panel = GeneratePanel(session=s)
        self.project_panel = ProjectPanel(session=s, points=lambda: self.override_panel.points)
        # pruned models land on the Precisions tab's Pareto chart beside its plans
        self.compress_panel = CompressPanel(
            lm, out_dir=s.out_dir / "compress", workspace=s.workspace, session=s,
            extra_points=lambda: self.override_panel.points if self.override_panel else [])
        self.tabs.children = [self.finetune_box, self.calibrate_panel, self.precisions_box, self.quantize_panel,
                              self.convert_panel, self.profile_panel, self.generate_panel, self.project_panel,
                              self.compress_panel]
        for i, title in enumerate(TAB_TITLES):
            self.tabs.set_title(i, title)
        for panel in (self.finetune_panel, self.calibrate_panel, self.quantize_panel, self.convert_panel,
                      self.profile_panel, self.generate_panel, self.project_panel, self.compress_panel,
                      getattr(self.convert_panel, "gap_panel", None), self.vision_panel):
            if panel is not None:
                self.status_group.add(panel.status_line)
        self.tabs.selected_index = 1  # Calibrate: fine-tuning is optional
        self.plan_label.value = "Quantize and Export use uniform INT4 until you press <i>Use this plan</i>"
        moved = " (a new run folder: a run holds one model's results)" if s.out_dir != before else ""
        self.status.value = html.escape(f"loaded {lm.name}: {len(lm.layers)} quantizable layers"
                                        + (f"; {model_words(lm)}" if lm.is_vision else "")
                                        + f"; outputs go to {s.out_dir}{moved}")
        return lm

    def run_sensitivity(self, score: str | None = None, precisions=(), frontier: bool = True):
        """Score every layer alone (cached in the workspace); the Precisions tab shows the bars, then uniform
        INT8 / INT4 and automatic plans are measured so that the size-against-damage chart has points.

        ``score``: ``proxy`` (the default choice: the Fisher estimate, seconds) or ``kl`` (measured, minutes);
        ``precisions``: a tuple, or None for every registered one; both default to the tab's choices."""
        if not self._require_model(self.sweep_line):
            return None
        score = score or self.sweep_how.value
        precisions = self.sweep_precisions.value if precisions == () else precisions
        precisions = None if precisions == EVERY_PRECISION else precisions
        plan = self.override_panel.plan
        how = "estimating" if score == "proxy" else "measuring"
        ok, report = self._attempt(f"{how} each layer's sensitivity...", lambda: run_sensitivity(
            self.lm, tokens=self.sweep_tokens, precisions=precisions, **plan.quantizer_settings, score=score,
            workspace=self.workspace, progress=True, backend=backend_for(workers=self.sweep_workers.value)),
            self.sweep_line)
        if not ok:
            return None
        self.session.sensitivity = report
        panel = OverridePanel(self.lm, sensitivity=report, plan=plan, tokens=self.sweep_tokens,
                              points=self.override_panel.points)
        self._set_override_panel(panel)
        done = (f"{report.score_label} of {len(report.layers)} layers at {', '.join(report.precisions)} on "
                f"{report.tokens:,} tokens ({report.seconds:.1f} s)")
        if frontier and not any(p.label.startswith("auto") for p in panel.points):
            ok, _ = self._attempt(f"{done}; measuring uniform and automatic plans for the chart...",
                                  panel.evaluate_frontier, self.sweep_line)
            if not ok:
                return report
        self.sweep_line.html.value = html.escape(done) + ("; the chart below shows uniform and automatic plans"
                                                          if panel.points else "")
        return report

    def use_plan(self) -> QuantPlan | None:
        """Make the Precisions tab's plan the session's: Quantize runs it, Export converts its result."""
        if not self._require_model(self.sweep_line):
            return None
        plan = self.override_panel.plan
        self.session.plan = plan
        self.status_group.succeeded(None)  # every earlier message is done with
        totals = self.override_panel.totals
        self.plan_label.value = html.escape(f"Quantize and Export use this plan ({totals['bits_per_weight']:.2f} "
                                            f"bits/weight, {totals['size_bytes'] / 1e6:.2f} MB)")
        return plan

    def use_finetuned(self) -> LoadedModel | None:
        """Load the model the Fine-tune tab merged, in every tab."""
        report = self.finetune_panel.report if self.finetune_panel is not None else None
        if report is None:
            self._show_error("fine-tune first (the Fine-tune button above)",
                             self.finetune_panel.status_line if self.finetune_panel is not None else None)
            return None
        return self.load(report.out_dir)

    def download(self) -> Path | None:
        """Pack the run into one zip under the output folder and hand it to the browser."""
        if not self._require_model(self.download_line):
            return None
        ok, path = self._attempt("packing the run...", lambda: self.session.write_archive(
            self.figures_on_show(), self.override_panel.points if self.override_panel else ()), self.download_line)
        if not ok:
            return None
        size = path.stat().st_size
        if size <= ARCHIVE_SEND_LIMIT:
            self.download_link.send_file(path)  # in pieces: the page counts them in as they arrive
            self.download_line.html.value = html.escape(f"downloading {path.name} ({format_bytes(size)}); also kept "
                                                        f"at {path}")
        else:
            self.download_line.html.value = html.escape(f"{path} is {format_bytes(size)}, too big to send through "
                                                        "the page: copy it from there")
        return path

    def figures_on_show(self) -> dict:
        """Every figure the tabs show, by tab and name (what Download packs)."""
        figures = {}
        for tab, panel in (("finetune", self.finetune_panel), ("calibrate", self.calibrate_panel),
                           ("quantize", self.quantize_panel), ("export", self.convert_panel),
                           ("export", getattr(self.convert_panel, "gap_panel", None)),
                           ("profile", self.profile_panel), ("project", self.project_panel),
                           ("compress", self.compress_panel)):
            for name, fig in (panel.figures if panel is not None else {}).items():
                figures[f"{tab}-{name}"] = fig
        if self.override_panel is not None and self.override_panel.points:
            figures["precisions-pareto"] = self.override_panel.chart
        return figures

    # -- helpers -------------------------------------------------------------------------------------
    def _set_override_panel(self, panel: OverridePanel) -> None:
        if self.override_panel is not None:
            self.override_panel.close()
        self.override_panel = panel
        panel.path.value = str(self.session.out_dir / "plan.json")  # its Save / Load file, in the outputs folder
        self.precisions_box.children = [self.precisions_label,
                                        widgets.HBox([self.sweep_how, self.sweep_precisions, self.sweep_workers, self.sweep_button]),
                                        self.sweep_line,
                                        widgets.HBox([self.use_plan_button, self.plan_label]),
                                        panel]

    def _on_plan(self, change) -> None:
        """Another tab changed the session's plan (Quantize ran a different one): Precisions shows it too."""
        plan, panel = change["new"], self.override_panel
        if panel is not None and plan is not None and panel.lm is self.session.lm and panel.plan != plan:
            panel.set_plan(plan, "plan from the Quantize tab")

    def _on_session_out_dir(self, change) -> None:
        """Loading another model moved the outputs to a new run folder: the text box shows it."""
        if Path(self.out_dir_text.value).expanduser().resolve() != change["new"]:
            self.out_dir_text.value = str(change["new"])

    def _on_out_dir(self, change) -> None:
        new = Path(change["new"].strip() or str(self.session.out_dir)).expanduser().resolve()
        if new == self.session.out_dir:
            return
        owner = run_model(new) if new.is_dir() else None
        if owner is not None and self.lm is not None and owner.get("fingerprint") != self.session.fingerprint:
            self._show_error(f"{new} holds the run of another model ({owner.get('model')}): choose an empty folder",
                             self.download_line)
            self.out_dir_text.value = str(self.session.out_dir)
            return
        self.session.out_dir = new
        if self.override_panel is not None:
            self.override_panel.path.value = str(new / "plan.json")
        self.download_line.html.value = html.escape(f"outputs go to {new}")

    def _require_model(self, line: StatusLine | None = None) -> bool:
        if self.lm is None:
            self._show_error("load a model first", line)
            return False
        return True
