"""``torch.nn`` of the stub: the base class the toolkit subclasses."""
from . import functional  # noqa: F401


class Module:
    """Never instantiated on the ONNX path."""


def __getattr__(name):
    raise AttributeError(f"torch.nn.{name} is not in the rknn venv's torch stub")
