"""Qualcomm QNN (HTP), ``qnn``: encodings overrides, calibration inputs and the SDK's commands.

    doc = qnn_encodings(qm, export)                  # qnn-onnx-converter --quantization_overrides
    validate_qnn_encodings(doc, onnx_path=export.prefill_path)
    convert("demo", "qnn", "out/qnn", bits=4)        # bundle + the measured QDQ twin (``ort_qdq``)
    convert("demo", "qnn", "out/qnn", bits=8, soc="8gen3")   # + context binaries, scored on the HTP emulator

The SDK (``qnn-onnx-converter``, ``qnn-model-lib-generator``, ``qnn-context-binary-generator``)
cannot be installed here, so the conversion writes everything it needs next to the static
prefill/decode graphs: ``quant_overrides_<graph>.json``, ``input_list_<graph>.txt`` with raw
calibration tensors, and ``commands.sh``. What runs here is the QDQ twin of the same graphs; with
``soc`` (``--soc``, a Snapdragon's device profile) onnxruntime-qnn compiles that twin for the SoC's
HTP into context binaries (``htp-<device>/``) and its emulator scores them (``targets.htp``), after
the plan is fitted to the HTP generation (below v73, float layers get 8-bit weights, named).

One encoder, ``qnn_encodings``, writes every QNN file (``workbench overrides --format qnn`` and the
bundle), in the AIMET 0.6.1 layout ``qnn-onnx-converter`` reads: ``param_encodings`` maps each
weight initializer of the graph to a list of encodings (one per output channel, or one per block,
channel-major, when the plan is group-wise) with ``bitwidth``, ``dtype: "int"``, ``is_symmetric``,
``scale``, ``offset``, ``min``, ``max``, where ``real = (q + offset) * scale`` for unsigned codes
``q`` in ``[0, 2^bitwidth - 1]``: the quantized model's own scales and zero points. Layers kept in
floating point get ``[{"bitwidth": 16, "dtype": "float"}]``, and so do the input and output of
their MatMul when only float layers read that input (HTP rejects a float x fixed-point MatMul).
The causal mask is pinned to [-MASK_RANGE, MASK_RANGE] (``ort_qdq``), and with calibration
statistics the inputs of the integer MatMuls get ``activation_bitwidth`` ranges. Every document is
checked by ``validate_qnn_encodings`` against its graph before it is written.

A plan with two-level scales (``int4-lpbq``) is written in the AIMET 1.0.0 layout instead, the
first that has LPBQ: ``param_encodings`` and ``activation_encodings`` are lists of entries with a
``name``; a two-level weight is ``{"enc_type": "LPBQ", "dtype": "INT", "bw": 8, "compressed_bw": 4,
"block_size": g, "is_sym": true, "scale": [float16 scale per output channel], "offset": [-128, ...],
"per_block_int_scale": [sub-scales, channel-major]}``: ``real = q * per_block_int_scale * scale`` for
4-bit codes ``q`` in [-8, 7] (their product with the sub-scale is the 8-bit ``bw`` value), exactly the
quantized model's stored parts. Other weights become ``PER_CHANNEL`` / ``PER_BLOCK`` entries with
the same scales and offsets as in 0.6.1, float ones ``{"dtype": "FLOAT", "bw": 16}``.
"""
from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..errors import PlanError
from ..quantize.plan import get_precision, PlanRule, QuantPlan
from ..files.workspace import atomic_write_json
from .base import inspect_graph
from .common import OverrideFile, graph_consumers, graph_names, layers_from_tensors, read_json_object, tensor_for
from .ort_qdq import (FLOAT_WEIGHT_TYPE, KV_BITS_KEY, KV_TENSOR, MASK_RANGE, causal_mask_tensors, lean_session,
                      measure_qdq, qdq_evaluator, qdq_twin)
from .registry import OverrideFormat, Target, check_precisions, register_target
from ..runtime.onnx_runner import OnnxCausalLM
from .htp import (DEPART_ERROR, float_layers_refused, htp_soc, INSTALL, layer_divergence, measure_htp, qnn_available,
                  write_context_binaries, write_htp_binaries)
from .htp_parts import check_chained, PARTS_FILE
from .htp_vision import VISION_GAP_ERROR, calibration_feeds, measure_vision_encoder, vision_qdq, vision_quantized
from .convert import ConvertJob, PreparedModels
from ..model.text_part import language_model_view, text_part_quantized
from ..onnx.vision_export import export_vision_encoder

__all__ = ["QNN_ENCODINGS_VERSION", "QNN_LPBQ_VERSION", "DEFAULT_ACTIVATION_BITWIDTH", "RECIPE", "recipe_plan",
           "symmetric_encoding",
           "qnn_encodings", "write_qnn_encodings",
           "read_qnn_encodings", "validate_qnn_encodings", "graph_tensor_names", "range_encoding",
           "write_qnn_bundle", "write_calibration_raw", "TARGET"]

QNN_ENCODINGS_VERSION = "0.6.1"
QNN_LPBQ_VERSION = "1.0.0"  # the first AIMET encodings layout with LPBQ
ENC_TYPES = ("PER_TENSOR", "PER_CHANNEL", "PER_BLOCK", "LPBQ")
DEFAULT_ACTIVATION_BITWIDTH = 16  # A16W8 / A16W4: what LLMs on Hexagon use; 8-bit activations wreck attention
FLOAT16 = [{"bitwidth": 16, "dtype": "float"}]
RECIPE = "qualcomm-w4a16"  # the recipe every LLM in qai-hub-models 0.65.0 ships in (templates/llm)


def recipe_plan(*, int8_layers: Iterable[str] = (), method: str = "rtn") -> "QuantPlan":
    """Qualcomm's w4a16 LLM recipe as a plan: int4 symmetric weights per output channel, ``lm_head`` int8 per
    channel, the embedding at 16 bits (the plan keeps it fp16, the QDQ graphs hold it as 16-bit integers), 16-bit
    activations and an 8-bit KV cache whose past and present share one encoding (``meta["kv_cache_bits"]``).
    ``int8_layers``: layers held at int8 (the recipe's ``int8_param_names``: those whose int4 MatMul saturates
    the HTP accumulator, so the device departs from the simulation; ``targets.htp.divergent_layers`` finds them)."""
    rules = [PlanRule("*embed_tokens", "fp16"), PlanRule("lm_head", "int8")]
    rules += [PlanRule(name, "int8") for name in int8_layers]
    return QuantPlan(default="int4", rules=tuple(rules), group_size=None, symmetric=True, method=method,
                     meta={"recipe": RECIPE, KV_BITS_KEY: 8, "activation_bits": 16, "embedding_bits": 16,
                           **({"int8_layers": list(int8_layers)} if int8_layers else {})})


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


def range_encoding(lo: float, hi: float, bits: int) -> list[dict]:
    """An asymmetric ``bits``-bit encoding covering [lo, hi] (lo <= 0 <= hi); min/max on the integer grid."""
    top = (1 << bits) - 1
    scale = (hi - lo) / top
    offset = int(round(lo / scale))
    return [{"bitwidth": bits, "dtype": "int", "is_symmetric": "False", "scale": scale, "offset": offset,
             "min": offset * scale, "max": (offset + top) * scale}]


def symmetric_encoding(scale: float, bits: int) -> list[dict]:
    """A symmetric ``bits``-bit encoding of step ``scale`` (AIMET's offset -2^(bits-1))."""
    offset, top = -(1 << (bits - 1)), (1 << bits) - 1
    return [{"bitwidth": bits, "dtype": "int", "is_symmetric": "True", "scale": float(scale), "offset": offset,
             "min": offset * float(scale), "max": (offset + top) * float(scale)}]


def _float_encoding(precision) -> list[dict]:
    return [{"bitwidth": int(precision.bits), "dtype": "float"}]


def _v1_entry(name: str, encs: list[dict], qw=None) -> dict:
    """One 0.6.1 encoding list as a 1.0.0 entry; an integer weight's block layout (and LPBQ) from ``qw``."""
    e0 = encs[0]
    if e0["dtype"] == "float":
        return {"name": name, "dtype": "FLOAT", "enc_type": "PER_TENSOR", "bw": e0["bitwidth"]}
    entry = {"name": name, "dtype": "INT", "bw": e0["bitwidth"], "is_sym": _bool_str(e0["is_symmetric"]),
             "scale": [e["scale"] for e in encs], "offset": [e["offset"] for e in encs]}
    if qw is None or len(encs) == 1:
        entry["enc_type"] = "PER_TENSOR" if len(encs) == 1 else "PER_CHANNEL"
    elif qw.n_groups == 1:
        entry["enc_type"] = "PER_CHANNEL"
    else:
        entry.update(enc_type="PER_BLOCK", block_size=qw.effective_group_size)
    if qw is not None and qw.two_level:
        bw = qw.bits + qw.scale_bits
        entry.update(enc_type="LPBQ", bw=bw, compressed_bw=qw.bits, block_size=qw.effective_group_size, is_sym=True,
                     scale=[float(c) for c in qw.channel_scales.tolist()],
                     offset=[-(1 << (bw - 1))] * qw.shape[0],
                     per_block_int_scale=[int(v) for v in qw.sub_scales.reshape(-1).tolist()])
    return entry


def _as_lpbq_document(doc: dict, quantized, weight_names: Mapping[str, str]) -> dict:
    """The 0.6.1 document ``doc`` in the 1.0.0 layout, the quantized model's two-level weights as LPBQ."""
    weight_of = {}
    for r in quantized.layers:
        qw = quantized.weights.get(r.name)
        if qw is not None and r.name in weight_names:
            weight_of.setdefault(weight_names[r.name], qw)
    return {"version": QNN_LPBQ_VERSION,
            "activation_encodings": [_v1_entry(t, e) for t, e in doc["activation_encodings"].items()],
            "param_encodings": [_v1_entry(t, e, weight_of.get(t)) for t, e in doc["param_encodings"].items()]}


def _load_graph(export, graph: str | Path | None):
    """The graph (proto, without weights) the encodings are for: ``graph``, else the export's prefill graph."""
    import onnx
    path = graph if graph is not None else getattr(export, "prefill_path", None)
    return (None, None) if path is None else (Path(path), onnx.load(str(path), load_external_data=False))


def qnn_encodings(quantized, export, *, graph: str | Path | None = None, calibration=None,
                  activation_bitwidth: int = DEFAULT_ACTIVATION_BITWIDTH, notes: list[str] | None = None,
                  kv_encodings: Mapping[str, float] | None = None) -> dict:
    """The QNN/AIMET encodings of a ``QuantizedModel`` for the graph ``export`` wrote (or ``graph``, its twin).

    ``calibration`` (``CalibrationStats``) adds ``activation_bitwidth``-bit ranges for the inputs
    of the integer MatMuls, from the largest |x| seen. ``kv_encodings`` (``{"<layer>.key": scale}``, the
    QDQ graphs' int8 KV cache) gives each layer's past input and present output that symmetric 8-bit encoding.
    """
    notes = notes if notes is not None else []
    weight_names, _ = graph_names(export)
    check_precisions(TARGET, quantized.precisions, "QNN")
    params: dict[str, list[dict]] = {}
    precisions: dict[str, str | None] = {}
    blockwise: list[str] = []
    for r in quantized.layers:
        precisions[r.name] = r.precision
        prec = get_precision(r.precision)
        if prec is None:
            notes.append(f"{r.name}: left unchanged by the plan; no encoding written (the converter's defaults apply)")
            continue
        tensor = tensor_for(weight_names, r.name)
        if tensor in params:
            continue
        if prec.is_float:
            params[tensor] = _float_encoding(prec)
            continue
        qw = quantized.weights.get(r.name)
        if qw is None:
            raise PlanError(f"layer '{r.name}' is {prec.name} in the plan but the quantized model has no weights "
                            "for it; quantize with the same plan")
        params[tensor] = _int_encodings(qw)
        if qw.group_size is not None and qw.n_groups > 1 and not qw.two_level:
            blockwise.append(r.name)
    if blockwise:
        notes.append(f"{len(blockwise)} layer(s) have several blocks per output channel (group size "
                     f"{quantized.plan.group_size}): written as per-block encodings, channel-major; plan with "
                     "group_size null for one encoding per output channel")
    doc = {"version": QNN_ENCODINGS_VERSION, "activation_encodings": {}, "param_encodings": params}
    lpbq = [r.name for r in quantized.layers if r.name in quantized.weights and quantized.weights[r.name].two_level]
    if lpbq:
        notes.append(f"{len(lpbq)} layer(s) have two-level scales: written as LPBQ in the AIMET {QNN_LPBQ_VERSION} "
                     "encodings layout (4-bit codes, 4-bit per-block integer scales, a float scale per output channel)")
    path, proto = _load_graph(export, graph)
    if proto is None:
        notes.append("activation encodings (float MatMuls, the causal mask, calibration ranges) need the graph "
                     "file; pass the ExportResult, not a mapping")
        return _as_lpbq_document(doc, quantized, weight_names) if lpbq else doc
    acts = doc["activation_encodings"]
    readers = _matmul_inputs(proto, weight_names, precisions)
    amax = _calibration_ranges(calibration, readers) if calibration is not None else {}
    for act, (layers, outputs) in readers.items():
        floats = [n for n in layers if get_precision(precisions.get(n)) is not None
                  and get_precision(precisions.get(n)).is_float]
        if floats and len(floats) == len(layers):
            acts[act] = FLOAT16
            for o in outputs:
                acts[o] = FLOAT16
        elif floats:
            notes.append(f"activation '{act}' feeds float and integer layers ({', '.join(layers)}); it stays "
                         "fixed-point, so the converter inserts a conversion before the float layers")
        if act not in acts and act in amax:
            acts[act] = range_encoding(-amax[act], amax[act], activation_bitwidth)
    mask = causal_mask_tensors(proto)
    for t in mask:
        acts[t] = range_encoding(-MASK_RANGE, MASK_RANGE, activation_bitwidth)
    if kv_encodings:
        kv = [v.name for v in (*proto.graph.input, *proto.graph.output) if KV_TENSOR.match(v.name)]
        for t in kv:
            _, layer, kind = KV_TENSOR.match(t).groups()
            acts[t] = symmetric_encoding(kv_encodings[f"{layer}.{kind}"], 8)
        if kv:
            notes.append("the KV-cache inputs and outputs at 8 bits, symmetric, each past input sharing its present "
                         "output's encoding (Qualcomm's w4a16 recipe)")
    if mask:
        notes.append(f"{len(mask)} causal-mask tensor(s) pinned to [-{MASK_RANGE:g}, {MASK_RANGE:g}] (min/max "
                     "calibration would give them a scale of ~1e34 and wipe out attention)")
    return _as_lpbq_document(doc, quantized, weight_names) if lpbq else doc


def _matmul_inputs(proto, weight_names, precisions) -> dict[str, tuple[list[str], list[str]]]:
    """``{activation: (layers whose weight multiplies it, those MatMuls' outputs)}`` in ``proto``."""
    inits = {i.name for i in proto.graph.initializer}
    out: dict[str, tuple[list[str], list[str]]] = {}
    for name, tensor in weight_names.items():
        if name not in precisions or tensor not in inits:
            continue
        for node in graph_consumers(proto.graph, tensor):
            if node.op_type not in ("MatMul", "Gemm"):
                continue
            for act in node.input:
                if act and act not in inits and act != tensor:
                    layers, outputs = out.setdefault(act, ([], []))
                    layers.append(name)
                    outputs.extend(o for o in node.output if o)
    return out


def _calibration_ranges(calibration, readers) -> dict[str, float]:
    """Largest |x| seen at each MatMul input, from the per-layer calibration statistics."""
    out = {}
    for act, (layers, _) in readers.items():
        seen = [float(calibration.layers[n].abs_max.float().max()) for n in layers
                if n in calibration.layers and getattr(calibration.layers[n], "abs_max", None) is not None]
        if seen:
            out[act] = max(seen) or 1e-8
    return out


def write_qnn_encodings(path: str | Path, quantized, export, *, graph: str | Path | None = None, calibration=None,
                        activation_bitwidth: int = DEFAULT_ACTIVATION_BITWIDTH,
                        kv_encodings: Mapping[str, float] | None = None) -> OverrideFile:
    """Write the encodings JSON after checking it (format, and names against the graph when it is at hand)."""
    notes: list[str] = []
    doc = qnn_encodings(quantized, export, graph=graph, calibration=calibration,
                        activation_bitwidth=activation_bitwidth, notes=notes, kv_encodings=kv_encodings)
    graph = graph if graph is not None else getattr(export, "prefill_path", None)
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
        doc = read_json_object(doc_or_path, "QNN encodings")
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
    if doc.get("version") == QNN_LPBQ_VERSION:
        return _validate_v1(doc, where, shapes, known)
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
    _raise(where, problems)


def _raise(where: str, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise PlanError(f"{where} is not valid QNN encodings: " + "; ".join(problems[:10]) + more)


def _v1_problems(e, shape: tuple[int, ...] | None) -> list[str]:
    """Problems of one AIMET 1.0.0 entry (``shape``: its initializer's, when known)."""
    if not isinstance(e, Mapping):
        return ["must be an object"]
    out = []
    dtype, enc, bw = e.get("dtype"), e.get("enc_type"), e.get("bw")
    if dtype not in ("INT", "FLOAT"):
        out.append(f"'dtype' must be \"INT\" or \"FLOAT\", got {dtype!r}")
    if enc not in ENC_TYPES:
        out.append(f"'enc_type' must be one of {', '.join(ENC_TYPES)}, got {enc!r}")
    if not isinstance(bw, int) or isinstance(bw, bool) or not 1 <= bw <= 32:
        out.append(f"'bw' must be an integer 1..32, got {bw!r}")
    if out or dtype == "FLOAT":
        return out + ([f"float encodings are 16 or 32 bits, got {bw}"] if dtype == "FLOAT" and bw not in (16, 32)
                      else [])
    scale, offset, sym = e.get("scale"), e.get("offset"), e.get("is_sym")
    if not isinstance(sym, bool):
        out.append(f"'is_sym' must be true or false, got {sym!r}")
    if not isinstance(scale, list) or not scale or not all(isinstance(v, (int, float)) and v > 0 for v in scale):
        return out + ["'scale' must be a non-empty list of positive numbers"]
    if not isinstance(offset, list) or len(offset) != len(scale) or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in offset):
        return out + [f"'offset' must be a list of {len(scale)} integers, one per scale"]
    top = (1 << bw) - 1
    if any(not -top <= o <= 0 for o in offset):
        out.append(f"an 'offset' lies outside [-{top}, 0]")
    if sym and any(o != -(1 << (bw - 1)) for o in offset):
        out.append(f"symmetric {bw}-bit encodings have offset {-(1 << (bw - 1))}")
    n = len(scale)
    if enc == "PER_TENSOR" and n != 1:
        out.append(f"PER_TENSOR has one scale, got {n}")
    blocks = None
    if enc in ("PER_BLOCK", "LPBQ"):
        bs = e.get("block_size")
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0:
            return out + [f"{enc} needs a positive integer 'block_size', got {bs!r}"]
        if shape is not None and len(shape) == 2:
            fits = [(c, k // bs) for c, k in ((shape[0], shape[1]), (shape[1], shape[0])) if k % bs == 0]
            if not fits:
                out.append(f"block_size {bs} divides neither axis of shape {list(shape)}")
            blocks = fits
    if shape is not None and len(shape) == 2:
        if enc == "PER_CHANNEL" and n not in shape:
            out.append(f"{n} scales fit neither the channels of shape {list(shape)}")
        if enc == "PER_BLOCK" and blocks is not None and not any(c * b == n for c, b in blocks):
            out.append(f"{n} scales fit neither the channels x blocks of shape {list(shape)}")
        if enc == "LPBQ" and blocks is not None and not any(c == n for c, _ in blocks):
            out.append(f"LPBQ has one float scale per output channel: {n} fit no axis of shape {list(shape)}")
    if enc == "LPBQ":
        cbw, ints = e.get("compressed_bw"), e.get("per_block_int_scale")
        if not isinstance(cbw, int) or isinstance(cbw, bool) or not 1 <= cbw < bw:
            return out + [f"LPBQ needs an integer 'compressed_bw' below bw {bw}, got {cbw!r}"]
        if sym is not True:
            out.append("LPBQ encodings are symmetric ('is_sym': true)")
        limit = 1 << (bw - cbw)
        if not isinstance(ints, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= limit
                                                 for v in ints):
            out.append(f"'per_block_int_scale' must be a list of integers in [1, {limit}]")
        elif blocks is not None and not any(c == n and c * b == len(ints) for c, b in blocks):
            out.append(f"{len(ints)} per-block scales fit no channels x blocks of shape {list(shape)}")
    return out


def _validate_v1(doc: Mapping, where: str, shapes: dict, known: set[str] | None) -> None:
    problems: list[str] = []
    for section in ("param_encodings", "activation_encodings"):
        entries = doc.get(section, [] if section == "activation_encodings" else None)
        if not isinstance(entries, list):
            problems.append(f"'{section}' must be a list of encodings with a 'name' each (version 1.0.0)")
            continue
        for i, e in enumerate(entries):
            name = e.get("name") if isinstance(e, Mapping) else None
            label = f"{section}[{i}]" + (f" ('{name}')" if isinstance(name, str) else "")
            if not isinstance(name, str):
                problems.append(f"{label}: needs a 'name' (string)")
            elif section == "param_encodings" and shapes and name not in shapes:
                problems.append(f"{label}: no initializer of that name in the graph")
            elif known is not None and name not in known:
                problems.append(f"{label}: no tensor of that name in the graph")
            problems.extend(f"{label}: {m}" for m in _v1_problems(e, shapes.get(name) if isinstance(name, str)
                                                                  else None))
            if len(problems) > 50:
                break
    _raise(where, problems)


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
    if doc["version"] == QNN_LPBQ_VERSION:
        for e in doc["param_encodings"]:
            if e["dtype"] == "FLOAT":
                out[e["name"]] = {"precision": f"fp{e['bw']}", "symmetric": None, "scales": None, "offsets": None}
                continue
            lpbq = e["enc_type"] == "LPBQ"
            out[e["name"]] = {"precision": _lpbq_precision(e["compressed_bw"], e["bw"]) if lpbq else f"int{e['bw']}",
                              "symmetric": e["is_sym"], "scales": np.array(e["scale"], dtype=np.float64),
                              "offsets": np.array(e["offset"], dtype=np.int64)}
            if lpbq:
                out[e["name"]]["per_block_int_scale"] = np.array(e["per_block_int_scale"], dtype=np.int64)
        return out
    for tensor, encs in doc["param_encodings"].items():
        e0 = encs[0]
        if e0["dtype"] == "float":
            out[tensor] = {"precision": f"fp{e0['bitwidth']}", "symmetric": None, "scales": None, "offsets": None}
        else:
            out[tensor] = {"precision": f"int{e0['bitwidth']}", "symmetric": _bool_str(e0["is_symmetric"]),
                           "scales": np.array([e["scale"] for e in encs], dtype=np.float64),
                           "offsets": np.array([e["offset"] for e in encs], dtype=np.int64)}
    return out


def _lpbq_precision(compressed_bw: int, bw: int) -> str:
    """The registered two-level precision an LPBQ encoding stands for."""
    from ..quantize.plan import PRECISIONS
    for p in PRECISIONS.values():
        if p.two_level and p.bits == compressed_bw and p.scale_bits == bw - compressed_bw:
            return p.name
    raise PlanError(f"no registered precision has {compressed_bw}-bit codes with {bw - compressed_bw}-bit sub-scales; "
                    "register one (workbench.register_precision) to read this LPBQ encoding")


def write_calibration_raw(out_dir: Path, name: str, feeds: Sequence[Mapping[str, np.ndarray]],
                          input_order: Sequence[str]) -> Path:
    """Raw tensors (native dtype, C order) per sample and an input list in QNN's ``name:=path`` format."""
    lines = []
    for k, feed in enumerate(feeds):
        d = out_dir / "calibration" / name / f"{k:03d}"
        d.mkdir(parents=True, exist_ok=True)
        parts = []
        for inp in input_order:
            f = d / f"{inp}.raw"
            np.ascontiguousarray(feed[inp]).tofile(f)
            parts.append(f"{inp}:={f.relative_to(out_dir)}")
        lines.append(" ".join(parts))
    lst = out_dir / f"input_list_{name}.txt"
    lst.write_text("\n".join(lines) + "\n")
    return lst


def _dims(proto) -> list[tuple[str, str]]:
    init = {i.name for i in proto.graph.initializer}
    out = []
    for vi in proto.graph.input:
        if vi.name not in init:
            out.append((vi.name, ",".join(str(d.dim_value) for d in vi.type.tensor_type.shape.dim)))
    return out


def write_qnn_bundle(out_dir: str | Path, export, qm, feeds: Mapping[str, Sequence[Mapping[str, np.ndarray]]], *,
                     activation_bits: int = DEFAULT_ACTIVATION_BITWIDTH, weight_bits: int = 8,
                     soc_model: str | None = None, kv_encodings: Mapping[str, float] | None = None) -> dict:
    """Write validated overrides, calibration inputs and ``commands.sh`` for the static graphs of ``export``."""
    import onnx
    out = Path(out_dir)
    graphs = {"prefill": export.prefill_path, "decode": export.decode_path}
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    cmds = ["#!/usr/bin/env bash",
            "# Build QNN HTP context binaries from the workbench's static graphs. Needs the Qualcomm AI Engine Direct",
            "# SDK: source $QNN_SDK_ROOT/bin/envsetup.sh first. Run from this directory.",
            "set -euo pipefail", ""]
    for name, path in graphs.items():
        proto = onnx.load(str(path), load_external_data=False)
        written = write_qnn_encodings(out / f"quant_overrides_{name}.json", qm, export, graph=path,
                                      activation_bitwidth=activation_bits, kv_encodings=kv_encodings)
        notes += [n for n in written.notes if n not in notes]
        order = [n for n, _ in _dims(proto)]
        write_calibration_raw(out, name, feeds[name], order)
        conv = ["qnn-onnx-converter", "--input_network", Path(path).name, "--output_path", f"qnn/{name}.cpp",
                "--input_list", f"input_list_{name}.txt", "--quantization_overrides", f"quant_overrides_{name}.json",
                "--act_bitwidth", str(activation_bits), "--weights_bitwidth", str(weight_bits), "--bias_bitwidth", "32",
                "--use_per_channel_quantization"]
        for inp, dims in _dims(proto):
            conv += ["--input_dim", inp, dims]
        cmds.append(" ".join(shlex.quote(c) for c in conv))
        cmds.append(f"qnn-model-lib-generator -c qnn/{name}.cpp -b qnn/{name}.bin -o qnn/lib -t x86_64-linux-clang")
        ctx = ["qnn-context-binary-generator", "--backend", "$QNN_SDK_ROOT/lib/x86_64-linux-clang/libQnnHtp.so",
               "--model", f"qnn/lib/x86_64-linux-clang/lib{name}.so", "--binary_file", f"{name}_htp",
               "--output_dir", "qnn/context"]
        if soc_model:
            ctx += ["--config_file", "htp_config.json"]
        cmds.append(" ".join(ctx))
        cmds.append("")
    if soc_model:
        (out / "htp_config.json").write_text(json.dumps({"backend_extensions": {"shared_library_path":
                                                         "libQnnHtpNetRunExtensions.so", "config_file_path":
                                                         "htp_backend.json"}}, indent=1))
    script = out / "commands.sh"
    script.write_text("\n".join(cmds) + "\n")
    script.chmod(0o755)
    return {"commands": str(script), "notes": notes}


HTP_WINDOWS = 4  # prefill windows scored on the HTP emulator (seconds each on the demo model)
HTP_DECODE_WINDOWS = 1  # windows decoded step by step on it (about a second per step on the demo model)
HTP_GAP_KL = 1e-2  # HTP against CPU QDQ above this KL: flagged (measured 1e-4 where the two agree)


def _soc_for(job):
    """The Snapdragon of ``--soc`` with the plan checked against what its HTP runs, or None."""
    if not job.soc:
        return None, FLOAT_WEIGHT_TYPE
    soc = htp_soc(job.soc)
    refused = float_layers_refused(job.prep.qm.precisions, soc)
    if not refused:
        return soc, FLOAT_WEIGHT_TYPE
    job.report.notes.append(f"{soc.label} runs no 16-bit weights (HTP v73+ does): the layer(s) the plan keeps in "
                            f"float, {', '.join(refused)}, get 8-bit weights (QUInt8) in the QDQ graphs; give them "
                            "int8 in the plan to measure that in the simulation too")
    job.report.details["htp_adapted_layers"] = refused
    return soc, "QUInt8"


def _run_on_htp(job, soc, sx, prefill_qdq: Path, ev, feed: Mapping[str, np.ndarray]) -> None:
    """Context binaries for ``soc``, each under its context limit (``--split-limit-mib``, else the SoC's: a graph
    over it is split into parts), and (with an evaluator) prefill and decode scored on the HTP emulator."""
    if not qnn_available():
        job.report.notes.append(f"onnxruntime-qnn is not installed, so nothing ran on the HTP ({soc.label}): "
                                f"{INSTALL}")
        return
    decode_qdq = prefill_qdq.with_name("decode.qdq.onnx")
    out = job.out / f"htp-{soc.device}"
    limit = job.split_limit_bytes or soc.context_limit_bytes
    job.say(f"compiling for {soc.label} with onnxruntime-qnn, then running on its HTP emulator")
    info = {"soc": soc.label, "device": soc.device, "soc_model": soc.soc_model, "arch": soc.arch,
            "context_limit_bytes": limit, "soc_context_limit_bytes": soc.context_limit_bytes}
    if ev is None:
        written = write_htp_binaries({"prefill": prefill_qdq, "decode": decode_qdq}, out, soc, limit=limit)
        info["context_binaries"], parts = written["context_binaries"], written["parts"]
    else:
        windows = [ev.ids[w.begin:w.end].tolist() for w in ev.windows[:HTP_WINDOWS]]
        m = measure_htp([sx.prefill_path, sx.decode_path], [prefill_qdq, decode_qdq], windows, device=soc,
                        out_dir=out, decode_windows=HTP_DECODE_WINDOWS, limit=limit)
        info["measurement"] = {k: v for k, v in m.to_dict().items() if k != "parts"}  # the parts: info["parts"]
        info["context_binaries"], parts = m.context_files, m.parts
    if parts:
        _report_parts(job, soc, parts, prefill_qdq, feed, out, info)
    if ev is not None:
        off = [g for g in ("prefill", "decode") if getattr(m, g)["kl_vs_simulation"] > HTP_GAP_KL]
        if off and not job.report.gap:
            job.report.gap = (f"on the HTP emulator ({soc.label}) the {' and '.join(off)} graph differs from CPU QDQ "
                              f"(KL {max(getattr(m, g)['kl_vs_simulation'] for g in off):.3g} > {HTP_GAP_KL:g}): "
                              "the NPU does not compute what the QDQ simulation does")
        _compare_layers(job, soc, prefill_qdq, windows[0], info)
        job.report.notes.append(
            f"on the HTP emulator ({soc.label}): prefill KL {m.prefill['kl_vs_float']:.5f} / top-1 "
            f"{m.prefill['top1_vs_float']:.4f} vs float, KL {m.prefill['kl_vs_simulation']:.2e} vs CPU QDQ "
            f"({m.prefill['tokens']} positions); decode KL {m.decode['kl_vs_float']:.5f} / top-1 "
            f"{m.decode['top1_vs_float']:.4f} vs float, KL {m.decode['kl_vs_simulation']:.2e} vs CPU QDQ "
            f"({m.decode['tokens']} steps after a {m.decode['prompt']}-token prompt)")
    job.report.details["htp"] = info
    if not parts:
        sizes = ", ".join(f"{Path(c['ctx']).name} + {c['bytes'] / 1e6:.1f} MB" for c in info["context_binaries"])
        job.report.notes.append(f"context binaries for {soc.label}: {sizes}"
                                + (f" (limit {_mib(limit)} per context)" if limit else "") + f", in {out}")


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _blocks(first: int, end: int) -> str:
    return f"block {first}" if end - first == 1 else f"blocks {first}-{end - 1}"


def _report_parts(job, soc, parts: dict, prefill_qdq: Path, feed: Mapping[str, np.ndarray], out: Path,
                  info: dict) -> None:
    """The split in the notes (parts and sizes, graph by graph) and ``details.htp.parts``; the prefill parts chained
    on the CPU against the whole QDQ prefill graph, for one calibration sample (a difference is a gap)."""
    prefill = parts["graphs"]["prefill"]["parts"]
    files = [out / p["qdq"] for p in prefill]
    chained = check_chained(prefill_qdq, files, feed) if len(files) > 1 else None
    info["parts"] = {**parts, "manifest": str(out / PARTS_FILE), "prefill_chained_on_cpu": chained}
    whose = "--split-limit-mib" if job.split_limit_bytes else f"{soc.label}'s own"
    graphs = "; ".join(f"{g} in {len(d['parts'])} part(s): " + ", ".join(
        f"{p['ctx'].removesuffix('_ctx.onnx')} ({_blocks(*p['blocks'])}) {_mib(p['bytes'])}" for p in d["parts"])
        for g, d in parts["graphs"].items())
    job.report.notes.append(f"split to fit a context limit of {_mib(parts['limit_bytes'])} ({whose}): {graphs}; "
                            f"listed in order, with the tensors passed between parts, in {out / PARTS_FILE}")
    if chained is not None and chained["identical"]:
        job.report.notes.append(f"the prefill parts chained on the CPU give the whole QDQ prefill graph's "
                                f"{chained['outputs']} outputs bit for bit")
    elif chained is not None and not job.report.gap:
        job.report.gap = (f"the prefill parts chained on the CPU differ from the whole QDQ prefill graph (largest "
                          f"difference {chained['max_abs_diff']:.3g}): the split does not compute what the graph does")


def _compare_layers(job, soc, prefill_qdq: Path, window, info: dict) -> None:
    """Each weighted layer alone on the HTP against the CPU QDQ graph (``htp.layer_divergence``), from one window;
    the departing layers are named in the notes and in ``details.htp.divergence`` (what ``plan --htp-divergence``
    raises to int8)."""
    job.say("comparing each layer alone on the HTP emulator with the CPU QDQ graph")
    feed = OnnxCausalLM(prefill_qdq, session_options=lean_session).prefill_feed(list(window))
    div = layer_divergence(prefill_qdq, feed, soc, rows=len(window))
    info["divergence"] = div
    worst = max(div["layers"].items(), key=lambda kv: kv[1]["relative_error"])
    if div["departing"]:
        job.report.notes.append(f"on the HTP ({soc.label}) {len(div['departing'])} layer(s) run alone depart from the "
                                f"simulation (relative error above {DEPART_ERROR:g}): {', '.join(div['departing'])}; "
                                f"`workbench plan MODEL ... --htp-divergence {job.out}` holds them at int8")
    else:
        job.report.notes.append(f"every one of the {len(div['layers'])} weighted layers, run alone on the HTP "
                                f"({soc.label}), stays within {DEPART_ERROR:g} relative error of the simulation "
                                f"(largest {worst[1]['relative_error']:.2g}, {worst[0]})")


def convert_qnn(job) -> None:
    """The static graphs with the plan's encodings and the SDK's commands, and their QDQ twin measured here;
    with ``--soc``, compiled for that Snapdragon by onnxruntime-qnn and run on its HTP emulator. A VLM: its vision
    encoder as its own fixed-size graph (``htp_vision``), then its language model as a text model."""
    if getattr(job.prep.float_lm, "is_vision", False):
        _convert_vision_language(job)
    else:
        _convert_text(job)


def _convert_text(job) -> None:
    soc, float_weights = _soc_for(job)
    job.say(f"exporting the float model to ONNX with static shapes {job.static}")
    sx = job.export_static(job.out)
    ev = qdq_evaluator(job)  # the float model leaves memory before the float graphs run for calibration
    feeds = job.feeds(sx)
    prefill_qdq = qdq_twin(job, sx, job.out / "ort-qdq-twin", feeds, float_weight_type=float_weights)
    kv = job.report.details["qdq"].get("kv_cache") or {}
    info = write_qnn_bundle(job.out, sx, job.prep.qm, feeds, activation_bits=job.activation_bits,
                            kv_encodings=kv.get("encodings"))
    job.report.notes += info["notes"]
    job.report.notes.append("the metrics above come from the QDQ twin of the same static graphs (same bit widths, "
                            "same mask fix) in onnxruntime CPU" + ("" if soc else "; --soc DEVICE runs it on the HTP "
                                                                   "emulator too (onnxruntime-qnn)"))
    for g in ("prefill", "decode"):
        job.report.details[f"inspection_{g}"] = inspect_graph(job.out / f"{g}.onnx", "qnn").summary()
    measure_qdq(job, prefill_qdq, ev)
    if soc is not None:
        _run_on_htp(job, soc, sx, prefill_qdq, ev, feeds["prefill"][0])


VISION_DIR = "vision"  # a VLM's encoder graphs, its QDQ twin and (with --soc) its context binary, in the output


def _convert_vision_language(job) -> None:
    """A VLM for Hexagon as Qualcomm ships one: the vision encoder (with the projector) as its own graph at one
    picture size, QDQ at the plan's weights and 16-bit activations, compiled and scored on the HTP emulator
    (``details.vision_encoder``); the language model then through the text path (the report's own figures and
    ``details.htp``), its layers named as a text model's (``model.text_part``)."""
    p = job.prep
    soc = htp_soc(job.soc) if job.soc else None
    out = job.out / VISION_DIR
    job.say("exporting the vision encoder as its own fixed-size graph")
    vx = export_vision_encoder(p.float_lm, out)
    feeds = calibration_feeds(p.float_lm, vx)
    job.say(f"quantizing the vision encoder to QDQ (A{job.activation_bits}, weights as the plan says), calibrated on "
            f"{len(feeds)} pictures")
    qdq = vision_qdq(vx, p.qm, feeds, out / "vision_encoder.qdq.onnx", activation_bits=job.activation_bits,
                     notes=job.report.notes)
    view = vision_quantized(p.qm, vx)
    written = write_qnn_encodings(job.out / "quant_overrides_vision_encoder.json", view, vx, graph=vx.path,
                                  activation_bitwidth=job.activation_bits)
    write_calibration_raw(job.out, "vision_encoder", feeds, ["pixel_values"])
    precisions = dict(Counter(view.precisions.get(name) or "float" for name in vx.weight_names))
    details = {"graph": str(vx.path), "qdq_graph": str(qdq), "image_size": list(vx.image_size),
               "grid_thw": list(vx.grid_thw), "image_tokens": vx.output_shape[0], "input_shape": list(vx.input_shape),
               "onnx_vs_pytorch_max_abs_diff": vx.max_abs_diff, "layer_precisions": precisions,
               "activation_bits": job.activation_bits, "calibration_pictures": len(feeds),
               "overrides": str(written.path)}
    job.report.details["vision_encoder"] = details
    on_htp = soc is not None and qnn_available()
    if soc is not None and not on_htp:
        job.report.notes.append(f"onnxruntime-qnn is not installed, so the vision encoder did not run on the HTP "
                                f"({soc.label}): {INSTALL}")
    htp_dir = out / f"htp-{soc.device}" if soc is not None else None
    if job.evaluate_outputs:
        details.update(measure_vision_encoder(p, vx, qdq, soc=soc if on_htp else None, out_dir=htp_dir, say=job.say))
        _note_vision(job, details)
    elif on_htp:
        details["htp"] = {"soc": soc.label, "device": soc.device,
                          **write_context_binaries({"vision_encoder": qdq}, htp_dir, soc)[0]}
    job.say("converting the language model as a text model")
    text = ConvertJob(PreparedModels(language_model_view(p.float_lm), language_model_view(p.sim_lm),
                                     text_part_quantized(p.qm), p.source), job.out, job.report, job.work,
                      text=job.text, max_tokens=job.max_tokens, ctx=job.ctx, activation_bits=job.activation_bits,
                      accuracy_level=job.accuracy_level, static=job.static, calibration_samples=job.calibration_samples,
                      calibration_seq_len=job.calibration_seq_len, greedy_steps=job.greedy_steps,
                      evaluate_outputs=job.evaluate_outputs, progress=job.progress, say=job.say,
                      owns_models=job.owns_models, soc=job.soc, split_limit_bytes=job.split_limit_bytes)
    _convert_text(text)
    _vision_commands(job.out, vx, job.activation_bits)


def _note_vision(job, d: dict) -> None:
    """The vision encoder's figures in the notes, and a gap when the HTP departs from the QDQ simulation."""
    size = f"{d['image_size'][1]}x{d['image_size'][0]}"
    q = d["qdq"]
    job.report.notes.append(
        f"vision encoder ({size} pictures, {d['image_tokens']} image tokens, weights "
        f"{', '.join(f'{k} x{v}' for k, v in d['layer_precisions'].items())}, A{d['activation_bits']}): CPU QDQ "
        f"embeddings cosine {q['embeddings']['vs_float']['cosine']:.4f} / relative error "
        f"{q['embeddings']['vs_float']['relative_error']:.3f} vs float; the whole model with its embeddings: answer KL "
        f"{q['answers']['whole_model']['answer_kl']:.5f} (the PyTorch simulation's "
        f"{d['simulation_answers']['answer_kl']:.5f}) on {d['pictures']} pictures")
    h = d.get("htp")
    if not h:
        return
    e = h["embeddings"]
    job.report.notes.append(
        f"vision encoder on the HTP emulator ({h['soc']}): {Path(h['context_binary']).name} + "
        f"{h['bytes'] / 2**20:.2f} MiB; embeddings cosine {e['vs_simulation']['cosine']:.4f} / relative error "
        f"{e['vs_simulation']['relative_error']:.3f} vs the CPU QDQ graph, {e['vs_float']['cosine']:.4f} / "
        f"{e['vs_float']['relative_error']:.3f} vs float; answer KL {h['answers']['whole_model']['answer_kl']:.5f} "
        f"(whole model), {h['answers']['float_language_model']['answer_kl']:.5f} (float language model); "
        f"{h['time']['median_ms']:.0f} ms per picture on the emulator (median after a warm-up; not a phone's time)")
    if e["vs_simulation"]["relative_error"] > VISION_GAP_ERROR and not job.report.gap:
        job.report.gap = (f"on the HTP emulator ({h['soc']}) the vision encoder's embeddings are "
                          f"{e['vs_simulation']['relative_error']:.3f} off the CPU QDQ graph's (relative error > "
                          f"{VISION_GAP_ERROR:g}): the NPU does not compute what the simulation does")


def _vision_commands(out: Path, vx, activation_bits: int) -> None:
    """The SDK's commands for the vision encoder, after the language model's in ``commands.sh``."""
    n, k = vx.input_shape
    conv = ["qnn-onnx-converter", "--input_network", f"{VISION_DIR}/{vx.path.name}", "--output_path",
            "qnn/vision_encoder.cpp", "--input_list", "input_list_vision_encoder.txt", "--quantization_overrides",
            "quant_overrides_vision_encoder.json", "--act_bitwidth", str(activation_bits), "--weights_bitwidth", "8",
            "--bias_bitwidth", "32", "--use_per_channel_quantization", "--input_dim", "pixel_values", f"{n},{k}"]
    lines = [" ".join(shlex.quote(c) for c in conv),
             "qnn-model-lib-generator -c qnn/vision_encoder.cpp -b qnn/vision_encoder.bin -o qnn/lib "
             "-t x86_64-linux-clang",
             "qnn-context-binary-generator --backend $QNN_SDK_ROOT/lib/x86_64-linux-clang/libQnnHtp.so --model "
             "qnn/lib/x86_64-linux-clang/libvision_encoder.so --binary_file vision_encoder_htp --output_dir "
             "qnn/context", ""]
    script = out / "commands.sh"
    with open(script, "a", encoding="utf-8") as f:
        f.write("# the vision encoder (pixel patches in, image embeddings out)\n" + "\n".join(lines) + "\n")


def _write(path, lm, plan, *, quantized=None, export=None, calibration=None) -> OverrideFile:
    return write_qnn_encodings(path, quantized, export, calibration=calibration)


def _read(path, lm, export=None) -> dict[str, str]:
    return layers_from_tensors(read_qnn_encodings(path), export, path)


TARGET = register_target(Target(
    "qnn", "Qualcomm QNN HTP", rules="qnn", convert=convert_qnn, runnable=True, int_bits=(4, 8),
    float_bits=(16, 32), overrides=OverrideFormat("qnn", _write, _read, needs_quantized=True, needs_graph=True),
    module=__name__, two_level=((4, 4),), options=("static", "soc"),
    precision_note="HTP runs 4 and 8-bit weights; two-level scales as LPBQ: 4-bit codes with 4-bit sub-scales "
                   "(compressed_bw 4, bw 8)"))
