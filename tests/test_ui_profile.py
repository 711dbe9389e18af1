"""The profile panel without a browser: Run fills the table and the chart; a bad folder is a status line."""
from workbench.run.profile import build_candidates
from workbench.ui.profile import ProfilePanel


def test_run_fills_table_and_chart(tiny_model_dir, tmp_path, workspace):
    out = build_candidates(tiny_model_dir, tmp_path / "c", candidates=("float",))
    panel = ProfilePanel(out, prompt_lengths=(8,), repeats=1, workspace=workspace)
    profiles = panel.run()
    assert [p.name for p in profiles] == ["float"] and panel.error is None
    assert "<td>float</td>" in panel.table.value and "prefill, 8-token prompt (ms)" in panel.table.value
    assert panel.figures["profile"].data
    # each decode speed against this host's bound: its read bandwidth, cached in the workspace
    gbps = panel.host["read_gbps"]
    assert panel.host["artifact"].startswith(str(workspace.root)) and "memory bound tok/s" in panel.table.value
    # the tiny model's decode graph fits in any CPU's last-level cache: no memory bound, and the row says why
    assert "fits in this CPU's" in panel.table.value and panel.figures["decode-bound"].data[0].y[0] is None
    assert "no memory bound" in panel.figures["decode-bound"].data[1].text[0]
    assert panel.status_line.bar.max == 1  # the bar moved model by model


def test_no_share_of_the_bound_above_one_unexplained():
    """Issue 55.5: "1.31 of bound": a graph in the cache is not held to the memory's bound; out of it, it is."""
    from workbench.run.profile import RuntimeProfile
    from workbench.ui.profile import _rows
    p = RuntimeProfile("m", "onnxruntime", [], 10**6, 1, 1, decode_tokens_per_second=1500.0, decode_bytes=5 * 10**6)
    assert p.fraction_of_bound(5.0) == 1.5  # 5 GB/s / 5 MB = 1,000 tok/s: beaten 1.5x, by the cache
    assert p.fraction_of_bound(5.0, cache_bytes=32 * 2**20) is None and p.decode_bound(5.0, 32 * 2**20) is None
    assert p.decode_bound(5.0, cache_bytes=2 * 2**20) == 1000.0  # larger than the cache: the memory bounds it
    table = _rows([p], 5.0, 32 * 2**20)
    assert "1.50" not in table and "5.00 MB decode graph fits in this CPU's 33.55 MB cache" in table


def test_prompt_lengths_read_as_two_numbers_and_a_skipped_target_is_a_note_not_an_error(tmp_path, monkeypatch):
    import workbench.ui.profile as ui
    panel = ProfilePanel(tmp_path)
    assert panel.prompt_lengths.value == "32, 128" and ui.parse_prompt_lengths(panel.prompt_lengths.value) == (32, 128)

    monkeypatch.setattr(ui, "profile_directory", lambda directory, log=None, on_model=None, **kw:
                        (log("skipped 'x/tensorrt': a tensorrt conversion, which does not run here"), [])[1])
    monkeypatch.setattr(ui, "host_bandwidth", lambda ws: {"read_gbps": 5.0})
    assert panel.run() == [] and panel.error is None
    assert "not profiled" in panel.skipped.value and "tensorrt" in panel.skipped.value
    assert "tensorrt" not in panel.log_output.outputs.__repr__()  # not in the log's pink stderr box


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


def test_what_export_says_does_not_run_here_is_neither_generated_nor_profiled(tiny_model_dir, tmp_path, workspace):
    """Issue 55.6: a TensorRT folder (its model.onnx looks like another target's files) was picked by Generate and
    timed by Profile while Export said it does not run here."""
    import json
    import pytest
    from workbench.errors import ModelLoadError
    from workbench.run.locate import find_runnable, locate, not_runnable_here
    from workbench.targets.registry import get_target
    out = build_candidates(tiny_model_dir, tmp_path / "c", candidates=("float",))
    folder = find_runnable(out)[0].folder
    assert not get_target("tensorrt").runnable
    (folder / "conversion.json").write_text(json.dumps({"target": "tensorrt"}), encoding="utf-8")
    assert not_runnable_here(folder) == "tensorrt" and locate(folder, strict=False) is None
    with pytest.raises(ModelLoadError, match="tensorrt conversion, which does not run here"):
        locate(folder)
    (folder / "conversion.json").write_text(json.dumps({"target": "ort-int4"}), encoding="utf-8")
    assert not_runnable_here(folder) is None  # a target that runs here is still run
