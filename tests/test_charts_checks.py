"""The figure checker: it finds each way a chart misleads, and passes a chart built the shared way."""
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.charts.checks import figure_problems
from workbench.charts.precision import make_pareto_figure
from workbench.charts.style import EDGE_DECADES, linear_range, log_axis


def _two_panels(colour=None):
    fig = make_subplots(rows=1, cols=2)
    for col in (1, 2):
        fig.add_trace(go.Scatter(x=[1, 8], y=[1, 30], name="custom", legendgroup="custom", showlegend=col == 1,
                                 marker={"color": colour} if colour else {}), row=1, col=col)
    return fig


def test_the_same_legend_entry_in_two_colours_is_found():
    problems = figure_problems(_two_panels())  # plotly colours the second panel's trace by its index
    assert any("legend 'custom'" in p for p in problems)
    assert not [p for p in figure_problems(_two_panels("#d62728")) if "legend" in p]


def test_a_legend_entry_over_points_of_several_colours_is_found():
    fig = go.Figure(go.Bar(name="converted", x=["a", "b"], y=[1, 2], marker_color=["#c0392b", "#457b9d"]))
    assert any("several" in p for p in figure_problems(fig))


def test_near_equal_points_zoomed_apart_are_found_and_a_range_fixes_it():
    fig = go.Figure(go.Scatter(x=[4.25, 4.26], y=[27.36, 27.64], mode="markers", name="p", marker_color="#000"))
    problems = figure_problems(fig)
    assert any("xaxis is zoomed" in p for p in problems) and any("yaxis is zoomed" in p for p in problems)
    fig.update_xaxes(range=linear_range([4.25, 4.26]))
    fig.update_yaxes(range=linear_range([27.36, 27.64]))
    assert figure_problems(fig) == []
    assert linear_range([1.0, 30.0]) is None  # spread enough: plotly's own range


def test_log_axes_need_decade_ticks_and_a_decade():
    fig = go.Figure(go.Scatter(x=[1, 2], y=[0.00338, 0.00356], mode="markers", name="p", marker_color="#000"))
    fig.update_yaxes(type="log")
    problems = figure_problems(fig)
    assert any("without ticks at each power of ten" in p for p in problems)
    assert any("less than a decade" in p for p in problems)
    fig.update_yaxes(**log_axis([0.00338, 0.00356]))
    assert figure_problems(fig) == [] and fig.layout.yaxis.range[1] - fig.layout.yaxis.range[0] >= 1


def test_end_decades_sit_inside_the_plot_and_subplot_titles_above_their_labels():
    lo, hi = log_axis([2e-5, 6e-3])["range"]
    assert (lo, hi) == (-5 - EDGE_DECADES, -2 + EDGE_DECADES)  # 10^-5 and 10^-2 labelled, not on the edges
    fig = make_pareto_figure([_point("uniform int4", 4.5, 6e-3, 27.6), _point("uniform int8", 8.5, 2e-5, 27.4)])
    titles = [a for a in fig.layout.annotations if a.text.startswith(("KL divergence", "perplexity"))]
    assert len(titles) == 2 and all(a.yshift and a.yshift > 0 for a in titles)


def test_long_point_labels_are_found():
    fig = go.Figure(go.Scatter(x=[1, 5], y=[1, 2], mode="markers+text", name="p", marker_color="#000",
                               text=["quantized awq plan 174c77bab", "ok"]))
    assert any("characters" in p for p in figure_problems(fig))


def _point(label, bits, kl, ppl, pred=None):
    return {"label": label, "bits_per_weight": bits, "size_bytes": int(bits * 1e6), "kl_divergence": kl,
            "perplexity": ppl, "predicted_kl": pred, "predicted_perplexity": ppl * 1.001 if pred else None}


def test_the_pareto_chart_reads_true_with_one_point_and_with_many():
    one = make_pareto_figure([_point("plan 1", 7.09, 0.00338, 27.4, pred=0.00356)])
    assert figure_problems(one) == []
    many = make_pareto_figure([_point("uniform int8", 10.1, 2e-5, 27.36), _point("uniform int4", 7.09, 6e-3, 27.64),
                               _point("auto 7.78 b/w", 7.78, 2.9e-4, 27.4, 2.2e-4),
                               _point("auto 8.86 b/w", 8.86, 6.4e-5, 27.37, 5.8e-5),
                               _point("plan 1 (RTN preview)", 7.5, 1e-3, 27.5, 9e-4),
                               _point("pruned + plan 1a2b3c4d (RTN)", 6.0, 2e-2, 29.0)])
    assert figure_problems(many) == []
    colours = {t.name: t.marker.color for t in many.data if t.showlegend is not False}
    assert len(set(colours.values())) == 4  # uniform, auto, custom, pruned; a prediction wears its plan's colour
    assert colours["auto (predicted)"] == colours["auto"]
