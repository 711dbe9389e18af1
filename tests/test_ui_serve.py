"""The app served by Voila: on 127.0.0.1 only, behind the token it prints, for loopback Hosts and Origins only,
its page loading nothing from elsewhere, and the kernel of a page that went away shut down."""
from __future__ import annotations

import base64
import http.client
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import stop_process

needs_voila = pytest.mark.skipif(importlib.util.find_spec("voila") is None, reason="voila is not installed: make install")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ROOT = Path(__file__).resolve().parents[1]
URL_LINE = re.compile(r"http://127\.0\.0\.1:(\d+)/\?token=([0-9a-f]{32,})")
EVIL = "evil.example.com"


def served(test):
    """A test against a running app server: needs voila, and reads /proc."""
    return needs_voila(linux_only(test))


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


class Server:
    """``python -m workbench.ui.serve`` on a free port; the URL, port and token read from what it prints."""

    def __init__(self, tmp: Path, *options: str):
        self.log = tmp / "voila.log"
        env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_TOKEN", "JUPYTER_TOKEN_FILE")}
        env["WORKBENCH_WORKSPACE"] = str(tmp / "workspace")
        self.proc = subprocess.Popen([sys.executable, "-m", "workbench.ui.serve", "--port", str(_free_port()),
                                      *options], cwd=ROOT, env=env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 120
        while not (found := URL_LINE.search(self.log.read_text())):
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.time() < deadline, "the app server printed no URL with a token within 120 s"
            time.sleep(0.5)
        self.url, self.port, self.token = found.group(0), int(found.group(1)), found.group(2)

    def request(self, path: str, method: str = "GET", headers: dict | None = None, timeout: float = 300):
        """(status, headers, body) of one request, redirects not followed; ``headers`` may replace Host."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, headers=headers or {})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read().decode(errors="replace")
        finally:
            conn.close()

    def page(self) -> tuple[str, str]:
        """The app's page with the token, and the id of the kernel it started."""
        status, _, body = self.request(f"/?token={self.token}")
        assert status == 200, body[-2000:]
        return body, re.search(r'"kernelId": "([0-9a-f-]{36})"', body).group(1)

    def websocket(self, kernel_id: str, host: str | None = None, origin: str | None = None):
        """Open the kernel's websocket as a browser would; (status, connection: open while it lasts)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Host": host or f"127.0.0.1:{self.port}", "Upgrade": "websocket", "Connection": "Upgrade",
                   "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(), "Sec-WebSocket-Version": "13"}
        if origin is not None:
            headers["Origin"] = origin
        conn.request("GET", f"/api/kernels/{kernel_id}/channels?token={self.token}", headers=headers)
        return conn.getresponse().status, conn

    def kernel_alive(self, kernel_id: str) -> bool:
        """The server lists the kernel, and its process runs (its command line names its connection file)."""
        status, _, _ = self.request(f"/api/kernels/{kernel_id}?token={self.token}")
        assert status in (200, 404), status
        return status == 200 and _kernel_process(kernel_id)

    def stop(self) -> None:
        stop_process(self.proc, 30)


def _kernel_process(kernel_id: str) -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if f"kernel-{kernel_id}.json".encode() in cmdline.read_bytes():
                return True
        except OSError:
            continue
    return False


def _wait(condition, timeout: float, step: float = 0.5) -> float | None:
    """Seconds until ``condition()`` held, or None if it did not within ``timeout``."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if condition():
            return time.time() - t0
        time.sleep(step)
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the checks below; its culling is slow enough that no check races it."""
    s = Server(tmp_path_factory.mktemp("serve"), "--cull-idle-timeout", "900")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def app_page(server):
    return server.page()


@served
def test_voila_serves_the_app_on_loopback_only(server, app_page):
    assert _listeners(server.port) == {"0100007F"}  # 127.0.0.1, and nothing else (no 0.0.0.0, no ::)
    page, _ = app_page
    assert "application/vnd.jupyter.widget-view+json" in page  # the notebook ran and left its widgets
    # the app's own words are checked on its widgets (test_ui_app.py::test_the_intro_sentence_is_said_once): the
    # served HTML no longer carries the widgets' state inline since the app grew its vision-language panels


@served
def test_the_page_links_nothing_from_another_host(app_page):
    """Voila's stock lab page links Font Awesome from a CDN; the workbench template serves it from Voila's bundle."""
    page, _ = app_page
    fetched = re.findall(r"<(?:link|script)\b[^>]*\b(?:href|src)\s*=\s*[\"']([^\"']+)", page)
    assert fetched, "the page names no stylesheet or script at all: the pattern above is stale"
    assert [u for u in fetched if re.match(r"(?i)^(?:[a-z]+:)?//", u) and "127.0.0.1" not in u] == []
    assert "cdn.jsdelivr.net" not in page and "cdnjs.cloudflare.com" not in page


@served
def test_the_printed_url_is_the_only_way_in(server, app_page):
    _, kernel_id = app_page
    for path in ("/", "/?token=0123456789abcdef0123456789abcdef0123456789abcdef"):
        status, headers, body = server.request(path)
        assert status == 302 and headers["Location"].startswith("/login?"), (path, status)  # to the token form
        assert "widget-view+json" not in body
    status, _, body = server.request("/login")
    assert status == 200 and "token" in body.lower()  # where a token can be typed in
    for api in (f"/api/kernels/{kernel_id}", f"/api/kernels/{kernel_id}?token=wrong"):
        assert server.request(api)[0] == 403
    assert server.request(f"/api/kernels/{kernel_id}?token={server.token}")[0] == 200


@pytest.mark.parametrize("host", [EVIL, f"{EVIL}:{{port}}", "127.0.0.1.evil.example.com", "localhost.evil.example.com",
                                  "10.0.0.1:{port}", "[::ffff:10.0.0.1]:{port}"])
@served
def test_a_request_for_another_host_is_refused(server, app_page, host):
    """DNS rebinding: a page of another site whose name resolves to 127.0.0.1 sends its own name as Host."""
    host, kernel_id = host.format(port=server.port), app_page[1]
    for path in (f"/?token={server.token}", "/voila/static/voila.js", "/voila/templates/lab/static/voila.js",
                 "/voila/labextensions/@voila-dashboards/widgets-manager8/package.json", "/login",
                 f"/api/kernels/{kernel_id}?token={server.token}"):
        status, _, body = server.request(path, headers={"Host": host})
        assert status == 403, (host, path, status)
        assert "widget-view+json" not in body


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "127.0.0.2:{port}",
                                  "localhost"])
@served
def test_loopback_names_are_served(server, app_page, host):
    """The same requests as above with this machine's names: served (the check refuses by name, not always)."""
    host, kernel_id = host.format(port=server.port), app_page[1]
    for path in ("/voila/static/voila.js", "/voila/templates/lab/static/voila.js",
                 "/voila/labextensions/@voila-dashboards/widgets-manager8/package.json", "/login",
                 f"/api/kernels/{kernel_id}?token={server.token}"):
        status, _, body = server.request(path, headers={"Host": host})
        assert status == 200 and body, (host, path, status)


@served
def test_a_websocket_from_another_origin_is_refused(server, app_page):
    _, kernel_id = app_page
    here = f"http://127.0.0.1:{server.port}"
    for host, origin in [(None, f"http://{EVIL}"), (None, "null"), (f"{EVIL}:{server.port}", f"http://{EVIL}:{server.port}"),
                         (EVIL, f"http://{EVIL}"), (None, f"http://localhost.{EVIL}:{server.port}")]:
        status, conn = server.websocket(kernel_id, host=host, origin=origin)
        conn.close()
        assert status == 403, (host, origin, status)
    status, conn = server.websocket(kernel_id, origin=here)  # the page's own websocket
    conn.close()
    assert status == 101
    # a state-changing request from another origin: refused, and the kernel lives on
    status, _, _ = server.request(f"/voila/api/shutdown/{kernel_id}?token={server.token}", method="POST",
                                  headers={"Origin": f"http://{EVIL}"})
    assert status == 403 and server.kernel_alive(kernel_id)


@served
def test_the_kernel_of_a_closed_page_is_culled_and_an_open_page_keeps_its(tmp_path):
    timeout, interval = 4, 1
    s = Server(tmp_path, "--cull-idle-timeout", str(timeout), "--cull-interval", str(interval))
    try:
        _, gone = s.page()  # the page is read and its tab closed: no websocket ever opens
        _, kept = s.page()
        status, ws = s.websocket(kept, origin=f"http://127.0.0.1:{s.port}")  # this page stays open
        assert status == 101
        opened = time.time()
        culled_after = _wait(lambda: not s.kernel_alive(gone), 60)
        assert culled_after is not None, "the kernel of the closed page still runs a minute on"
        time.sleep(max(0.0, opened + 3 * (timeout + interval) - time.time()))
        assert s.kernel_alive(kept), "the open page's kernel was culled"
        ws.close()  # the tab closes
        closed_for = _wait(lambda: not s.kernel_alive(kept), 60)
        assert closed_for is not None and closed_for < timeout + 3 * interval + 15, closed_for
        log = s.log.read_text()
        assert f"Culling 'idle' kernel 'python3' ({gone})" in log and f"({kept}) with 0 connections" in log
        print(f"culled {closed_for:.1f} s after its page closed (idle timeout {timeout} s, checks every {interval} s)")
    finally:
        s.stop()


@needs_voila
def test_make_voila_culls_closed_pages_within_two_minutes():
    """The defaults ``make voila`` runs with: closed pages' kernels go within 60-90 s, open pages are never culled."""
    from workbench.ui.serve import DEFAULT_CULL_IDLE_TIMEOUT, DEFAULT_CULL_INTERVAL, voila_command
    cmd = voila_command(port=1234)
    assert f"--MappingKernelManager.cull_idle_timeout={DEFAULT_CULL_IDLE_TIMEOUT}" in cmd
    assert f"--MappingKernelManager.cull_interval={DEFAULT_CULL_INTERVAL}" in cmd
    assert "--MappingKernelManager.cull_connected=False" in cmd
    assert DEFAULT_CULL_IDLE_TIMEOUT + DEFAULT_CULL_INTERVAL <= 120


@needs_voila
def test_host_and_origin_names():
    from workbench.ui.voila_app import is_loopback_host, is_loopback_origin
    for ok in ("127.0.0.1", "127.0.0.1:8866", "localhost:8866", "LOCALHOST", "[::1]:8866", "[::1]", "127.1.2.3:80"):
        assert is_loopback_host(ok), ok
    for bad in ("evil.example.com", "evil.example.com:8866", "127.0.0.1.nip.io", "localhost.evil.example.com",
                "0.0.0.0:8866", "[::]:8866", "10.0.0.1", "[::1", "", None, "::1"):
        assert not is_loopback_host(bad), bad
    assert is_loopback_origin("http://127.0.0.1:8866") and is_loopback_origin("http://localhost:1")
    for bad in ("null", "http://evil.example.com", "file://", "chrome-extension://abc", "127.0.0.1:8866", None):
        assert not is_loopback_origin(bad), bad


def test_workspace_is_passed_on_as_an_absolute_path(tmp_path):
    """The kernels start beside the notebook: a relative workspace would put the app's outputs there."""
    from workbench.ui.serve import app_environment
    assert app_environment({}, cwd=tmp_path)["WORKBENCH_WORKSPACE"] == str(tmp_path / "workspace")
    assert app_environment({"WORKBENCH_WORKSPACE": "ws"}, cwd=tmp_path)["WORKBENCH_WORKSPACE"] == str(tmp_path / "ws")
    assert app_environment({"WORKBENCH_WORKSPACE": "/abs/ws"}, cwd=tmp_path)["WORKBENCH_WORKSPACE"] == "/abs/ws"


def _make_app_lab_options() -> list[str]:
    """The JupyterLab options on ``make app``'s recipe line, as make would pass them."""
    recipe = re.search(r"^app:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    words = shlex.split(recipe.replace("\\\n", " "))
    return [w for w in words if w.startswith("--LabApp.")]


@linux_only
@pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None, reason="jupyterlab is not installed: make install")
def test_make_app_turns_jupyterlab_news_off(tmp_path):
    """JupyterLab asks on first open whether to fetch its news feed; ``make app`` answers no for the user."""
    options = _make_app_lab_options()
    assert "--LabApp.news_url=None" in options
    port, token = _free_port(), "t" + os.urandom(12).hex()
    env = {**os.environ, "JUPYTER_TOKEN": token, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}
    lab = subprocess.Popen([str(Path(sys.executable).with_name("jupyter")), "lab", str(tmp_path), "--no-browser",
                            "--ServerApp.ip=127.0.0.1", f"--port={port}", "--allow-root", *options],
                           env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "lab.log", "w"),
                           start_new_session=True)
    try:
        assert _wait(lambda: bool(_listeners(port)) or lab.poll() is not None, 120) is not None, "JupyterLab did not start"
        assert lab.poll() is None, (tmp_path / "lab.log").read_text()[-2000:]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", f"/lab?token={token}")
        page = conn.getresponse().read().decode()
        config = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                      page, re.S).group(1))
        assert config["news"] == {"disabled": True}  # the page neither asks nor fetches
        conn.request("GET", "/lab/api/news", headers={"Authorization": f"token {token}"})
        assert json.loads(conn.getresponse().read())["news"] == []
    finally:
        stop_process(lab, 20)
