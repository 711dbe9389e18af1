"""No packet leaves the machine: convert + profile + generate of the demo model, and the app server's start,
traced for every connect/sendto (strace -f: onnxruntime's telemetry is native code) and under a Python
socket audit hook; any attempt to reach a non-loopback address, or any DNS query, fails the test."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from workbench.offline import OFFLINE_ENV, apply_offline_env

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

SCRIPT = r'''
import ipaddress, sys, time
t0 = time.time()
bad = []
LOCAL = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "")

def hook(event, args):
    if event == "socket.getaddrinfo" and str(args[0]) not in LOCAL:
        bad.append(f"getaddrinfo {args[0]!r}")
    elif event in ("socket.connect", "socket.sendto", "socket.sendmsg") and isinstance(args[-1], tuple):
        host = str(args[-1][0])
        try:
            local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = host in LOCAL
        if not local:
            bad.append(f"{event} {args[-1]!r}")

sys.addaudithook(hook)
from workbench.cli import main
out = sys.argv[1]
assert main(["convert", "demo", "--target", "ort-int4", "--bits", "4", "--out", out, "--max-tokens", "256", "--json"]) == 0
assert main(["profile", out, "--repeats", "1", "--decode-steps", "4", "--prompt-lengths", "8", "--json"]) == 0
assert main(["generate", out, "--prompt", "Hello", "--max-new-tokens", "8"]) == 0
time.sleep(max(0.0, float(sys.argv[2]) - (time.time() - t0)))  # onnxruntime's telemetry fires ~20 s in
print("AUDIT", bad, flush=True)
sys.exit(3 if bad else 0)
'''

_ADDR = re.compile(r'sa_family=(AF_INET6?)[^}]*?(?:sin6?_port=htons\((\d+)\))[^}]*?'
                   r'(?:inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)")')


def outside_calls(trace: str) -> list[str]:
    """strace lines that reach a non-loopback address, or anything on port 53 (a DNS query, to any resolver)."""
    import ipaddress
    found = []
    for line in trace.splitlines():
        if not re.search(r"\b(connect|sendto|sendmsg|sendmmsg)\(", line):
            continue
        for family, port, v4, v6 in _ADDR.findall(line):
            addr = ipaddress.ip_address(v4 or v6)
            if port == "53" or not addr.is_loopback:
                found.append(line.strip())
    return found


def test_the_trace_parser_sees_an_outside_address():
    assert outside_calls('9 connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("127.0.0.11")}, 16)')
    assert outside_calls('9 sendto(3, "x", 1, 0, {sa_family=AF_INET, sin_port=htons(443), '
                         'sin_addr=inet_addr("10.0.0.1")}, 16) = 1')
    assert not outside_calls('9 connect(5, {sa_family=AF_INET, sin_port=htons(8866), sin_addr=inet_addr("127.0.0.1")}, '
                             '16) = 0')
    assert not outside_calls('9 connect(5, {sa_family=AF_UNIX, sun_path="/run/x"}, 110) = 0')


def test_offline_settings_are_applied_without_overriding_the_user():
    env = apply_offline_env({"HF_HUB_OFFLINE": "0"})
    assert env["ORT_DISABLE_TELEMETRY"] == "1" and env["HF_HUB_OFFLINE"] == "0"
    assert all(os.environ.get(k) for k in OFFLINE_ENV)  # importing workbench set them
    from workbench.ui.serve import app_environment
    assert all(app_environment({})[k] == v for k, v in OFFLINE_ENV.items())  # the app's kernels get them


def _clean_env() -> dict:
    """This test process's environment without the offline settings: the child must set them itself."""
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
def test_convert_profile_generate_send_nothing_outside(tmp_path):
    trace = tmp_path / "trace.txt"
    done = subprocess.run(["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg,sendmmsg", "-o", str(trace),
                           sys.executable, "-c", SCRIPT, str(tmp_path / "conv"), "32"],
                          capture_output=True, text=True, env=_clean_env(), timeout=600)
    assert done.returncode in (0, 3), done.stderr[-3000:]
    audit = [line for line in done.stdout.splitlines() if line.startswith("AUDIT")]
    assert audit == ["AUDIT []"], audit
    assert outside_calls(trace.read_text()) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_app_server_start_sends_nothing_outside(tmp_path):
    pytest.importorskip("voila")
    port = _free_port()
    trace = tmp_path / "trace.txt"
    server = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg,sendmmsg", "-o", str(trace),
                               sys.executable, "-m", "workbench.ui.serve", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_clean_env(),
                              start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        else:
            pytest.fail("the app server did not start listening within 120 s")
        time.sleep(10)  # what a server does once started (update checks, announcements) happens here
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # strace, voila and anything it started: their own process group
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert outside_calls(trace.read_text()) == []
