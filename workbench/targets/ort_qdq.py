"""ONNX Runtime QDQ, ``ort-qdq``: static QDQ models for its QNN execution provider, and its override files.

    doc = ort_overrides(qm, export)                        # the plan as TensorQuantOverrides (one policy)
    quantize_qdq("onnx/prefill.onnx", "prefill.qdq.onnx", feeds, init_overrides=doc["init_overrides"])
    get_qnn_qdq_config(model, reader, activation_type=QuantType.QUInt16, **load_ort_overrides("ort.json"))

The one ONNX Runtime policy, used by the override file (``workbench overrides --format ort``), the
``ort-qdq`` conversion and the QDQ twin measured for ``qnn``; it is what onnxruntime 1.32's QDQ
quantizer accepts and runs on its CPU, and what the QNN execution provider takes:

- integer layers keep the plan's width: int4 as ``QInt4`` (``QUInt4`` when asymmetric), int8 as
  ``QInt8`` / ``QUInt8``, per output channel; per-channel plans carry their exact scales and zero
  points, group-wise plans their type, symmetry and axis (QDQ for QNN has no block scales, so
  onnxruntime computes per-channel scales and the notes say so);
- layers the plan keeps in float get 16-bit weights (``QUInt16``, an A16W16 MatMul) instead of being
  excluded: a float weight beside 16-bit activations is the float x fixed-point MatMul HTP rejects;
- activations are 16-bit (``QUInt16``), and the causal mask is pinned: it is built from float32's
  minimum, which min/max calibration turns into a scale of ~1e34 that wipes out attention, so the
  mask tensors get [-MASK_RANGE, MASK_RANGE] instead.

Rules: ``assets/targets/qnn.json`` (QDQ models are for the QNN execution provider); runner:
``OnnxCausalLM`` on onnxruntime's CPU.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Iterable, Mapping

import numpy as np

from ..errors import PlanError
from ..onnx.export import share_external_data
from ..runtime.onnx_runner import OnnxCausalLM
from ..quantize.plan import get_precision
from ..files.workspace import atomic_write_json
from .base import inspect_graph
from .common import OverrideFile, graph_names, layers_from_tensors, read_json_object, tensor_for
from .ort_int4 import release_float_model
from .qdq_weights import prequantize_weights
from .registry import OverrideFormat, Target, check_precisions, register_target

__all__ = ["MASK_RANGE", "ORT_TYPES", "FLOAT_WEIGHT_TYPE", "causal_mask_tensors", "ort_overrides", "lean_session",
           "write_ort_overrides", "load_ort_overrides", "read_ort_overrides", "activation_ranges", "quantize_qdq",
           "paired_tensors", "decode_shared_ranges", "KV_BITS_KEY", "kv_cache_bits", "kv_cache_encodings",
           "quantize_kv_cache", "kv_cache_dtype", "int8_kv_cache", "qdq_twin", "open_qdq_graphs", "TARGET"]

MASK_RANGE = 100.0  # exp(-100) is 0 in every float format: masked keys stay masked, real scores keep their resolution
ORT_TYPES = {(8, True): "QInt8", (8, False): "QUInt8", (4, True): "QInt4", (4, False): "QUInt4",
             (16, True): "QInt16", (16, False): "QUInt16"}
FLOAT_WEIGHT_TYPE = "QUInt16"  # weights of layers the plan keeps in float
ACTIVATION_TYPES = {8: "QUInt8", 16: "QUInt16"}


def causal_mask_tensors(proto, threshold: float = -1e30) -> list[str]:
    """Float tensors downstream of a huge negative constant, up to (not past) the Softmax that consumes them."""
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data
    seeds = set()
    for init in proto.graph.initializer:
        if init.data_type in (1, 10, 16) and int(np.prod(init.dims or [1])) <= 16 and not uses_external_data(init):
            if float(numpy_helper.to_array(init).min(initial=0)) <= threshold:
                seeds.add(init.name)
    for node in proto.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.t.data_type in (1, 10, 16) and int(np.prod(a.t.dims or [1])) <= 16:
                    if float(numpy_helper.to_array(a.t).min(initial=0)) <= threshold:
                        seeds.add(node.output[0])
    masked, out = set(seeds), []
    float_ops = {"Where", "Add", "Expand", "Slice", "Reshape", "Concat", "Mul", "Unsqueeze", "Squeeze", "Transpose",
                 "Min", "Max", "Sub", "Tile", "Gather"}
    for node in proto.graph.node:
        if node.op_type in float_ops and any(i in masked for i in node.input):
            masked.update(node.output)
            out.extend(node.output)
    return out


def _ort_axis(layout: str | None, tensor: str) -> int:
    if layout == "in_out" or (layout is None and tensor.endswith(".T")):
        return 1
    return 0


def ort_overrides(quantized, export, *, notes: list[str] | None = None, twin: bool = False,
                  float_weight_type: str = FLOAT_WEIGHT_TYPE) -> dict:
    """``{"init_overrides": ..., "float_weights": ...}``: the plan in onnxruntime's TensorQuantOverrides.

    ``twin``: for QNN's QDQ twin, whose precisions the QNN target has already checked; its two-level
    (LPBQ) layers are written as group-wise ones, with onnxruntime's own scales.
    """
    notes = notes if notes is not None else []
    weight_names, layouts = graph_names(export)
    if not twin:
        check_precisions(TARGET, quantized.precisions, "ONNX Runtime QDQ")
    else:
        lpbq = [n for n, qw in quantized.weights.items() if qw.two_level]
        if lpbq:
            bits = quantized.weights[lpbq[0]].bits
            notes.append(f"the QDQ twin holds {len(lpbq)} two-level (LPBQ) layer(s) as {bits}-bit weights with "
                         "per-channel scales onnxruntime computes (QDQ has no LPBQ): its figures approximate what "
                         "HTP runs from the LPBQ encodings")
    init_overrides: dict[str, list[dict]] = {}
    float_weights: dict[str, str] = {}
    grouped = []
    for r in quantized.layers:
        prec = get_precision(r.precision)
        if prec is None:
            continue
        tensor = tensor_for(weight_names, r.name)
        if tensor in init_overrides:
            continue  # tied: the tensor is written once
        if prec.is_float:
            float_weights[tensor] = prec.name
            init_overrides[tensor] = [{"quant_type": float_weight_type}]
            continue
        qw = quantized.weights[r.name]
        qtype = ORT_TYPES[(qw.bits, qw.symmetric)]
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
        notes.append(f"{len(float_weights)} layer(s) the plan keeps in float get {float_weight_type} weights "
                     f"({'an A16W16 MatMul' if float_weight_type == FLOAT_WEIGHT_TYPE else 'what this HTP runs'}): "
                     "HTP rejects a float weight beside fixed-point activations")
    return {"init_overrides": init_overrides, "float_weights": float_weights}


def write_ort_overrides(path: str | Path, quantized, export) -> OverrideFile:
    notes: list[str] = []
    doc = ort_overrides(quantized, export, notes=notes)
    p = atomic_write_json(Path(path), doc)
    return OverrideFile(p, "ort", len(doc["init_overrides"]), notes,
                        "get_qnn_qdq_config(model, reader, activation_type=QuantType.QUInt16, "
                        f"**workbench.precision.overrides.load_ort_overrides('{p}'))")


def _with_quant_types(init_overrides: Mapping[str, list[dict]], where: str) -> dict[str, list[dict]]:
    """JSON overrides with ``QuantType`` members and float32 scales, as onnxruntime takes them."""
    from onnxruntime.quantization import QuantType
    init = {}
    for tensor, entries in init_overrides.items():
        out = []
        for e in entries:
            e = dict(e)
            if "quant_type" in e:
                try:
                    e["quant_type"] = QuantType[e["quant_type"]]
                except KeyError:
                    raise PlanError(f"{where}: tensor '{tensor}' has unknown quant_type {e.get('quant_type')!r}; "
                                    f"use one of {list(QuantType.__members__)}") from None
            for k in ("scale", "rmin", "rmax"):
                if k in e:
                    e[k] = np.array(e[k], np.float32)
            out.append(e)
        init[tensor] = out
    return init


def load_ort_overrides(path: str | Path) -> dict:
    """Keyword arguments for ``get_qnn_qdq_config``: ``init_overrides`` with real ``QuantType`` values."""
    doc = read_json_object(path, "ONNX Runtime overrides")
    if not isinstance(doc.get("init_overrides"), Mapping):
        raise PlanError(f"'{path}' has no 'init_overrides' object; write it with `workbench overrides --format ort`")
    return {"init_overrides": _with_quant_types(doc["init_overrides"], f"'{path}'")}


def read_ort_overrides(path: str | Path) -> dict[str, dict]:
    """``{tensor: {"precision", "symmetric", "scales", "zero_points"}}`` as the file says."""
    doc = read_json_object(path, "ONNX Runtime overrides")
    by_type = {v: k for k, v in ORT_TYPES.items()}
    floats = doc.get("float_weights", {})
    out = {}
    for tensor, entries in doc.get("init_overrides", {}).items():
        if tensor in floats:
            out[tensor] = {"precision": floats[tensor], "symmetric": None, "scales": None, "zero_points": None}
            continue
        bits, sym = by_type[entries[0]["quant_type"]]
        sym = entries[0].get("symmetric", sym)
        has = "scale" in entries[0]
        out[tensor] = {"precision": f"int{bits}", "symmetric": sym,
                       "scales": np.array([e["scale"] for e in entries]) if has else None,
                       "zero_points": np.array([e["zero_point"] for e in entries]) if has else None}
    return out


def _side_graph(float_onnx: Path, tag: str) -> Path:
    """A scratch graph path beside ``float_onnx``, so its external-data locations resolve unchanged."""
    return float_onnx.parent / f".{float_onnx.stem}.{tag}.{os.getpid()}.onnx"


def _quantizable_graph(float_onnx: Path, needs_opset21: bool) -> Path | None:
    """``float_onnx`` moved to opset 21 when 16-bit or 4-bit types need it, converted and written without its weights.

    onnxruntime would do this itself on the whole model, weights included (three copies in memory and
    another on disk); the graph's nodes are all that change. None when no conversion is needed.
    """
    import onnx
    proto = onnx.load(str(float_onnx), load_external_data=False)
    opset = next(x.version for x in proto.opset_import if x.domain in ("", "ai.onnx"))
    if opset >= 21 or not needs_opset21:
        return None
    inline = [i for i in proto.graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL]
    converted = onnx.version_converter.convert_version(proto, 21)
    path = _side_graph(float_onnx, "opset21")
    if sum(i.ByteSize() for i in inline) >= 1 << 30:  # an inline graph that large: keep its weights out of protobuf
        onnx.save(converted, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(converted, str(path))
    return path


def lean_session(options) -> None:
    """No memory arena and no memory pattern: a session over weights behind ``DequantizeLinear`` otherwise keeps
    every dequantized weight's buffer (calibration at the Qwen2.5-0.5B shape: 4.0 GB resident, 2.6 GB without)."""
    options.enable_mem_pattern = False
    options.enable_cpu_mem_arena = False


def _look_up_before_dequantizing(graph) -> None:
    """``DequantizeLinear(table) -> Gather`` rewritten as ``Gather(table) -> DequantizeLinear`` where the table has
    one scale: the same values (dequantizing is element by element), without the whole table in float32
    (545 MB at the Qwen2.5-0.5B shape) for a lookup of a few rows. For calibration runs only."""
    import onnx
    inits = {i.name for i in graph.initializer}
    dq = {n.output[0]: n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
          and not any(a.name == "axis" for a in n.attribute)}
    scalar = {i.name for i in graph.initializer if not i.dims}
    nodes = []
    for n in graph.node:
        d = dq.get(n.input[0]) if n.op_type == "Gather" else None
        if d is not None and all(i in scalar for i in d.input[1:]):
            looked_up = n.output[0] + "__wb_codes"
            nodes.append(onnx.helper.make_node("Gather", [d.input[0], n.input[1]], [looked_up], name=n.name,
                                               axis=next((a.i for a in n.attribute if a.name == "axis"), 0)))
            nodes.append(onnx.helper.make_node("DequantizeLinear", [looked_up, *d.input[1:]], [n.output[0]],
                                               name=n.name + "__wb_dequantize"))
        else:
            nodes.append(n)
    read = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(n for n in nodes if n.op_type != "DequantizeLinear" or n.output[0] in read)  # the tables' own


def activation_ranges(graph: str | Path, feeds: Iterable[Mapping[str, np.ndarray]], op_types: Iterable[str]):
    """onnxruntime's MinMax calibration ranges (``TensorsData``) from one session over per-tensor ReduceMin/ReduceMax.

    The same tensors as ``MinMaxCalibrater`` (its own selection), the same reductions and the same
    merge over samples (NaN-ignoring min and max); but each sample's two scalars per tensor are merged
    as soon as they come back, and the weights stay where they are (external data), read once by the session.
    """
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import CalibrationMethod, MinMaxCalibrater, TensorsData
    graph = Path(graph)
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(graph), load_external_data=False))
    tensors, value_infos = MinMaxCalibrater.select_tensors_to_calibrate(
        SimpleNamespace(op_types_to_calibrate=list(op_types)), proto)
    weights = {n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}  # pre-quantized weights
    tensors = sorted(set(tensors) - weights)
    _look_up_before_dequantizing(proto.graph)
    del proto.graph.output[:]
    for t in tensors:
        elem = value_infos[t].type.tensor_type.elem_type
        for op in ("ReduceMin", "ReduceMax"):
            out = f"{t}__wb_{op}"
            proto.graph.node.append(onnx.helper.make_node(op, [t], [out], keepdims=1, name=out))
            proto.graph.output.append(onnx.helper.make_tensor_value_info(out, elem, None))
    side = _side_graph(graph, "ranges")
    try:
        onnx.save(proto, str(side))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as the calibrator runs it
        lean_session(options)
        session = ort.InferenceSession(str(side), options, providers=["CPUExecutionProvider"])
    finally:
        side.unlink(missing_ok=True)
    lows: list = [None] * len(tensors)
    highs: list = [None] * len(tensors)
    n = 0
    for feed in feeds:
        outs = session.run(None, dict(feed))
        for k in range(len(tensors)):
            lo, hi = outs[2 * k].reshape(-1), outs[2 * k + 1].reshape(-1)
            lows[k] = lo if lows[k] is None else np.fmin(lows[k], lo)
            highs[k] = hi if highs[k] is None else np.fmax(highs[k], hi)
        n += 1
    if not n:
        raise ValueError("no calibration inputs: give at least one feed")
    return TensorsData(CalibrationMethod.MinMax, {t: (lo, hi) for t, lo, hi in zip(tensors, lows, highs)})


def _node_key(node) -> tuple[str, str]:
    """Where a node sits (its name's scope, without the builder's running number) and what it computes."""
    return node.name.rpartition("/")[0], node.op_type


def paired_tensors(source, target) -> dict[str, str]:
    """``{tensor of target: the tensor of source that holds the same quantity}`` for two graphs of one model.

    The prefill and decode graphs compute the same per-token quantities in the same order; the
    decode graph adds the KV-cache concatenations, and the builder's running numbers in node names
    differ. Nodes are aligned by (scope, operator) in graph order; tensors of the same name pair
    with themselves, and a decode graph's ``past_key_values.{i}.{key,value}`` with ``present.{i}.*``
    (the cache the prefill graph writes is what the decode graph reads).
    """
    from difflib import SequenceMatcher
    a, b = list(source.graph.node), list(target.graph.node)
    pairs: dict[str, str] = {}
    matcher = SequenceMatcher(None, [_node_key(n) for n in a], [_node_key(n) for n in b], autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            for oa, ob in zip(a[block.a + k].output, b[block.b + k].output):
                if oa and ob:
                    pairs[ob] = oa
    # graph inputs and outputs have fixed names; internal names carry running numbers that differ
    ends_a = {v.name for v in (*source.graph.input, *source.graph.output)}
    for v in (*target.graph.input, *target.graph.output):
        if v.name in ends_a:
            pairs[v.name] = v.name
        elif v.name.startswith("past_key_values.") and "present." + v.name[len("past_key_values."):] in ends_a:
            pairs[v.name] = "present." + v.name[len("past_key_values."):]
    return pairs


def _widened(ranges, shared: Mapping[str, tuple[float, float]]):
    """``ranges`` (``TensorsData``) with each tensor's range widened to cover ``shared[tensor]``."""
    from onnxruntime.quantization.calibrate import TensorData, TensorsData
    out = {}
    for t, td in ranges.data.items():
        lo, hi = td.range_value
        if t in shared:
            s_lo, s_hi = shared[t]
            lo = np.minimum(lo, np.asarray(s_lo, dtype=lo.dtype))
            hi = np.maximum(hi, np.asarray(s_hi, dtype=hi.dtype))
        out[t] = TensorData(lowest=lo, highest=hi)
    return TensorsData(ranges.calibration_method, out)


def quantize_qdq(float_onnx: str | Path, out_path: str | Path, feeds: Iterable[Mapping[str, np.ndarray]], *,
                 init_overrides: Mapping[str, list[dict]] | None = None, activation_bits: int = 16,
                 per_channel: bool = True, mask_range: float = MASK_RANGE,
                 shared_ranges: Mapping[str, tuple[float, float]] | None = None, quantized=None,
                 export=None) -> dict:
    """Static QDQ quantization with onnxruntime's QNN configuration and ``init_overrides`` (``ort_overrides``).

    Activations get ``activation_bits`` (16 or 8, unsigned, as HTP wants); weights without an
    override 8 bit. A graph with external data gives a QDQ graph with external data. The activation
    ranges are onnxruntime's MinMax calibration, computed by ``activation_ranges`` and handed to its
    quantizer, and the opset change 16-bit types need is made on the graph alone. With ``quantized``
    (the plan's ``QuantizedModel``) and ``export`` (the graph's ``ExportResult``) the MatMul weights are
    written first, from the plan's integers, one tensor at a time (``prequantize_weights``), and the
    activations are calibrated on the graph with those weights: onnxruntime then never holds the
    float weights. ``shared_ranges`` (``{tensor: (lo, hi)}``) widens the calibrated ranges: the decode
    graph takes the prefill graph's (``paired_tensors``). The result's ``ranges`` are the ranges used,
    ``{tensor: (lo, hi)}``; ``prequantized`` how many weights were written from the plan.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_static
    from onnxruntime.quantization.calibrate import save_tensors_data
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    if activation_bits not in ACTIVATION_TYPES:
        raise ValueError(f"activation_bits must be 8 or 16, got {activation_bits}")
    float_onnx = Path(float_onnx)
    mask = causal_mask_tensors(onnx.load(str(float_onnx), load_external_data=False))
    overrides = {t: [{"rmin": -mask_range, "rmax": mask_range}] for t in mask}
    overrides.update(init_overrides or {})
    config = get_qnn_qdq_config(str(float_onnx), None,
                                activation_type=QuantType[ACTIVATION_TYPES[activation_bits]],
                                weight_type=QuantType.QUInt8, per_channel=per_channel,
                                init_overrides=_with_quant_types(overrides, str(float_onnx)) or None)
    wide_or_4bit = {QuantType.QInt16, QuantType.QUInt16, QuantType.QInt4, QuantType.QUInt4}  # DequantizeLinear-21 types
    tensor_overrides = config.extra_options["TensorQuantOverrides"]
    needs_opset21 = config.activation_type in wide_or_4bit or config.weight_type in wide_or_4bit or any(
        e.get("quant_type") in wide_or_4bit for entries in tensor_overrides.values() for e in entries)
    out_path = Path(out_path)
    partial = out_path.parent / f".{out_path.name}.partial"  # graph and its data file named as they will stay
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    root = logging.getLogger()  # the quantizer logs advice to the root logger; keep CLI and notebook output clean
    level = root.level
    root.setLevel(logging.ERROR)
    converted = side = None
    written: set[str] = set()
    try:
        converted = _quantizable_graph(float_onnx, needs_opset21)
        graph = converted or float_onnx
        excluded: list[str] = []
        if quantized is not None:
            side, written, excluded = prequantize_weights(graph, quantized, export, tensor_overrides,
                                                          _side_graph(float_onnx, "qweights"))
            for t in written:
                del tensor_overrides[t]
            graph = side
        ranges = activation_ranges(graph, feeds, config.op_types_to_quantize)
        if shared_ranges:
            ranges = _widened(ranges, shared_ranges)
        used = {t: (float(np.min(td.range_value[0])), float(np.max(td.range_value[1])))
                for t, td in ranges.data.items()}
        save_tensors_data(ranges, partial / "ranges.json")
        quantize_static(str(graph), partial / out_path.name, None, calibration_cache_path=partial / "ranges.json",
                        calibrate_method=config.calibrate_method, quant_format=config.quant_format,
                        activation_type=config.activation_type, weight_type=config.weight_type,
                        op_types_to_quantize=config.op_types_to_quantize, nodes_to_quantize=config.nodes_to_quantize,
                        nodes_to_exclude=list(config.nodes_to_exclude or []) + excluded, per_channel=config.per_channel,
                        reduce_range=config.reduce_range, use_external_data_format=config.use_external_data_format,
                        extra_options=config.extra_options)
        (partial / "ranges.json").unlink()
        for f in sorted(partial.iterdir(), key=lambda f: f.suffix == ".onnx"):  # the graph last
            f.replace(out_path.parent / f.name)
    finally:
        root.setLevel(level)
        shutil.rmtree(partial, ignore_errors=True)
        for g in (converted, side):
            if g is not None:
                g.unlink(missing_ok=True)
                Path(str(g) + ".data").unlink(missing_ok=True)
    return {"mask_tensors": mask, "mask_range": mask_range, "activation_bits": activation_bits,
            "per_channel": per_channel, "ranges": used, "prequantized": len(written)}


def decode_shared_ranges(prefill_onnx: str | Path, decode_onnx: str | Path,
                         prefill_ranges: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """The prefill graph's calibrated ranges under the decode graph's tensor names (``paired_tensors``).

    A decode step computes, per token, what the prefill graph computes at that position, but its
    calibration sees one token per sample where the prefill graph's sees every position: on its own
    it misses the outliers and clips them (KL 0.036 against 2.1e-4 for prefill on the demo model).
    """
    import onnx
    pairs = paired_tensors(onnx.load(str(prefill_onnx), load_external_data=False),
                           onnx.load(str(decode_onnx), load_external_data=False))
    return {d: prefill_ranges[p] for d, p in pairs.items() if p in prefill_ranges}


KV_BITS_KEY = "kv_cache_bits"  # plan.meta: the KV cache's width in the QDQ graphs (8: Qualcomm's w4a16 recipe)
KV_TENSOR = re.compile(r"^(past_key_values|present)\.(\d+)\.(key|value)$")


def kv_cache_bits(plan) -> int | None:
    """The KV-cache width a plan asks for (``meta["kv_cache_bits"]``: 8), or None (the activations' width)."""
    bits = (plan.meta or {}).get(KV_BITS_KEY) if plan is not None else None
    if bits is None:
        return None
    if bits != 8:
        raise PlanError(f"plan meta '{KV_BITS_KEY}' is {bits!r}; the QDQ graphs carry an 8-bit KV cache (8) or the "
                        "activations' width (leave it out)")
    return 8


def _encoded_range(graph, q_node) -> tuple[float, float]:
    """The real range a QuantizeLinear's scale and zero point cover."""
    from onnx import numpy_helper
    inits = {i.name: i for i in graph.initializer}
    scale = float(numpy_helper.to_array(inits[q_node.input[1]]).reshape(-1)[0])
    zp = numpy_helper.to_array(inits[q_node.input[2]])
    info = np.iinfo(zp.dtype)
    z = int(zp.reshape(-1)[0])
    return (info.min - z) * scale, (info.max - z) * scale


def _kv_quantize_nodes(graph) -> dict[str, object]:
    """``{past/present tensor: the QuantizeLinear that encodes it}`` in a QDQ graph."""
    producer = {o: n for n in graph.node for o in n.output}
    out = {}
    for v in graph.input:
        if KV_TENSOR.match(v.name):
            q = next((n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == v.name), None)
            if q is not None:
                out[v.name] = q
    for v in graph.output:
        dq = producer.get(v.name)
        if KV_TENSOR.match(v.name) and dq is not None and dq.op_type == "DequantizeLinear":
            q = producer.get(dq.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                out[v.name] = q
    return out


def kv_cache_encodings(graphs) -> dict[str, float]:
    """``{"<layer>.key": scale}``: one symmetric 8-bit scale per layer's key and value, covering what every graph's
    16-bit encoding of that layer's past and present covers (prefill's present, decode's past and present), so
    past and present share it and the cache a graph writes is what the next one reads, code for code."""
    import onnx
    amax: dict[str, float] = {}
    for path in graphs:
        proto = onnx.load(str(path), load_external_data=False)
        for tensor, q in _kv_quantize_nodes(proto.graph).items():
            _, layer, kind = KV_TENSOR.match(tensor).groups()
            lo, hi = _encoded_range(proto.graph, q)
            key = f"{layer}.{kind}"
            amax[key] = max(amax.get(key, 0.0), abs(lo), abs(hi))
    return {k: (v or 1e-8) / 127.0 for k, v in amax.items()}


def quantize_kv_cache(path: str | Path, encodings: Mapping[str, float]) -> int:
    """Rewrite a QDQ graph's KV cache as int8 with ``encodings`` (``kv_cache_encodings``): each past input and
    present output becomes an int8 tensor of the graph (symmetric, zero point 0), read by its
    ``DequantizeLinear`` and written by its ``QuantizeLinear`` directly, so a runtime keeps and feeds back the
    codes themselves (a quarter of float32's bytes) and never requantizes them. Returns the tensors changed."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    path = Path(path)
    proto = onnx.load(str(path), load_external_data=False)
    g = proto.graph
    nodes = _kv_quantize_nodes(g)
    have = {i.name for i in g.initializer}
    renamed = set()
    for tensor, q in nodes.items():
        _, layer, kind = KV_TENSOR.match(tensor).groups()
        scale, zero = f"kv_cache.{layer}.{kind}_scale", f"kv_cache.{layer}.{kind}_zero_point"
        if scale not in have:
            g.initializer.extend([numpy_helper.from_array(np.array(encodings[f"{layer}.{kind}"], np.float32), scale),
                                  numpy_helper.from_array(np.array(0, np.int8), zero)])
            have |= {scale, zero}
        dqs = [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]]
        if tensor.startswith("past_key_values."):  # int8 input straight into its DequantizeLinear
            for dq in dqs:
                dq.input[0], dq.input[1], dq.input[2] = tensor, scale, zero
            g.node.remove(q)
            renamed.add(q.output[0])
            vi = next(v for v in g.input if v.name == tensor)
        else:  # the QuantizeLinear's int8 output is the graph's output; the float copy is internal
            q.input[1], q.input[2] = scale, zero
            inner = tensor + "_dequantized"
            for n in g.node:
                for k, name in enumerate(n.input):
                    if name == tensor:
                        n.input[k] = inner
            for dq in dqs:
                dq.input[0], dq.input[1], dq.input[2] = tensor, scale, zero
                if dq.output[0] == tensor:
                    dq.output[0] = inner
            renamed.add(q.output[0])
            q.output[0] = tensor
            vi = next(v for v in g.output if v.name == tensor)
        vi.type.tensor_type.elem_type = TensorProto.INT8
    keep = [v for v in g.value_info if v.name not in renamed and not KV_TENSOR.match(v.name)]
    del g.value_info[:]
    g.value_info.extend(keep)
    used = {i for n in g.node for i in n.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    tmp = path.with_name(path.name + ".partial")
    onnx.save(proto, str(tmp))
    os.replace(tmp, path)
    return len(nodes)


def kv_cache_dtype(path: str | Path):
    """The numpy dtype of a graph's KV-cache inputs or outputs (float32, or int8 after ``quantize_kv_cache``)."""
    import onnx
    from onnx import helper
    g = onnx.load(str(path), load_external_data=False).graph
    for v in (*g.input, *g.output):
        if KV_TENSOR.match(v.name):
            return np.dtype(helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type))
    return None


def int8_kv_cache(paths, notes: list[str] | None = None) -> dict:
    """The prefill and decode QDQ graphs ``paths`` rewritten with one shared int8 encoding per layer's key and
    value (``kv_cache_encodings``, ``quantize_kv_cache``); what was done, for the conversion's details."""
    import onnx
    encodings = kv_cache_encodings(paths)
    changed = sum(quantize_kv_cache(p, encodings) for p in paths)
    past = [v for v in onnx.load(str(paths[-1]), load_external_data=False).graph.input if KV_TENSOR.match(v.name)]
    per_token = sum(v.type.tensor_type.shape.dim[1].dim_value * v.type.tensor_type.shape.dim[3].dim_value
                    for v in past)
    if notes is not None:
        notes.append(f"KV cache int8 (Qualcomm's w4a16 recipe): {len(encodings)} symmetric 8-bit encodings, each "
                     "shared by a layer's past input and present output in both graphs, which read and write the "
                     f"int8 codes themselves ({per_token:,} bytes a token against {4 * per_token:,} in float32)")
    return {"bits": 8, "symmetric": True, "encodings": encodings, "tensors": changed, "bytes_per_token": per_token,
            "float32_bytes_per_token": 4 * per_token}


def qdq_twin(job, static_export, qdq_dir: Path, feeds: Mapping[str, list], *,
             float_weight_type: str = FLOAT_WEIGHT_TYPE) -> Path:
    """QDQ prefill/decode graphs of ``static_export`` by the plan (``ort_overrides``), calibrated on ``feeds``
    (``job.feeds``); returns the prefill graph. ``float_weight_type``: the weights of layers the plan keeps float."""
    report = job.report
    notes: list[str] = []
    doc = ort_overrides(job.prep.qm, static_export, notes=notes, twin=True, float_weight_type=float_weight_type)
    report.notes += notes
    job.say(f"quantizing to QDQ (A{job.activation_bits}, weights as the plan says)")
    infos, paths = {}, [qdq_dir / "prefill.qdq.onnx", qdq_dir / "decode.qdq.onnx"]
    weights = {"quantized": job.prep.qm, "export": static_export}
    infos["prefill"] = quantize_qdq(static_export.prefill_path, paths[0], feeds["prefill"],
                                    init_overrides=doc["init_overrides"], activation_bits=job.activation_bits,
                                    **weights)
    shared = decode_shared_ranges(static_export.prefill_path, static_export.decode_path, infos["prefill"]["ranges"])
    infos["decode"] = quantize_qdq(static_export.decode_path, paths[1], feeds["decode"],
                                   init_overrides=doc["init_overrides"], activation_bits=job.activation_bits,
                                   shared_ranges=shared, **weights)
    report.notes.append(f"{infos['prefill']['prequantized']} weights written from the plan's integers (per-channel "
                        "plans: its codes and scales; others: onnxruntime's parameters), one tensor at a time; the "
                        "activations calibrated with those weights in place")
    report.notes.append(f"the decode graph's activation ranges cover the prefill graph's for the same quantities "
                        f"({len(shared)} tensors, the KV-cache inputs as the prefill graph writes them): its own "
                        f"calibration has one token per sample ({len(feeds['decode'])})")
    if share_external_data(paths, "weights.qdq.data"):
        report.notes.append("the QDQ graphs keep their weights in one shared weights.qdq.data")
    bits = sorted({e[0]["quant_type"] for e in doc["init_overrides"].values()})
    report.details["qdq"] = {"activation_bits": job.activation_bits, "weight_types": bits,
                             "static": list(job.static), "mask_tensors": len(infos["prefill"]["mask_tensors"]),
                             "mask_range": infos["prefill"]["mask_range"]}
    if kv_cache_bits(job.prep.qm.plan):
        report.details["qdq"]["kv_cache"] = int8_kv_cache(paths, report.notes)
    for g in ("prefill", "decode"):
        report.details[f"inspection_qdq_{g}"] = inspect_graph(qdq_dir / f"{g}.qdq.onnx", "qnn").summary()
    return paths[0]


def qdq_evaluator(job):
    """The float model's and the simulation's scores on windows of the static sequence length; then the float
    model, when the conversion loaded it, leaves memory before the QDQ graphs are made (None: no evaluation)."""
    eval_ctx = min(job.ctx or job.static[0], job.static[0])
    if eval_ctx != (job.ctx or job.default_ctx):
        job.report.notes.append(f"evaluated with {eval_ctx}-token windows, the static graph's sequence length "
                                "(the simulation is scored on the same windows)")
    ev = job.evaluator(eval_ctx)
    if job.owns_models:
        release_float_model(job.prep, keep=[ev.head] if ev is not None else [])
    return ev


def measure_qdq(job, prefill_qdq: Path, ev, decode_qdq: Path | None = None) -> None:
    """Score the QDQ prefill graph, and the decode graph teacher-forced, with ``qdq_evaluator``'s scores beside them."""
    if ev is None:
        return
    ev.fill(job.report, ev.score(OnnxCausalLM(prefill_qdq, session_options=lean_session).logits, "qdq"), prefill_qdq)
    decode_qdq = decode_qdq or prefill_qdq.with_name("decode.qdq.onnx")
    if decode_qdq.is_file():
        job.say("scoring the QDQ decode graph, teacher-forced")
        runner = OnnxCausalLM(prefill_qdq, decode_qdq, session_options=lean_session)
        ev.fill_decode(job.report, ev.score_decode(runner, "qdq"), decode_qdq)


def convert_ort_qdq(job) -> None:
    job.say(f"exporting the float model to ONNX with static shapes {job.static}")
    sx = job.export_static(job.work / "static")
    ev = qdq_evaluator(job)  # the float model leaves memory before the float graphs run for calibration
    feeds = job.feeds(sx)
    measure_qdq(job, qdq_twin(job, sx, job.out, feeds), ev)


def _write(path, lm, plan, *, quantized=None, export=None, calibration=None) -> OverrideFile:
    return write_ort_overrides(path, quantized, export)


def _read(path, lm, export=None) -> dict[str, str]:
    return layers_from_tensors(read_ort_overrides(path), export, path)


def open_qdq_graphs(folder: str | Path, *, threads: int | None = None) -> OnnxCausalLM:
    """The QDQ prefill and decode graphs of an ort-qdq conversion in onnxruntime's CPU provider."""
    return OnnxCausalLM(Path(folder) / "prefill.qdq.onnx", Path(folder) / "decode.qdq.onnx", threads=threads)


TARGET = register_target(Target(
    "ort-qdq", "ONNX Runtime QDQ for the QNN execution provider", rules="qnn", convert=convert_ort_qdq,
    runnable=True, runner=open_qdq_graphs, files=("prefill.qdq.onnx", "decode.qdq.onnx"), int_bits=(4, 8),
    float_bits=(16, 32), options=("static",),
    precision_note="its QDQ weights are 4 or 8-bit with float scales onnxruntime's quantizer computes: two-level "
                   "scales go through ort-int4 or qnn (LPBQ)",
    overrides=OverrideFormat("ort", _write, _read, needs_quantized=True, needs_graph=True),
    module=__name__))
