"""charts.finetune: the loss figure is built from the report it is given."""
from workbench.charts.finetune import make_loss_figure


def test_loss_figure_has_the_losses_their_mean_and_the_validation_curve():
    report = {"losses": [4.0, 3.0, 2.0, 1.0] * 10, "validation": [(10, 2.5), (20, 2.0), (40, 2.2)], "best_step": 20,
              "perplexity_before": 9.5, "perplexity_after": 7.25, "eval_tokens": 1234}
    fig = make_loss_figure(report)
    loss, mean, val = fig.data
    assert list(loss.y) == report["losses"] and list(loss.x) == list(range(1, 41))
    assert mean.name == "mean of 2" and mean.y[1] == 3.5 and mean.y[0] == 4.0  # a running mean of 40 // 20 steps
    assert list(val.x) == [10, 20, 40] and list(val.y) == [2.5, 2.0, 2.2]
    assert "9.50 -> 7.25 on 1,234 tokens" in fig.layout.title.text
    assert fig.layout.shapes[0].x0 == 20  # the kept step marked


def test_loss_figure_without_validation_and_with_its_own_title():
    fig = make_loss_figure({"losses": [1.0, 0.5]}, title="Distillation: KL", y_title="KL")
    assert [t.name for t in fig.data] == ["loss", "mean of 1"] and fig.layout.title.text == "Distillation: KL"
    assert fig.layout.yaxis.title.text == "KL" and not fig.layout.shapes


def test_no_line_is_drawn_on_the_axis():
    """Two steps and a flat held-back line below them (what the app's short run gives): every value sits inside the
    y range with a margin, a flat line too."""
    fig = make_loss_figure({"losses": [4.46, 4.51], "validation": [(0, 4.22), (2, 4.22)], "best_step": 2})
    low, high = fig.layout.yaxis.range
    assert low < 4.22 - 0.01 and high > 4.51 + 0.01
    flat = make_loss_figure({"losses": [2.0, 2.0]}).layout.yaxis.range
    assert flat[0] < 2.0 < flat[1]
