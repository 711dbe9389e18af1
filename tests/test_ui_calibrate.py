"""CalibratePanel headless: run fills the coverage and the charts; bad input shows an error and unfreezes."""
from __future__ import annotations

import pytest

from workbench.ui.calibrate import CalibratePanel


def test_run_fills_the_panel(lm, workspace):
    panel = CalibratePanel(lm, samples=3, seq_len=64, workspace=workspace)
    # before any data each sub-tab says what will appear there, not an empty frame
    assert all(w.value.startswith("<div class='workbench-placeholder'") and "after Run calibration" in w.value
               for w in panel.waiting.values()) and set(panel.waiting) == {"coverage", "overview", "channels", "heatmap"}
    stats = panel.run()
    assert not any(w.value for w in panel.waiting.values())  # the charts took their places
    assert stats is panel.stats and panel.error is None
    assert panel.calib_set.report.samples == 3
    assert "3 samples" in panel.coverage.value and "computed in" in panel.status.value
    assert list(panel.layer.options) == list(stats.layers)
    assert panel.layer.value == max(stats.layers, key=lambda n: stats.layers[n].max_to_median)
    assert set(panel.figures) == {"coverage", "overview", "channels", "heatmap"}
    assert "outlier" in panel.figures["overview"].layout.title.text
    assert not any(w.disabled for w in panel.controls)
    panel.sort_by.value = "kurtosis"  # redraws without running again
    panel.layer.value = "lm_head"
    assert "kurtosis" in panel.figures["overview"].layout.title.text
    assert panel.figures["channels"].layout.title.text.startswith("lm_head:")


def test_second_run_reads_back(lm, workspace):
    CalibratePanel(lm, samples=2, seq_len=64, workspace=workspace).run()
    panel = CalibratePanel(lm, samples=2, seq_len=64, workspace=workspace)
    panel.run()
    assert panel.stats.cached and "read back from the workspace" in panel.status.value


def test_bad_file_shows_the_error(lm, workspace, tmp_path):
    panel = CalibratePanel(lm, data=tmp_path / "missing.jsonl", samples=2, seq_len=64, workspace=workspace)
    assert panel.run() is None
    assert "does not exist" in panel.error and "error:" in panel.status.value
    assert not any(w.disabled for w in panel.controls) and panel.stats is None


def test_in_the_app_the_result_is_the_sessions_calibration(lm, workspace, tmp_path):
    from workbench.ui.session import AppSession
    session = AppSession(out_dir=tmp_path / "run", workspace=workspace)
    session.set_model(lm)
    panel = CalibratePanel(lm, samples=2, seq_len=64, session=session)
    assert panel.workspace is workspace
    panel.run()
    assert session.calibration == (panel.calib_set, panel.stats)
    assert "plan " in panel.children[1].value  # the tab names the session's plan
