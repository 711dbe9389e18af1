"""Serve the click-through app (``notebooks/app.ipynb``) with Voila, on 127.0.0.1 only, behind a token.

    python -m workbench.ui.serve [--port 8866] [--notebook notebooks/app.ipynb]    (--help: kernel culling)

``make voila`` runs this. Voila executes the notebook in a fresh kernel for each visitor and shows only its
widgets. The server listens on the loopback address alone, answers only requests addressed to ``127.0.0.1``,
``localhost`` or ``[::1]`` (and websockets from pages of those), and asks for the token in the URL it prints
at start (``http://127.0.0.1:8866/?token=...``), as JupyterLab does: neither another user of this machine
nor a web page can drive a kernel. A kernel whose page has gone (no websocket open) and that has done nothing
for a minute is shut down at the next check, every 30 s (both settable); a page left open keeps its kernel
however long it idles. The workspace (``$WORKBENCH_WORKSPACE``, default ``./workspace`` where this is
started) is passed on as an absolute path, so the app's outputs land there and not beside the notebook.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from ..cli.common import count
from ..errors import WorkbenchError
from ..offline import apply_offline_env

__all__ = ["voila_command", "app_environment", "AppServerError", "DEFAULT_APP_NOTEBOOK", "DEFAULT_PORT",
           "DEFAULT_CULL_IDLE_TIMEOUT", "DEFAULT_CULL_INTERVAL"]

DEFAULT_APP_NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "app.ipynb"
DEFAULT_PORT = 8866
# a closed page's kernel (about 500 MB with the demo model loaded) goes within 60-90 s of its last activity
DEFAULT_CULL_IDLE_TIMEOUT = 60
DEFAULT_CULL_INTERVAL = 30
VOILA_APP = Path(__file__).resolve().with_name("voila_app.py")
# run voila_app.py as the main script without importing the workbench package (and torch) into the server
_RUN_FILE = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"


class AppServerError(WorkbenchError):
    """The app server cannot start as asked: Voila missing, or no notebook where one was named."""


def voila_command(notebook: str | Path = DEFAULT_APP_NOTEBOOK, port: int = DEFAULT_PORT,
                  cull_idle_timeout: int = DEFAULT_CULL_IDLE_TIMEOUT,
                  cull_interval: int = DEFAULT_CULL_INTERVAL) -> list[str]:
    """The server's command line: ``voila_app.py`` (loopback, token, local assets) in a fresh interpreter."""
    if importlib.util.find_spec("voila") is None:
        raise AppServerError("voila is not installed: run `make install` (or pip install -c constraints.txt voila)")
    return [sys.executable, "-c", _RUN_FILE, str(VOILA_APP), str(notebook), f"--port={port}",
            f"--MappingKernelManager.cull_idle_timeout={cull_idle_timeout}",
            f"--MappingKernelManager.cull_interval={cull_interval}",
            "--MappingKernelManager.cull_connected=False", "--MappingKernelManager.cull_busy=False"]


def app_environment(environ: dict | None = None, cwd: str | Path | None = None) -> dict:
    """The server's environment: offline settings (``OFFLINE_ENV``) and ``WORKBENCH_WORKSPACE`` made absolute."""
    env = apply_offline_env(dict(os.environ if environ is None else environ))  # the kernels inherit it
    ws = Path(env.get("WORKBENCH_WORKSPACE") or "workspace").expanduser()
    env["WORKBENCH_WORKSPACE"] = str(ws if ws.is_absolute() else Path(cwd or Path.cwd()) / ws)
    return env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=count(1), default=DEFAULT_PORT)
    ap.add_argument("--notebook", default=str(DEFAULT_APP_NOTEBOOK))
    ap.add_argument("--cull-idle-timeout", type=count(1), default=DEFAULT_CULL_IDLE_TIMEOUT, metavar="SECONDS",
                    help="shut down a kernel with no page open after this long without activity (%(default)s)")
    ap.add_argument("--cull-interval", type=count(1), default=DEFAULT_CULL_INTERVAL, metavar="SECONDS",
                    help="how often to look for such kernels (%(default)s)")
    args = ap.parse_args(argv)
    notebook = Path(args.notebook).resolve()
    try:
        if not notebook.is_file():
            raise AppServerError(f"no app notebook at '{args.notebook}': pass --notebook with the path of an .ipynb")
        cmd = voila_command(notebook, args.port, args.cull_idle_timeout, args.cull_interval)
    except AppServerError as e:
        raise SystemExit(f"workbench.ui.serve: error: {e}") from None
    env = app_environment()
    os.chdir(notebook.parent)  # the kernels start beside the notebook; outputs go to the workspace
    os.execve(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
