"""The project panel: candidate plans on chosen devices before anything is flashed.

    panel = ProjectPanel("qwen2.5-1.5b", plans={"int8": QuantPlan.uniform("int8"), "int4": QuantPlan.uniform("int4")},
                         devices=["8gen3", "rk3588"])      # file names, names or aliases
    panel.context.value = 2048
    panel.run()                       # what the Project button does: {plan label: [Projection per device]}
    display(panel)

Per plan and device it shows the decode bound and the projected tokens/s, whether weights + KV cache + buffers
fit the RAM and the accelerator's limit, and which layers the accelerator cannot run at their precision
(``workbench.devices.projection``). With a device LLM runtime (``runtime``: each device's own by default) speed, first
token and memory are fitted to the vendor's measurements, each with its held-out error and the nearest
measurement, and a chart puts the vendor's points, the fit and the plans on one pair of axes. In the app (``session=``) the plans are the session's plan, its quantized model's
and every plan the Precisions tab evaluated (``points``); those measured plans are also placed on a chart of
quality against size against projected speed on one device.
"""
from __future__ import annotations

import html
from typing import Callable, Mapping, Sequence

import ipywidgets as widgets

from ..charts.projection import make_device_figure, make_speed_pareto_figure, make_vendor_fit_figure
from ..devices.runtimes import RUNTIMES
from ..devices.profiles import get_device, load_devices
from ..errors import PlanError
from ..quantize.plan import QuantPlan
from ..devices.projection import AUTO, DEFAULT_CONTEXT, project_plans
from ..charts.report import Candidates, projection_summary_html
from .base import CheckList, StepPanel, placeholder_html, ruled_style
from .session import SessionLabel, plan_name

__all__ = ["ProjectPanel", "DEFAULT_DEVICES"]

# the devices a user most likely projects onto, each fitted to its vendor's own measurements where they exist:
# the last three Snapdragon phone chips (the 8 Elite Gen 5 is the Galaxy S26's), the X2 Elite laptop chip, the
# RK3588 board and the Jetson Orin Nano
DEFAULT_DEVICES = ("snapdragon-8-gen-3", "snapdragon-8-elite", "snapdragon-8-elite-gen-5", "snapdragon-x2-elite",
                   "rk3588", "jetson-orin-nano")


class ProjectPanel(StepPanel):
    """Devices (several), context length; Project shows every candidate plan's bounds and fit on each device."""

    def __init__(self, model=None, *, plans: Mapping[str, QuantPlan] | None = None, session=None,
                 points: Callable[[], Sequence] | Sequence = (), devices: Sequence[str] | None = None,
                 context: int = DEFAULT_CONTEXT):
        self.session, self.model, self.fixed_plans = session, model, dict(plans or {})
        self._points = points
        self.projections: dict = {}
        self.rows: list[dict] = []  # measured plans placed on the quality / size / speed chart
        self._setup()
        registry = load_devices()
        chosen = [get_device(k, registry).key for k in devices] if devices is not None else \
            [k for k in DEFAULT_DEVICES if k in registry] or list(registry)[:1]
        self.devices = CheckList([(d.name, k) for k, d in registry.items()], value=chosen, description="devices")
        self.context = widgets.BoundedIntText(value=context, min=0, max=1 << 20, description="context",
                                              tooltip="tokens in the KV cache while decoding")
        self.runtime = widgets.Dropdown(
            description="runtime", value=AUTO, layout={"width": "320px"},
            options=[("each device's own", AUTO)] + [(f"{r.title} ({r.name})", r.name) for r in RUNTIMES.values()]
            + [("none (bandwidth bound x practitioners' efficiency)", None)],
            tooltip="the LLM runtime on the device: its weight layout and KV cache, and the vendor measurements fitted")
        self.run_button = widgets.Button(description="Project", button_style="primary", icon="mobile-alt")
        self.run_button.on_click(lambda _: self.run())
        # hidden until a projection gives it devices (an empty menu stood under the button before any run)
        self.pareto_device = widgets.Dropdown(description="speed on", options=[],
                                              layout={"width": "320px", "display": "none"})
        self.waiting = widgets.HTML(placeholder_html(
            "after Project: per plan and device the tokens/s, the first token's time and whether it fits in memory "
            "(the rest in a details fold), then charts of speed and memory per device, the vendors' measurements "
            "against their fit, and quality against size and speed on one device"))
        self.pareto_device.observe(lambda _: self._draw_pareto(), names="value")
        self.table = widgets.HTML()
        self.device_plot, self.pareto_plot, self.vendor_plot = widgets.Output(), widgets.Output(), widgets.Output()
        self.controls = [self.devices, self.context, self.runtime, self.run_button, self.pareto_device]
        head = [widgets.HTML("<b>Project</b> candidate plans onto devices: decode tokens/s bound by memory bandwidth "
                             "and fitted to the vendors' own measurements of the device's runtime (with the error "
                             "the fit had on models it had not seen), memory fit, and the layers the accelerator "
                             "cannot run (shapes only: nothing runs)")]
        if session is not None:
            head.append(self._own(SessionLabel(session)))
        super().__init__([*head, widgets.HBox([self.devices, widgets.VBox([self.context, self.runtime,
                                                                            self.run_button])]),
                          self.status, self.log_output, self.waiting, self.table, self.device_plot, self.vendor_plot,
                          self.pareto_device, self.pareto_plot])

    # -- what is projected ----------------------------------------------------------------------------
    def points(self) -> list:
        """The measured plans offered as candidates (the Precisions tab's evaluated points, in the app)."""
        return list(self._points() if callable(self._points) else self._points)

    def candidates(self) -> tuple[dict, list[dict]]:
        """``({label: plan}, rows)``: the plans to project, each once, and the measured ones' KL and bits/weight."""
        c = Candidates()
        s = self.session
        if s is not None:
            if s.lm is None or s.plan is None:
                raise PlanError("load a model first")
            if s.quantized is not None:
                cost = s.cost
                # by what it is, not its folder's hash ("quantized awq-56903f2e")
                c.add(f"quantized model ({plan_name(s.quantized.plan, s.lm)}, {s.quantized.method.upper()})",
                      s.quantized.plan,
                      None if cost is None else cost.kl_divergence, None if cost is None else cost.bits_per_weight)
            c.add("session plan", s.plan)
        for label, plan in self.fixed_plans.items():
            c.add(label, plan)
        for p in self.points():
            if getattr(p, "plan", None) is not None:
                c.add(p.label, p.plan, p.kl_divergence, p.bits_per_weight)
        if not c.plans:
            raise PlanError("no plan to project: give plans=, or use the panel in the app after loading a model")
        return c.plans, c.rows

    def _model(self):
        if self.session is not None:
            return self.session.lm
        if self.model is None:
            raise PlanError("no model: give a model, a config.json or a shape name")
        return self.model

    # -- actions --------------------------------------------------------------------------------------
    def run(self) -> dict | None:
        """Project every candidate plan onto the chosen devices; fill the table and the charts."""
        def work():
            plans, rows = self.candidates()
            return project_plans(self._model(), list(self.devices.value), plans, context=self.context.value,
                                 runtime=self.runtime.value), rows
        ok, result = self._attempt("projecting...", work)
        if not ok:
            return None
        self.projections, self.rows = result
        self.waiting.value = ""
        self.table.value = ruled_style("projection") + projection_summary_html(self.projections)
        self._plot("devices", make_device_figure(self.projections), self.device_plot)
        self._plot("vendor", make_vendor_fit_figure(self.projections), self.vendor_plot)
        first = next(iter(self.projections.values()))
        with_speed = [p.device for p in first if p.projected_decode_tps is not None]
        keep = self.pareto_device.value if self.pareto_device.value in with_speed else None
        self.pareto_device.options = with_speed
        self.pareto_device.layout.display = "" if with_speed else "none"
        self.pareto_device.value = keep or (with_speed[0] if with_speed else None)
        self._draw_pareto()
        n = sum(len(ps) for ps in self.projections.values())
        self.status.value = html.escape(f"{len(self.projections)} plan(s) on {len(first)} device(s), {n} projections "
                                        f"at a {self.context.value}-token context")
        return self.projections

    def _draw_pareto(self) -> None:
        device = self.pareto_device.value
        if not self.rows or not self.projections or device is None:
            self.figures.pop("pareto", None)
            self.pareto_plot.outputs = ()
            return
        self._plot("pareto", make_speed_pareto_figure(self.rows, self.projections, device), self.pareto_plot)
