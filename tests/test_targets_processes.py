"""Killed runs leave no toolkit children and no temporary folders: a real parent started, SIGKILLed, its children
watched (the rknn toolkit's subprocess, the HTP emulator's spawned process and its resource tracker)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from workbench.targets.processes import owned_tempdir, process_alive, remove_orphaned_temporaries

ROOT = Path(__file__).resolve().parents[1]


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for a reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait(predicate, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")

PARENT_RKNN = """
import sys
from pathlib import Path
import workbench.targets.rknn as rknn
rknn.WORKER = Path(sys.argv[1])  # the worker's place: a child that only waits, started as the toolkit's is
work = rknn.owned_tempdir(rknn.TEMP_KIND)
(work / "calib.npy").write_bytes(bytes(1 << 20))
print(work, flush=True)
rknn._run_worker(Path(sys.executable), {}, work, work / "rknn_build.log", 600, 1)
"""

WORKER = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1]).with_name("child.pid").write_text(str(os.getpid()))
time.sleep(600)
"""


def test_a_killed_rknn_run_takes_its_toolkit_child_and_the_next_run_removes_its_folder(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    parent = subprocess.Popen([sys.executable, "-c", PARENT_RKNN, str(worker)], stdout=subprocess.PIPE, text=True)
    try:
        work = Path(parent.stdout.readline().strip())
        assert work.name.startswith(f"workbench-rknn-{parent.pid}-")
        assert _wait(lambda: (work / "child.pid").is_file() and (work / "child.pid").read_text(), 60)
        child = int((work / "child.pid").read_text())
        assert _running(child)
    finally:
        _kill(parent)
    assert _wait(lambda: not _running(child), 5), f"the toolkit child {child} outlived its killed parent"
    assert work.is_dir()  # a SIGKILL runs no cleanup ...
    new = owned_tempdir("workbench-rknn")  # ... the next run's start removes it
    try:
        assert not work.exists() and new.is_dir() and process_alive(os.getpid())
    finally:
        new.rmdir()


def test_only_folders_of_dead_owners_are_removed(tmp_path):
    tmp = Path(tempfile.gettempdir())
    alive = Path(tempfile.mkdtemp(prefix=f"workbench-rknn-{os.getppid()}-", dir=tmp))  # a running owner (pytest's)
    mine = Path(tempfile.mkdtemp(prefix=f"workbench-rknn-{os.getpid()}-", dir=tmp))
    other_kind = Path(tempfile.mkdtemp(prefix="workbench-rknn-out-", dir=tmp))  # not a pid: another kind's name
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = Path(tempfile.mkdtemp(prefix=f"workbench-rknn-{int(dead.stdout)}-", dir=tmp))
    try:
        assert gone in remove_orphaned_temporaries("workbench-rknn")
        assert not gone.exists() and alive.is_dir() and mine.is_dir() and other_kind.is_dir()
    finally:
        for d in (alive, mine, other_kind, gone):
            if d.exists():
                d.rmdir()


PARENT_HTP = """
import sys
from workbench.targets.htp import measure_htp
windows = [list(range(5 + i, 21 + i)) for i in range(40)]
measure_htp(None, sys.argv[1:3], windows, device="8gen3")
"""


def test_a_killed_htp_measurement_takes_its_spawned_child_and_resource_tracker(tmp_path):
    from workbench.targets.htp import qnn_available
    if not qnn_available():
        pytest.skip("onnxruntime-qnn is not installed")
    from workbench.targets.convert import convert
    convert("demo", "ort-qdq", tmp_path / "qdq", bits=8, evaluate_outputs=False, static=(16, 32))
    graphs = [tmp_path / "qdq" / "prefill.qdq.onnx", tmp_path / "qdq" / "decode.qdq.onnx"]
    parent = subprocess.Popen([sys.executable, "-c", PARENT_HTP, *map(str, graphs)])
    try:
        spawned = lambda: [c for c in _children(parent.pid) if "multiprocessing" in _cmdline(c)]  # noqa: E731
        assert _wait(lambda: any("spawn_main" in _cmdline(c) for c in spawned()), 120)
        kids = spawned()
        assert any("resource_tracker" in _cmdline(c) for c in kids), [_cmdline(c) for c in kids]
        ctx = [d for d in Path(tempfile.gettempdir()).glob(f"workbench-htp-ctx-{parent.pid}-*")]
        assert len(ctx) == 1
    finally:
        _kill(parent)
    assert _wait(lambda: not any(map(_running, kids)), 10), \
        f"outlived the killed parent: {[_cmdline(c) for c in kids if _running(c)]}"
    new = owned_tempdir("workbench-htp-ctx")
    try:
        assert not ctx[0].exists()
    finally:
        new.rmdir()


HUNG_ENGINE = """
import sys, time
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
conn.send(("ok", "ready", 0.0))
op, args = conn.recv()
if op == "fast":
    conn.send(("ok", args[0] * 2, 0.0))
    op, args = conn.recv()
time.sleep(3600)  # a hung engine: never answers
"""


def test_a_hung_engine_child_is_killed_after_the_timeout(tmp_path):
    from workbench.targets.processes import ChildCrashed, ChildEngine, ChildHung
    script = tmp_path / "hung_engine.py"
    script.write_text(HUNG_ENGINE)
    child = ChildEngine(script, timeout=1.5)
    assert child.call("fast", 21) == 42  # answered in time: the timeout is per request
    t = time.monotonic()
    with pytest.raises(ChildHung, match=r"no answer in 1.5 s, killed"):
        child.call("hang")
    assert time.monotonic() - t < 20
    assert child.proc.poll() is not None and not _running(child.proc.pid)
    with pytest.raises(ChildCrashed):  # the next request is refused, not sent to a dead child
        child.call("fast", 1)
    child.close()


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_a_bad_engine_timeout_setting_is_one_line(monkeypatch, value):
    from workbench.errors import WorkbenchError
    from workbench.targets.processes import ENGINE_TIMEOUT_VAR, engine_timeout
    monkeypatch.setenv(ENGINE_TIMEOUT_VAR, value)
    with pytest.raises(WorkbenchError, match=r"WORKBENCH_ENGINE_TIMEOUT must be a number of seconds above 0"):
        engine_timeout()
    monkeypatch.setenv(ENGINE_TIMEOUT_VAR, "2.5")
    assert engine_timeout() == 2.5
