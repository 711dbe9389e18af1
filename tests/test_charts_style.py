"""One meaning per colour across the tabs: green / orange / red judge (damage, a gap, a plan that does not fit) and
no category (a precision, a kind of plan, a plan on the Project charts, a measured speed) wears them."""
from __future__ import annotations

import plotly.graph_objects as go

from workbench.charts.checks import figure_problems
from workbench.charts.precision import make_pareto_figure
from workbench.charts.profile import make_profile_figure
from workbench.charts.projection import NO_FIT, PLAN_COLOURS
from workbench.charts.quantize import make_layer_error_figure
from workbench.charts.style import (CATEGORY_COLOURS, JUDGEMENT_COLOURS, KIND_COLOURS, MEASURED_COLOUR,
                                    PRECISION_COLOURS, precision_colour)
from workbench.ui.overrides import DAMAGE_BANDS

JUDGING = {c.lower() for c in JUDGEMENT_COLOURS.values()}


def _drawn(fig: go.Figure) -> set[str]:
    out = set()
    for t in fig.data:
        colour = t.marker.color if getattr(t, "marker", None) is not None else None
        colours = colour if isinstance(colour, (list, tuple)) else [colour]
        out |= {c.lower() for c in colours if isinstance(c, str)}
    return out


def test_no_category_wears_a_judgement_colour():
    categories = [*KIND_COLOURS.values(), *PRECISION_COLOURS.values(), *CATEGORY_COLOURS, *PLAN_COLOURS,
                  MEASURED_COLOUR]
    assert not {c.lower() for c in categories} & JUDGING
    assert {c for c, _ in DAMAGE_BANDS} == set(JUDGEMENT_COLOURS.values()) and NO_FIT == JUDGEMENT_COLOURS["bad"]


def test_precisions_run_darker_with_fewer_bits():
    def darkness(hex_colour: str) -> int:
        return -sum(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    widths = ["int2", "int3", "int4", "int5", "int6", "int8"]
    assert [darkness(precision_colour(w)) for w in widths] == sorted(
        (darkness(precision_colour(w)) for w in widths), reverse=True)
    assert precision_colour("int4_two_level") == precision_colour("int4") and precision_colour(None) != "#d62728"


def test_quantize_and_precisions_charts_draw_no_judgement_colour():
    layers = [{"name": "a", "precision": "int4", "weight_error": 0.1}, {"name": "b", "precision": "int8",
                                                                       "weight_error": 0.01},
              {"name": "c", "precision": "fp16", "weight_error": None}]
    assert not _drawn(make_layer_error_figure(layers)) & JUDGING
    points = [{"label": "uniform int4", "bits_per_weight": 4.5, "size_bytes": 10, "kl_divergence": 0.01,
               "perplexity": 20.0, "tokens": 255},
              {"label": "auto 5.1 b/w", "bits_per_weight": 5.1, "size_bytes": 11, "kl_divergence": 0.004,
               "perplexity": 19.5, "tokens": 255},
              {"label": "plan 1", "bits_per_weight": 5.5, "size_bytes": 12, "kl_divergence": 0.003,
               "perplexity": 19.4, "tokens": 255}]
    pareto = make_pareto_figure(points)
    assert not _drawn(pareto) & JUDGING and not figure_problems(pareto)
    profile = make_profile_figure([{"name": "m", "decode_tokens_per_second": 100.0, "prefill_ms": {"16": 2.0},
                                    "size_bytes": 8e6}])
    assert not _drawn(profile) & JUDGING
