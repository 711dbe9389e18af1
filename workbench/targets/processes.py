"""Toolkit child processes and temporary folders that do not outlive a killed run.

    subprocess.run(cmd, preexec_fn=die_with_parent_fn())      # a child the kernel kills with its parent
    def child_main(...): die_with_parent(parent_pid); ...      # the same, first thing in a multiprocessing child
    with owned_temporary("workbench-rknn") as work: ...         # /tmp/workbench-rknn-<pid>-xxxx, removed on exit
    child = ChildEngine(SCRIPT); child.call("load", ...)     # a native engine whose crash ends only the child
    child = ChildEngine(SCRIPT, timeout=600)                # ... and whose hang is killed after 600 s a request

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
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from ..errors import WorkbenchError

__all__ = ["die_with_parent", "die_with_parent_fn", "process_alive", "remove_orphaned_temporaries",
           "owned_tempdir", "owned_temporary", "ChildEngine", "ChildCrashed", "ChildHung", "ChildFailed",
           "ENGINE_TIMEOUT_VAR", "engine_timeout", "timeout_setting", "run_killable"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ENGINE_TIMEOUT_VAR = "WORKBENCH_ENGINE_TIMEOUT"  # seconds one request to a native engine's child may take
DEFAULT_ENGINE_TIMEOUT = 900.0  # a 7B load from a slow disk or a long generate on a busy CPU, with room to spare


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


class ChildCrashed(Exception):
    """The engine's child process ended mid-request (a segfault, an abort, the kernel's OOM killer): ``how``."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


class ChildHung(ChildCrashed):
    """The engine's child did not answer one request within the timeout, and was killed."""


class ChildFailed(Exception):
    """The engine raised in its child process (the child lives on): its message."""


def timeout_setting(var: str, default: float) -> float:
    """Seconds from the environment variable ``var`` (``default`` where unset); anything but a positive, finite
    number is one line naming the variable."""
    value = os.environ.get(var, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise WorkbenchError(f"${var} must be a number of seconds above 0, got '{value}': fix it or unset it "
                             f"(default {default:g})")
    return seconds


def engine_timeout() -> float:
    """Seconds one request to a native engine may take (``$WORKBENCH_ENGINE_TIMEOUT``, default 900)."""
    return timeout_setting(ENGINE_TIMEOUT_VAR, DEFAULT_ENGINE_TIMEOUT)


def run_killable(cmd: Sequence[str], *, timeout: float, **kwargs) -> int:
    """``subprocess.run`` in a session of its own: on timeout every process of it is killed (a toolkit's own
    children too, not only the one started), then ``subprocess.TimeoutExpired`` is raised. Returns the exit status."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=die_with_parent_fn(), **kwargs)
    try:
        return proc.wait(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


class ChildEngine:
    """A native engine served by a script in a child process (``python -P script FD``): a crash there ends the
    child, not the workbench, and comes back as ``ChildCrashed``; a request not answered within ``timeout``
    seconds (a hung engine) kills the child and comes back as ``ChildHung``. The child dies with this process.

    ``call(op, *args)`` sends one request and returns its result; ``seconds`` is the time the child spent in the
    engine for it (its own clock: the pipe and the child's start-up are not counted). Array results arrive as
    raw float32 bytes after their reply."""

    def __init__(self, script: str | Path, timeout: float | None = None):
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, "-P", str(script), str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent_fn())
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.seconds = 0.0
        self.timeout = timeout
        self._receive()  # "ready": the engine's library imported

    def _how(self) -> str:
        try:
            rc = self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            rc = self.proc.wait()
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with status {rc}"

    def _receive(self):
        try:
            if self.timeout is not None and not self.conn.poll(self.timeout):
                self.proc.kill()
                self.proc.wait()
                self.conn.close()
                raise ChildHung(f"no answer in {self.timeout:g} s, killed")
            status, result, seconds = self.conn.recv()
            if status == "ok" and isinstance(result, tuple) and result[:1] == ("array",):
                import numpy as np
                out = np.empty(result[1], dtype=np.float32)  # writable, filled in place from the pipe
                self.conn.recv_bytes_into(memoryview(out).cast("B"))
                result = out
        except (EOFError, OSError):
            raise ChildCrashed(self._how()) from None
        if status != "ok":
            raise ChildFailed(str(result))
        self.seconds = float(seconds)
        return result

    def call(self, op: str, *args):
        """The child's answer to ``op(*args)``; ChildCrashed when the child ends before answering."""
        if self.proc.poll() is not None or self.conn.closed:
            raise ChildCrashed(self._how())
        try:
            self.conn.send((op, args))
        except OSError:
            raise ChildCrashed(self._how()) from None
        return self._receive()

    def close(self) -> None:
        """Ask the child to end, then make sure it has."""
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        try:
            self.conn.send(("close", ()))
            proc.wait(timeout=5)
        except Exception:
            proc.kill()
            proc.wait()
        finally:
            self.conn.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
