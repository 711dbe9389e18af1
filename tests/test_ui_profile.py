"""The profile panel without a browser: Run fills the table and the chart; a bad folder is a status line."""
from workbench.run.profile import build_candidates
from workbench.ui.profile import ProfilePanel


def test_run_fills_table_and_chart(tiny_model_dir, tmp_path, workspace):
    out = build_candidates(tiny_model_dir, tmp_path / "c", candidates=("float",))
    panel = ProfilePanel(out, prompt_lengths=(8,), repeats=1, workspace=workspace)
    profiles = panel.run()
    assert [p.name for p in profiles] == ["float"] and panel.error is None
    assert "<td>float</td>" in panel.table.value and "prefill 8 ms" in panel.table.value
    assert panel.figures["profile"].data
    # each decode speed against this host's bound: its read bandwidth, cached in the workspace
    gbps = panel.host["read_gbps"]
    assert panel.host["artifact"].startswith(str(workspace.root)) and "bound tok/s" in panel.table.value
    assert f"<td>{profiles[0].decode_bound(gbps):.0f}</td>" in panel.table.value
    assert panel.figures["decode-bound"].data[0].y[0] == profiles[0].decode_bound(gbps)


def test_bad_folder_and_bad_lengths_are_status_lines(tmp_path):
    panel = ProfilePanel(tmp_path / "missing")
    assert panel.run() is None and "is not a directory" in panel.error
    panel.prompt_lengths.value = "32,abc"
    panel.directory.value = str(tmp_path)
    assert panel.run() is None and "comma-separated positive integers" in panel.error


def test_in_the_app_the_folder_follows_exports_output(tiny_model_dir, workspace, tmp_path):
    from workbench.model.load import load_model
    from workbench.ui.session import AppSession
    session = AppSession(out_dir=tmp_path / "run", workspace=workspace)
    session.set_model(load_model(tiny_model_dir))
    panel = ProfilePanel(session=session)
    assert panel.directory.value == str(session.conversion_dir)
    session.out_dir = tmp_path / "other"
    assert panel.directory.value == str(tmp_path / "other" / "convert" / "not-quantized")
    panel.close()  # a closed panel no longer follows the session
    session.out_dir = tmp_path / "third"
    assert panel.directory.value.startswith(str(tmp_path / "other"))
