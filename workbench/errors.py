"""The one exception family the workbench raises for bad input: each message says what to do."""
from __future__ import annotations

__all__ = ["WorkbenchError", "ModelLoadError", "PlanError", "DataError", "WorkspaceError", "NativeEngineError",
           "printable"]


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
