"""`workbench report`: a folder of command-line outputs to one HTML file; paths without a run are one line."""
import json

from workbench.cli import main


def test_report_of_command_line_outputs(tmp_path, capsys):
    """quantize + convert with the CLI into one folder, then report it."""
    out = tmp_path / "out"
    assert main(["quantize", "demo", "--out", str(out / "q"), "--bits", "4", "--max-tokens", "1024",
                 "--json"]) == 0
    assert main(["convert", str(out / "q"), "--target", "ort-int4", "--out", str(out / "c"), "--max-tokens", "1024",
                 "--json"]) == 0
    capsys.readouterr()
    page = tmp_path / "report.html"
    assert main(["report", str(out), "--out", str(page), "--device", "8gen3", "--device", "rk3588", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["run"] == str(out.resolve()) and summary["bytes"] == len(page.read_bytes())
    assert summary["figures"] == ["Quantized model: weight error per layer", "Conversions against the simulation",
                                  "Plans on devices", "Vendor measurements and the fit",
                                  "Quality, size and projected speed"]
    text = page.read_text(encoding="utf-8")
    assert text.count("Plotly.newPlot(") == 5 and "RK3588" in text and "Jetson" not in text
    assert main(["report", str(out), "--out", str(page), "--context", "4096"]) == 0
    assert "4096-token KV cache" in page.read_text(encoding="utf-8") and "wrote" in capsys.readouterr().out


def test_paths_without_a_run_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for path, words in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "holds no workbench run")):
        assert main(["report", str(path), "--out", str(tmp_path / "r.html")]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()
