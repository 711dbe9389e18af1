"""What a user meets that is not a crash but misleads: each says so in one sentence, or is refused in one line
(exit 2). A user's device profile that replaces a bundled one, a context or prompt a projection cannot hold, bad or
ignored conversion options, an HTP refusal that names its cause, the RKNN toolkit's python and results, full disks
and file-size limits, and external data that leaves a graph's folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main

REPO = Path(__file__).resolve().parents[1]


def _run(capsys, *argv) -> tuple[int, list[str], list[str]]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, [ln for ln in out.splitlines() if ln.strip()], [ln for ln in err.splitlines() if ln.strip()]


def _one_error(capsys, *argv) -> str:
    """The one error line of a refused command (progress bars and notes aside)."""
    rc, out, err = _run(capsys, *argv)
    errors = [ln for ln in err if ": error: " in ln]
    assert rc == 2 and len(errors) == 1, (rc, out[-5:], err[-5:])
    assert not any("Traceback" in ln for ln in err)
    assert "internal error" not in errors[0] and "expected one argument" not in errors[0]
    return errors[0]


# -- a user's device profile replacing a bundled one -------------------------------------------------------------

@pytest.fixture
def fast_rk3588(tmp_path, monkeypatch):
    """A user's rk3588.json with 1000x the bundled bandwidth, in $WORKBENCH_DEVICES."""
    import workbench.devices.profiles as profiles
    doc = json.loads((profiles.DEVICES_DIR / "rk3588.json").read_text())
    doc["memory_bandwidth_gbps"]["value"] *= 1000
    (tmp_path / "rk3588.json").write_text(json.dumps(doc))
    monkeypatch.setenv(profiles.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(profiles, "_said", set())
    return tmp_path / "rk3588.json"


def test_a_user_profile_replacing_a_bundled_one_is_said_when_used(fast_rk3588, capsys):
    from workbench.devices.profiles import DEVICES_DIR
    rc, out, err = _run(capsys, "project", "qwen2.5-1.5b", "--device", "rk3588", "--bits", "8")
    assert rc == 0
    notes = [ln for ln in err if "replaces" in ln]
    assert len(notes) == 1, err
    assert str(fast_rk3588) in notes[0] and str(DEVICES_DIR / "rk3588.json") in notes[0]
    assert "memory_bandwidth_gbps 34000 (was 34)" in notes[0], notes[0]
    rc, out, err = _run(capsys, "devices")
    assert rc == 0 and [ln for ln in out if ln.startswith("note: device 'rk3588'") and "replaces" in ln], out


def test_a_bundled_profile_used_as_it_is_says_nothing(capsys, monkeypatch):
    monkeypatch.delenv("WORKBENCH_DEVICES", raising=False)
    rc, out, err = _run(capsys, "project", "qwen2.5-1.5b", "--device", "rk3588", "--bits", "8")
    assert rc == 0 and not [ln for ln in err + out if "replaces" in ln]


# -- projections past what a context holds ------------------------------------------------------------------------

def test_a_huge_context_is_projected_at_the_bound_never_above_it():
    from workbench.devices.projection import project
    p = project("qwen2.5-1.5b", "8gen3", context=10**12, runtime="auto")
    assert p.decode_bound_tps < 1e-3
    assert p.projected_decode_tps <= p.decode_bound_tps and p.efficiency <= 1.0
    assert any("above the bandwidth bound" in n and "1,000,000,000,000-token context" in n for n in p.notes), p.notes
    short = project("qwen2.5-1.5b", "8gen3", context=1024, runtime="auto")
    assert short.projected_decode_tps < short.decode_bound_tps
    assert not any("above the bandwidth bound" in n for n in short.notes)


def test_the_projection_table_never_prints_a_zero_bound(capsys):
    rc, out, err = _run(capsys, "project", "qwen2.5-1.5b", "--device", "8gen3", "--bits", "4",
                        "--context", "1000000000000")
    decode = next(ln for ln in out if ln.strip().startswith("decode "))
    assert rc == 0 and "0.0 tok/s" not in decode and "e-06 tok/s" in decode, decode
    eff = next(ln for ln in out if ln.strip().startswith("efficiency"))
    assert "1.00 of the bound" in eff, eff


def test_a_prompt_longer_than_the_context_is_noted():
    from workbench.devices.projection import project
    p = project("qwen2.5-1.5b", "8gen3", context=100, prompt=500, runtime=None)
    assert any("500-token prompt is longer than the 100-token context" in n for n in p.notes), p.notes
    assert not any("prompt is longer" in n for n in project("qwen2.5-1.5b", "8gen3", context=500, prompt=500,
                                                              runtime=None).notes)


# -- conversion options: their values in the user's terms, and said when a target ignores them -------------------

@pytest.mark.parametrize("command", ["convert", "export"])
@pytest.mark.parametrize("value", ["-1,5", "1,1", "0,5", "4,0", "-3,-3"])
def test_a_static_shape_out_of_range_is_refused_in_the_options_terms(command, value, capsys, tmp_path):
    extra = ["--bits", "4", "--target", "qnn"] if command == "convert" else []
    line = _one_error(capsys, command, "demo", *extra, "--static", value, "--out", tmp_path / "out")
    assert f"--static {value}: SEQ" in line and "at least 2" in line and "PAST" in line, line
    assert "ctx" not in line, line  # no name the user never gave
    assert not (tmp_path / "out").exists()


def test_a_negative_value_reaches_its_options_own_check(capsys):
    """argparse alone takes ``-5`` after an option for an unknown flag ("expected one argument")."""
    with pytest.raises(SystemExit) as stop:
        main(["project", "demo", "--device", "8gen3", "--ram-gb", "-5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "argument --ram-gb: must be a finite number > 0, got -5" in err, err
    assert "expected one argument" not in err


def test_options_a_target_does_not_read_are_named():
    from workbench.targets.convert import ignored_options
    from workbench.targets.registry import get_target
    notes = ignored_options(get_target("ort-int4"), static=(64, 128), soc="8gen3")
    assert notes == ["--static is ignored by ort-int4: it is read by ort-qdq, qnn, rknn only",
                     "--soc is ignored by ort-int4: it is read by qnn only"], notes
    assert ignored_options(get_target("qnn"), static=(64, 128), soc="8gen3") == []
    assert ignored_options(get_target("rknn"), static=(64, 128), soc=None) == []
    assert ignored_options(get_target("ort-int4"), static=None, soc=None) == []


def test_convert_says_which_options_ort_int4_ignored(capsys, tmp_path):
    rc, out, err = _run(capsys, "convert", "demo", "--bits", "4", "--target", "ort-int4", "--static", "64,128",
                        "--soc", "8gen3", "--out", tmp_path / "o", "--max-tokens", "64")
    assert rc == 0, err
    assert "note: --static is ignored by ort-int4: it is read by ort-qdq, qnn, rknn only" in out, out
    assert "note: --soc is ignored by ort-int4: it is read by qnn only" in out, out
    record = json.loads((tmp_path / "o" / "conversion.json").read_text())
    assert any("--soc is ignored" in n for n in record["notes"])


# -- the RKNN toolkit: its python, its result file, a hang ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["missing", "directory", "not-executable"])
def test_an_rknn_python_that_is_not_a_program_is_refused_naming_it(kind, tmp_path, monkeypatch, capsys):
    py = tmp_path / "venv" / "bin" / "python"
    if kind == "directory":
        py.mkdir(parents=True)
    elif kind == "not-executable":
        py.parent.mkdir(parents=True)
        py.write_text("#!/bin/sh\nexit 0\n")
        py.chmod(0o644)
    monkeypatch.setenv("WORKBENCH_RKNN_PYTHON", str(py))
    line = _one_error(capsys, "convert", "demo", "--bits", "8", "--target", "rknn", "--out", tmp_path / "o")
    why = {"missing": "does not exist", "directory": "is not a file", "not-executable": "is not executable"}[kind]
    assert f"$WORKBENCH_RKNN_PYTHON names '{py}', which {why}" in line and "make rknn-env" in line, line
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.partial-*"))


def test_a_bad_rknn_timeout_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORKBENCH_RKNN_TIMEOUT", "soon")
    line = _one_error(capsys, "convert", "demo", "--bits", "8", "--target", "rknn", "--out", tmp_path / "o")
    assert "$WORKBENCH_RKNN_TIMEOUT must be a number of seconds above 0, got 'soon'" in line, line


def _result(work: Path, text: str | None = None, doc=None) -> Path:
    res = work / "result.json"
    res.write_text(text if text is not None else json.dumps(doc))
    return res


def _graph(work: Path, name: str, logits=None) -> dict:
    path = work / "logits" / name / "0000.npy"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x93NUMPY")
    return {"name": name, "ok": True, "logits": logits if logits is not None else [str(path)], "rknn_bytes": 10,
            "seconds": {"build": 1.0}}


@pytest.mark.parametrize("case, says", [
    ("empty", "empty"),
    ("garbage", "not JSON"),
    ("a-list", "no list of graphs"),
    ("no-graphs", "no list of graphs"),
    ("one-graph", "graphs prefill where prefill, decode were built"),
    ("logits-outside", "the decode graph has no logits files in its work folder"),
    ("no-logits", "the prefill graph has no logits files"),
])
def test_an_unusable_rknn_result_file_is_one_line(case, says, tmp_path):
    from workbench.targets.rknn import RknnError, read_worker_result
    work = tmp_path / "work"
    work.mkdir()
    outside = tmp_path / "elsewhere.npy"
    outside.write_bytes(b"x")
    good = [_graph(work, "prefill"), _graph(work, "decode")]
    res = {"empty": lambda: _result(work, ""),
           "garbage": lambda: _result(work, "\x00\x01garbage{"),
           "a-list": lambda: _result(work, doc=[1, 2]),
           "no-graphs": lambda: _result(work, doc={"peak_rss_bytes": 5}),
           "one-graph": lambda: _result(work, doc={"graphs": good[:1]}),
           "logits-outside": lambda: _result(work, doc={"graphs": [good[0], _graph(work, "decode", [str(outside)])]}),
           "no-logits": lambda: _result(work, doc={"graphs": [_graph(work, "prefill", []), good[1]]}),
           }[case]()
    with pytest.raises(RknnError) as e:
        read_worker_result(res, ["prefill", "decode"], work, tmp_path / "rknn_build.log")
    msg = str(e.value)
    assert says in msg and str(res) in msg and "rknn_build.log" in msg and "\n" not in msg, msg
    assert read_worker_result(_result(work, doc={"graphs": good}), ["prefill", "decode"], work, tmp_path / "log")


HUNG_TOOLKIT = """#!/bin/sh
sleep 3600 &
echo $! > "{pids}"
echo $$ >> "{pids}"
wait
"""


def test_a_hung_rknn_toolkit_is_stopped_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A toolkit that never finishes is killed (its own children too) after $WORKBENCH_RKNN_TIMEOUT; the conversion
    writes its bundle and says why no .rknn was built; no staging folder or toolkit temp folder is left."""
    import os
    import tempfile
    pids = tmp_path / "pids"
    fake = tmp_path / "python"
    fake.write_text(HUNG_TOOLKIT.format(pids=pids))
    fake.chmod(0o755)
    monkeypatch.setenv("WORKBENCH_RKNN_PYTHON", str(fake))
    monkeypatch.setenv("WORKBENCH_RKNN_TIMEOUT", "3")
    rc, out, err = _run(capsys, "convert", "demo", "--bits", "8", "--target", "rknn", "--out", tmp_path / "o",
                        "--static", "32,64")
    assert rc == 0, err
    assert any(ln.startswith("note: no .rknn: rknn-toolkit2 did not finish in 3 s") and "was stopped" in ln
               and "$WORKBENCH_RKNN_TIMEOUT" in ln for ln in out), out
    assert (tmp_path / "o" / "build_rknn.py").is_file()
    assert not list(tmp_path.glob(".o.partial-*")) and not list(tmp_path.glob(".o.old-*"))
    assert not list(Path(tempfile.gettempdir()).glob(f"workbench-rknn-{os.getpid()}-*"))
    for pid in map(int, pids.read_text().split()):
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", pid


# -- the HTP's refusal of 16-bit weights with 8-bit activations names its cause ------------------------------------

def test_an_fp16_lm_head_with_8_bit_activations_on_htp_v75_is_refused_naming_the_plan_line(tmp_path):
    """`--bits 8 --activation-bits 8` keeps lm_head fp16, which the QDQ graph holds as 16-bit weights beside 8-bit
    activations; HTP v75 refuses that pairing (error 3110), not 16-bit weights as such (v73+ runs them)."""
    pytest.importorskip("onnxruntime_qnn")
    from workbench.targets.convert import convert
    from workbench.targets.htp import HtpRefused, matmul_bits, open_htp
    out = tmp_path / "qdq"
    convert("demo", "ort-qdq", out, bits=8, activation_bits=8, max_tokens=64)
    prefill = out / "prefill.qdq.onnx"
    assert matmul_bits(prefill, ["/lm_head/MatMul", "/model.layers.0.mlp.down_proj/MatMul"]) == {
        "/lm_head/MatMul": (16, 8), "/model.layers.0.mlp.down_proj/MatMul": (8, 8)}
    with pytest.raises(HtpRefused) as e:
        open_htp(prefill, out / "decode.qdq.onnx", device="8gen3")
    msg = str(e.value)
    assert "HTP v75" in msg and "16-bit weights with 8-bit activations" in msg and "need HTP v73+" not in msg, msg
    assert '{"pattern": "lm_head", "precision": "int8"}' in msg and "--activation-bits 16" in msg, msg


# -- full disks and file-size limits: the file named, and what to do -------------------------------------------

def test_a_full_disk_while_quantize_writes_its_weights_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    import errno

    import workbench.quantize.storage as storage

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 4096)  # what got written before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(storage, "save_file", full)
    out = tmp_path / "q"
    line = _one_error(capsys, "quantize", "demo", "--bits", "4", "--method", "rtn", "--out", out)
    assert f"no space left on the disk writing '{out}/" in line and ".safetensors'" in line, line
    assert "free space there (or give --out on another disk)" in line and "Errno" not in line, line
    assert not out.exists() and not list(tmp_path.iterdir())  # no staging folder left


def test_a_file_too_large_from_a_wrapped_writer_is_not_a_bug(tmp_path, monkeypatch, capsys):
    """safetensors reports EFBIG inside its own exception type: still a full-disk class line, never 'internal error'."""
    import workbench.quantize.storage as storage

    class SafetensorError(Exception):
        pass

    def too_large(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    monkeypatch.setattr(storage, "save_file", too_large)
    out = tmp_path / "q"
    line = _one_error(capsys, "quantize", "demo", "--bits", "4", "--method", "rtn", "--out", out)
    assert f"writing '{out}/" in line and ".safetensors'" in line, line
    assert "file system" in line or "ulimit -f" in line, line


def test_a_real_file_size_limit_names_the_file_and_the_limit(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "onnx"
    proc = subprocess.run(["bash", "-c", f"ulimit -f 1000; exec {sys.executable} -m workbench export demo --out {out} "
                           "--no-check"], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert f"writing '{out}/prefill.onnx' went past this shell's file-size limit (`ulimit -f`)" in lines[0], lines
    assert "internal error" not in proc.stderr and "Errno" not in lines[0]
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("error, code", [
    (OSError(28, "No space left on device"), 28),
    (OSError(27, "File too large"), 27),
    (OSError(122, "Disk quota exceeded"), 122),
    (RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: "
                  "file write failed: No space left on device"), 28),
    (Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left\" })"), 28),
    (OSError("1048576 requested and 458272 written"), None),  # numpy's short write: the limit decides which
])
def test_storage_failures_are_recognised_whoever_reports_them(error, code):
    from workbench.errors import storage_failure
    found = storage_failure(error)
    assert found is not None and (code is None or found[0] == code), found
    wrapped = ValueError("saving failed")
    wrapped.__cause__ = error
    assert storage_failure(wrapped) == found
    assert storage_failure(ValueError("no such tensor")) is None


def test_the_cli_line_for_a_full_disk_outside_any_staged_folder(tmp_path):
    from workbench.cli import error_line
    args = type("Args", (), {"out": str(tmp_path / "o"), "command": "x"})()
    line = error_line(RuntimeError("file write failed: No space left on device"), args, [])
    assert line.startswith("error: no space left on the disk writing into") and str(tmp_path / "o") in line, line
    line = error_line(OSError(28, "No space left on device", str(tmp_path / "f.bin")), args, [])
    assert f"'{tmp_path / 'f.bin'}'" in line and "internal error" not in line, line


def test_a_full_disk_inside_a_workspace_step_names_its_file_and_keeps_the_partial(tmp_path):
    import errno

    from workbench.errors import WorkspaceError
    from workbench.files.workspace import Workspace

    def compute(partial: Path):
        (partial / "stats.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(WorkspaceError) as e:
        ws.get_or_compute("calibrate", {"model": "demo"}, compute)
    msg = str(e.value)
    assert "no space left on the disk writing" in msg and "stats.safetensors'" in msg, msg
    assert "set WORKBENCH_WORKSPACE to a folder on another disk" in msg, msg
    assert list((tmp_path / "ws" / "calibrate").glob(".partial-*/stats.safetensors"))  # a rerun resumes from it


# -- external data leaving a graph's folder -----------------------------------------------------------------------

def _graph_with_external_data(folder: Path, location: str) -> Path:
    """A one-node graph whose weight is read from ``location`` (as a tampered export would name it)."""
    import onnx
    from onnx import TensorProto, helper
    folder.mkdir(parents=True, exist_ok=True)
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        w.external_data.add(key=k, value=v)
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    path = folder / "model.onnx"
    onnx.save(helper.make_model(g), str(path))
    return path


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_inspect_says_external_data_leaves_the_folder_and_never_opens_it(where, tmp_path):
    import shutil
    import subprocess
    import sys
    secret = tmp_path / "passwd"
    secret.write_bytes(b"\0" * 64)
    folder = tmp_path / "graph"
    location = {"dotdot": "../passwd", "absolute": str(secret), "symlink": "weights.bin"}[where]
    graph = _graph_with_external_data(folder, location)
    if where == "symlink":
        (folder / "weights.bin").symlink_to(secret)
    cmd = [sys.executable, "-m", "workbench", "inspect", str(graph), "--target", "ort"]
    log = tmp_path / "strace.log"
    if shutil.which("strace"):
        cmd = ["strace", "-f", "-qq", "-e", "trace=openat,open", "-o", str(log), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert f"names external data location of 'w' '{location}', which resolves outside its folder" in lines[0], lines
    assert "copy it next to the graph" not in lines[0] and "in 'passwd'" not in lines[0]
    if log.exists():
        assert not [ln for ln in log.read_text().splitlines() if str(tmp_path) in ln and "passwd" in ln], "opened"


def test_inspect_still_names_missing_external_data_inside_the_folder(tmp_path):
    from workbench.errors import ModelLoadError
    from workbench.onnx.inspect import load_onnx
    graph = _graph_with_external_data(tmp_path / "g", "model.onnx.data")
    with pytest.raises(ModelLoadError, match=r"keeps its weights in 'model.onnx.data', which is missing"):
        load_onnx(graph)
