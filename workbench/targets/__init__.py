"""Deployment targets: operator rules (``assets/targets/*.json``) and, per target, its converter or SDK commands.

    report = inspect_graph("out/onnx/decode.onnx", "qnn")
    print(report.summary())

One module per target: ``qnn`` (QNN HTP: static export, encodings overrides, converter commands),
``ort`` (ONNX Runtime: QDQ for the QNN execution provider, INT4 MatMulNBits), ``mnn`` (MNN
conversion and runtime), ``rknn`` (RKNN-Toolkit2 build script), ``tensorrt`` (trtexec commands).
"""
from .base import RULES_DIR, Finding, GraphReport, graph_is_static, inspect_graph, load_rules

__all__ = ["TARGETS", "RULES_DIR", "Finding", "GraphReport", "inspect_graph", "load_rules", "graph_is_static"]

TARGETS = ("qnn", "ort", "mnn", "rknn", "tensorrt")  # each has assets/targets/<name>.json
