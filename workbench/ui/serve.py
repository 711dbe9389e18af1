"""Serve the click-through app (``notebooks/app.ipynb``) with Voila, on 127.0.0.1 only.

    python -m workbench.ui.serve [--port 8866] [--notebook notebooks/app.ipynb]

``make voila`` runs this. Voila executes the notebook in a fresh kernel for each visitor and shows
only its widgets; the server and its kernels listen on the loopback address alone. The workspace
(``$WORKBENCH_WORKSPACE``, default ``./workspace`` where this is started) is passed on as an
absolute path, so the app's outputs land there and not beside the notebook.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from ..offline import apply_offline_env

__all__ = ["voila_command", "app_environment", "DEFAULT_APP_NOTEBOOK", "DEFAULT_PORT"]

DEFAULT_APP_NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "app.ipynb"
DEFAULT_PORT = 8866


def voila_command(notebook: str | Path = DEFAULT_APP_NOTEBOOK, port: int = DEFAULT_PORT) -> list[str]:
    """The Voila command line: loopback only, no browser."""
    exe = shutil.which("voila", path=str(Path(sys.executable).parent)) or shutil.which("voila")
    if exe is None:
        raise SystemExit("voila is not installed: run `make install` (or pip install -c constraints.txt voila)")
    return [exe, str(notebook), "--Voila.ip=127.0.0.1", f"--port={port}", "--no-browser"]


def app_environment(environ: dict | None = None, cwd: str | Path | None = None) -> dict:
    """The server's environment: offline settings (``OFFLINE_ENV``) and ``WORKBENCH_WORKSPACE`` made absolute."""
    env = apply_offline_env(dict(os.environ if environ is None else environ))  # the kernels inherit it
    ws = Path(env.get("WORKBENCH_WORKSPACE") or "workspace").expanduser()
    env["WORKBENCH_WORKSPACE"] = str(ws if ws.is_absolute() else Path(cwd or Path.cwd()) / ws)
    return env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--notebook", default=str(DEFAULT_APP_NOTEBOOK))
    args = ap.parse_args(argv)
    notebook = Path(args.notebook).resolve()
    if not notebook.is_file():
        raise SystemExit(f"no app notebook at '{args.notebook}'")
    cmd = voila_command(notebook, args.port)
    env = app_environment()
    os.chdir(notebook.parent)  # the kernels start beside the notebook; outputs go to the workspace
    os.execve(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
