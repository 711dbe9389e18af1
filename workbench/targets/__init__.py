"""Deployment targets, one module each, in one registry; and the operator rules they check graphs against.

    report = inspect_graph("out/onnx/decode.onnx", "qnn")
    print(report.summary()); get_target("qnn").convert, target_names("convert")

``convert`` is the convert step that runs one (``convert(model, plan, target, out)``). Each other module here (``ort_int4``, ``ort_genai``, ``ort_qdq``, ``qnn``, ``mnn``, ``llamacpp``, ``tensorrt``, ``rknn``)
registers one ``Target``: its rule table (``assets/targets/*.json``), its converter, its runner and
its override-file format. Every module of this package except the shared ones is imported here, so
adding a target is one file plus one rule table; a target defined elsewhere registers itself with
``register_target`` when its module is imported.
"""
import importlib
import pkgutil

from .base import RULES_DIR, Finding, GraphReport, graph_is_static, inspect_graph, load_rules
from .registry import (OverrideFormat, Target, check_precisions, check_signed_scales, get_target, grid_reach,
                       override_format, quantized_reach, register_target, target_names)

__all__ = ["TARGETS", "RULES_DIR", "Finding", "GraphReport", "inspect_graph", "load_rules", "graph_is_static",
           "Target", "OverrideFormat", "register_target", "get_target", "target_names", "override_format",
           "check_precisions", "check_signed_scales", "grid_reach", "quantized_reach", "RULE_TABLES"]

_SHARED = {"base", "registry", "common", "convert", "mnn_llm_engine"}  # not targets: shared pieces, the convert step, a child script
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in _SHARED:
        importlib.import_module(f"{__name__}.{_m.name}")

RULE_TABLES = tuple(sorted(p.stem for p in RULES_DIR.glob("*.json")))  # assets/targets/<name>.json
TARGETS = target_names("rules")  # what `workbench inspect --target` takes: targets with rules (and the tables' names)
