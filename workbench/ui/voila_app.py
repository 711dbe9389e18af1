"""The Voila server process of the app: loopback names only, a token, pages served from this machine alone.

``python -m workbench.ui.serve`` starts this file in a fresh interpreter (``run_voila_app``); it imports nothing
from ``workbench``, so the server does not hold torch (150 MB) for its lifetime. What it adds to Voila 0.5:

- every handler, the static files included, refuses a request whose ``Host`` is not ``localhost`` or a
  loopback address (DNS rebinding: a page from elsewhere that resolves its own name to 127.0.0.1), and a
  websocket or a state-changing request whose ``Origin`` is not one of those;
- jupyter_server's own Host check is on (``allow_remote_access=False``), and Voila's token login guards the
  page, the kernels and their websockets;
- the page template ``workbench`` (``jupyter/voila/templates/``) is Voila's ``lab`` without its links to a CDN.
"""
from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from tornado.web import HTTPError
from voila.app import Voila

__all__ = ["LoopbackVoila", "loopback_only", "is_loopback_host", "is_loopback_origin", "JUPYTER_DATA", "TEMPLATE",
           "run_voila_app"]

JUPYTER_DATA = Path(__file__).resolve().with_name("jupyter")  # holds voila/templates/workbench; put on JUPYTER_PATH
TEMPLATE = "workbench"
LOCAL_HOSTNAMES = ("localhost",)  # besides any loopback address (127.0.0.0/8, ::1)
STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}


def _is_loopback_name(name: str | None) -> bool:
    if not name:
        return False
    if name in LOCAL_HOSTNAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback_host(host: str | None) -> bool:
    """Whether a Host header names this machine: ``localhost``, ``127.x.x.x`` or ``[::1]``, with any port."""
    try:
        return _is_loopback_name(urlsplit(f"//{host}").hostname) if host else False
    except ValueError:  # an unbalanced bracket
        return False


def is_loopback_origin(origin: str | None) -> bool:
    """Whether an Origin header is a page of this machine (``null``, sent by sandboxed frames, is not)."""
    try:
        parts = urlsplit(origin or "")
        return parts.scheme in ("http", "https") and _is_loopback_name(parts.hostname)
    except ValueError:
        return False


class _LoopbackOnly:
    """Mixed into every handler: the Host check, and the Origin check for websockets and state-changing requests."""

    def prepare(self, *args, **kwargs):
        request = self.request
        host = request.headers.get("Host")
        if host is not None and not is_loopback_host(host):
            self._refuse("refused a request for Host %r: the app answers only 127.0.0.1 / localhost", host)
        origin = request.headers.get("Origin")
        upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
        if origin is not None and (upgrade or request.method in STATE_CHANGING) and not is_loopback_origin(origin):
            self._refuse("refused a %s from Origin %r: only pages of this machine may use the app",
                         "websocket" if upgrade else request.method, origin)
        return super().prepare(*args, **kwargs)

    def _refuse(self, message: str, *args) -> None:
        # no user yet: a jupyter_server handler's error page reads it (as its own check_host leaves it)
        self.current_user = self._jupyter_current_user = None
        raise HTTPError(403, message, *args)


def loopback_only(handler: type) -> type:
    """``handler`` with the Host / Origin checks run before its own ``prepare``: Voila's static file handlers are
    plain tornado ones, which no jupyter_server check reaches."""
    return type(f"LoopbackOnly{handler.__name__}", (_LoopbackOnly, handler), {})


class LoopbackVoila(Voila):
    """Voila with jupyter_server's Host check on and every handler behind ``loopback_only``."""

    def init_settings(self):
        settings = super().init_settings()
        settings.update(allow_remote_access=False, local_hostnames=list(LOCAL_HOSTNAMES))
        return settings

    def init_handlers(self):
        return [(spec[0], loopback_only(spec[1]), *spec[2:]) for spec in super().init_handlers()]


def run_voila_app(argv: list[str]) -> None:
    """Run the server with Voila's command line ``argv`` plus what is not negotiable: 127.0.0.1, a token generated
    now (the URL that carries it is printed), the ``workbench`` template (found on JUPYTER_PATH), no browser."""
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (str(JUPYTER_DATA), os.environ.get("JUPYTER_PATH")) if p)
    LoopbackVoila.launch_instance([*argv, "--Voila.ip=127.0.0.1", "--token", f"--template={TEMPLATE}",
                                   "--no-browser"])


if __name__ == "__main__":
    run_voila_app(sys.argv[1:])
