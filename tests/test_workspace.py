import json
import os
import signal
import subprocess
import sys

import pytest

from workbench.errors import WorkspaceError
from workbench.files.workspace import Workspace, atomic_write_text, hash_inputs, output_lock, staged_output


def test_get_or_compute_caches_on_inputs(workspace):
    calls = []

    def compute(d):
        calls.append(d)
        (d / "payload.txt").write_text("hello")
        return {"answer": 42}

    a = workspace.get_or_compute("step", {"x": 1, "y": [1, 2]}, compute)
    b = workspace.get_or_compute("step", {"y": [1, 2], "x": 1}, compute)
    assert len(calls) == 1 and a.key == b.key and a.path == b.path
    assert a.result == {"answer": 42}
    m = json.loads((a.path / "manifest.json").read_text())
    assert m["files"]["payload.txt"]["size"] == 5 and len(m["files"]["payload.txt"]["sha256"]) == 64
    assert m["inputs"] == {"x": 1, "y": [1, 2]} and "torch" in m["versions"] and m["created"]
    c = workspace.get_or_compute("step", {"x": 2, "y": [1, 2]}, compute)
    assert len(calls) == 2 and c.key != a.key


def test_killed_step_leaves_no_complete_artifact_and_resumes(workspace):
    inputs = {"n": 3}

    def crashing(d):
        (d / "progress.json").write_text('{"done": 1}')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        workspace.get_or_compute("sweep", inputs, crashing)
    assert workspace.find("sweep", inputs) is None
    assert workspace.list("sweep") == []

    seen = {}

    def resuming(d):
        seen["progress"] = json.loads((d / "progress.json").read_text())
        return {}

    art = workspace.get_or_compute("sweep", inputs, resuming)
    assert seen["progress"] == {"done": 1}
    assert workspace.find("sweep", inputs).path == art.path
    assert not workspace.partial_path("sweep", art.key).exists()


def test_verify_detects_changed_file(workspace):
    art = workspace.get_or_compute("s", {"a": 1}, lambda d: (d / "f.bin").write_bytes(b"abc") and None)
    art.verify()
    (art.path / "f.bin").write_bytes(b"abd")
    with pytest.raises(WorkspaceError, match="missing or changed"):
        art.verify()
    with pytest.raises(WorkspaceError, match="no file 'other'"):
        art.file("other")


def test_upstream_keys_recorded(workspace):
    up = workspace.get_or_compute("calibrate", {"m": 1}, lambda d: None)
    down = workspace.get_or_compute("quantize", {"m": 1, "calib": up.key}, lambda d: None, upstream=[up])
    assert down.manifest["upstream"] == [up.key]


def test_atomic_write_leaves_no_temp_files(tmp_path):
    p = atomic_write_text(tmp_path / "sub" / "a.txt", "x")
    assert p.read_text() == "x"
    assert [f.name for f in p.parent.iterdir()] == ["a.txt"]


def test_hash_inputs_stable():
    assert hash_inputs({"a": 1, "b": 2}) == hash_inputs({"b": 2, "a": 1})
    assert hash_inputs({"a": 1}) != hash_inputs({"a": 2})


# -- output directories -------------------------------------------------------------------------

def test_staged_output_writes_new_and_replaces_only_its_own_kind(tmp_path):
    from workbench.files.workspace import check_output_dir, staged_output
    out = tmp_path / "o"
    with staged_output(out, "workbench-test") as d:
        assert d.parent == tmp_path and d.name.startswith(".o.partial-") and not out.exists()
        (d / "sub").mkdir()
        (d / "sub" / "a.bin").write_bytes(b"1")
    assert (out / "sub" / "a.bin").read_bytes() == b"1" and (out / "manifest.json").is_file()
    with staged_output(out, "workbench-test") as d:
        (d / "b.bin").write_bytes(b"2")
    assert sorted(p.name for p in out.iterdir()) == ["b.bin", "manifest.json"]
    with pytest.raises(WorkspaceError, match=r"holds a workbench-test's output, not a workbench-other one"):
        check_output_dir(out, "workbench-other")
    (tmp_path / "f").write_text("x")
    with pytest.raises(WorkspaceError, match=r"--out '.*f' is a file"):
        check_output_dir(tmp_path / "f", "workbench-test")
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty", "workbench-test") == tmp_path / "empty"


def test_staged_output_failure_keeps_the_earlier_output(tmp_path):
    from workbench.files.workspace import staged_output
    out = tmp_path / "o"
    with staged_output(out, "workbench-test") as d:
        (d / "a").write_text("old")
    with pytest.raises(RuntimeError), staged_output(out, "workbench-test") as d:
        (d / "a").write_text("new")
        raise RuntimeError("step failed")
    assert (out / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_staged_output_refuses_files_added_while_it_ran(tmp_path):
    from workbench.files.workspace import staged_output
    out = tmp_path / "o"
    with pytest.raises(WorkspaceError, match="no workbench manifest"), staged_output(out, "workbench-test") as d:
        (d / "a").write_text("new")
        out.mkdir()
        (out / "mine.txt").write_text("x")
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_what_a_killed_run_staged_is_removed_by_the_next_run(tmp_path):
    import subprocess
    import sys

    from workbench.files.workspace import staged_output
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".o.partial-{int(dead.stdout)}-abc"
    (stale / "weights").mkdir(parents=True)
    alive = tmp_path / f".o.partial-{os.getppid()}-def"  # a process that is running
    alive.mkdir()
    with staged_output(tmp_path / "o", "workbench-test") as d:
        (d / "a").write_text("x")
    assert not stale.exists() and alive.exists() and (tmp_path / "o" / "a").is_file()


# ---------------------------------------------------------------- one writer per output, links

def _env():
    return {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _holder(code: str) -> subprocess.Popen:
    """A second real process that takes a lock, says 'held' and waits."""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env())
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_writer_of_one_out_is_refused_in_one_line_and_a_killed_one_leaves_no_lock(tmp_path):
    out = tmp_path / "q"
    holder = _holder(f"import time; from workbench.files.workspace import output_lock\n"
                     f"with output_lock({str(out)!r}):\n    print('held', flush=True); time.sleep(60)")
    try:
        done = subprocess.run([sys.executable, "-m", "workbench", "quantize", "demo", "--bits", "8", "--out", str(out)],
                              capture_output=True, text=True, env=_env(), timeout=120)
        assert done.returncode == 2 and done.stdout == ""
        err = [line for line in done.stderr.splitlines() if "mxfp8" not in line]
        assert err == [f"workbench quantize: error: --out '{out}' is being written by another workbench run "
                       f"(process {holder.pid}); wait for it to finish, or choose another --out"], done.stderr
        assert not out.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with output_lock(out):  # the kernel dropped the killed holder's lock
        with output_lock(out):  # and one process may nest it
            pass


def test_a_second_run_of_one_workspace_step_is_refused(tmp_path):
    ws = tmp_path / "ws"
    holder = _holder("import time; from workbench.files.workspace import Workspace\n"
                     f"Workspace({str(ws)!r}).get_or_compute('calibrate', {{'a': 1}}, "
                     "lambda d: (print('held', flush=True), time.sleep(60)) and None)")
    try:
        with pytest.raises(WorkspaceError, match=rf"another workbench run \(process {holder.pid}\) is computing this "
                                                 "calibrate result"):
            Workspace(ws).get_or_compute("calibrate", {"a": 1}, lambda d: None)
        Workspace(ws).get_or_compute("calibrate", {"a": 2}, lambda d: None)  # another key is not held
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    art = Workspace(ws).get_or_compute("calibrate", {"a": 1}, lambda d: {"ok": 1})
    assert art.manifest["result"] == {"ok": 1}


def test_an_unwritable_workspace_names_the_setting(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(WorkspaceError, match=r"workspace '.*file' cannot be used .*set WORKBENCH_WORKSPACE"):
        Workspace(f).get_or_compute("calibrate", {"a": 1}, lambda d: None)


@pytest.mark.parametrize("earlier", [False, True])
def test_a_symlinked_out_replaces_its_target_and_leaves_no_old_entries(tmp_path, earlier):
    target = tmp_path / "real"
    target.mkdir()
    if earlier:
        with staged_output(target, "kind-x") as d:
            (d / "a.txt").write_text("first")
    link = tmp_path / "link"
    link.symlink_to(target)
    with staged_output(link, "kind-x") as d:
        (d / "b.txt").write_text("second")
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert (target / "b.txt").read_text() == "second" and not (target / "a.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_a_failed_step_leaves_no_empty_parent(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with staged_output(out, "kind-x"):
            raise RuntimeError("the step failed")
    assert list(tmp_path.iterdir()) == []


def test_outputs_follow_the_umask_whoever_wrote_them(tmp_path):
    import stat

    import torch
    from safetensors.torch import save_file
    old = os.umask(0o027)
    try:
        with staged_output(tmp_path / "out", "kind-x") as d:
            save_file({"a": torch.zeros(2)}, d / "model.safetensors")  # safetensors writes 0600
            (d / "sub").mkdir(mode=0o700)
            (d / "sub" / "run.sh").write_text("#!/bin/sh\n")
            os.chmod(d / "sub" / "run.sh", 0o700)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    out = tmp_path / "out"
    assert (mode(out), mode(out / "sub"), mode(out / "model.safetensors"), mode(out / "sub" / "run.sh")) == \
        (0o750, 0o750, 0o640, 0o750)
