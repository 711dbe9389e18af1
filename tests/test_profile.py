"""Profiles of exported and converted models: real files, real timings, clear errors."""
import json

import pytest

from workbench.charts.profile import make_profile_figure
from workbench.cli import main
from workbench.errors import WorkbenchError
from workbench.profile import build_candidates, find_runtimes, profile_directory


@pytest.fixture(scope="module")
def candidates(tiny_model_dir, tmp_path_factory):
    return build_candidates(tiny_model_dir, tmp_path_factory.mktemp("prof") / "out", candidates=("float", "ort-int4"))


def test_every_candidate_is_found_and_timed(candidates):
    names = [name for name, _, _ in find_runtimes(candidates)]
    assert names == ["float", "ort-int4"]
    profiles = profile_directory(candidates, prompt_lengths=(8, 16), decode_steps=4, repeats=2)
    for p in profiles:
        assert p.runtime == "onnxruntime" and set(p.prefill_ms) == {8, 16}
        assert all(ms > 0 for ms in p.prefill_ms.values()) and p.decode_tokens_per_second > 0
        assert p.size_bytes == sum((candidates / p.name / f).stat().st_size for f in ("prefill.onnx", "decode.onnx"))
    by = {p.name: p for p in profiles}
    assert by["ort-int4"].size_bytes < by["float"].size_bytes  # 4-bit weights beside float32 ones
    fig = make_profile_figure(profiles)
    assert list(fig.data[2].x) == ["float", "ort-int4"]


def test_mnn_decode_is_timed_with_its_kv_cache(tiny_model_dir, tmp_path):
    out = build_candidates(tiny_model_dir, tmp_path / "out", candidates=("mnn",))
    [p] = profile_directory(out, prompt_lengths=(8,), decode_steps=4, repeats=1)
    assert p.runtime == "MNN" and p.prefill_ms[8] > 0 and p.decode_tokens_per_second > 0 and not p.notes


def test_cli_json(candidates, capsys):
    assert main(["profile", str(candidates), "--prompt-lengths", "8", "--repeats", "1", "--decode-steps", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in out["profiles"]] == ["float", "ort-int4"]


def test_bad_input(tmp_path, candidates, capsys):
    with pytest.raises(WorkbenchError, match="is not a directory"):
        find_runtimes(tmp_path / "missing")
    with pytest.raises(WorkbenchError, match="no prefill.onnx, prefill.qdq.onnx or prefill.mnn below"):
        find_runtimes(tmp_path)
    with pytest.raises(WorkbenchError, match="at least 1"):
        profile_directory(candidates, repeats=0)
    assert main(["profile", str(candidates), "--prompt-lengths", "eight"]) == 2
    assert "comma-separated positive integers, e.g. 32,128" in capsys.readouterr().err
    with pytest.raises(WorkbenchError, match="unknown candidate"):
        build_candidates("demo", tmp_path / "x", candidates=("coreml",))


@pytest.mark.parametrize("damage", ["truncate-prefill", "truncate-decode", "random-bytes"])
def test_a_damaged_onnx_file_is_named_in_one_line(candidates, tmp_path, capsys, damage):
    import random
    import shutil
    d = tmp_path / "float"
    shutil.copytree(candidates / "float", d)
    name = "decode.onnx" if damage == "truncate-decode" else "prefill.onnx"
    data = (d / name).read_bytes()
    (d / name).write_bytes(random.Random(0).randbytes(4096) if damage == "random-bytes" else data[:len(data) // 2])
    assert main(["profile", str(tmp_path), "--repeats", "1", "--prompt-lengths", "8", "--decode-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"'{d / name}'" in err and "Traceback" not in err
    assert err.startswith("workbench profile: error:")
