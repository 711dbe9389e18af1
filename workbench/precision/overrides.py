"""Say a plan's per-layer precisions to converters: QNN/AIMET encodings, ONNX Runtime overrides, llama.cpp, MNN.

    qm = quantize_model(lm, plan); graph = export_onnx(lm, "out/onnx")
    write_overrides("qnn", "q.json", lm, plan, quantized=qm, export=graph)   # qnn-onnx-converter --quantization_overrides
    write_overrides("ort", "ort.json", lm, plan, quantized=qm, export=graph) # get_qnn_qdq_config(..., **load_ort_overrides())
    write_overrides("llamacpp", "types.txt", lm, plan)   # llama-quantize --tensor-type-file types.txt in.gguf out.gguf Q8_0
    write_overrides("mnn", "mnn.json", lm, plan)         # llmexport.py --quant_config mnn.json

Each format belongs to its target's module in ``workbench.targets`` (``qnn``, ``ort_qdq``,
``llamacpp``, ``mnn``) and is found through the target registry, so a registered target's format
is written and read here too. Each writer returns an ``OverrideFile`` whose ``notes`` say what the
format cannot express; each format has a reader that maps the file back to ``{layer: precision}``
so round trips can be checked, and ``validate_qnn_encodings`` checks QNN files against the graph.
The names below are the target modules' own, kept importable from here.
"""
from __future__ import annotations

from pathlib import Path

from ..model.load import LoadedModel
from ..quantize.plan import QuantPlan
from ..targets import override_format, target_names
from ..quantize import quantize_model
from ..targets.common import OverrideFile, graph_names
from ..targets.llamacpp import (gguf_tensor_name, llamacpp_tensor_types, read_llamacpp_tensor_types,
                               write_llamacpp_tensor_types)
from ..targets.mnn import mnn_op_name, mnn_quant_config, read_mnn_quant_config, write_mnn_quant_config
from ..targets.ort_qdq import load_ort_overrides, ort_overrides, read_ort_overrides, write_ort_overrides
from ..targets.qnn import (QNN_ENCODINGS_VERSION, graph_tensor_names, qnn_encodings, read_qnn_encodings,
                          validate_qnn_encodings, write_qnn_encodings)

__all__ = ["OverrideFile", "OVERRIDE_FORMATS", "QNN_ENCODINGS_VERSION", "qnn_encodings", "write_qnn_encodings",
           "read_qnn_encodings", "validate_qnn_encodings", "ort_overrides", "write_ort_overrides",
           "load_ort_overrides", "read_ort_overrides", "gguf_tensor_name", "llamacpp_tensor_types",
           "write_llamacpp_tensor_types", "read_llamacpp_tensor_types", "mnn_op_name", "mnn_quant_config",
           "write_mnn_quant_config", "read_mnn_quant_config", "write_overrides", "read_overrides",
           "graph_tensor_names"]

OVERRIDE_FORMATS = target_names("overrides")  # qnn, ort, llamacpp, mnn, and any registered target's


def write_overrides(fmt: str, path: str | Path, lm: LoadedModel, plan: QuantPlan, *, quantized=None, export=None,
                    calibration=None) -> OverrideFile:
    """Write ``plan`` for one converter; formats that carry scales (qnn, ort) need the exported graph."""
    _, spec = override_format(fmt)
    if spec.needs_graph:
        graph_names(export)  # says how to pass the graph before anything is quantized
    if spec.needs_quantized and quantized is None:
        quantized = quantize_model(lm, plan, progress=False)
    return spec.write(path, lm, plan, quantized=quantized, export=export, calibration=calibration)


def read_overrides(fmt: str, path: str | Path, lm: LoadedModel, export=None) -> dict[str, str]:
    """``{layer: precision}`` a written override file says, for checking it against the plan."""
    _, spec = override_format(fmt)
    return spec.read(path, lm, export=export)
