"""The one exception family the workbench raises for bad input: each message says what to do."""
from __future__ import annotations

import errno
import re

try:
    import resource
except ImportError:  # not on Windows: no file-size limit to read
    resource = None

__all__ = ["WorkbenchError", "ModelLoadError", "PlanError", "DataError", "WorkspaceError", "NativeEngineError",
           "printable", "storage_failure", "storage_message"]


class WorkbenchError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero, never a traceback."""


class ModelLoadError(WorkbenchError):
    """A model directory is missing, incomplete, corrupt or not a causal language model."""


class PlanError(WorkbenchError):
    """A quantization plan is malformed or does not fit the model it is applied to."""


class DataError(WorkbenchError):
    """A text, calibration or evaluation file is missing, empty or has the wrong fields."""


class WorkspaceError(WorkbenchError):
    """An artifact in the workspace is missing or inconsistent."""


class NativeEngineError(ModelLoadError):
    """A native runtime (run in a child process) crashed or refused a model folder: the folder is damaged."""


def printable(text: str) -> str:
    """``text`` on one line with control characters escaped (``\\x1b``): names read from a model folder (a
    ``conversion.json`` target, a config's file name) may carry terminal escapes that must not reach a terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(str(text).splitlines()))


_STORAGE = frozenset((errno.ENOSPC, errno.EFBIG, errno.EDQUOT))  # disk full, file too large, quota used up
_STORAGE_TEXT = re.compile(r"No space left on device|File too large|Disk quota exceeded|StorageFull|FileTooLarge|"
                           r"os error (28|27|122)\b")
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile / save on a cut write


def _file_size_limited() -> bool:
    """Whether this process has a file-size limit (``ulimit -f``): what a short write or EFBIG then comes from."""
    try:
        return resource is not None and resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
    except (OSError, ValueError):
        return False


def storage_failure(e: BaseException) -> tuple[int, str | None] | None:
    """``(errno, file or None)`` when ``e`` (or what it was raised from) is a full disk, a used-up quota or a file
    past the size limit (``ulimit -f``), whichever writer reported it: an ``OSError``, safetensors' or torch's
    wrapped message, or numpy's short write. None for anything else."""
    seen = set()
    while e is not None and id(e) not in seen and not isinstance(e, WorkbenchError):  # one already says what to do
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE:
            return e.errno, e.filename if isinstance(e.filename, str) else None
        text = str(e)
        found = _STORAGE_TEXT.search(text)
        if found:
            code = {"28": errno.ENOSPC, "27": errno.EFBIG, "122": errno.EDQUOT}.get(found.group(1) or "")
            word = found.group(0)
            code = code or (errno.EFBIG if word in ("File too large", "FileTooLarge") else
                            errno.EDQUOT if word == "Disk quota exceeded" else errno.ENOSPC)
            return code, None
        if isinstance(e, OSError) and _SHORT_WRITE.search(text):
            return (errno.EFBIG if _file_size_limited() else errno.ENOSPC), None
        e = e.__cause__ if e.__cause__ is not None else None if e.__suppress_context__ else e.__context__
    return None


def storage_message(code: int, where: str, other_disk: str | None = None) -> str:
    """One sentence for a write that failed at ``where`` (a file, or the folder written to) and what to do;
    ``other_disk`` says how to write elsewhere (``"give --out on another disk"``)."""
    elsewhere = f" (or {other_disk})" if other_disk else ""
    if code == errno.EFBIG and _file_size_limited():
        return (f"writing {where} went past this shell's file-size limit (`ulimit -f`): raise it (`ulimit -f "
                "unlimited`) and run again")
    if code == errno.EFBIG:
        return (f"writing {where}: the file is larger than its file system takes (FAT32 stops at 4 GiB): write it to "
                f"another file system{elsewhere} and run again")
    if code == errno.EDQUOT:
        return f"writing {where}: your disk quota is used up; free some of it{elsewhere} and run again"
    return f"no space left on the disk writing {where}: free space there{elsewhere} and run again"
