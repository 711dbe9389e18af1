"""bench/decode.py on a tiny shape: every artifact built and timed in one run, llama.cpp's absence reported."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "bench" / "decode.py"
_spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
decode = importlib.util.module_from_spec(_spec)
sys.modules["bench_decode"] = decode
_spec.loader.exec_module(decode)


def test_one_run_times_every_artifact(tmp_path, capsys):
    assert decode.main(["--tiny", "--out", str(tmp_path), "--prompt", "8", "--steps", "4", "--repeats", "1",
                        "--llama-cpp", str(tmp_path / "no-llama"), "--bandwidth", "40", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["artifact"]: r for r in doc["rows"]}
    assert doc["read_gbps"] == 40 and doc["steps"] == 4
    ours = rows["workbench ort-genai (INT4 g32)"]
    for name in ("float ONNX (workbench export)", "workbench ort-int4 (INT4 g32, accuracy level 4)",
                 "workbench ort-genai (INT4 g32)", "workbench ort-genai (INT4 g128)"):
        r = rows[name]
        assert r["tokens_per_second"] > 0 and r["bytes_per_token"] > 0 and r["file_bytes"] >= r["bytes_per_token"]
        assert r["fraction_of_bound"] == r["tokens_per_second"] / (40e9 / r["bytes_per_token"])
    assert ours["bytes_per_token"] < rows["float ONNX (workbench export)"]["bytes_per_token"] / 4
    builders = [r for n, r in rows.items() if n.startswith("onnxruntime-genai builder")]
    assert len(builders) == 2 and all(r["tokens_per_second"] or r["note"].startswith("absent") for r in builders)
    llama = rows["llama.cpp Q4_0"]
    assert llama["tokens_per_second"] is None and llama["note"].startswith("absent: llama.cpp not found")
    text = decode.table([decode.Row(**{k: v for k, v in r.items() if k != "fraction_of_bound"})
                         for r in doc["rows"]], 40)
    assert "absent: llama.cpp not found" in text and "of bound" in text
    assert decode.main(["--tiny", "--out", str(tmp_path), "--prompt", "8", "--steps", "4", "--repeats", "1",
                        "--bandwidth", "40", "--json"]) == 0  # a second run times what the first built
    out, err = capsys.readouterr()
    assert "reusing workbench-genai-g32" in err and "quantizing" not in err
    again = {r["artifact"]: r for r in json.loads(out)["rows"]}
    assert again["workbench ort-genai (INT4 g32)"]["file_bytes"] == ours["file_bytes"]
    assert again["workbench ort-genai (INT4 g32)"]["note"] == ours["note"]
