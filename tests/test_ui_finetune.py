"""The fine-tuning panel without a browser: Run fills the progress bar, the summary and the loss figure."""
from workbench.ui.finetune import FinetunePanel


def test_run_shows_progress_summary_and_loss_curve(tiny_model_dir, tmp_path):
    panel = FinetunePanel(str(tiny_model_dir), out_dir=tmp_path / "tuned", steps=3, batch_size=2, seq_len=32)
    report = panel.run()
    assert report is not None and panel.error is None
    assert panel.progress.value == 3 and panel.progress.bar_style == "success"
    assert "held-out perplexity" in panel.status.value
    fig = panel.figures["loss"]
    assert len(fig.data[0].y) == 3
    assert [t.name for t in fig.data if t.name == "held-back windows"] and fig.layout.shapes  # the merged step


def test_bad_data_is_a_red_status_line(tiny_model_dir, tmp_path):
    panel = FinetunePanel(str(tiny_model_dir), data=tmp_path / "missing.txt", out_dir=tmp_path / "t", steps=2)
    assert panel.run() is None
    assert "does not exist" in panel.error and panel.progress.bar_style == "danger"
    assert not panel.run_button.disabled  # controls are given back after the error
