"""The fine-tuning panel without a browser: Run fills the progress bar, the summary and the loss figure."""
import ipywidgets as widgets

from workbench.ui.finetune import FinetunePanel


def bars(widget) -> list:
    """Every progress bar under ``widget``."""
    if isinstance(widget, widgets.IntProgress):
        return [widget]
    return [b for child in getattr(widget, "children", ()) for b in bars(child)]


def test_run_shows_progress_summary_and_loss_curve(tiny_model_dir, tmp_path):
    panel = FinetunePanel(str(tiny_model_dir), out_dir=tmp_path / "tuned", steps=3, batch_size=2, seq_len=32)
    # issue 55.12: one bar, the status line's (a "steps" bar of the panel's own ran beside it: two at once)
    assert bars(panel) == [panel.status_line.bar] and panel.status_line.bar.layout.display == "none"
    counts = []
    panel.status_line.count = lambda n, total, desc: counts.append((n, total, desc))
    report = panel.run()
    assert report is not None and panel.error is None
    assert ("fine-tune" in {d for _, _, d in counts}) and max(n for n, t, d in counts if d == "fine-tune") == 3
    assert "held-out perplexity" in panel.status.value
    fig = panel.figures["loss"]
    assert len(fig.data[0].y) == 3
    assert [t.name for t in fig.data if t.name == "held-back windows"] and fig.layout.shapes  # the merged step


def test_bad_data_is_a_red_status_line(tiny_model_dir, tmp_path):
    panel = FinetunePanel(str(tiny_model_dir), data=tmp_path / "missing.txt", out_dir=tmp_path / "t", steps=2)
    assert panel.run() is None
    assert "does not exist" in panel.error and panel.status_line.bar.layout.display == "none"
    assert not panel.run_button.disabled  # controls are given back after the error
