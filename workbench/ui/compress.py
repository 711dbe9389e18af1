"""The compression panel: keep ratios, predicted size, Score / Prune / Distill, and what each step cost.

    panel = CompressPanel("demo", out_dir="out/compress")
    panel.heads.value, panel.mlp.value = 0.25, 0.2    # fractions of the model's heads / channels removed
    panel.score(); panel.prune(); panel.distill()     # what the buttons do
    display(panel)

Every measured model becomes a point (size against KL and perplexity, against the float model) on
one Pareto chart with the precision plans (``extra_points`` supplies those, e.g. the override
panel's), and a row of the table beside it. Every point on the chart is scored on this tab's one
evaluation (the same text and token count): a precision plan measured elsewhere on other tokens is
measured again here (round-to-nearest, as every point here) rather than drawn beside points it
cannot be compared with.

Quantized points, and quantization-aware distillation, use one precision plan: the app session's
current plan (``session=``: the plan Precisions hands on and Quantize runs, followed as it changes),
else ``quant_plan`` (uniform INT4 by default). Its precisions, group size (with ``quantize_model``'s
fallback where a pruned width is not a multiple of it) and symmetry are applied by round-to-nearest,
the rounding quantization-aware distillation trains against; every point is labelled with the
plan's hash and says so when the plan's own method is another.
"""
from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Callable, Sequence

import ipywidgets as widgets

from ..charts.compress import (make_channel_importance_figure, make_compress_table_figure, make_distill_figure,
                               make_head_importance_figure)
from ..charts.precision import make_pareto_figure
from ..compress.distill import DistillConfig, DistillReport, distill
from ..evaluation.evaluate import capture_reference
from ..model.load import LoadedModel, load_model
from ..quantize.plan import QuantPlan
from ..errors import WorkbenchError
from ..compress.prune import (HEAD_UNITS, SCORES, Geometry, PruneImportance, PrunePlan, geometry, head_and_channel_importance,
                     measure_point, predicted_size, prune)
from ..precision.sensitivity import evaluation_tokens
from ..files.workspace import Workspace
from .base import StepPanel, metric_words_html, placeholder_html
from .session import describe_plan
from ..units import format_bytes
from ..compress.prune import IMPORTANCE_FILE

__all__ = ["CompressPanel"]


def _rounded(plan: QuantPlan) -> str:
    """The hash of ``plan`` rounded to nearest: what this tab measures whatever the plan's own method."""
    import dataclasses
    return dataclasses.replace(plan, method="rtn").content_hash()


class CompressPanel(StepPanel):
    """Heads / MLP fractions removed, head unit, score; INT4 on or off; distillation steps and temperature."""

    def __init__(self, model: str | Path | LoadedModel = "demo", *, out_dir: str | Path = "out/compress",
                 workspace: Workspace | None = None, heads: float = 0.25, mlp: float = 0.2, steps: int = 100,
                 temperature: float = 5.0, eval_tokens: int = 4096, importance_tokens: int = 2048,
                 quant_plan: QuantPlan | None = None, extra_points: Callable[[], Sequence] | None = None,
                 session=None):
        self._setup()
        self.session = session
        self.lm = model if isinstance(model, LoadedModel) else load_model(model)
        try:
            self.geo = geometry(self.lm.model)
            self.unsupported = None
        except WorkbenchError as e:  # the app still opens for a model this tab cannot prune; the tab says why
            self.geo, self.unsupported = Geometry(0, 1, 1, 0, 0, 0), str(e)
        self.out_dir = Path(out_dir)
        self.workspace = workspace or Workspace()
        self.eval_tokens, self.importance_tokens = eval_tokens, importance_tokens
        self._quant_plan = quant_plan or QuantPlan.uniform("int4")
        self.extra_points = extra_points or (lambda: [])
        self.importance: PruneImportance | None = None
        self.points: list[dict] = []
        self.prune_report: dict | None = None
        self.distill_report: DistillReport | None = None
        self._ids = self._reference = None
        # changed on release: after Score each change redraws which units the plan would remove
        self.heads = widgets.FloatSlider(value=heads, min=0, max=0.95, step=0.05, description="heads removed",
                                         readout_format=".0%", style={"description_width": "110px"},
                                         continuous_update=False)
        self.mlp = widgets.FloatSlider(value=mlp, min=0, max=0.95, step=0.05, description="MLP removed",
                                       readout_format=".0%", style={"description_width": "110px"},
                                       continuous_update=False)
        self.head_unit = widgets.Dropdown(options=list(HEAD_UNITS), value="group", description="head unit")
        self.score_kind = widgets.Dropdown(options=list(SCORES), value="taylor", description="rank by")
        self.quantize = widgets.Checkbox(value=True, description="also quantize", indent=False,
                                         layout={"width": "130px"})
        self.plan_note = widgets.HTML()
        self.steps = widgets.BoundedIntText(value=steps, min=1, max=100_000, description="distil steps")
        self.temperature = widgets.BoundedFloatText(value=temperature, min=0.1, max=100, step=0.5,
                                                    description="temperature", style={"description_width": "initial"})
        self.predicted = widgets.HTML()
        self.score_button = widgets.Button(description="Score", icon="bar-chart",
                                           tooltip="importance of every head and MLP channel (cached)")
        self.prune_button = widgets.Button(description="Prune", button_style="primary", icon="scissors")
        self.words = widgets.HTML()  # what KL, top-1 and perplexity mean, once the table shows them
        self.waiting = widgets.HTML(placeholder_html(
            "after Score: every head's and MLP channel's importance per layer; after Prune (and Distil): the "
            "pruned model, and it quantized by the session's plan, on a size / KL / perplexity chart and table "
            "beside the plans measured in Precisions"))
        self.distill_button = widgets.Button(description="Distil", button_style="primary", icon="graduation-cap")
        self.score_button.on_click(lambda _: self.score())
        self.prune_button.on_click(lambda _: self.prune())
        self.distill_button.on_click(lambda _: self.distill())
        for w in (self.heads, self.mlp, self.head_unit, self.quantize):
            w.observe(lambda _: self._on_settings(), names="value")
        self.importance_plot, self.channel_plot, self.pareto_plot, self.table_plot, self.loss_plot = \
            (widgets.Output() for _ in range(5))
        self.controls = [self.heads, self.mlp, self.head_unit, self.score_kind, self.quantize, self.steps,
                         self.temperature, self.score_button, self.prune_button, self.distill_button]
        g = self.geo
        super().__init__([
            widgets.HTML(f"<b>Compress</b> {html.escape(str(self.lm.name))}: remove attention heads and MLP channels "
                         f"by importance, then distil from the original. {g.layers} layers of {g.heads} query heads "
                         f"over {g.kv_heads} KV heads and {g.intermediate} MLP channels. The first and last "
                         "layers stay whole; the fractions are of the whole model's heads and channels, taken as "
                         "whole units from the middle layers where they matter least (layers keep their own "
                         "counts)."),
            widgets.HBox([self.heads, self.mlp, self.head_unit, self.score_kind]),
            widgets.HBox([self.quantize, self.plan_note]), widgets.HBox([self.steps, self.temperature]),
            self.predicted,
            widgets.HBox([self.score_button, self.prune_button, self.distill_button]),
            self.status_line, self.log_output, self.waiting, self.pareto_plot, self.table_plot, self.words,
            self.loss_plot, self.importance_plot,
            self.channel_plot])
        if session is not None:
            self._watch(session, lambda _: self._on_plan(), "plan")
        self._on_plan()
        if self.unsupported:
            self._show_error(self.unsupported)
            for w in self.controls:
                w.disabled = True
            self.controls = []  # nothing re-enables them

    @property
    def quant_plan(self) -> QuantPlan:
        """The precision plan quantized points use: the session's current plan in the app, else the given one."""
        if self.session is not None and self.session.plan is not None:
            return self.session.plan
        return self._quant_plan

    @quant_plan.setter
    def quant_plan(self, plan: QuantPlan) -> None:
        if self.session is not None:
            self.session.plan = plan  # one plan for every tab: setting it here sets the session's
        else:
            self._quant_plan = plan
            self._on_plan()

    def _plan_tag(self, plan: QuantPlan | None = None) -> str:
        """``plan 1a2b3c4d``, ``(RTN)`` added when the plan's own method is another: what a point is labelled."""
        plan = plan or self.quant_plan
        return f"plan {plan.content_hash()}" + ("" if plan.method == "rtn" else " (RTN)")

    def _on_plan(self) -> None:
        """The plan changed (the session's, or set here): say which it is, predict its size again."""
        plan = self.quant_plan
        method = "" if plan.method == "rtn" else (
            f"; rounded to nearest here, not by its method ({plan.method.upper()}): quantization-aware "
            "distillation trains round-to-nearest")
        where = "the session's plan" if self.session is not None else "plan"
        name = html.escape(describe_plan(plan, self.lm))
        self.plan_note.value = f"<span style='font-size:12px'>with {where} <b>{name}</b>{html.escape(method)}</span>"
        self._update_prediction()

    def plan(self) -> PrunePlan:
        return PrunePlan(heads=round(self.heads.value, 4), mlp=round(self.mlp.value, 4),
                         head_unit=self.head_unit.value, score=self.score_kind.value)

    def _on_settings(self) -> None:
        """A slider or option moved: predict again, and once scored, grey the units the plan would remove."""
        self._update_prediction()
        if self.importance is not None and self.prune_report is None:
            self._show_importance(self._predicted_kept())

    def _predicted_kept(self) -> dict | None:
        """The heads and channels Prune would keep at the sliders' settings, by the scores (None if unscored)."""
        if self.importance is None:
            return None
        try:
            return self.plan().keep(self.geo, self.importance)
        except WorkbenchError:
            return None

    def _update_prediction(self) -> dict | None:
        if self.unsupported:
            return None
        try:
            # with the scores, which layers lose units is what Prune will do (without them, spread evenly)
            size = predicted_size(self.lm, self.plan(), self.quant_plan, importance=self.importance)
        except Exception as e:  # noqa: BLE001 - a slider position the model cannot take: say so, keep going
            self.predicted.value = f"<span style='color:#c0392b'>{html.escape(str(e))}</span>"
            return None
        g = self.geo
        fp16 = self.lm.size_bytes(precision="fp16")
        q = f", {format_bytes(size['quantized_bytes'])} with {self._plan_tag()}" if self.quantize.value else ""
        per_layer = ", ".join(f"{s['heads']}/{s['intermediate']}" for s in size["layers"])
        basis = "by the scores" if self.importance is not None else "spread evenly until Score"
        self.predicted.value = (f"predicted ({basis}): {size['heads_removed']:.0%} of query heads, "
                                f"{size['kv_heads_removed']:.0%} "
                                f"of KV heads, {size['mlp_removed']:.1%} of MLP channels removed (query heads / MLP "
                                f"channels by layer: {per_layer}; of {g.heads}/{g.intermediate}); "
                                f"{size['parameters']:,} parameters, <b>{format_bytes(size['fp16_bytes'])}</b> at fp16 "
                                f"({size['fp16_bytes'] / fp16 - 1:+.1%}){q}")
        return size

    # -- measurement ------------------------------------------------------------------------------
    def _eval(self):
        if self._ids is None:
            self._ids = evaluation_tokens(self.lm, None, self.eval_tokens)
            ctx = min(512, getattr(self.lm.config, "max_position_embeddings", 512) or 512, self._ids.numel())
            self._ctx = ctx
            self._reference = capture_reference(self.lm.model, self._ids, ctx=ctx, progress=False)
        return self._ids, self._reference

    def _add_point(self, label: str, lm: LoadedModel, plan: QuantPlan | None) -> dict:
        """Measure ``lm`` (quantized by ``plan`` with round-to-nearest when given) and make it a point."""
        ids, ref = self._eval()
        if plan is not None:
            from ..quantize import quantize_model
            qm = quantize_model(lm, plan, method="rtn", progress=False)  # the group-size fallback included
            point = measure_point(label, qm.build_model(), ids, ref, size_bytes=lm.size_bytes(plan),
                                  bits_per_weight=qm.bits_per_weight, ctx=self._ctx, parameters=lm.parameters)
            # the plan (hash, method, group size); its bits/weight on this model are the point's own column
            point["plan"] = describe_plan(plan) + ("" if plan.method == "rtn" else " rounded to nearest")
            point["plan_hash"], point["fallbacks"] = plan.content_hash(), qm.fallbacks
            point["rounded_hash"] = _rounded(plan)  # what is measured here: the plan rounded to nearest
        else:
            point = measure_point(label, lm.model, ids, ref, size_bytes=lm.size_bytes(precision="fp16"),
                                  bits_per_weight=16.0, ctx=self._ctx)
        self.points = [p for p in self.points if p["label"] != label] + [point]
        return point

    def _measure_extra(self) -> None:
        """Measure the precision plans of ``extra_points`` on this tab's evaluation (each plan once): a point
        scored on other tokens would sit on the same axis with another text's perplexity."""
        done = {p.get("rounded_hash") for p in self.points}
        for e in self.extra_points():
            plan = getattr(e, "plan", None) if not isinstance(e, dict) else e.get("plan")
            if not isinstance(plan, QuantPlan) or _rounded(plan) in done:
                continue  # the same plan rounded to nearest (an AWQ plan and its RTN preview) is measured once
            label = getattr(e, "label", None) or (e.get("label") if isinstance(e, dict) else None) or "plan"
            label = label.replace(" (RTN preview)", "") + ("" if plan.method == "rtn" else " (RTN)")
            self._add_point(label, self.lm, plan)
            done.add(_rounded(plan))

    def _show_points(self) -> None:
        pareto = make_pareto_figure(self.points, x="size_bytes")
        plans = list(dict.fromkeys(p["plan"] for p in self.points if p.get("plan")))
        tokens = self.points[0]["tokens"] if self.points else 0
        title = (f"Every point scored on the same {tokens:,} tokens of the bundled held-out text "
                 f"({self._ctx}-token windows)")
        if len(plans) == 1:  # which plan the quantized points were rounded by, on the chart itself
            title += "<br><span style='font-size:11px'>quantized by: " + html.escape(plans[0]) + "</span>"
        elif plans:  # several: the table's last column names each (a line of them ran off the chart)
            title += "<br><span style='font-size:11px'>each quantized point's plan: the table's last column</span>"
        # two lines of title above the panels' own titles: the top margin holds both (the second line sat on
        # "KL divergence to the float model")
        pareto.update_layout(title={"text": title, "font": {"size": 13}, "y": 0.98, "yanchor": "top"},
                             margin={"t": 110 if "<br>" in title else 80}, height=460)
        self._plot("pareto", pareto, self.pareto_plot)
        self._plot("table", make_compress_table_figure(self.points), self.table_plot)
        self.words.value, self.waiting.value = metric_words_html(), ""

    def _fallback_note(self, point: dict) -> str:
        """What the group-size fallback did to a quantized point's layers, in one clause (empty when nothing)."""
        fallbacks = point.get("fallbacks") or {}
        if not fallbacks:
            return ""
        first = next(iter(fallbacks.values()))
        return f"; {point['label']}: {len(fallbacks)} layer(s) fell back to another group size ({first})"

    # -- the buttons ----------------------------------------------------------------------------------
    def score(self) -> PruneImportance | None:
        """Importance of every head and channel (cached in the workspace), drawn per layer."""
        ok, imp = self._attempt("scoring heads and channels...", lambda: head_and_channel_importance(
            self.lm, tokens=self.importance_tokens, kl_tokens=self.eval_tokens, workspace=self.workspace,
            progress=True))
        if not ok:
            return None
        self.importance = imp
        self.prune_report = None  # the chart now shows what the sliders would remove
        self._update_prediction()
        self._show_importance(self._predicted_kept())
        self.status.value = f"scored {imp.tokens:,} tokens (gradients) and {imp.kl_tokens:,} (KL per masked head)"
        return imp

    def _show_importance(self, kept: dict | None = None, pruned: bool = False) -> None:
        """The scores, with the units kept marked: by Prune (``pruned``) or as the sliders would (predicted)."""
        unit, score = self.head_unit.value, self.score_kind.value
        self._plot("heads", make_head_importance_figure(self.importance, score=score, unit=unit,
                                                        kept=kept["heads"] if kept else None), self.importance_plot)
        self._plot("channels", make_channel_importance_figure(
            self.importance, score="activation" if score == "activation" else "taylor",
            kept=kept["mlp"] if kept else None, removed_by="Prune" if pruned else "these settings"),
            self.channel_plot)
        if not self.points:  # the scores are drawn (below); what Prune will add is still to come
            self.waiting.value = placeholder_html(
                "after Prune (and Distil): the pruned model, and it quantized by the session's plan, on a size / KL "
                "/ perplexity chart and table beside the plans measured in Precisions")

    def prune(self) -> dict | None:
        """Prune by the sliders into ``out_dir/pruned``; measure it (and it quantized) against the original."""
        plan = self.plan()
        quant = self.quant_plan if self.quantize.value else None
        tag = self._plan_tag(quant) if quant is not None else None

        def work():
            if not any(p["label"] == "float" for p in self.points):
                self._add_point("float", self.lm, None)
            if quant is not None and not any(p["label"] == tag for p in self.points):
                self._add_point(tag, self.lm, quant)  # the unpruned model with the same plan, for comparison
            self._measure_extra()
            report = prune(self.lm, plan, self.out_dir / "pruned", workspace=self.workspace, evaluate_tokens=None,
                           importance=self.importance, progress=True)
            pruned = load_model(self.out_dir / "pruned")
            self._add_point("pruned", pruned, None)
            if quant is not None:
                self._add_point(f"pruned + {tag}", pruned, quant)
            return report
        ok, report = self._attempt("pruning...", work)
        if not ok:
            return None
        self.prune_report = report
        if self.importance is None:
            self.importance = PruneImportance.load(self.out_dir / "pruned" / IMPORTANCE_FILE)
        self._show_importance(report["kept"], pruned=True)
        self._update_prediction()  # the counts by layer are now the ones Prune kept
        self._show_points()
        p = next(p for p in self.points if p["label"] == "pruned")
        f = next(p for p in self.points if p["label"] == "float")
        q = next((p for p in self.points if p["label"] == f"pruned + {tag}"), None) if tag else None
        self.status.value = html.escape(f"{report['summary']}; perplexity {f['perplexity']:.2f} -> "
                                        f"{p['perplexity']:.2f}, KL {p['kl_divergence']:.4f} on {p['tokens']:,} tokens"
                                        + (self._fallback_note(q) if q else ""))
        return report

    def distill(self) -> DistillReport | None:
        """Distil the pruned model from the original (quantization-aware when the checkbox is on)."""
        if self.prune_report is None:
            self._show_error("prune first (the Prune button)")
            return None
        steps = self.steps.value
        cfg = DistillConfig(steps=steps, temperature=self.temperature.value)
        plan = self.quant_plan if self.quantize.value else None
        # the status line's bar counts the steps (the library's "distill" bar drives it); no second bar beside it
        t0 = time.perf_counter()
        first, losses = {}, []
        every = max(1, steps // 20)

        def on_step(step: int, loss: float) -> None:
            first.setdefault("step", step - 1)  # a resumed run starts later
            losses.append(loss)
            done = step - first["step"]
            left = (time.perf_counter() - t0) / done * (steps - step) if done else 0.0
            self.status.value = f"step {step}/{steps}, loss {loss:.4f}, about {left:.0f} s left"
            if step % every == 0:  # the live curve
                self._plot("distill", make_distill_figure({"losses": list(losses)}), self.loss_plot)

        def work():
            report = distill(self.out_dir / "pruned", self.lm, self.out_dir / "distilled", cfg, plan=plan,
                             eval_tokens=self.eval_tokens, overwrite=True, progress=True, on_step=on_step)
            student = load_model(self.out_dir / "distilled")
            label = f"pruned + {self._plan_tag(plan)} + distilled" if plan else "pruned + distilled"
            point = self._add_point(label, student, plan)
            self._measure_extra()
            return report, point
        ok, result = self._attempt("distilling...", work)
        if not ok:
            return None
        report, point = result
        self.distill_report = report
        self._plot("distill", make_distill_figure(report), self.loss_plot)
        self._show_points()
        self.status.value = html.escape(report.summary() + self._fallback_note(point))
        return report
