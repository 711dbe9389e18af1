"""Qualcomm QNN (HTP), ``qnn``: encodings overrides, calibration inputs and the SDK's commands.

    doc = qnn_encodings(qm, export)                  # qnn-onnx-converter --quantization_overrides
    validate_qnn_encodings(doc, onnx_path=export.prefill_path)
    convert("demo", "qnn", "out/qnn", bits=4)        # bundle + the measured QDQ twin (``ort_qdq``)

The SDK (``qnn-onnx-converter``, ``qnn-model-lib-generator``, ``qnn-context-binary-generator``)
cannot be installed here, so the conversion writes everything it needs next to the static
prefill/decode graphs: ``quant_overrides_<graph>.json``, ``input_list_<graph>.txt`` with raw
calibration tensors, and ``commands.sh``. What runs here is the QDQ twin of the same graphs.

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
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..errors import PlanError
from ..plan import get_precision
from ..workspace import atomic_write_json
from .base import inspect_graph
from .common import OverrideFile, graph_consumers, graph_names, layers_from_tensors, read_json_object, tensor_for
from .ort_qdq import MASK_RANGE, causal_mask_tensors, measure_qdq, qdq_evaluator, qdq_twin
from .registry import OverrideFormat, Target, check_precisions, register_target

__all__ = ["QNN_ENCODINGS_VERSION", "DEFAULT_ACTIVATION_BITWIDTH", "qnn_encodings", "write_qnn_encodings",
           "read_qnn_encodings", "validate_qnn_encodings", "graph_tensor_names", "range_encoding",
           "write_qnn_bundle", "write_calibration_raw", "TARGET"]

QNN_ENCODINGS_VERSION = "0.6.1"
DEFAULT_ACTIVATION_BITWIDTH = 16  # A16W8 / A16W4: what LLMs on Hexagon use; 8-bit activations wreck attention
FLOAT16 = [{"bitwidth": 16, "dtype": "float"}]


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


def _float_encoding(precision) -> list[dict]:
    return [{"bitwidth": int(precision.bits), "dtype": "float"}]


def _load_graph(export, graph: str | Path | None):
    """The graph (proto, without weights) the encodings are for: ``graph``, else the export's prefill graph."""
    import onnx
    path = graph if graph is not None else getattr(export, "prefill_path", None)
    return (None, None) if path is None else (Path(path), onnx.load(str(path), load_external_data=False))


def qnn_encodings(quantized, export, *, graph: str | Path | None = None, calibration=None,
                  activation_bitwidth: int = DEFAULT_ACTIVATION_BITWIDTH, notes: list[str] | None = None) -> dict:
    """The QNN/AIMET encodings of a ``QuantizedModel`` for the graph ``export`` wrote (or ``graph``, its twin).

    ``calibration`` (``CalibrationStats``) adds ``activation_bitwidth``-bit ranges for the inputs
    of the integer MatMuls, from the largest |x| seen.
    """
    notes = notes if notes is not None else []
    weight_names, _ = graph_names(export)
    check_precisions(TARGET, [r.precision for r in quantized.layers], "QNN")
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
        if qw.group_size is not None and qw.n_groups > 1:
            blockwise.append(r.name)
    if blockwise:
        notes.append(f"{len(blockwise)} layer(s) have several blocks per output channel (group size "
                     f"{quantized.plan.group_size}): written as per-block encodings, channel-major; plan with "
                     "group_size null for one encoding per output channel")
    doc = {"version": QNN_ENCODINGS_VERSION, "activation_encodings": {}, "param_encodings": params}
    path, proto = _load_graph(export, graph)
    if proto is None:
        notes.append("activation encodings (float MatMuls, the causal mask, calibration ranges) need the graph "
                     "file; pass the ExportResult, not a mapping")
        return doc
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
    if mask:
        notes.append(f"{len(mask)} causal-mask tensor(s) pinned to [-{MASK_RANGE:g}, {MASK_RANGE:g}] (min/max "
                     "calibration would give them a scale of ~1e34 and wipe out attention)")
    return doc


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
                        activation_bitwidth: int = DEFAULT_ACTIVATION_BITWIDTH) -> OverrideFile:
    """Write the encodings JSON after checking it (format, and names against the graph when it is at hand)."""
    notes: list[str] = []
    doc = qnn_encodings(quantized, export, graph=graph, calibration=calibration,
                        activation_bitwidth=activation_bitwidth, notes=notes)
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
                     soc_model: str | None = None) -> dict:
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
                                      activation_bitwidth=activation_bits)
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


def convert_qnn(job) -> None:
    """The static graphs with the plan's encodings and the SDK's commands, and their QDQ twin measured here."""
    job.say(f"exporting the float model to ONNX with static shapes {job.static}")
    sx = job.export_static(job.out)
    feeds = job.feeds(sx)
    ev = qdq_evaluator(job)
    prefill_qdq = qdq_twin(job, sx, job.out / "ort-qdq-twin", feeds)
    info = write_qnn_bundle(job.out, sx, job.prep.qm, feeds, activation_bits=job.activation_bits)
    job.report.notes += info["notes"]
    job.report.notes.append("QNN itself cannot run here: the metrics come from the QDQ twin of the same static "
                            "graphs (same bit widths, same mask fix) in onnxruntime CPU")
    for g in ("prefill", "decode"):
        job.report.details[f"inspection_{g}"] = inspect_graph(job.out / f"{g}.onnx", "qnn").summary()
    measure_qdq(job, prefill_qdq, ev)


def _write(path, lm, plan, *, quantized=None, export=None, calibration=None) -> OverrideFile:
    return write_qnn_encodings(path, quantized, export, calibration=calibration)


def _read(path, lm, export=None) -> dict[str, str]:
    return layers_from_tensors(read_qnn_encodings(path), export, path)


TARGET = register_target(Target(
    "qnn", "Qualcomm QNN HTP", rules="qnn", convert=convert_qnn, runnable=True, int_bits=(4, 8),
    float_bits=(16, 32), overrides=OverrideFormat("qnn", _write, _read, needs_quantized=True, needs_graph=True),
    module=__name__))
