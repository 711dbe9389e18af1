"""The app served by Voila: it listens on 127.0.0.1 only and its page carries the app's widgets."""
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from workbench.ui.serve import DEFAULT_APP_NOTEBOOK, voila_command
from conftest import stop_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listeners(port: int) -> set[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_voila_serves_the_app_on_loopback_only(tmp_path):
    port = _free_port()
    try:
        cmd = voila_command(DEFAULT_APP_NOTEBOOK, port)
    except SystemExit as e:
        pytest.skip(str(e))
    proc = subprocess.Popen(cmd, cwd=DEFAULT_APP_NOTEBOOK.parent, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "voila.log", "w"))
    try:
        deadline = time.time() + 90
        while not _listeners(port):
            assert proc.poll() is None, (tmp_path / "voila.log").read_text()[-2000:]
            assert time.time() < deadline, "voila did not start listening in 90 s"
            time.sleep(0.5)
        assert _listeners(port) == {"0100007F"}  # 127.0.0.1, and nothing else (no 0.0.0.0, no ::)
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=180).read().decode()
        assert "application/vnd.jupyter.widget-view+json" in page  # the notebook ran and left its widgets
        assert "Choose per-layer INT4 / INT8 / FP16" in page
    finally:
        stop_process(proc, 20)


def test_workspace_is_passed_on_as_an_absolute_path(tmp_path):
    """The kernels start beside the notebook: a relative workspace would put the app's outputs there."""
    from workbench.ui.serve import app_environment
    assert app_environment({}, cwd=tmp_path)["WORKBENCH_WORKSPACE"] == str(tmp_path / "workspace")
    assert app_environment({"WORKBENCH_WORKSPACE": "ws"}, cwd=tmp_path)["WORKBENCH_WORKSPACE"] == str(tmp_path / "ws")
    assert app_environment({"WORKBENCH_WORKSPACE": "/abs/ws"}, cwd=tmp_path)["WORKBENCH_WORKSPACE"] == "/abs/ws"
