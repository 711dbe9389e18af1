"""The quantization panel: method, precision (INT2..INT8, two-level), group size, symmetric; Run; the cost and errors.

    panel = QuantizePanel(lm, method="awq", bits=4, group_size=128)
    panel.run()            # what the Run button does; returns the QuantCost
    panel.qm, panel.cost, panel.rows
    display(panel)

Every run adds a row to the results table, so RTN and AWQ, INT8 and INT4 can be compared on the
same held-out windows (the reference is evaluated once per panel). Given a plan, the controls start
from the plan's method, group size and symmetry. In the app (``session=``) the plan is the session's,
AWQ and RTN's scale search use the Calibrate tab's calibration, and each result becomes the session's quantized model
(saved, and what Export converts). A vision-language model is also scored on pictures (``images=``, else the image set
field, else the bundled demo-vl held-out set): answer-token KL and top-1 against the float model, image-text matching
of both, in words and one table row per run (``workbench.model.vision_quality``; the float side scored once per set).
"""
from __future__ import annotations

import html
import time
from dataclasses import replace

import ipywidgets as widgets

from ..assets import demo_text_path
from ..charts.quantize import make_cost_table_figure, make_layer_error_figure
from ..evaluation.evaluate import DEFAULT_CTX
from ..model.load import LoadedModel
from ..model.calibrate import reads_importance, calibrate, importance_statistics
from ..quantize.plan import QuantPlan, get_precision
from ..quantize import CALIBRATED_METHODS, heldout_ids, measure_cost, measure_reference, quantize_model
from ..files.workspace import Workspace
from ..model.vision_quality import measure_vision_baseline, measure_vision_quality, vision_eval_set
from .base import StepPanel, metric_words_html, ruled_table
from .overrides import precision_choices
from .session import SessionLabel
from .vision import vision_sentences

__all__ = ["QuantizePanel"]

GROUP_CHOICES = [("32", 32), ("64", 64), ("128", 128), ("256", 256), ("per-channel", None)]
FROM_PLAN = object()  # default of method / group_size / symmetric / scale_search: the plan's value (QuantPlan()'s
# without one)


class QuantizePanel(StepPanel):
    """Choose method, bits, group size, symmetry and scale search; Run quantizes, evaluates and shows the cost."""

    def __init__(self, lm: LoadedModel, *, method=FROM_PLAN, bits: int = 4, group_size=FROM_PLAN,
                 symmetric=FROM_PLAN, scale_search=FROM_PLAN, plan: QuantPlan | None = None, data=None, text=None, samples: int = 128,
                 seq_len: int = 512, ctx: int | None = None, max_tokens: int | None = None,
                 workspace: Workspace | None = None, session=None, images=None):
        self.session = session
        self.vision_set = images  # a VLM: the VisionEvalSet scored (None: the image set field, default bundled)
        if session is not None:
            plan = plan or session.plan
            workspace = workspace or session.workspace
        self.lm, self.base_plan, self.workspace = lm, plan, workspace
        max_pos = getattr(lm.model.config, "max_position_embeddings", None) or DEFAULT_CTX
        self.ctx = ctx or min(DEFAULT_CTX, max_pos)  # evaluation window: the model's context, at most 512
        self.samples_n, self.seq_len = samples, seq_len
        self.text_path = text
        self.baseline = None
        self._baseline_tokens = None  # the eval-tokens setting the baseline was measured with
        self.qm = self.cost = self.vision = None
        self.rows: list[dict] = []
        self.vision_rows: list[dict] = []  # a VLM: each run's quality on pictures (VisionQuality.to_dict() + label)
        self._vision_baseline = None  # (image set field, VisionBaseline): the float model scored once per set
        self._setup()
        start = plan or QuantPlan()
        method = start.method if method is FROM_PLAN else method
        group_size = start.group_size if group_size is FROM_PLAN else group_size
        symmetric = start.symmetric if symmetric is FROM_PLAN else symmetric
        scale_search = start.scale_search if scale_search is FROM_PLAN else scale_search
        self.method = widgets.Dropdown(options=[("round-to-nearest", "rtn"), ("AWQ", "awq"), ("GPTQ", "gptq"),
                                                ("AWQ + GPTQ", "awq+gptq")],
                                       value=method, description="method")
        self.bits = widgets.Dropdown(options=self._bit_options(plan), value="plan" if plan is not None else bits,
                                     description="bits")
        self.group_size = widgets.Dropdown(options=self._group_options(group_size), value=group_size,
                                           description="group size")
        self.symmetric = widgets.Checkbox(value=symmetric, description="symmetric", indent=False)
        self.scale_search = widgets.Checkbox(value=scale_search, description="scale search", indent=False,
                                             tooltip="each group's range searched for the least error instead of "
                                                     "min/max (AWQ's clipped layers keep their clips)")
        self.full_range = widgets.Checkbox(value=start.full_range, description="16 levels", indent=False,
                                           tooltip="symmetric codes over all 2^b levels with stretched ranges "
                                                   "(llama.cpp's Q4_0 grid): lowest KL at every width on trained "
                                                   "models, about 4.6x the search time; its scales are signed, "
                                                   "so only GGUF and onnxruntime int4 hold it (docs/quantize.md)")
        self.eval_tokens = widgets.IntText(value=max_tokens or 0, description="tokens scored (0: all)",
                                           style={"description_width": "initial"}, layout={"width": "220px"},
                                           tooltip="held-out tokens the cost is measured on; 0: the whole "
                                                   "evaluation text")
        self.data = widgets.Text(value=str(data or demo_text_path("calibration")), description="calibration",
                                 placeholder="used by AWQ", layout={"width": "640px"})
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.run_button.on_click(lambda _: self.run())
        self.table_plot, self.error_plot = widgets.Output(), widgets.Output()
        self.is_vision = getattr(lm, "is_vision", False)
        self.image_set = widgets.Text(value="", description="image set", layout={"width": "640px"},
                                      placeholder="the bundled demo-vl held-out pictures, or a folder with "
                                                  "captions.jsonl / questions.jsonl",
                                      tooltip="a vision-language model is scored on these pictures: answer-token KL "
                                              "and top-1, image-text matching of the float and quantized model")
        self.pictures = widgets.HTML()  # a VLM: what the quantized model does on pictures, in words and a table
        self.warnings = widgets.HTML()
        self.words = widgets.HTML()  # what KL, top-1 and perplexity mean, once the table shows them
        self.controls = [self.method, self.bits, self.group_size, self.symmetric, self.scale_search, self.full_range,
                         self.data,
                         self.eval_tokens, self.run_button, self.image_set]
        head = [widgets.HTML(f"<b>Quantize</b> {html.escape(lm.name)}: weights to integers by plan, cost measured "
                             "against the unquantized model")]
        self.calibration_note = widgets.HTML()
        if session is not None:
            head.append(self._own(SessionLabel(session)))
            self._watch(session, self._on_session_plan, "plan")
            self._watch(session, self._show_calibration, "calibration")
            self._show_calibration()
        super().__init__([
            *head, widgets.HBox([self.method, self.bits, self.group_size, self.symmetric, self.scale_search,
                                 self.full_range]),
            widgets.HBox([self.data, self.calibration_note]),
            *([self.image_set] if self.is_vision else []),
            widgets.HBox([self.eval_tokens, self.run_button]), self.status_line, self.log_output, self.warnings,
            self.pictures, self.table_plot, self.words, self.error_plot])

    @staticmethod
    def _bit_options(plan: QuantPlan | None) -> list:
        """"plan", then every registered integer precision: plain widths by their bits, fixed layouts (two-level,
        float minimums) by name."""
        ints = [(label, get_precision(name)) for label, name in precision_choices() if name != "fp16"]
        return ([("plan", "plan")] if plan is not None else []) + \
            [(label, p.name if p.two_level or p.minimums else p.bits) for label, p in ints]

    @staticmethod
    def _group_options(group_size) -> list:
        known = [v for _, v in GROUP_CHOICES]
        return GROUP_CHOICES + ([] if group_size in known else [(str(group_size), group_size)])

    def _show_calibration(self, _change=None) -> None:
        """Say which calibration AWQ will use: the Calibrate tab's run, or this file."""
        calibration = self.session.calibration
        if calibration is None:
            self.calibration_note.value = "<small>AWQ and RTN's importance calibrate on this file until the Calibrate tab has run</small>"
        else:
            meta = calibration[1].meta
            self.calibration_note.value = (f"<small>AWQ and RTN's importance use the Calibrate tab's run: {meta.get('samples', '?')} "
                                           f"samples, {meta.get('tokens', 0):,} tokens</small>")

    def _on_session_plan(self, change) -> None:
        """The session's plan changed (Use this plan, a load): the controls show it."""
        self.set_plan(change["new"])

    def set_plan(self, plan: QuantPlan | None) -> None:
        """Start the controls from ``plan`` (its method, group size, symmetry and scale search; bits "plan")."""
        self.base_plan = plan
        if plan is None:
            return
        self.bits.options = self._bit_options(plan)
        self.bits.value = "plan"
        self.method.value = plan.method
        self.group_size.options = self._group_options(plan.group_size)
        self.group_size.value = plan.group_size
        self.symmetric.value = plan.symmetric
        self.scale_search.value = plan.scale_search
        self.full_range.value = plan.full_range

    def current_plan(self) -> QuantPlan:
        """The plan the controls describe (the given plan with these settings, or a uniform one)."""
        settings = {"group_size": self.group_size.value, "symmetric": self.symmetric.value,
                    "scale_search": self.scale_search.value, "method": self.method.value,
                    "full_range": self.full_range.value and self.symmetric.value}  # an asymmetric grid has 2^b
        if self.bits.value == "plan":
            return replace(self.base_plan, **settings)
        return QuantPlan.uniform(self._uniform_precision(), **settings)

    def _uniform_precision(self) -> str:
        """The precision the bits dropdown names (a width: ``int<bits>``; a two-level precision: its name)."""
        v = self.bits.value
        return v if isinstance(v, str) else f"int{v}"

    def run(self):
        """Quantize by the current plan, evaluate against the float model, show the results."""
        ok, result = self._attempt("running...", self._quantize_and_measure)
        if not ok:
            return None
        plan, seconds, label = result
        self.rows.append({"label": label, **self.cost.to_dict(), "seconds": seconds})
        fallbacks = len(self.qm.fallbacks)
        saved = ""
        if self.session is not None:
            saved = f"; saved to {self.session.quantized_path}"
        self.status.value = html.escape(f"{label}: {len(self.qm.weights)} integer layers in {seconds:.1f} s; "
                                        f"{self.cost.bits_per_weight:.2f} bits per weight"
                                        + (f"; {fallbacks} layer(s) used a smaller group size" if fallbacks else "")
                                        + saved)
        self.warnings.value = "".join(f"<p style='color:#c0392b'>warning: {html.escape(w)}</p>"
                                      for w in self.cost.warnings)
        if self.vision is not None:
            self.vision_rows.append({"label": label, **self.vision.to_dict()})
            self.pictures.value = pictures_html(self.vision_rows)
        self._plot("cost", make_cost_table_figure(self.rows), self.table_plot)
        self.words.value = metric_words_html("KL", "nats", "top-1", "perplexity")
        self._plot("errors", make_layer_error_figure(self.qm.layers), self.error_plot)
        return self.cost

    def _calibration(self, workspace: Workspace, plan: QuantPlan):
        """AWQ's calibration and RTN's importance weights: the session's (the Calibrate tab's run) when there is
        one, else computed here (RTN: the short pass `workbench quantize` runs by default)."""
        if self.session is not None and self.session.calibration is not None:
            return self.session.calibration
        if plan.method not in CALIBRATED_METHODS:
            return importance_statistics(self.lm, self.data.value.strip() or None, workspace, progress=False)[0]
        result = calibrate(self.lm, self.data.value.strip() or None, samples=self.samples_n, seq_len=self.seq_len,
                           workspace=workspace)
        if self.session is not None:
            self.session.calibration = result
        return result

    def _quantize_and_measure(self):
        """The library calls behind Run: reference (once), calibration for AWQ, quantize, measure, keep."""
        plan = self.current_plan()
        label = (f"{'plan' if self.bits.value == 'plan' else self._uniform_precision().upper()} {plan.method.upper()} "
                 f"g{plan.group_size or 'channel'}{'' if plan.symmetric else ' asym'}"
                 f"{'' if plan.scale_search else ' min/max'}{' 16-level' if plan.full_range else ''}")
        tokens = self.eval_tokens.value or None
        if self.baseline is None or self._baseline_tokens != tokens:  # rows compare on one text: start them again
            self.baseline = measure_reference(self.lm.model, heldout_ids(self.lm, self.text_path, tokens), ctx=self.ctx)
            self._baseline_tokens = tokens
            ref = self.baseline.report
            self.rows = []
            self.rows.append({"label": "float (reference)", "perplexity": ref.perplexity,
                              "bits_per_weight": 16.0, "seconds": None})
        calibration = workspace = None
        if plan.method in CALIBRATED_METHODS or reads_importance(plan):  # RTN's search weighs errors by them
            workspace = self.workspace or Workspace()  # statistics and the AWQ search are cached there
            calibration = self._calibration(workspace, plan)
        t0 = time.perf_counter()
        self.qm = quantize_model(self.lm, plan, calibration=calibration, workspace=workspace)
        seconds = time.perf_counter() - t0
        self.cost = measure_cost(self.qm, self.baseline)
        self.vision = self._measure_pictures() if self.is_vision else None
        if self.session is not None:
            self.session.set_quantized(self.qm, self.cost, vision=self.vision)  # the session's plan becomes this one
        return plan, seconds, label

    def _measure_pictures(self):
        """A VLM's quantized model on pictures against the float model, whose side is scored once per image set."""
        where = self.image_set.value.strip()
        if self._vision_baseline is None or self._vision_baseline[0] != where:
            images = self.vision_set if self.vision_set is not None and not where else vision_eval_set(where or None)
            print(f"scoring the float model on {images.describe()}", flush=True)
            self._vision_baseline = (where, measure_vision_baseline(self.lm, images))
            self.vision_rows = []  # rows compare on one set of pictures
        print("scoring the quantized model on the same pictures", flush=True)
        return measure_vision_quality(self.lm, self.qm.build_model(), baseline=self._vision_baseline[1])


def pictures_html(rows: list[dict]) -> str:
    """The latest run on pictures in plain words, and every run of this panel as a table (float model first)."""
    if not rows:
        return ""
    last = rows[-1]
    words = "".join(f"<p style='margin:2px 0'>{html.escape(s)}</p>" for s in vision_sentences(last))

    def pm(value, err, spec, err_spec=None):
        return "-" if value is None else f"{value:{spec}} ± {err:{err_spec or spec}}"
    body = (f"<tr><td>float (reference)</td><td>(reference)</td><td>(reference)</td>"
            f"<td>{pm(last['reference_itm_accuracy'], last['reference_itm_accuracy_stderr'], '.1%')}</td><td>-</td></tr>")
    body += "".join(f"<tr><td>{html.escape(r['label'])}</td><td>{pm(r['answer_kl'], r['answer_kl_stderr'], '.5f')}</td>"
                    f"<td>{pm(r['answer_top1'], r['answer_top1_stderr'], '.1%')}</td>"
                    f"<td>{pm(r['itm_accuracy'], r['itm_accuracy_stderr'], '.1%')}</td>"
                    f"<td>{pm(r['itm_difference'], r['itm_difference_stderr'], '+.1%', '.1%')}</td></tr>" for r in rows)
    table = ruled_table("workbench-pictures-table", "<th>model</th><th>answer-token KL (nats)</th><th>answer top-1 "
                        "agreement</th><th>image-text matching</th><th>matching vs float</th>", body)
    return (f"<div class='workbench-pictures'><b>On pictures</b> ({html.escape(last['source'])}; "
            f"{last['seconds']:.1f} s):{words}{table}<p style='font-size:12px;color:#5d6d7e'>Below: the language "
            "model alone on held-out text, no picture (the text the eval tokens field sets): a check that text still "
            "reads as before; a model trained on captions only has a high perplexity on prose, float and quantized "
            "alike.</p></div>")
