"""bench/devices_gap.py: a thin command line over workbench.run.devices_gap (the rows are tested in test_devices_gap)."""
import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("devices_gap", Path(__file__).parents[1] / "bench" / "devices_gap.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_unknown_target_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--targets", "simulation,npu"])
    assert "unknown target(s) npu" in capsys.readouterr().err


def test_a_bad_soc_is_one_line_and_status_2(tmp_path, capsys):
    assert bench.main(["--targets", "htp", "--soc", "nowhere", "--work", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "nowhere" in err[0]


@pytest.mark.slow
def test_prints_the_table_and_writes_the_rows(tiny_model_dir, tmp_path, capsys):
    html = tmp_path / "gap.html"
    assert bench.main(["--model", str(tiny_model_dir), "--targets", "simulation", "--max-tokens", "256",
                       "--work", str(tmp_path / "w"), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| simulation |")]
    assert len(table) == 1 and "INT8 plan" in out
    rows = json.loads((tmp_path / "w" / "devices_gap.json").read_text())["rows"]
    assert f"| {rows[0]['prefill']['kl']:.2e} |" in table[0]
    assert "plotly" in html.read_text()[:20000].lower()


@pytest.mark.slow
def test_prints_the_executorch_row_with_its_own_tok_s(tiny_model_dir, tmp_path, capsys):
    from workbench.run.devices_gap import missing_toolchain
    if missing_toolchain("executorch"):
        pytest.skip(missing_toolchain("executorch"))
    assert bench.main(["--model", str(tiny_model_dir), "--bits", "4", "--targets", "executorch", "--max-tokens",
                       "256", "--work", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("| target |"))
    line = next(line for line in out.splitlines() if line.startswith("| executorch |"))
    row = json.loads((tmp_path / "w" / "devices_gap.json").read_text())["rows"][0]
    assert "prefill tok/s" in head and row["speed"]["decode_tps"] > 0
    assert f"| {row['speed']['prefill_tps']:,.0f} | {row['speed']['decode_tps']:,.0f} |" in line
    assert f"| {row['prefill']['kl']:.2e} |" in line
