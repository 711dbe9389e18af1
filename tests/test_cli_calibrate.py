"""``workbench calibrate``: JSON output, the table, caching across runs, and bad input as one line."""
from __future__ import annotations

import json
import re

import pytest

from workbench.cli import main

TEXT = "Calibration text for the command line: every layer's inputs are measured over these tokens. " * 30


@pytest.fixture
def data_file(tmp_path):
    p = tmp_path / "calib.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


def run_json(capsys, *argv):
    assert main(["calibrate", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output(tiny_model_dir, data_file, tmp_path, capsys):
    ws = tmp_path / "ws"
    out = run_json(capsys, tiny_model_dir, "--data", data_file, "--samples", 3, "--seq-len", 64, "--workspace", ws)
    cov = out["coverage"]
    assert cov["samples"] == 3 and cov["requested"] == 3 and cov["seq_len"] == 64
    assert 3 * 32 <= cov["tokens"] <= 3 * 64 and cov["path"] == str(data_file)
    assert "histogram" in cov and cov["split_records"] == 1
    names = [layer["name"] for layer in out["layers"]]
    assert "lm_head" in names and "model.layers.0.mlp.down_proj" in names
    first = out["layers"][0]
    for key in ("abs_max", "mean_abs", "kurtosis", "percentiles", "near_zero_fraction", "outlier_channels",
                "outlier_ratio", "max_to_median"):
        assert key in first
    assert out["artifact"].startswith(str(ws)) and (tmp_path / out["artifact"] / "stats.safetensors").is_file()
    assert out["cached"] is False
    again = run_json(capsys, tiny_model_dir, "--data", data_file, "--samples", 3, "--seq-len", 64, "--workspace", ws)
    assert again["cached"] is True and again["artifact"] == out["artifact"] and again["layers"] == out["layers"]


def test_default_data_is_the_demo_calibration_text(tiny_model_dir, tmp_path, capsys):
    out = run_json(capsys, tiny_model_dir, "--samples", 2, "--seq-len", 32, "--workspace", tmp_path / "ws")
    assert out["coverage"]["path"].endswith("demo-model/calibration.txt")


def test_table_output(tiny_model_dir, data_file, tmp_path, capsys):
    assert main(["calibrate", str(tiny_model_dir), "--data", str(data_file), "--samples", "2", "--seq-len", "64",
                 "--workspace", str(tmp_path / "ws")]) == 0
    text = capsys.readouterr().out
    assert re.search(r"2 samples, \d+ tokens kept", text)
    assert "model.layers.1.mlp.down_proj" in text and "kurtosis" in text


@pytest.mark.parametrize("content, suffix, message", [
    (None, ".txt", "does not exist"),
    ('{"text": "ok"}\n{"txt": "typo"}\n', ".jsonl", "line 2: missing field 'text'"),
    ('[{"instruction": "a"}]', ".json", "record 1: Alpaca record is missing field 'output'"),
    ('{"text": "ok"\n', ".jsonl", "line 1: not valid JSON"),
])
def test_bad_data_is_one_line_and_exit_2(tiny_model_dir, tmp_path, capsys, content, suffix, message):
    p = tmp_path / f"bad{suffix}"
    if content is not None:
        p.write_text(content, encoding="utf-8")
    code = main(["calibrate", str(tiny_model_dir), "--data", str(p), "--workspace", str(tmp_path / "ws"), "--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("workbench calibrate: error:") and message in err
    assert len(err.strip().splitlines()) == 1


def test_seq_len_too_long(tiny_model_dir, data_file, tmp_path, capsys):
    code = main(["calibrate", str(tiny_model_dir), "--data", str(data_file), "--seq-len", "4096",
                 "--workspace", str(tmp_path / "ws")])
    assert code == 2 and "exceeds the model's max_position_embeddings" in capsys.readouterr().err
