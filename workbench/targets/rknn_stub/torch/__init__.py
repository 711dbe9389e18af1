"""Stand-in for torch inside the rknn-toolkit2 venv only (never on the project's path).

rknn-toolkit2 imports torch at import time (it subclasses ``torch.nn.Module`` and decorates with
``torch.no_grad()``) but needs it for nothing the rknn target calls (ONNX in, simulator out), so
this stub keeps a multi-GB CUDA torch out of that venv. Anything else it touches raises.
"""
from . import nn

__version__ = "2.4.0"


class no_grad:
    """Decorator and context manager that does nothing."""

    def __call__(self, fn):
        return fn

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Tensor:
    """Placeholder type for annotations."""


def __getattr__(name):
    raise AttributeError(f"torch.{name} is not in the rknn venv's torch stub (workbench/targets/rknn_stub)")
