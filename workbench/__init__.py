"""workbench: take a small language model from a Hugging Face checkpoint to an edge NPU, and
show with numbers and pictures what each quantization choice costs.

The main verbs::

    from workbench import load_model, QuantPlan, evaluate, encode_text, Workspace
"""
from __future__ import annotations

import logging
import warnings

from .offline import apply_offline_env

apply_offline_env()  # before anything imports onnxruntime or the Hugging Face libraries
warnings.filterwarnings("ignore", message=".*_C_mxfp8.*")
# torchao (there for the executorch target) is imported by transformers whenever it is installed; on a CPU machine
# it logs each GPU kernel library it cannot load, and torch logs its enum registrations: noise on every command
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

from .assets import DEMO_MODEL_DIR, demo_text_path  # noqa: E402
from .errors import DataError, ModelLoadError, PlanError, WorkbenchError, WorkspaceError  # noqa: E402
from .evaluation.evaluate import EvalReport, encode_text, evaluate, paired_difference, read_text  # noqa: E402
from .model.load import LayerInfo, LoadedModel, load_model  # noqa: E402
from .quantize.plan import PRECISIONS, Precision, QuantPlan, get_precision, register_precision  # noqa: E402
from .files.workspace import Artifact, Workspace  # noqa: E402

__version__ = "0.1.0"
# The import layers, bottom first (docs/architecture.md says what each holds): a module may import its own
# package and any layer below it, never one above, at module level or inside a function
# (scripts/check_imports.py checks it; tests/test_check_imports.py runs that).
__layers__ = (
    ("errors", "units", "offline", "assets"),  # the basics: they import nothing of the package
    "files", "numerics", "evaluation", "quantize", "model", "devices", "runtime", "onnx", "targets", "run",
    "precision", "compress", "charts", "cli", "ui",
)
__all__ = [
    "WorkbenchError", "ModelLoadError", "PlanError", "DataError", "WorkspaceError",
    "EvalReport", "encode_text", "evaluate", "paired_difference", "read_text",
    "DEMO_MODEL_DIR", "LayerInfo", "LoadedModel", "demo_text_path", "load_model",
    "PRECISIONS", "Precision", "QuantPlan", "get_precision", "register_precision",
    "Artifact", "Workspace", "__version__",
]
