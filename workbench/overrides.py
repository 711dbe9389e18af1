"""Say a plan's per-layer precisions to converters: QNN/AIMET encodings, ONNX Runtime overrides, llama.cpp, MNN.

    qm = quantize_model(lm, plan); graph = export_onnx(lm, "out/onnx")
    write_qnn_encodings("q.json", qm, graph)          # qnn-onnx-converter --quantization_overrides q.json
    write_ort_overrides("ort.json", qm, graph)        # get_qnn_qdq_config(model, reader, **load_ort_overrides(...))
    write_llamacpp_tensor_types("types.txt", lm, plan)  # llama-quantize --tensor-type-file types.txt in.gguf out.gguf Q8_0
    write_mnn_quant_config("mnn.json", lm, plan)      # llmexport.py --quant_config mnn.json

Each writer returns an ``OverrideFile`` whose ``notes`` say what the format cannot express (a
tied lm_head llama.cpp stores once, group sizes a format fixes itself, ...); each format has a
reader that maps the file back to ``{layer: precision}`` so round trips can be checked, and
``validate_qnn_encodings`` checks the QNN format and, given the graph, the tensor names.

QNN encodings follow the AIMET 0.6.1 layout ``qnn-onnx-converter`` reads: ``param_encodings``
maps each weight initializer of the exported graph to a list of encodings (one per output
channel, or one per block, channel-major, when the plan is group-wise) with ``bitwidth``,
``dtype: "int"``, ``is_symmetric``, ``scale``, ``offset``, ``min``, ``max``, where
``real = (q + offset) * scale`` for unsigned codes ``q`` in ``[0, 2^bitwidth - 1]``; layers kept
in floating point get ``[{"bitwidth": 16, "dtype": "float"}]``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from .errors import PlanError
from .models import LoadedModel
from .plan import QuantPlan, get_precision
from .workspace import atomic_write_json, atomic_write_text, read_json_file

__all__ = ["OverrideFile", "OVERRIDE_FORMATS", "QNN_ENCODINGS_VERSION", "qnn_encodings", "write_qnn_encodings",
           "read_qnn_encodings", "validate_qnn_encodings", "ort_overrides", "write_ort_overrides",
           "load_ort_overrides", "read_ort_overrides", "gguf_tensor_name", "llamacpp_tensor_types",
           "write_llamacpp_tensor_types", "read_llamacpp_tensor_types", "mnn_op_name", "mnn_quant_config",
           "write_mnn_quant_config", "read_mnn_quant_config", "write_overrides", "read_overrides",
           "graph_tensor_names"]

OVERRIDE_FORMATS = ("qnn", "ort", "llamacpp", "mnn")
QNN_ENCODINGS_VERSION = "0.6.1"
DEFAULT_ACTIVATION_BITWIDTH = 16  # A16W8 / A16W4: what LLMs on Hexagon use; 8-bit activations wreck attention


@dataclass
class OverrideFile:
    """A written override file: where, which format, how many tensors it names, what it could not say."""

    path: Path
    format: str
    tensors: int
    notes: list[str] = field(default_factory=list)
    usage: str = ""

    def to_dict(self) -> dict:
        return {"path": str(self.path), "format": self.format, "tensors": self.tensors, "notes": list(self.notes),
                "usage": self.usage}


def _layer_precisions(layers, plan: QuantPlan) -> dict[str, str | None]:
    names = [info.name for info in layers]
    plan.validate(names)
    return plan.resolve(names)


def _graph_names(export) -> tuple[dict[str, str], dict[str, str]]:
    """(weight_names, weight_layouts) from an ``ExportResult`` or a plain mapping of names."""
    if export is None:
        raise PlanError("this format names tensors of the exported ONNX graph: pass export=export_onnx(lm, dir) "
                        "(or the weight_names mapping it returns)")
    if isinstance(export, Mapping):
        return dict(export), {}
    return dict(export.weight_names), dict(getattr(export, "weight_layouts", {}) or {})


def _tensor_for(weight_names: Mapping[str, str], name: str) -> str:
    try:
        return weight_names[name]
    except KeyError:
        raise PlanError(f"layer '{name}' has no weight tensor in the exported graph; export the same model the plan "
                        "was made for") from None


# -- QNN / AIMET encodings ------------------------------------------------------------------------

def _int_encodings(qw) -> list[dict]:
    """One AIMET encoding per (output channel, block) of a ``QuantizedWeight``, channel-major."""
    bits = int(qw.bits)
    scales = qw.scales.detach().cpu().numpy().astype(np.float64).reshape(-1)
    if qw.symmetric:
        offsets = np.full(scales.shape, -(1 << (bits - 1)), dtype=np.int64)
    else:
        offsets = -qw.zeros.detach().cpu().numpy().astype(np.int64).reshape(-1)
    top = (1 << bits) - 1
    sym = "True" if qw.symmetric else "False"
    return [{"bitwidth": bits, "dtype": "int", "is_symmetric": sym, "scale": float(s), "offset": int(o),
             "min": float(o * s), "max": float((o + top) * s)} for s, o in zip(scales, offsets)]


def _float_encoding(precision) -> list[dict]:
    return [{"bitwidth": int(precision.bits), "dtype": "float"}]


def _consumers(graph, tensor: str) -> list:
    """Nodes that read ``tensor``, looking through a Transpose/Cast between an initializer and its MatMul."""
    out = []
    for node in graph.node:
        if tensor in node.input:
            if node.op_type in ("Transpose", "Cast", "Identity") and node.output:
                out.extend(_consumers(graph, node.output[0]))
            else:
                out.append(node)
    return out


def _activation_inputs(onnx_path: Path, weight_tensor: str) -> list[str]:
    """The activation tensors multiplied by a weight (the other input of each MatMul/Gemm/Gather)."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    acts = []
    for node in _consumers(model.graph, weight_tensor):
        if node.op_type in ("MatMul", "Gemm"):
            acts.extend(i for i in node.input if i and i not in inits and i != weight_tensor)
    return acts


def qnn_encodings(quantized, export, *, calibration=None, activation_bitwidth: int = DEFAULT_ACTIVATION_BITWIDTH,
                  notes: list[str] | None = None) -> dict:
    """The QNN/AIMET encodings document of a ``QuantizedModel`` for the graph ``export`` wrote.

    ``calibration`` (``CalibrationStats``) adds ``activation_encodings`` for the inputs of the
    quantized MatMuls: asymmetric ``activation_bitwidth``-bit ranges from the largest |x| seen.
    """
    notes = notes if notes is not None else []
    weight_names, _ = _graph_names(export)
    params: dict[str, list[dict]] = {}
    precisions: dict[str, str | None] = {}
    blockwise: list[str] = []
    for r in quantized.layers:
        precisions[r.name] = r.precision
        prec = get_precision(r.precision)
        if prec is None:
            notes.append(f"{r.name}: left unchanged by the plan; no encoding written (the converter's defaults apply)")
            continue
        tensor = _tensor_for(weight_names, r.name)
        if tensor in params:
            continue
        if prec.is_float:
            params[tensor] = _float_encoding(prec)
        else:
            qw = quantized.weights.get(r.name)
            if qw is None:
                raise PlanError(f"layer '{r.name}' is {prec.name} in the plan but the quantized model has no weights "
                                "for it; quantize with the same plan")
            params[tensor] = _int_encodings(qw)
            if qw.group_size is not None and qw.n_groups > 1:
                blockwise.append(r.name)
    if blockwise:
        notes.append(f"{len(blockwise)} layer(s) have several blocks per output channel (group size "
                     f"{quantized.plan.group_size}): written as per-block encodings, channel-major; plan with "
                     "group_size null for one encoding per output channel")
    doc = {"version": QNN_ENCODINGS_VERSION, "activation_encodings": {}, "param_encodings": params}
    if calibration is not None:
        prefill = getattr(export, "prefill_path", None)
        if prefill is None:
            notes.append("activation encodings need the exported graph file; pass the ExportResult, not a mapping")
        else:
            doc["activation_encodings"] = _activation_encodings(calibration, weight_names, precisions, Path(prefill),
                                                                activation_bitwidth, notes)
    return doc


def _activation_encodings(calibration, weight_names, precisions, onnx_path, bits, notes) -> dict:
    by_tensor: dict[str, list[tuple[str, float]]] = {}
    for name, stats in calibration.layers.items():
        if name not in weight_names or getattr(stats, "abs_max", None) is None:
            continue
        amax = float(stats.abs_max.float().max())
        for act in _activation_inputs(onnx_path, weight_names[name]):
            by_tensor.setdefault(act, []).append((name, amax))
    out = {}
    top = (1 << bits) - 1
    for act, uses in by_tensor.items():
        kinds = {precisions.get(n) for n, _ in uses}
        if all(get_precision(p) is not None and get_precision(p).is_float for p in kinds):
            out[act] = [{"bitwidth": 16, "dtype": "float"}]
            continue
        if any(get_precision(p) is not None and get_precision(p).is_float for p in kinds):
            notes.append(f"activation '{act}' feeds float and integer layers ({', '.join(n for n, _ in uses)}); "
                         "it gets an integer encoding, so the converter inserts a conversion before the float layers")
        amax = max(a for _, a in uses) or 1e-8
        scale = 2 * amax / top
        offset = int(round(-amax / scale))
        out[act] = [{"bitwidth": bits, "dtype": "int", "is_symmetric": "False", "scale": scale, "offset": offset,
                     "min": offset * scale, "max": (offset + top) * scale}]
    return out


def write_qnn_encodings(path: str | Path, quantized, export, *, calibration=None,
                        activation_bitwidth: int = DEFAULT_ACTIVATION_BITWIDTH) -> OverrideFile:
    """Write the encodings JSON and check it (format, and names against the graph when it is at hand)."""
    notes: list[str] = []
    doc = qnn_encodings(quantized, export, calibration=calibration, activation_bitwidth=activation_bitwidth,
                        notes=notes)
    graph = getattr(export, "prefill_path", None)
    validate_qnn_encodings(doc, onnx_path=graph)
    p = atomic_write_json(Path(path), doc)
    return OverrideFile(p, "qnn", len(doc["param_encodings"]), notes,
                        f"qnn-onnx-converter --input_network {graph or 'model.onnx'} --quantization_overrides {p}")


def _bool_str(value) -> bool | None:
    if isinstance(value, bool):
        return value
    if value in ("True", "true"):
        return True
    if value in ("False", "false"):
        return False
    return None


def graph_tensor_names(onnx_path: str | Path) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(initializer name -> shape, every tensor name) of an ONNX graph, without loading weight data."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name: tuple(int(d) for d in i.dims) for i in model.graph.initializer}
    names = set(inits)
    for node in model.graph.node:
        names.update(n for n in node.input if n)
        names.update(n for n in node.output if n)
    names.update(v.name for v in model.graph.input)
    names.update(v.name for v in model.graph.output)
    return inits, names


def _entry_count_fits(count: int, shape: tuple[int, ...]) -> bool:
    if count == 1 or len(shape) != 2:
        return count >= 1
    for channels, per in ((shape[0], shape[1]), (shape[1], shape[0])):
        if count % channels == 0 and per % (count // channels) == 0:
            return True
    return False


def validate_qnn_encodings(doc_or_path, *, onnx_path: str | Path | None = None,
                           tensor_names: Iterable[str] | None = None) -> None:
    """Raise ``PlanError`` listing every problem: fields, value consistency, and names absent from the graph."""
    if isinstance(doc_or_path, (str, Path)):
        doc = read_json_file(doc_or_path, "QNN encodings file", error=PlanError)
        where = str(Path(doc_or_path))
    else:
        doc, where = doc_or_path, "QNN encodings"
    problems: list[str] = []
    if not isinstance(doc, Mapping):
        raise PlanError(f"{where}: must be a JSON object with 'version' and 'param_encodings'")
    if not isinstance(doc.get("version"), str):
        problems.append("missing 'version' (a string such as \"0.6.1\")")
    shapes: dict[str, tuple[int, ...]] = {}
    known: set[str] | None = set(tensor_names) if tensor_names is not None else None
    if onnx_path is not None:
        shapes, all_names = graph_tensor_names(onnx_path)
        known = all_names if known is None else known | all_names
    for section in ("param_encodings", "activation_encodings"):
        block = doc.get(section, {} if section == "activation_encodings" else None)
        if not isinstance(block, Mapping):
            problems.append(f"'{section}' must be an object mapping tensor names to lists of encodings")
            continue
        for tensor, encs in block.items():
            label = f"{section}['{tensor}']"
            if section == "param_encodings" and shapes and tensor not in shapes:
                problems.append(f"{label}: no initializer of that name in the graph")
            elif known is not None and tensor not in known:
                problems.append(f"{label}: no tensor of that name in the graph")
            if not isinstance(encs, list) or not encs:
                problems.append(f"{label}: must be a non-empty list of encodings")
                continue
            if tensor in shapes and not _entry_count_fits(len(encs), shapes[tensor]):
                problems.append(f"{label}: {len(encs)} encodings fit neither the channels nor blocks of shape "
                                f"{list(shapes[tensor])}")
            for i, e in enumerate(encs):
                problems.extend(f"{label}[{i}]: {msg}" for msg in _encoding_problems(e))
                if len(problems) > 50:
                    break
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise PlanError(f"{where} is not valid QNN encodings: " + "; ".join(problems[:10]) + more)


def _encoding_problems(e) -> list[str]:
    if not isinstance(e, Mapping):
        return ["must be an object"]
    out = []
    bw, dtype = e.get("bitwidth"), e.get("dtype")
    if not isinstance(bw, int) or not 1 <= bw <= 32:
        out.append(f"'bitwidth' must be an integer 1..32, got {bw!r}")
    if dtype not in ("int", "float"):
        out.append(f"'dtype' must be \"int\" or \"float\", got {dtype!r}")
    if dtype == "float":
        if bw not in (16, 32):
            out.append(f"float encodings are 16 or 32 bits, got {bw!r}")
        return out
    missing = [k for k in ("is_symmetric", "scale", "offset", "min", "max") if k not in e]
    if missing:
        return out + [f"integer encoding lacks {', '.join(missing)}"]
    sym = _bool_str(e["is_symmetric"])
    if sym is None:
        out.append(f"'is_symmetric' must be \"True\" or \"False\", got {e['is_symmetric']!r}")
    scale, offset, lo, hi = e["scale"], e["offset"], e["min"], e["max"]
    if not isinstance(scale, (int, float)) or not scale > 0:
        out.append(f"'scale' must be positive, got {scale!r}")
        return out
    if not isinstance(offset, int) or isinstance(offset, bool):
        out.append(f"'offset' must be an integer, got {offset!r}")
        return out
    if out:
        return out
    top = (1 << bw) - 1
    if not -top <= offset <= 0:
        out.append(f"'offset' {offset} outside [-{top}, 0]")
    if sym and offset != -(1 << (bw - 1)):
        out.append(f"symmetric {bw}-bit encodings have offset {-(1 << (bw - 1))}, got {offset}")
    tol = 1e-6 * max(1.0, abs(lo), abs(hi))
    if abs(lo - offset * scale) > tol or abs(hi - (offset + top) * scale) > tol:
        out.append(f"min/max ({lo}, {hi}) disagree with scale {scale} and offset {offset}")
    if not lo <= 0 <= hi:
        out.append(f"range [{lo}, {hi}] must contain 0")
    return out


def read_qnn_encodings(path: str | Path) -> dict[str, dict]:
    """``{tensor: {"precision", "symmetric", "scales", "offsets"}}`` from an encodings file (validated first)."""
    validate_qnn_encodings(path)
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    out = {}
    for tensor, encs in doc["param_encodings"].items():
        e0 = encs[0]
        if e0["dtype"] == "float":
            out[tensor] = {"precision": f"fp{e0['bitwidth']}", "symmetric": None, "scales": None, "offsets": None}
        else:
            out[tensor] = {"precision": f"int{e0['bitwidth']}", "symmetric": _bool_str(e0["is_symmetric"]),
                           "scales": np.array([e["scale"] for e in encs], dtype=np.float64),
                           "offsets": np.array([e["offset"] for e in encs], dtype=np.int64)}
    return out


# -- ONNX Runtime TensorQuantOverrides -------------------------------------------------------------

_ORT_TYPES = {(8, True): "QInt8", (8, False): "QUInt8", (4, True): "QInt4", (4, False): "QUInt4",
              (16, True): "QInt16", (16, False): "QUInt16"}


def _ort_axis(layout: str | None, tensor: str) -> int:
    if layout == "in_out" or (layout is None and tensor.endswith(".T")):
        return 1
    return 0


def ort_overrides(quantized, export, *, notes: list[str] | None = None) -> dict:
    """``{"init_overrides": ..., "nodes_to_exclude": ..., "float_weights": ...}`` for ``get_qnn_qdq_config``.

    Per-channel plans carry their exact scales and zero points; group-wise plans carry the
    type, symmetry and axis (onnxruntime's QDQ format has no block scales for QNN) and
    onnxruntime computes per-channel scales itself. Float layers are listed in
    ``nodes_to_exclude`` (their MatMul nodes stay float) when the graph file is at hand.
    """
    notes = notes if notes is not None else []
    weight_names, layouts = _graph_names(export)
    prefill = getattr(export, "prefill_path", None)
    graph = None
    if prefill is not None:
        import onnx
        graph = onnx.load(str(prefill), load_external_data=False).graph
    init_overrides: dict[str, list[dict]] = {}
    exclude: list[str] = []
    float_weights: dict[str, str] = {}
    grouped = []
    for r in quantized.layers:
        prec = get_precision(r.precision)
        if prec is None:
            continue
        tensor = _tensor_for(weight_names, r.name)
        if prec.is_float:
            float_weights[tensor] = prec.name
            if graph is None:
                notes.append(f"{r.name}: kept {prec.name}, but without the graph file its nodes cannot be named in "
                             "nodes_to_exclude")
            else:
                exclude.extend(n.name for n in _consumers(graph, tensor) if n.name and n.name not in exclude)
            continue
        qw = quantized.weights[r.name]
        qtype = _ORT_TYPES[(qw.bits, qw.symmetric)]
        axis = _ort_axis(layouts.get(r.name), tensor)
        if qw.n_groups == 1:
            scales = qw.scales.reshape(-1).tolist()
            zeros = [0] * len(scales) if qw.symmetric else qw.zeros.reshape(-1).tolist()
            init_overrides[tensor] = [{"quant_type": qtype, "axis": axis, "scale": float(s), "zero_point": int(z)}
                                      for s, z in zip(scales, zeros)]
        else:
            init_overrides[tensor] = [{"quant_type": qtype, "axis": axis, "symmetric": bool(qw.symmetric)}]
            grouped.append(r.name)
    if grouped:
        notes.append(f"{len(grouped)} group-wise layer(s) (group size {quantized.plan.group_size}): onnxruntime's QDQ "
                     "overrides have no block scales, so their type/axis/symmetry are written and onnxruntime "
                     "computes per-channel scales; use group_size null to carry the exact scales")
    if float_weights:
        notes.append("float layers are excluded from quantization via nodes_to_exclude; they run in float32 "
                     "(QDQ has no fp16 weight override)")
    return {"init_overrides": init_overrides, "nodes_to_exclude": exclude, "float_weights": float_weights}


def write_ort_overrides(path: str | Path, quantized, export) -> OverrideFile:
    notes: list[str] = []
    doc = ort_overrides(quantized, export, notes=notes)
    p = atomic_write_json(Path(path), doc)
    return OverrideFile(p, "ort", len(doc["init_overrides"]) + len(doc["float_weights"]), notes,
                        "get_qnn_qdq_config(model, reader, activation_type=QuantType.QUInt16, "
                        f"**workbench.overrides.load_ort_overrides('{p}'))")


def load_ort_overrides(path: str | Path) -> dict:
    """Keyword arguments for ``get_qnn_qdq_config``: ``init_overrides`` with real ``QuantType`` values, ``nodes_to_exclude``."""
    from onnxruntime.quantization import QuantType
    doc = _read_json(path, "ONNX Runtime overrides")
    if not isinstance(doc.get("init_overrides"), Mapping):
        raise PlanError(f"'{path}' has no 'init_overrides' object; write it with `workbench overrides --format ort`")
    init = {}
    for tensor, entries in doc["init_overrides"].items():
        out = []
        for e in entries:
            e = dict(e)
            try:
                e["quant_type"] = QuantType[e["quant_type"]]
            except KeyError:
                raise PlanError(f"'{path}': tensor '{tensor}' has unknown quant_type {e.get('quant_type')!r}; "
                                f"use one of {list(QuantType.__members__)}") from None
            if "scale" in e:
                e["scale"] = np.float32(e["scale"])
            out.append(e)
        init[tensor] = out
    return {"init_overrides": init, "nodes_to_exclude": list(doc.get("nodes_to_exclude", []))}


def read_ort_overrides(path: str | Path) -> dict[str, dict]:
    """``{tensor: {"precision", "symmetric", "scales", "zero_points"}}`` as the file says."""
    doc = _read_json(path, "ONNX Runtime overrides")
    by_type = {v: k for k, v in _ORT_TYPES.items()}
    out = {}
    for tensor, entries in doc.get("init_overrides", {}).items():
        bits, sym = by_type[entries[0]["quant_type"]]
        sym = entries[0].get("symmetric", sym)
        has = "scale" in entries[0]
        out[tensor] = {"precision": f"int{bits}", "symmetric": sym,
                       "scales": np.array([e["scale"] for e in entries]) if has else None,
                       "zero_points": np.array([e["zero_point"] for e in entries]) if has else None}
    for tensor, prec in doc.get("float_weights", {}).items():
        out[tensor] = {"precision": prec, "symmetric": None, "scales": None, "zero_points": None}
    return out


# -- llama.cpp --tensor-type -----------------------------------------------------------------------

_GGUF_ROLES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def gguf_tensor_name(fqn: str) -> str | None:
    """The GGUF tensor (without ``.weight``) of a Hugging Face layer name, as llama.cpp's converter names it."""
    if fqn.endswith("embed_tokens"):
        return "token_embd"
    if fqn == "lm_head":
        return "output"
    m = _LAYER_RE.match(fqn)
    if m and m.group(2) in _GGUF_ROLES:
        return f"blk.{m.group(1)}.{_GGUF_ROLES[m.group(2)]}"
    return None


def _gguf_type(precision, symmetric: bool) -> str:
    return {"fp32": "f32", "fp16": "f16", "int8": "q8_0", "int4": "q4_0" if symmetric else "q4_1"}[precision.name]


_GGUF_TO_PRECISION = {"f32": "fp32", "f16": "fp16", "bf16": "fp16", "q8_0": "int8", "q4_0": "int4", "q4_1": "int4"}


def llamacpp_tensor_types(lm: LoadedModel, plan: QuantPlan, *, notes: list[str] | None = None) -> list[tuple[str, str]]:
    """``(pattern, ggml type)`` pairs for ``llama-quantize --tensor-type``; patterns are anchored regexes."""
    notes = notes if notes is not None else []
    precisions = _layer_precisions(lm.layers, plan)
    out = []
    for info in lm.layers:
        prec = get_precision(precisions[info.name])
        gguf = gguf_tensor_name(info.name)
        if prec is None:
            notes.append(f"{info.name}: left unchanged by the plan; llama-quantize's base type applies")
            continue
        if gguf is None:
            notes.append(f"{info.name}: no GGUF tensor name known for this layer; not expressible")
            continue
        if info.tied_to is not None:
            tied_prec = precisions.get(info.tied_to)
            if tied_prec != precisions[info.name]:
                notes.append(f"{info.name}: tied to {info.tied_to}; llama.cpp stores one token_embd tensor for both, "
                             f"so {info.name} at {prec.name} cannot differ from {info.tied_to} at {tied_prec}")
            continue
        out.append((f"^{re.escape(gguf)}\\.weight$", _gguf_type(prec, plan.symmetric)))
    if any(get_precision(p) is not None and not get_precision(p).is_float for p in precisions.values()):
        notes.append(f"llama.cpp quantizes in fixed 32-weight blocks (q8_0/q4_0) and computes its own scales: the "
                     f"plan's group size {plan.group_size} and scales are not carried over")
    return out


def write_llamacpp_tensor_types(path: str | Path, lm: LoadedModel, plan: QuantPlan) -> OverrideFile:
    """A ``--tensor-type-file``: one ``pattern=type`` per line (also valid as ``--tensor-type`` arguments)."""
    notes: list[str] = []
    pairs = llamacpp_tensor_types(lm, plan, notes=notes)
    p = atomic_write_text(Path(path), "".join(f"{pat}={t}\n" for pat, t in pairs))
    base = _gguf_type(get_precision(plan.default), plan.symmetric).upper() if get_precision(plan.default) else "Q8_0"
    return OverrideFile(p, "llamacpp", len(pairs), notes,
                        f"llama-quantize --tensor-type-file {p} model-f16.gguf model-mixed.gguf {base}  "
                        f"(or: {' '.join(f'--tensor-type {a}={b}' for a, b in pairs[:2])} ...)")


def read_llamacpp_tensor_types(path: str | Path, lm: LoadedModel) -> dict[str, str]:
    """``{layer: precision}`` from a tensor-type file or ``--tensor-type`` argument list."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"llama.cpp tensor-type file '{p}' does not exist")
    words = [w for w in p.read_text(encoding="utf-8").split() if w != "--tensor-type"]
    by_gguf = {}
    for info in lm.layers:  # a tied lm_head has no tensor of its own: llama.cpp reads token_embd for it
        g = gguf_tensor_name(info.tied_to) if info.tied_to else gguf_tensor_name(info.name)
        if g:
            by_gguf.setdefault(f"{g}.weight", []).append(info.name)
    out: dict[str, str] = {}
    for i, w in enumerate(words):
        if "=" not in w:
            raise PlanError(f"'{p}': entry {i + 1} '{w}' is not PATTERN=TYPE")
        pattern, gtype = w.rsplit("=", 1)
        if gtype.lower() not in _GGUF_TO_PRECISION:
            raise PlanError(f"'{p}': entry {i + 1} has type '{gtype}', which this reader does not map to a precision")
        rx = re.compile(pattern)
        hits = [name for tensor, names in by_gguf.items() if rx.search(tensor) for name in names]
        if not hits:
            raise PlanError(f"'{p}': pattern '{pattern}' matches no tensor of this model")
        for name in hits:
            out[name] = _GGUF_TO_PRECISION[gtype.lower()]
    return out


# -- MNN llmexport --quant_config ------------------------------------------------------------------

def mnn_op_name(fqn: str) -> str | None:
    """The op name MNN's ``llmexport.py`` gives a linear layer (its ``--quant_config`` keys)."""
    if fqn == "lm_head":
        return "/lm/lm_head/Linear"
    m = _LAYER_RE.match(fqn)
    if m and m.group(2) in _GGUF_ROLES:
        return f"/layers.{m.group(1)}/{m.group(2).replace('.', '/')}/Linear"
    return None


def mnn_quant_config(lm: LoadedModel, plan: QuantPlan, *, notes: list[str] | None = None) -> dict:
    """``{op name: {"bits", "block_size", "symmetric"}}`` as ``llmexport.py --quant_config`` reads it."""
    from .quantize import resolve_group_size
    notes = notes if notes is not None else []
    precisions = _layer_precisions(lm.layers, plan)
    cfg = {}
    for info in lm.layers:
        prec = get_precision(precisions[info.name])
        if prec is None:
            notes.append(f"{info.name}: left unchanged by the plan; llmexport's --quant_bit applies")
            continue
        if info.kind == "embedding":
            flag = {"fp16": 16, "fp32": 16, "int8": 8, "int4": 4}[prec.name]
            notes.append(f"{info.name}: embeddings are not in the quant config; pass --embed_bit {flag} to llmexport"
                         + (" (it also stores them as bf16, not fp32)" if prec.name == "fp32" else ""))
            continue
        op = mnn_op_name(info.name)
        if op is None:
            notes.append(f"{info.name}: no MNN op name known for this layer; not expressible")
            continue
        if prec.is_float:
            if prec.bits != 16:
                notes.append(f"{info.name}: MNN keeps float linear weights at 16 bits; {prec.name} written as 16")
            cfg[op] = {"bits": 16}
        else:
            gs, _ = resolve_group_size(info.shape[1], plan.group_size)
            cfg[op] = {"bits": prec.bits, "block_size": gs or 0, "symmetric": bool(plan.symmetric)}
        if info.tied_to is not None:
            notes.append(f"{info.name}: tied to {info.tied_to}; unless llmexport gets --seperate_embed, MNN reuses "
                         "lm_head's quantized weights for the embedding")
    if plan.symmetric:
        notes.append("pass --sym to llmexport: MNN reads symmetry for the whole model when it lays out scales")
    return cfg


def write_mnn_quant_config(path: str | Path, lm: LoadedModel, plan: QuantPlan) -> OverrideFile:
    notes: list[str] = []
    cfg = mnn_quant_config(lm, plan, notes=notes)
    p = atomic_write_json(Path(path), cfg)
    return OverrideFile(p, "mnn", len(cfg), notes,
                        f"python llmexport.py --path MODEL --export mnn --quant_config {p}"
                        + (" --sym" if plan.symmetric else ""))


def read_mnn_quant_config(path: str | Path, lm: LoadedModel) -> dict[str, str]:
    """``{layer: precision}`` from an MNN quant config."""
    doc = _read_json(path, "MNN quant config")
    by_op = {mnn_op_name(info.name): info.name for info in lm.layers if mnn_op_name(info.name)}
    out = {}
    for op, spec in doc.items():
        if op not in by_op:
            raise PlanError(f"'{path}': op '{op}' is not a linear layer of this model")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("bits"), int):
            raise PlanError(f"'{path}': op '{op}' needs an integer 'bits'")
        out[by_op[op]] = "fp16" if spec["bits"] == 16 else f"int{spec['bits']}"
    return out


# -- dispatch ---------------------------------------------------------------------------------------

def _read_json(path, what: str) -> dict:
    doc = read_json_file(path, f"{what} file", error=PlanError)
    if not isinstance(doc, dict):
        raise PlanError(f"{what} file '{Path(path)}' must hold a JSON object")
    return doc


def write_overrides(fmt: str, path: str | Path, lm: LoadedModel, plan: QuantPlan, *, quantized=None, export=None,
                    calibration=None) -> OverrideFile:
    """Write ``plan`` for one converter; ``qnn``/``ort`` need the quantized weights and the exported graph."""
    if fmt not in OVERRIDE_FORMATS:
        raise PlanError(f"unknown override format '{fmt}'; choose one of: {', '.join(OVERRIDE_FORMATS)}")
    if fmt == "llamacpp":
        return write_llamacpp_tensor_types(path, lm, plan)
    if fmt == "mnn":
        return write_mnn_quant_config(path, lm, plan)
    if quantized is None:
        from .quantize import quantize_model
        quantized = quantize_model(lm, plan, progress=False)
    if fmt == "qnn":
        return write_qnn_encodings(path, quantized, export, calibration=calibration)
    return write_ort_overrides(path, quantized, export)


def read_overrides(fmt: str, path: str | Path, lm: LoadedModel, export=None) -> dict[str, str]:
    """``{layer: precision}`` a written override file says, for checking it against the plan."""
    if fmt == "llamacpp":
        return read_llamacpp_tensor_types(path, lm)
    if fmt == "mnn":
        return read_mnn_quant_config(path, lm)
    if fmt not in OVERRIDE_FORMATS:
        raise PlanError(f"unknown override format '{fmt}'; choose one of: {', '.join(OVERRIDE_FORMATS)}")
    weight_names, _ = _graph_names(export)
    by_tensor: dict[str, list[str]] = {}
    for name, tensor in weight_names.items():
        by_tensor.setdefault(tensor, []).append(name)
    raw = read_qnn_encodings(path) if fmt == "qnn" else read_ort_overrides(path)
    out = {}
    for tensor, info in raw.items():
        if tensor not in by_tensor:
            raise PlanError(f"'{path}' names tensor '{tensor}', which holds no layer weight of this graph")
        for name in by_tensor[tensor]:
            out[name] = info["precision"]
    return out
