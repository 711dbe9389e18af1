"""Profiles of exported and converted models: real files, real timings, clear errors."""
import json

import pytest

from workbench.charts.profile import make_profile_figure
from workbench.cli import main
from workbench.errors import WorkbenchError
from workbench.run.profile import build_candidates, profile_directory
from workbench.run.locate import find_runnable


@pytest.fixture(scope="module")
def candidates(tiny_model_dir, tmp_path_factory):
    return build_candidates(tiny_model_dir, tmp_path_factory.mktemp("prof") / "out", candidates=("float", "ort-int4"))


def test_every_candidate_is_found_and_timed(candidates):
    found = find_runnable(candidates)
    assert [f.folder.name for f in found] == ["float", "ort-int4"]
    assert [f.target.name for f in found] == ["ort-int4", "ort-int4"]  # the export, recognised by its files
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


def test_cli_json(candidates, capsys, tmp_path):
    assert main(["profile", str(candidates), "--prompt-lengths", "8", "--repeats", "1", "--decode-steps", "2",
                 "--workspace", str(tmp_path / "ws"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in out["profiles"]] == ["float", "ort-int4"]
    gbps = out["host_bandwidth"]["read_gbps"]
    for p in out["profiles"]:
        whole = (candidates / p["name"] / "decode.onnx").stat().st_size
        # the float embedding table is read one row per step; ort-int4's float16 tied head is read widened
        assert 0.5 * whole < p["decode_bytes"] < (whole if p["name"] == "float" else 2 * whole)
        assert p["decode_bound_tps"] == pytest.approx(gbps * 1e9 / p["decode_bytes"])
        assert p["fraction_of_bound"] == pytest.approx(p["decode_tokens_per_second"] / p["decode_bound_tps"])


def test_cli_table_shows_each_decode_speed_against_the_host_bound(candidates, capsys, tmp_path):
    assert main(["profile", str(candidates), "--prompt-lengths", "8", "--repeats", "1", "--decode-steps", "2",
                 "--workspace", str(tmp_path / "ws")]) == 0
    text = capsys.readouterr().out
    assert "of bound" in text and "bound: this host's read bandwidth" in text and "host-bandwidth" in text


def test_host_bandwidth_is_measured_once_and_cached(tmp_path, monkeypatch):
    import workbench.run.profile as prof
    from workbench.files.workspace import Workspace
    calls = []
    monkeypatch.setattr(prof, "measure_read_bandwidth", lambda: calls.append(1) or 12.5)
    ws = Workspace(tmp_path / "ws")
    first = prof.host_bandwidth(ws)
    assert first["read_gbps"] == 12.5 and prof.host_bandwidth(ws)["read_gbps"] == 12.5 and len(calls) == 1
    prof.host_bandwidth(ws, force=True)
    assert len(calls) == 2


def test_read_bandwidth_and_the_fraction_of_the_bound():
    from workbench.run.profile import RuntimeProfile, measure_read_bandwidth
    assert measure_read_bandwidth(64 * 2 ** 20, repeats=2) > 0.1  # GB/s: any machine reads faster than this
    p = RuntimeProfile("x", "onnxruntime", [], 0, 1, 1, decode_tokens_per_second=5.0, decode_bytes=2_000_000_000)
    assert p.decode_bound(10.0) == pytest.approx(5.0) and p.fraction_of_bound(10.0) == pytest.approx(1.0)
    assert RuntimeProfile("y", "MNN", [], 0, 1, 1).fraction_of_bound(10.0) is None


def test_bad_input(tmp_path, candidates, capsys):
    with pytest.raises(WorkbenchError, match="is not a directory"):
        find_runnable(tmp_path / "missing")
    with pytest.raises(WorkbenchError, match=r"nothing to run below .* \(no folder with .*prefill.onnx \+ decode.onnx"):
        find_runnable(tmp_path)
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


def test_a_decode_step_reads_one_row_of_an_embedding_table(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from workbench.onnx.inspect import decode_step_bytes

    def graph(tied: bool):
        e = numpy_helper.from_array(np.ones((100, 8), np.float32), "E")
        w = numpy_helper.from_array(np.ones((8, 8), np.float32), "W")
        nodes = [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["y"])]
        if tied:
            nodes.append(helper.make_node("MatMul", ["y", "E_T"], ["logits"]))
            nodes.insert(0, helper.make_node("Transpose", ["E"], ["E_T"]))
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("logits" if tied else "y", TensorProto.FLOAT, None)],
                              initializer=[e, w])
        path = tmp_path / f"decode-{tied}.onnx"
        onnx.save(helper.make_model(g), path)
        return path
    assert decode_step_bytes(graph(tied=False)) == 8 * 4 + 8 * 8 * 4  # one row of E, all of W
    assert decode_step_bytes(graph(tied=True)) == 100 * 8 * 4 + 8 * 8 * 4  # E also feeds the output layer


def test_decode_bytes_count_widened_float16_weights_at_float32(tmp_path):
    """A float16 weight only a Cast to float32 reads is held (and read) as float32; a float16 table only a Gather
    reads costs one row a token."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from workbench.onnx.inspect import decode_step_bytes
    w = numpy_helper.from_array(np.zeros((8, 4), np.float16), "w")
    table = numpy_helper.from_array(np.zeros((100, 8), np.float16), "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
             helper.make_node("Cast", ["e"], ["x"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["w"], ["w32"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "w32"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4])], [w, table])
    onnx.save(helper.make_model(graph), tmp_path / "decode.onnx")
    assert decode_step_bytes(tmp_path / "decode.onnx") == 8 * 4 * 4 + 8 * 2
    # a tied float16 head: the table is gathered a row at a time and read whole, widened, by the head
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
             helper.make_node("Cast", ["e"], ["x"], to=TensorProto.FLOAT),
             helper.make_node("Transpose", ["table"], ["t"], perm=[1, 0]),
             helper.make_node("Cast", ["t"], ["t32"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "t32"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 100])], [table])
    onnx.save(helper.make_model(graph), tmp_path / "tied.onnx")
    assert decode_step_bytes(tmp_path / "tied.onnx") == 100 * 8 * 4 + 8 * 2


def test_the_memory_a_model_added_is_shown_in_the_unit_of_its_size():
    """peak_rss_added_mb is MiB (/proc); tables and summaries say MB (10^6 bytes), as the size beside it."""
    from workbench.run.profile import RuntimeProfile
    p = RuntimeProfile(name="m", runtime="onnxruntime", files=[], size_bytes=2 * 10**6, threads=1, repeats=1,
                       peak_rss_added_mb=100.0)
    assert p.rss_added_mb == 104.8576 and "+105 MB RSS" in p.summary()
    assert RuntimeProfile(name="m", runtime="x", files=[], size_bytes=1, threads=1, repeats=1).rss_added_mb is None
