"""Toolkit child processes and temporary folders that do not outlive a killed run.

    subprocess.run(cmd, preexec_fn=die_with_parent_fn())      # a child the kernel kills with its parent
    def child_main(...): die_with_parent(parent_pid); ...      # the same, first thing in a multiprocessing child
    with owned_temporary("workbench-rknn") as work: ...         # /tmp/workbench-rknn-<pid>-xxxx, removed on exit

A vendor toolkit runs in a child (rknn-toolkit2 in its own venv, the HTP emulator in a spawned process):
killed by SIGKILL or SIGTERM, the parent runs no cleanup, so the child would go on computing for minutes
and its temporary folder (hundreds of MB for rknn) would stay. On Linux each child asks the kernel to
SIGKILL it when its parent exits (``PR_SET_PDEATHSIG``); temporary folders carry their owner's process id,
and the next run removes those whose owner is gone.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import shutil
import signal
import tempfile
from pathlib import Path

__all__ = ["die_with_parent", "die_with_parent_fn", "process_alive", "remove_orphaned_temporaries",
           "owned_tempdir", "owned_temporary"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl():
    """libc's ``prctl``, or None off Linux; looked up before a fork, so the child only calls it."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent_pid: int | None = None, prctl=None) -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux; elsewhere nothing happens).

    With ``parent_pid``, exit at once when the parent is already gone: it died before this call.
    """
    prctl = prctl or _prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def die_with_parent_fn():
    """A ``preexec_fn`` for ``subprocess``: the child dies with this process (the setting survives the exec)."""
    parent, prctl = os.getpid(), _prctl()
    return lambda: die_with_parent(parent, prctl)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_orphaned_temporaries(kind: str) -> list[Path]:
    """Remove ``<tmp>/<kind>-<pid>-*`` folders whose process is gone (a killed run's); returns those removed."""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(f"{glob.escape(kind)}-*-*"):
        pid = d.name[len(kind) + 1:].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)) or not d.is_dir():
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def owned_tempdir(kind: str) -> Path:
    """A new ``<tmp>/<kind>-<this pid>-xxxx`` folder, after removing the ones killed runs of ``kind`` left."""
    remove_orphaned_temporaries(kind)
    return Path(tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-"))


@contextlib.contextmanager
def owned_temporary(kind: str):
    """``owned_tempdir`` for the block, removed when it ends (the next run removes it if this one is killed)."""
    d = owned_tempdir(kind)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
