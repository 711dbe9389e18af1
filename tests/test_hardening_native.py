"""A damaged or tampered native-runtime folder is one line and exit 2, never a crash of the workbench, and never a
file outside the folder opened by the engine (MNN-LLM; ExecuTorch's program header).

One real ``mnn-llm`` folder is converted once; each case copies it and damages the copy the way a bad disk, a cut
download or a hostile folder would. Where a config points outside the folder, the file it points at is a real,
loadable copy (so an engine that followed it would run), and its access time is set before its modification
time: on a ``relatime`` or ``strictatime`` mount any read by the engine moves it. With ``strace`` the test also
checks no process of the run opened it.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import MNN.llm  # noqa: F401  (the engine)
    import _tools  # noqa: F401  (the converter extension)
except ImportError:
    pytest.skip("MNN is not installed: pip install -c constraints.txt MNN", allow_module_level=True)

from workbench.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """`workbench convert demo --bits 4 --target mnn-llm` (a short evaluation: the folder, its manifest and record)."""
    out = tmp_path_factory.mktemp("hardening") / "good"
    stale = _stale_scratch_folder()
    proc = _cli("convert", "demo", "--bits", "4", "--target", "mnn-llm", "--out", out, "--max-tokens", "256")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "manifest.json").is_file() and (out / "conversion.json").is_file()
    STALE["left"] = stale.exists()
    return out


STALE: dict = {}


def _stale_scratch_folder() -> Path:
    """What a killed conversion leaves: ``<tmp>/workbench-convert-<its pid>-xxxx``, its process gone."""
    import tempfile
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.gettempdir()) / f"workbench-convert-{dead.pid}-killedrun"
    (stale / "mnn-llm").mkdir(parents=True, exist_ok=True)
    (stale / "mnn-llm" / "llm.onnx").write_bytes(b"\0" * 1000)
    return stale


def _cli(*args, strace_log: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "workbench", *map(str, args)]
    if strace_log is not None:
        cmd = ["strace", "-f", "-qq", "-e", "trace=openat,open,execve", "-o", str(strace_log), *cmd]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert len(lines) == 1 and ": error: " in lines[0], lines
    assert "internal error" not in lines[0] and "Traceback" not in proc.stderr
    return lines[0]


def _copy(good: Path, dest: Path, *, manifest: bool = False) -> Path:
    """A copy of the good folder; without its manifest (whose recorded sizes would catch a cut file first), so the
    checks that do not rely on it are the ones tested."""
    shutil.copytree(good, dest)
    if not manifest:
        (dest / "manifest.json").unlink()
    return dest


def _edit_json(path: Path, **changes) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def _untouched(path: Path):
    """Set ``path``'s access time before its modification time (so a read moves it, relatime included); returns a
    check that it did not move."""
    st = path.stat()
    os.utime(path, ns=(st.st_mtime_ns - 10**11, st.st_mtime_ns))
    before = path.stat().st_atime_ns

    def check():
        assert path.stat().st_atime_ns == before, f"'{path}' was read"
    return check


def _crashing(folder: Path) -> None:
    """Every op of ``llm.mnn`` given input tensor indexes far out of range: the flatbuffer stays whole and its sizes
    right (every check before the engine passes), and MNN's engine reads out of bounds on load (SIGSEGV)."""
    from flatbuffers import encode, number_types as nt
    from flatbuffers.table import Table
    buf = bytearray((folder / "llm.mnn").read_bytes())
    net = Table(buf, encode.Get(nt.UOffsetTFlags.packer_type, buf, 0))
    ops = net.Offset(4 + 2 * 3)
    start = net.Vector(ops)
    for k in range(net.VectorLen(ops)):
        op = Table(buf, net.Indirect(start + 4 * k))
        at = op.Offset(4)
        if at:
            vec = op.Vector(at)
            for j in range(op.VectorLen(at)):
                struct.pack_into("<i", buf, vec + 4 * j, 0x3FFFFFFF)
    (folder / "llm.mnn").write_bytes(bytes(buf))


def _damage(case: str, d: Path, outside: Path) -> str:
    """Damage ``d`` as ``case`` says; returns text the one-line error must hold."""
    if case == "weight-truncated":
        with open(d / "llm.mnn.weight", "r+b") as f:
            f.truncate(100_000)
        return "llm.mnn.weight"
    if case == "weight-empty":
        (d / "llm.mnn.weight").write_bytes(b"")
        return "llm.mnn.weight"
    if case == "graph-truncated":
        with open(d / "llm.mnn", "r+b") as f:
            f.truncate(20_000)
        return "llm.mnn"
    if case == "graph-garbage":
        (d / "llm.mnn").write_bytes(os.urandom((d / "llm.mnn").stat().st_size))
        return "llm.mnn"
    if case == "tokenizer-garbage":
        (d / "tokenizer.txt").write_bytes(os.urandom((d / "tokenizer.txt").stat().st_size))
        return "tokenizer.txt"
    if case == "tokenizer-truncated":
        text = (d / "tokenizer.txt").read_text(encoding="utf-8").splitlines()
        (d / "tokenizer.txt").write_text("\n".join(text[:100]) + "\n", encoding="utf-8")
        return "tokenizer.txt"
    if case == "huge-hidden":
        _edit_json(d / "llm_config.json", hidden_size=1 << 30)
        return "hidden_size"
    if case == "huge-layers":
        _edit_json(d / "llm_config.json", layer_nums=10**9)
        return "layer_nums"
    if case == "hidden-not-the-files":  # a sane number, but not the one the embedding file was written with
        _edit_json(d / "llm_config.json", hidden_size=512)
        return "embeddings_bf16.bin"
    if case == "huge-run-settings":
        _edit_json(d / "config.json", max_all_tokens=1 << 40)
        return "max_all_tokens"
    if case == "config-not-json":
        (d / "config.json").write_text("{not json", encoding="utf-8")
        return "config.json' is not JSON"
    if case == "llm-config-not-json":
        (d / "llm_config.json").write_text("[1, 2", encoding="utf-8")
        return "llm_config.json' is not JSON"
    if case == "embeddings-missing":
        (d / "embeddings_bf16.bin").unlink()
        return "embeddings_bf16.bin"
    if case == "embeddings-truncated":
        with open(d / "embeddings_bf16.bin", "r+b") as f:
            f.truncate(1_000_000)
        return "embeddings_bf16.bin"
    if case == "manifest-size":  # an embedding of whole rows, just not this model's: the manifest's recorded size
        shutil.copy2(outside.parent / "manifest.json", d / "manifest.json")
        with open(d / "embeddings_bf16.bin", "ab") as f:
            f.write(b"\0" * 512 * 4)  # four more bf16 rows: a multiple of hidden x 2, still wrong
        return "manifest.json"
    raise AssertionError(case)


DAMAGE = ["weight-truncated", "weight-empty", "graph-truncated", "graph-garbage", "tokenizer-garbage",
          "tokenizer-truncated", "huge-hidden", "huge-layers", "hidden-not-the-files", "huge-run-settings",
          "config-not-json", "llm-config-not-json", "embeddings-missing", "embeddings-truncated", "manifest-size"]


@pytest.fixture
def outside(good, tmp_path):
    """A whole good copy outside the folder under test (what an escaping name points at)."""
    shutil.copytree(good, tmp_path / "good-copy")
    return tmp_path / "good-copy" / "config.json"


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_folder_is_one_line_and_exit_2(good, tmp_path, outside, case):
    d = _copy(good, tmp_path / "folder")
    expect = _damage(case, d, outside)
    gen = _one_error_line(_cli("generate", d, "--prompt", "hi", "--max-new-tokens", "4"))
    assert expect in gen, gen
    prof = _one_error_line(_cli("profile", d, "--repeats", "1"))
    assert expect in prof, prof


ESCAPES = {
    "base-dir": lambda d, o: (_edit_json(d / "config.json", base_dir=str(o.parent) + "/"), o.parent / "llm.mnn"),
    "absolute-tokenizer": lambda d, o: (_edit_json(d / "config.json", tokenizer_file=str(o.parent / "tokenizer.txt")),
                                        o.parent / "tokenizer.txt"),
    "absolute-model": lambda d, o: (_edit_json(d / "config.json", llm_model=str(o.parent / "llm.mnn")),
                                    o.parent / "llm.mnn"),
    "dotdot-weight": lambda d, o: (_edit_json(d / "config.json", llm_weight="../good-copy/llm.mnn.weight"),
                                   o.parent / "llm.mnn.weight"),
    "embeddings-symlink": lambda d, o: ((d / "embeddings_bf16.bin").unlink(),
                                        (d / "embeddings_bf16.bin").symlink_to(o.parent / "embeddings_bf16.bin"),
                                        o.parent / "embeddings_bf16.bin")[-1:],
    "llm-config-elsewhere": lambda d, o: (_edit_json(d / "config.json", llm_config=str(o.parent / "llm_config.json")),
                                          o.parent / "llm_config.json"),
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_a_name_leaving_the_folder_is_refused_and_never_opened(good, tmp_path, outside, case):
    d = _copy(good, tmp_path / "folder")
    target = ESCAPES[case](d, outside)[-1]
    untouched = _untouched(target)
    log = tmp_path / "strace.log" if shutil.which("strace") else None
    line = _one_error_line(_cli("generate", d, "--prompt", "hi", "--max-new-tokens", "4", strace_log=log))
    assert "outside its folder" in line or "base_dir" in line, line
    untouched()
    if log is not None:
        opened = [ln for ln in log.read_text().splitlines() if str(target) in ln and "openat(" in ln]
        assert not opened, opened
    untouched()
    _one_error_line(_cli("profile", d, "--repeats", "1"))
    untouched()


def test_llm_weight_naming_etc_passwd_is_refused_before_the_engine_starts(good, tmp_path):
    d = _copy(good, tmp_path / "folder")
    _edit_json(d / "config.json", llm_weight="../../../../etc/passwd")
    log = tmp_path / "strace.log" if shutil.which("strace") else None
    line = _one_error_line(_cli("generate", d, "--prompt", "hi", "--max-new-tokens", "4", strace_log=log))
    assert "'../../../../etc/passwd'" in line and "outside its folder" in line, line
    if log is not None:
        text = log.read_text()
        assert not [ln for ln in text.splitlines() if "execve(" in ln and "mnn_llm_engine.py" in ln]  # no engine
        assert not [ln for ln in text.splitlines() if '"/etc/passwd"' in ln and "openat(" in ln]


def test_an_engine_crash_is_one_line_naming_the_folder(good, tmp_path):
    """A folder that passes every check and still crashes MNN (segfault) ends the engine's child, not the
    workbench: one line, exit 2."""
    d = _copy(good, tmp_path / "folder", manifest=True)
    _crashing(d)
    for args in (("generate", d, "--prompt", "hi", "--max-new-tokens", "4"), ("profile", d, "--repeats", "1")):
        line = _one_error_line(_cli(*args))
        assert "crashed" in line and "SIG" in line and str(d) in line, line


HUNG_ENGINE = """
import sys, time
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
conn.send(("ok", "ready", 0.0))
conn.recv()
time.sleep(3600)  # an engine that hangs loading the folder
"""


def test_a_hung_engine_is_killed_and_is_one_line_naming_the_folder(good, tmp_path, monkeypatch, capsys):
    """A folder on which MNN hangs (its child never answers) is stopped after $WORKBENCH_ENGINE_TIMEOUT: one line
    naming the folder, exit 2, and the engine's child gone."""
    import time

    import workbench.targets.mnn_llm as mnn_llm
    from workbench.cli import main
    script = tmp_path / "hung_engine.py"
    script.write_text(HUNG_ENGINE)
    monkeypatch.setattr(mnn_llm, "ENGINE_SCRIPT", script)
    monkeypatch.setenv("WORKBENCH_ENGINE_TIMEOUT", "2")
    d = _copy(good, tmp_path / "folder", manifest=True)
    t = time.monotonic()
    assert main(["generate", str(d), "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    assert time.monotonic() - t < 60
    out, err = capsys.readouterr()
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert len(lines) == 1 and "hung loading" in lines[0] and str(d) in lines[0], lines
    assert "no answer in 2 s, killed" in lines[0] and "WORKBENCH_ENGINE_TIMEOUT" in lines[0], lines
    hung = [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(script).encode() in _read(p)]
    assert not hung, hung


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_a_tree_with_bad_folders_profiles_the_good_ones(good, tmp_path):
    root = tmp_path / "tree"
    _copy(good, root / "a-good", manifest=True)
    _crashing(_copy(good, root / "b-crashes", manifest=True))
    _damage("weight-truncated", _copy(good, root / "c-truncated"), tmp_path)
    _copy(good, root / "d-good", manifest=True)
    proc = _cli("profile", root, "--repeats", "1")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    rows = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()]
    assert "a-good" in rows and "d-good" in rows, proc.stdout
    skipped = [ln for ln in proc.stderr.splitlines() if ln.startswith("profile: skipped")]
    assert len(skipped) == 2, proc.stderr
    assert "b-crashes" in skipped[0] and "crashed" in skipped[0]
    assert "c-truncated" in skipped[1] and "llm.mnn.weight" in skipped[1]


def test_the_good_folder_still_runs_and_its_speed_is_the_engine_own(good):
    """The checks pass a good folder, the engine answers from its child, and the times reported are the engine's
    own (its clock in the child): no more than the wall time around the call, and not the child's start-up."""
    import time

    import numpy as np

    from workbench.targets.mnn_llm import MnnLlm, check_mnn_llm_folder
    assert set(check_mnn_llm_folder(good)) >= {"llm_model", "llm_weight", "embedding_file", "tokenizer_file"}
    lm = MnnLlm(good, threads=1)
    try:
        assert 0 < lm.load_seconds < 30
        steps = lm.steps()
        first = steps.start([1, 2, 3])
        t = time.perf_counter()
        nxt = steps.step(int(np.argmax(first)), 3)
        wall = time.perf_counter() - t
        assert first.ndim == nxt.ndim == 1 and 0 < steps.engine_seconds <= wall
        assert lm.logits(np.array([[1, 2, 3]])).shape[:2] == (1, 3)
        assert lm.peak_rss_added_mb() is None or lm.peak_rss_added_mb() > 0
    finally:
        lm.close()


def test_a_damaged_executorch_program_is_one_line(good, tmp_path):
    pytest.importorskip("executorch.runtime")
    d = tmp_path / "et"
    d.mkdir()
    (d / "model.pte").write_bytes(b"\x1c\x00\x00\x00ET12" + os.urandom(4000))  # the header, then garbage
    record = json.loads((good / "conversion.json").read_text())
    record["target"] = "executorch"
    (d / "conversion.json").write_text(json.dumps(record))
    line = _one_error_line(_cli("profile", d, "--repeats", "1"))
    assert "model.pte" in line and "this is a bug" not in line, line
    (d / "model.pte").write_bytes(os.urandom(4000))
    line = _one_error_line(_cli("generate", d, "--prompt", "hi", "--max-new-tokens", "4"))
    assert "model.pte" in line and "not an ExecuTorch program" in line, line


def test_folder_file_refuses_what_the_engine_should_not_read(tmp_path):
    from workbench.files.folder_paths import folder_file, folder_json
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    assert folder_file(tmp_path, "a.bin", "cfg", size=10).name == "a.bin"
    with pytest.raises(ModelLoadError, match="not the 12"):
        folder_file(tmp_path, "a.bin", "cfg", size=12, why="of 3 x 4")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ModelLoadError, match="outside its folder"):
        folder_file(tmp_path / "sub", "../a.bin", "cfg")
    with pytest.raises(ModelLoadError, match="is missing"):
        folder_file(tmp_path, "b.bin", "cfg")
    (tmp_path / "c.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="not an object"):
        folder_json(tmp_path / "c.json")


def test_a_killed_conversion_scratch_folder_is_removed_by_the_next_conversion(good):
    assert STALE == {"left": False}


def test_terminal_escapes_in_a_conversion_record_are_never_printed_raw(good, tmp_path):
    d = _copy(good, tmp_path / "folder", manifest=True)
    _edit_json(d / "conversion.json", target="\x1b]0;owned\x07\x1b[2Jmnn-llm")
    gen = _cli("generate", d, "--prompt", "hi", "--max-new-tokens", "2")
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert "\x1b" not in gen.stdout + gen.stderr and "\\x1b" in gen.stderr  # shown escaped in the header
    for f in ("llm.mnn", "config.json"):  # now nothing runs there: the error names the recorded target
        (d / f).unlink()
    line = _one_error_line(_cli("generate", d, "--prompt", "hi"))
    assert "\x1b" not in line and "\\x1b]0;owned" in line, line


def _genai_folder(tmp_path: Path, graph_bytes: bytes | None = None, location: str | None = None) -> Path:
    import onnx
    from onnx import TensorProto, helper
    folder = tmp_path / "genai"
    folder.mkdir(parents=True)
    (folder / "genai_config.json").write_text(json.dumps({
        "model": {"vocab_size": 8, "context_length": 16, "decoder": {"filename": "model.onnx"}},
        "search": {"max_length": 16}}))
    if graph_bytes is not None:
        (folder / "model.onnx").write_bytes(graph_bytes)
        return folder
    w = helper.make_tensor("w", TensorProto.FLOAT, [4], [0.0] * 4)
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("float_data")
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        w.external_data.add(key=k, value=v)
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"))
    return folder


def test_an_ort_genai_graph_naming_data_outside_or_damaged_is_refused_before_the_runtime(tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="pip install --no-deps onnxruntime-genai==0.18.0")
    from workbench.targets.ort_genai import GenaiCausalLM
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 16)
    untouched = _untouched(secret)
    with pytest.raises(ModelLoadError, match="outside its folder"):
        GenaiCausalLM(_genai_folder(tmp_path, location="../secret.bin"))
    untouched()
    with pytest.raises(ModelLoadError, match="not a readable ONNX graph"):
        GenaiCausalLM(_genai_folder(tmp_path / "b", graph_bytes=os.urandom(3000)))
