"""The override panel: pick each layer's precision, see size and bits/weight live, measure the plan.

    panel = OverridePanel(lm, sensitivity=report)        # report from run_sensitivity (optional)
    panel.set_precision("model.layers.0.self_attn.q_proj", "fp16")
    panel.apply_selection(["v_proj"], (0, 3), "fp16")    # every v_proj of blocks 0-3, no pattern to type
    panel.apply_rule("*.v_proj", "fp16"); panel.totals  # size and bits/weight, no model run
    panel.evaluate()                                     # the Evaluate button: ppl, KL, top-1, a Pareto point
    panel.undo(); panel.save("plan.json")
    display(panel)

Each layer is one compact row: its sensitivity bar and three buttons for the usual INT4 / INT8 /
FP16, with a menu beside them for every other precision; the whole table shows at once.
Evaluate swaps cached quantized weights into the float model and scores it against reference
log-probs captured once (``PlanEvaluator``); blocks before the first layer changed since the last
press are replayed from that press, so after the first press a one-layer change re-runs only the
blocks from that layer on, over the token budget.
"""
from __future__ import annotations

import html
import math
import time
from typing import Sequence

import ipywidgets as widgets
import traitlets

from ..precision.autoplan import PlanPoint, plan_footprint, predict_damage, plan_for_budget
from ..charts.precision import make_pareto_figure
from ..charts.style import JUDGEMENT_COLOURS
from ..errors import WorkbenchError
from ..model.load import LoadedModel
from ..quantize.plan import PlanRule, QuantPlan, get_precision
from ..precision.sensitivity import DEFAULT_SWEEP_TOKENS, LayerVariants, PlanEvaluator, SensitivityReport, evaluation_tokens
from ..model.vision_quality import part_layers
from ..units import format_bytes
from .base import CheckList, metric_words_html

__all__ = ["OverridePanel", "LayerChoice", "precision_choices", "COMMON_PRECISIONS", "DAMAGE_BANDS"]

COMMON_PRECISIONS = ("int4", "int8", "fp16")  # a button each; every other precision is in the row's menu
# the bars' colours: where a layer's damage sits between the least and most sensitive layer (log scale)
DAMAGE_BANDS = ((JUDGEMENT_COLOURS["good"], "least sensitive 40%"), (JUDGEMENT_COLOURS["middle"], "middle"),
                (JUDGEMENT_COLOURS["bad"], "most sensitive 25%"))


def precision_choices() -> list[tuple[str, str]]:
    """(label, precision) for the dropdowns: INT4 and INT8 first, every other registered integer precision, FP16."""
    from ..quantize.plan import PRECISIONS
    ints = [p.name for p in PRECISIONS.values() if not p.is_float]
    ordered = [n for n in ("int4", "int8") if n in ints] + [n for n in ints if n not in ("int4", "int8")] + ["fp16"]
    return [(n.upper(), n) for n in ordered]
BITS_HELP = ("bits/weight: the stored bits of every quantizable layer's weights (codes plus their scales) over "
             "its weight count; a layer kept at FP16 (often the embedding) counts 16, so INT4 everywhere else "
             "reads above 4")
CHART_WIDTH = 980  # pixels
_KEEP = "keep"  # dropdown value for a layer the plan leaves alone (precision None)


def _bar_html(value: float | None, lo: float, hi: float) -> str:
    """A small horizontal bar, log-scaled between the least and most sensitive layer."""
    if value is None:
        return "<span style='color:#999'>no sweep</span>"
    frac = 0.0 if hi <= lo else (math.log10(max(value, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    width = int(4 + 76 * min(max(frac, 0.0), 1.0))
    colour = DAMAGE_BANDS[2][0] if frac > 0.75 else DAMAGE_BANDS[1][0] if frac > 0.4 else DAMAGE_BANDS[0][0]
    return (f"<div style='display:flex;align-items:center;gap:6px'><div style='width:{width}px;height:10px;"
            f"background:{colour}'></div><span style='font-size:11px'>{value:.2e}</span></div>")


def _legend_html(lo: float, hi: float, kl_title: str) -> str:
    """What the bars' colours mean, with the KL at each threshold."""
    def at(frac: float) -> float:
        return 10 ** (math.log10(lo) + frac * (math.log10(hi) - math.log10(lo)))
    swatch = "<span style='display:inline-block;width:10px;height:10px;background:{}'></span> {}"
    parts = [swatch.format(DAMAGE_BANDS[0][0], f"below {at(0.4):.1e}"),
             swatch.format(DAMAGE_BANDS[1][0], f"{at(0.4):.1e} to {at(0.75):.1e}"),
             swatch.format(DAMAGE_BANDS[2][0], f"above {at(0.75):.1e}")]
    return (f"<div style='font-size:12px;color:#34495e'>bars: {kl_title} when the layer alone is quantized (nats per "
            "token, log scale between the least and most sensitive layer): " + " &nbsp; ".join(parts) + "</div>")


class LayerChoice(widgets.HBox):
    """One layer's precision: INT4 / INT8 / FP16 buttons and a menu for the rest. ``value`` is the precision name
    (or ``keep`` for a layer the plan leaves alone); ``options`` lists every choice as (label, value)."""

    value = traitlets.Unicode()

    def __init__(self, value: str, options: Sequence[tuple[str, str]]):
        self.options = list(options)
        common = [(label, v) for label, v in self.options if v in COMMON_PRECISIONS]
        self.buttons = widgets.ToggleButtons(options=common, value=None, style={"button_width": "54px"},
                                             layout={"width": "auto"})
        self.more = widgets.Dropdown(options=[("other...", "")] + [o for o in self.options if o[1] not in
                                                                     COMMON_PRECISIONS],
                                     value="", layout={"width": "112px"})
        super().__init__([self.buttons, self.more], layout={"align_items": "center"})
        self.buttons.observe(self._picked, names="value")
        self.more.observe(self._picked, names="value")
        self.value = value

    def _picked(self, change) -> None:
        if change["new"]:  # None / "" when the other control took the choice
            self.value = change["new"]

    @traitlets.observe("value")
    def _show(self, change) -> None:
        v = change["new"]
        self.buttons.value = v if v in COMMON_PRECISIONS else None
        self.more.value = "" if v in COMMON_PRECISIONS else v

    @property
    def disabled(self) -> bool:
        return self.buttons.disabled

    @disabled.setter
    def disabled(self, value: bool) -> None:
        self.buttons.disabled = self.more.disabled = value


class OverridePanel(widgets.VBox):
    """Every layer with its shape, parameters, sensitivity and a precision dropdown; totals; Evaluate."""

    def __init__(self, lm: LoadedModel, *, sensitivity: SensitivityReport | None = None,
                 plan: QuantPlan | None = None, evaluator: PlanEvaluator | None = None,
                 tokens: int = DEFAULT_SWEEP_TOKENS, points: Sequence[PlanPoint] = (),
                 sensitivity_precision: str = "int4"):
        self.lm = lm
        self.sensitivity = sensitivity
        self.tokens = tokens
        self.plan = plan or QuantPlan.uniform("int8", **(sensitivity.quantizer_settings if sensitivity else {}))
        self.plan.validate([info.name for info in lm.layers])
        self._evaluator = evaluator
        self._history: list[QuantPlan] = []
        self._syncing = False
        self.points: list[PlanPoint] = list(points)
        self.last_seconds: float | None = None
        self.log_output = widgets.Output(layout={"border": "1px solid #ddd", "max_height": "160px", "overflow": "auto"})

        damages = {}
        if sensitivity is not None:
            for layer in sensitivity.layers:
                d = layer.damage.get(sensitivity_precision)
                if d is not None:
                    damages[layer.name] = float(d["kl"])
        positive = [v for v in damages.values() if v > 0]
        lo, hi = (min(positive), max(positive)) if positive else (1e-9, 1e-9)
        kl_title = "est. KL" if sensitivity is not None and sensitivity.score == "proxy" else "KL"
        options = precision_choices() + [("unchanged", _KEEP)]
        self.dropdowns: dict[str, LayerChoice] = {}  # by layer: the row's choice (buttons and menu)
        # a gap after each heading: "parameters" and the KL heading ran together ("parametersKL alone at int4")
        cell = "display:inline-block;font-weight:bold;font-size:11px;padding-right:8px;box-sizing:border-box"
        # the name column fits the longest name (a VLM's language_model.layers.0.self_attn.q_proj ran into the shape)
        name_px = max(250, 7 * max((len(i.name.removeprefix("model.")) for i in lm.layers), default=0) + 12)
        header = widgets.HTML(f"<span style='{cell};width:{name_px}px'>layer</span>"
                              f"<span style='{cell};width:80px'>shape</span>"
                              f"<span style='{cell};width:80px'>parameters</span>"
                              f"<span style='{cell};width:140px'>{kl_title} alone at {sensitivity_precision}</span>"
                              f"<span style='{cell}'>precision</span>")
        rows = [header]
        self.rows: dict[str, widgets.HBox] = {}  # by layer: its row (a VLM's rows sit in their part's section)
        for info in lm.layers:
            choice = LayerChoice(self._value_for(info.name), options)
            choice.observe(self._on_dropdown(info.name), names="value")
            self.dropdowns[info.name] = choice
            short = info.name.removeprefix("model.")
            tied = " <i style='color:#999'>(tied)</i>" if info.tied_to else ""
            rows.append(widgets.HBox([
                widgets.HTML(f"<code style='font-size:11px' title='{info.name}'>{short}</code>{tied}",
                             layout={"width": f"{name_px}px"}),
                widgets.HTML(f"<span style='font-size:11px'>{'x'.join(map(str, info.shape))}</span>",
                             layout={"width": "80px"}),
                widgets.HTML(f"<span style='font-size:11px'>{info.parameters:,}</span>", layout={"width": "80px"}),
                widgets.HTML(_bar_html(damages.get(info.name), lo, hi), layout={"width": "140px"}),
                choice], layout={"flex": "0 0 auto", "height": "30px", "align_items": "center"}))
            self.rows[info.name] = rows[-1]
        # a VLM: one collapsible section per part (vision encoder, projector, language model), each with a setter
        self.part_layers = part_layers(lm) if getattr(lm, "is_vision", False) else {}
        self.part_setters: dict[str, widgets.ToggleButtons] = {}
        self.sections: dict[str, widgets.Accordion] = {}
        for part, names in self.part_layers.items():
            setter = widgets.ToggleButtons(options=[(label, v) for label, v in options if v in COMMON_PRECISIONS],
                                           value=None, style={"button_width": "54px"}, layout={"width": "auto"},
                                           tooltips=[f"every layer of the {part} at this precision"] * 3)
            setter.observe(self._on_part_setter(part), names="value")
            self.part_setters[part] = setter
            body = widgets.VBox([widgets.HBox([widgets.HTML(f"<b>whole {html.escape(part)}</b>:",
                                                            layout={"width": f"{name_px}px"}), setter]),
                                 widgets.HTML(header.value), *(self.rows[n] for n in names)])
            self.sections[part] = widgets.Accordion([body], selected_index=0)
            self.sections[part].add_class("workbench-part")
        self.table = widgets.VBox(list(self.sections.values()) if self.sections else rows)  # no scroll box inside
        self.legend = widgets.HTML(_legend_html(lo, hi, kl_title) if positive else "")

        # many layers at once, no pattern to type: layer types and a block range
        roles = list(dict.fromkeys(info.role for info in lm.layers))
        blocks = sorted({int(info.block.split(".")[1]) for info in lm.layers if info.block.startswith("layers.")})
        self.select_roles = CheckList([(role, role) for role in roles], description="layer types (none ticked: "
                                      "every type)", columns=4, width="135px")
        self.select_blocks = widgets.IntRangeSlider(value=(blocks[0], blocks[-1]) if blocks else (0, 0),
                                                    min=blocks[0] if blocks else 0, max=blocks[-1] if blocks else 0,
                                                    description="blocks", continuous_update=False,
                                                    layout={"width": "340px"}, disabled=not blocks)
        self.select_outside = widgets.Checkbox(value=True, description="and the embedding / output layer",
                                               indent=False, layout={"width": "auto"},
                                               tooltip="layers outside the blocks, when their type is picked")
        self.select_precision = widgets.Dropdown(options=precision_choices(), value="fp16", layout={"width": "110px"})
        self.select_button = widgets.Button(description="Set selected", icon="check-square",
                                            tooltip="give every layer of the picked types in the block range this "
                                                    "precision")
        self.select_button.on_click(lambda _: self.apply_selection(self.select_roles.value, self.select_blocks.value,
                                                                   self.select_precision.value))

        self.pattern = widgets.Text(placeholder="*.q_proj  or  re:.*layers\\.[0-1]\\..*", description="pattern",
                                    layout={"width": "360px"})
        self.rule_precision = widgets.Dropdown(options=precision_choices(), value="fp16", layout={"width": "110px"})
        self.apply_button = widgets.Button(description="Apply rule", icon="check")
        self.apply_button.on_click(lambda _: self.apply_rule(self.pattern.value, self.rule_precision.value))
        self.rule_note = widgets.HTML()  # what the last rule did, beside its button (not in the log under the chart)
        self.undo_button = widgets.Button(description="Undo", icon="undo", disabled=True)
        self.undo_button.on_click(lambda _: self.undo())
        self.evaluate_button = widgets.Button(description="Evaluate", icon="play", button_style="primary")
        self.evaluate_button.on_click(lambda _: self.evaluate())
        self.baselines_button = widgets.Button(description="Uniform INT8/INT4", icon="plus",
                                               tooltip="evaluate uniform INT8 and INT4 for the Pareto chart")
        self.baselines_button.on_click(lambda _: self.evaluate_uniform())
        self.path = widgets.Text(value="plan.json", description="plan file", layout={"width": "360px"})
        self.save_button = widgets.Button(description="Save", icon="save")
        self.save_button.on_click(lambda _: self.save(self.path.value))
        self.load_button = widgets.Button(description="Load", icon="folder-open")
        self.load_button.on_click(lambda _: self.load(self.path.value))
        self.totals_label = widgets.HTML()
        self.result_label = widgets.HTML()
        self.chart = self._make_chart()
        self._controls = [self.apply_button, self.undo_button, self.evaluate_button, self.baselines_button,
                          self.save_button, self.load_button, self.pattern, self.rule_precision,
                          self.select_roles, self.select_blocks, self.select_precision, self.select_button,
                          *self.dropdowns.values(), *self.part_setters.values()]
        self._refresh_totals()
        self._sync_parts()
        super().__init__([
            widgets.HTML("<h3>Per-layer precision</h3>"),
            self.totals_label,
            widgets.HBox([self.select_roles, widgets.VBox([self.select_blocks, self.select_outside]),
                          self.select_precision, self.select_button, self.undo_button]),
            self.legend,
            self.table,
            widgets.HTML("<small>or by name: a glob (<code>*.v_proj</code>) or <code>re:</code> a regular "
                         "expression</small>"),
            widgets.HBox([self.pattern, self.rule_precision, self.apply_button, self.rule_note]),
            widgets.HBox([self.evaluate_button, self.baselines_button, self.result_label]),
            widgets.HTML(metric_words_html()),
            widgets.HBox([self.path, self.save_button, self.load_button]),
            self.chart,
            self.log_output,
        ])

    # -- plan editing -------------------------------------------------------------------------------
    def _value_for(self, name: str) -> str:
        p = self.plan.precision_name_for(name)
        return p if p in {v for _, v in precision_choices()} else _KEEP

    def _on_dropdown(self, name: str):
        def handler(change):
            if self._syncing:
                return
            value = None if change["new"] == _KEEP else change["new"]
            self._set_plan(self.plan.with_override(name, value), f"{name} -> {value}")
        return handler

    def _set_plan(self, plan: QuantPlan, what: str = "", *, record: bool = True) -> None:
        if record:
            self._history.append(self.plan)
        self.plan = plan
        self.undo_button.disabled = not self._history
        self._sync_dropdowns()
        self._refresh_totals()
        if what:
            self._log(what)

    def _sync_dropdowns(self) -> None:
        self._syncing = True
        try:
            for name, dd in self.dropdowns.items():
                value = self._value_for(name)
                if dd.value != value:
                    dd.value = value
        finally:
            self._syncing = False
        self._sync_parts()

    def part_precision(self, part: str) -> str | None:
        """The one precision every layer of ``part`` has in the plan, or None when they differ."""
        values = {self._value_for(name) for name in self.part_layers[part]}
        return values.pop() if len(values) == 1 else None

    def _sync_parts(self) -> None:
        """Each part's section title (layers, parameters, bytes, precisions) and setter follow the plan."""
        if not self.part_layers:
            return
        sizes = {p.name: p for p in self.lm.parts()}
        self._syncing = True
        try:
            for part, names in self.part_layers.items():
                common = self.part_precision(part)
                setter = self.part_setters[part]
                if setter.value != (common if common in COMMON_PRECISIONS else None):
                    setter.value = common if common in COMMON_PRECISIONS else None
                mix = sorted({self._value_for(n) for n in names})
                said = ("all " if len(mix) == 1 else "mixed ") + " / ".join(
                    "unchanged" if v == _KEEP else v.upper() for v in mix)
                info = sizes[part]
                self.sections[part].set_title(0, f"{part}: {len(names)} layers, {info.parameters:,} parameters, "
                                                 f"{format_bytes(info.bytes)}; {said}")
        finally:
            self._syncing = False

    def _on_part_setter(self, part: str):
        def handler(change):
            if not self._syncing and change["new"]:
                self.set_part(part, change["new"])
        return handler

    def set_part(self, part: str, precision: str | None) -> int:
        """Give every layer of a VLM's ``part`` (``vision encoder``, ``projector``, ``language model``)
        ``precision``, each by its own name: one step, undone by one Undo."""
        if part not in self.part_layers:
            raise KeyError(f"'{part}' is not a part of this model; parts: {', '.join(self.part_layers) or 'none'}")
        names = self.part_layers[part]
        plan = self.plan
        for name in names:
            plan = plan.with_override(name, precision)
        self._set_plan(plan, f"{part}: {len(names)} layers -> {precision}")
        return len(names)

    def set_precision(self, name: str, precision: str | None) -> None:
        """Change one layer (what its dropdown does)."""
        if name not in self.dropdowns:
            raise KeyError(f"'{name}' is not a layer of this model")
        self.dropdowns[name].value = _KEEP if precision is None else get_precision(precision).name

    def apply_rule(self, pattern: str, precision: str | None) -> bool:
        """Add a bulk rule (glob or ``re:``); a pattern matching no layer is refused with a message."""
        pattern = (pattern or "").strip()
        if not pattern:
            self._rule_said("type a pattern first, e.g. *.q_proj", error=True)
            return False
        try:
            new = self.plan
            for rule in self.plan.rules:  # a later bulk rule wins over earlier per-layer choices it covers
                if rule.is_exact and rule.pattern != pattern and PlanRule(pattern, None).matches(rule.pattern):
                    new = new.without_rule(rule.pattern)
            new = new.with_override(pattern, precision)
            new.validate(self.dropdowns)
        except WorkbenchError as e:
            self._rule_said(f"rule not applied: {e}", error=True)
            return False
        self._set_plan(new, f"rule {pattern} -> {precision}")
        n = sum(1 for name in self.dropdowns if PlanRule(pattern, None).matches(name))
        self._rule_said(f"{pattern}: {n} layer(s) set to {precision or 'kept as they are'}")
        return True

    def _rule_said(self, message: str, error: bool = False) -> None:
        """A rule's outcome beside its button, where the eye is; the log keeps it too."""
        colour = "#c0392b" if error else "#5d6d7e"
        self.rule_note.value = f"<span style='font-size:12px;color:{colour}'>{html.escape(message)}</span>"
        self._log(message)

    def selected_layers(self, roles: Sequence[str] = (), blocks: tuple[int, int] | None = None,
                        outside: bool | None = None) -> list[str]:
        """Layers whose type is in ``roles`` (none: every type) and whose block is in ``blocks`` (inclusive);
        the embedding and output layer (no block) too when ``outside`` (default: the checkbox)."""
        outside = self.select_outside.value if outside is None else outside
        picked = []
        for info in self.lm.layers:
            if roles and info.role not in roles:
                continue
            if info.block.startswith("layers."):
                if blocks is not None and not blocks[0] <= int(info.block.split(".")[1]) <= blocks[1]:
                    continue
            elif not outside:
                continue
            picked.append(info.name)
        return picked

    def apply_selection(self, roles: Sequence[str], blocks: tuple[int, int] | None, precision: str | None) -> int:
        """Give every layer of ``roles`` in the block range ``precision``: one step, undone by one Undo."""
        names = self.selected_layers(tuple(roles), tuple(blocks) if blocks is not None else None)
        if not names:
            self._log("no layer is of those types in those blocks")
            return 0
        plan = self.plan
        for name in names:
            plan = plan.with_override(name, precision)
        what = ", ".join(roles) if roles else "every layer type"
        span = f" in blocks {blocks[0]}-{blocks[1]}" if blocks is not None else ""
        self._set_plan(plan, f"{len(names)} layers ({what}{span}) -> {precision}")
        return len(names)

    def set_plan(self, plan: QuantPlan, what: str = "plan set") -> None:
        """Show ``plan`` (e.g. the app session's, changed in another tab); Undo goes back to the previous one."""
        plan.validate(self.dropdowns)
        self._set_plan(plan, what)

    def undo(self) -> bool:
        if not self._history:
            self._log("nothing to undo")
            return False
        self._set_plan(self._history.pop(), "undone", record=False)
        return True

    def save(self, path: str) -> None:
        try:
            saved = self.plan.save(path)
        except (WorkbenchError, OSError) as e:
            self._log(f"could not save: {e}")
            return
        self._log(f"saved plan to {saved}")

    def load(self, path: str) -> bool:
        try:
            plan = QuantPlan.load(path)
            plan.validate(self.dropdowns)
        except WorkbenchError as e:
            self._log(f"could not load: {e}")
            return False
        self._set_plan(plan, f"loaded {path}")
        return True

    # -- totals and evaluation ----------------------------------------------------------------------
    @property
    def totals(self) -> dict:
        """Size in bytes and bits per weight of the current plan, from layer shapes only."""
        return plan_footprint(self.lm, self.plan)

    def _refresh_totals(self) -> None:
        t = self.totals
        counts: dict[str, int] = {}
        for p in self.plan.resolve(self.dropdowns).values():
            counts[p or "unchanged"] = counts.get(p or "unchanged", 0) + 1
        mix = ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
        pred = ""
        if self.sensitivity is not None:
            try:
                d = predict_damage(self.sensitivity, self.plan.resolve(self.dropdowns))
                pred = f" &nbsp; predicted KL <b>{d['kl_divergence']:.2e}</b>"
            except WorkbenchError:
                pred = ""
        self.totals_label.value = (
            f"weights <b>{t['size_bytes'] / 1e6:.2f} MB</b> ({t['size_bytes']:,} bytes; MB = 10<sup>6</sup> bytes), "
            f"<b>{t['bits_per_weight']:.2f}</b> bits/weight &nbsp; [{mix}]{pred}<br><small style='color:#5d6d7e'>"
            f"{BITS_HELP}</small>")

    def _evaluator_for(self, plan: QuantPlan) -> PlanEvaluator:
        ev = self._evaluator
        if ev is None or not ev.variants.matches(plan):  # codes made otherwise are not what Quantize ships
            ids = ev.ids if ev is not None else evaluation_tokens(self.lm, tokens=self.tokens)
            reference = ev.reference if ev is not None else None
            ev = PlanEvaluator(self.lm, ids, variants=LayerVariants.for_plan(self.lm, plan), reference=reference)
            self._evaluator = ev
        return ev

    def _measure(self, plan: QuantPlan, label: str) -> PlanPoint:
        t0 = time.perf_counter()
        report = self._evaluator_for(plan).evaluate(plan)
        foot = plan_footprint(self.lm, plan)
        pred_kl = pred_ppl = None
        if self.sensitivity is not None:
            try:
                d = predict_damage(self.sensitivity, plan.resolve(self.dropdowns))
                pred_kl, pred_ppl = d["kl_divergence"], report.reference_perplexity * math.exp(d["nll_delta"])
            except WorkbenchError:
                pass
        point = PlanPoint(label, foot["size_bytes"], foot["bits_per_weight"], report.kl_divergence, report.perplexity,
                          report.top1_agreement, report.reference_perplexity, report.tokens, pred_kl, pred_ppl,
                          time.perf_counter() - t0, plan, report)
        self.points.append(point)
        return point

    def evaluate(self) -> PlanPoint | None:
        """Measure the current plan (perplexity, KL, top-1) and add it to the Pareto chart."""
        self._freeze(True)
        try:
            t0 = time.perf_counter()
            preview = self.plan.method != "rtn"  # the evaluator swaps in RTN weights, whatever the plan's method
            point = self._measure(self.plan, f"plan {sum(1 for p in self.points if p.label.startswith('plan')) + 1}"
                                  + (" (RTN preview)" if preview else ""))
            self.last_seconds = time.perf_counter() - t0
        except WorkbenchError as e:
            self._log(f"evaluation failed: {e}")
            return None
        finally:
            self._freeze(False)
        note = (f"<b style='color:#d68910'>RTN preview</b> (Evaluate rounds to nearest; this plan's "
                f"{self.plan.method.upper()} is measured by Quantize): " if preview else "")
        self.result_label.value = (f"{note}perplexity <b>{point.perplexity:.3f}</b> (float "
                                   f"{point.reference_perplexity:.3f}), KL <b>{point.kl_divergence:.2e}</b>, top-1 "
                                   f"<b>{point.top1_agreement:.4f}</b> on {point.tokens:,} tokens, "
                                   f"{self.last_seconds:.2f} s")
        self._log(f"{point.label}: {point.bits_per_weight:.2f} bits/weight, KL {point.kl_divergence:.3e}, "
                  f"ppl {point.perplexity:.3f}, top-1 {point.top1_agreement:.4f} ({self.last_seconds:.2f} s)")
        self._update_chart()
        return point

    def evaluate_uniform(self) -> list[PlanPoint]:
        """Add uniform INT8 and INT4 (same group size, symmetry and scale search as the current plan) to the chart."""
        self._freeze(True)
        out = []
        try:
            for p in ("int8", "int4"):
                plan = QuantPlan.uniform(p, **self.plan.quantizer_settings)
                out.append(self._measure(plan, f"uniform {p}"))
                self._log(f"uniform {p}: KL {out[-1].kl_divergence:.3e}, ppl {out[-1].perplexity:.3f}")
        except WorkbenchError as e:
            self._log(f"evaluation failed: {e}")
        finally:
            self._freeze(False)
        self._update_chart()
        return out

    def evaluate_frontier(self, budgets: Sequence[float] = (1.1, 1.25)) -> list[PlanPoint]:
        """Uniform INT8 and INT4, and the automatic plans (``plan_for_budget``) at ``budgets`` times the INT4 size,
        all measured: what fills the chart as soon as a sensitivity sweep ends."""
        if self.sensitivity is None:
            self._log("run the sensitivity sweep first: automatic plans are chosen from it")
            return []
        points = self.evaluate_uniform()
        if len(points) < 2:
            return points
        self._freeze(True)
        try:
            for factor in budgets:
                auto = plan_for_budget(self.lm, self.sensitivity, size_bytes=int(factor * points[1].size_bytes))
                point = self._measure(auto.plan, f"auto {auto.bits_per_weight:.2f} b/w")
                points.append(point)
                pred = f" (predicted {point.predicted_kl:.3e})" if point.predicted_kl is not None else ""
                self._log(f"{point.label}: KL {point.kl_divergence:.3e}{pred}")
        except WorkbenchError as e:
            self._log(f"evaluation failed: {e}")
        finally:
            self._freeze(False)
        self._update_chart()
        return points

    # -- display helpers ----------------------------------------------------------------------------
    def _figure(self):
        """The Pareto chart at a width its two panels and legend fit (the page's default squeezes them)."""
        fig = make_pareto_figure(self.points)
        fig.update_layout(width=CHART_WIDTH)
        return fig

    def _make_chart(self):
        import plotly.graph_objects as go
        return go.FigureWidget(self._figure())

    def _update_chart(self) -> None:
        fig = self._figure()
        with self.chart.batch_update():
            self.chart.data = ()
            self.chart.add_traces(list(fig.data))
            self.chart.layout = fig.layout

    def _freeze(self, frozen: bool) -> None:
        for w in self._controls:
            w.disabled = frozen
        if not frozen:
            self.undo_button.disabled = not self._history

    def _log(self, message: str) -> None:
        with self.log_output:
            print(message)
