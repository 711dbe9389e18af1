"""QDQ weights written from the plan's own integers, one tensor at a time, before onnxruntime sees the graph.

    side, written = prequantize_weights(graph_path, quantized, export, init_overrides, side_path)
    quantize_static(side, ...)        # quantizes the activations; the weights are already DequantizeLinear inputs

onnxruntime's QDQ quantizer loads every float32 weight of a graph and holds it beside its quantized
copy while it writes the model (6.3 GB at the Qwen2.5-0.5B shape). Its quantizer also leaves alone
any tensor a ``DequantizeLinear`` already produces ("pre-quantized weights"). So each MatMul weight
is replaced here by ``{name}_quantized -> DequantizeLinear -> {name}``, its integers appended to a
data file as they are made:

- layers whose plan has one scale per output channel keep the plan's codes, scales and zero points
  exactly (GPTQ's or the scale search's codes included, which re-rounding the float weights with the
  plan's scales would lose);
- layers onnxruntime computes the scales of (group-wise and two-level plans, which QDQ for QNN cannot
  carry, and 16-bit weights of layers the plan keeps in float) get onnxruntime's own parameters
  (``compute_data_quant_params``, per channel or per tensor as its quantizer would) from the float
  weight, read from the graph's data file one tensor at a time.

Embedding tables (``Gather`` data) are written the same way and their lookups left out of
onnxruntime's pass (its quantizer cannot share parameters with a tensor it did not quantize): a
table quantized per tensor gives the lookup's output the Q/DQ pair onnxruntime would (the table's own
scale and zero point); one quantized per row (a per-channel integer embedding) cannot lend its
per-row scales to the output, which gets an activation Q/DQ pair from its calibrated range instead
(onnxruntime's own quantizer fails on it: "scale must be 1D tensor with size 128").
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import PlanError
from .common import graph_names

__all__ = ["prequantize_weights"]

QUANTIZED_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX = "_quantized", "_scale", "_zero_point"  # onnxruntime's names


def _weight_readers(graph) -> dict[str, list]:
    """``{initializer: [nodes reading it]}`` for the graph's initializers."""
    inits = {i.name for i in graph.initializer}
    readers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            if i in inits:
                readers.setdefault(i, []).append(n)
    return readers


CHUNK_ELEMENTS = 1 << 22  # float values read at a time from a large weight (16 MB)


def _float_chunks(init, base: Path, chunk: int = CHUNK_ELEMENTS):
    """One float initializer's values as flat pieces in order, read from its data file a piece at a time."""
    from onnx import numpy_helper
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data
    if not uses_external_data(init):
        flat = numpy_helper.to_array(init).ravel()
        yield from (flat[i:i + chunk] for i in range(0, flat.size, chunk))
        return
    info = ExternalDataInfo(init)
    dtype = np.dtype(numpy_helper.helper.tensor_dtype_to_np_dtype(init.data_type))
    count = int(np.prod(init.dims))
    with open(base / info.location, "rb") as f:
        f.seek(info.offset or 0)
        for start in range(0, count, chunk):
            n = min(chunk, count - start)
            yield np.fromfile(f, dtype=dtype, count=n)


def _float_array(init, base: Path) -> np.ndarray:
    """One float initializer's values (a layer's weight: the largest are written per tensor, in pieces)."""
    return np.concatenate(list(_float_chunks(init, base))).reshape(tuple(init.dims))


def _plan_codes(qw, dims: tuple[int, ...], axis: int) -> np.ndarray:
    """The plan's codes ``[out, in]`` laid out as the graph's weight (``[in, out]`` when the axis is 1; a lookup
    table's rows, axis 0, as they are)."""
    codes = qw.qweight.cpu().numpy()
    codes = codes.T if axis == 1 else codes
    if tuple(codes.shape) != tuple(dims):
        raise PlanError(f"the plan's codes are {tuple(qw.shape)} but the graph's weight is {tuple(dims)}: export "
                        "the model the plan was made for")
    return codes


class _DataFile:
    """Tensors appended to one external-data file as they are made; each proto points into it."""

    def __init__(self, path: Path):
        self.path, self._f = path, open(path, "wb")

    def put(self, tensor):
        """``tensor`` with its bytes moved into the file."""
        raw = tensor.raw_data
        tensor.ClearField("raw_data")
        return self.put_pieces(tensor, [raw])

    def put_pieces(self, tensor, pieces):
        """``tensor`` (no data of its own) pointing at ``pieces`` (bytes), written one after the other."""
        from onnx import TensorProto
        offset = self._f.tell()
        if offset % 4096:
            self._f.write(b"\0" * (4096 - offset % 4096))
            offset = self._f.tell()
        for piece in pieces:
            self._f.write(piece)
        tensor.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.path.name), ("offset", str(offset)), ("length", str(self._f.tell() - offset))):
            e = tensor.external_data.add()
            e.key, e.value = k, v
        return tensor

    def close(self):
        self._f.close()


def _quantized_tensor(name: str, values: np.ndarray, qtype) -> "object":
    """An integer TensorProto of ``values`` (4-bit types packed two to a byte, as ONNX stores them)."""
    import ml_dtypes
    from onnx import TensorProto, numpy_helper
    if qtype in (TensorProto.INT4, TensorProto.UINT4):
        values = values.astype(ml_dtypes.int4 if qtype == TensorProto.INT4 else ml_dtypes.uint4)
    else:
        values = values.astype(numpy_helper.helper.tensor_dtype_to_np_dtype(qtype))
    return numpy_helper.from_array(values, name)


def _per_tensor(init, base: Path, qtype, symmetric: bool, data: _DataFile):
    """onnxruntime's per-tensor quantization of one float weight, computed and written a piece at a time:
    its range over every piece, then each piece through its own ``quantize_nparray`` (element by element)."""
    from onnx import TensorProto, numpy_helper
    from onnxruntime.quantization.quant_utils import compute_data_quant_params, quantize_nparray
    lo = hi = None
    for piece in _float_chunks(init, base):
        lo = piece.min() if lo is None else min(lo, piece.min())
        hi = piece.max() if hi is None else max(hi, piece.max())
    dtype = numpy_helper.helper.tensor_dtype_to_np_dtype(init.data_type)
    empty = np.zeros(0, dtype)
    zero, scale = compute_data_quant_params(empty if lo is None else np.array([lo, hi], dtype), qtype, symmetric)
    np_type = numpy_helper.helper.tensor_dtype_to_np_dtype(qtype)
    q = TensorProto()
    q.name, q.data_type = init.name + QUANTIZED_SUFFIX, qtype
    q.dims.extend(init.dims)
    pieces = (quantize_nparray(qtype, p, scale, zero).astype(np_type).tobytes() for p in _float_chunks(init, base))
    return data.put_pieces(q, pieces), zero, scale


def _role(init, readers: Mapping[str, list], entries) -> str | None:
    """"matmul" for a MatMul weight, "gather" for a lookup table quantized per tensor, "rows" for one quantized
    per row, None for the rest."""
    nodes = readers.get(init.name, [])
    if not entries or not nodes:
        return None
    if all(n.op_type == "MatMul" and list(n.input).index(init.name) == 1 for n in nodes):
        return "matmul"
    if all(n.op_type == "Gather" and list(n.input).index(init.name) == 0 for n in nodes):
        return "rows" if "axis" in entries[0] else "gather"
    return None


def prequantize_weights(graph_path: str | Path, quantized, export, init_overrides: Mapping[str, list[dict]],
                        side_path: str | Path) -> tuple[Path, set[str], list[str]]:
    """``graph_path`` with each overridden weight as integers behind a ``DequantizeLinear``, saved as ``side_path``
    (beside ``graph_path``, so its other data resolves) with the integers in ``side_path.data``.

    ``init_overrides``: onnxruntime's TensorQuantOverrides for the graph (``ort_overrides``, with
    ``QuantType`` members). MatMul weights get the plan's codes or onnxruntime's parameters; a lookup
    table quantized per tensor gets onnxruntime's, and its lookup's output the Q/DQ pair onnxruntime
    gives it (the table's scale and zero point), so the lookup is left out of onnxruntime's pass.
    Returns the side graph, the tensors written (whose overrides onnxruntime no longer needs) and the
    nodes onnxruntime must leave out.
    """
    import onnx
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.quant_utils import compute_data_quant_params, quantize_onnx_initializer

    graph_path, side_path = Path(graph_path), Path(side_path)
    base = graph_path.parent
    proto = onnx.load(str(graph_path), load_external_data=False)
    weight_names, _ = graph_names(export)
    layer_of = {t: layer for layer, t in weight_names.items()}
    readers = _weight_readers(proto.graph)
    data = _DataFile(side_path.with_name(side_path.name + ".data"))
    kept, added, dq_nodes, written, lookups = [], [], [], set(), {}
    try:
        for init in proto.graph.initializer:
            entries = init_overrides.get(init.name)
            role = _role(init, readers, entries)
            if role is None:
                kept.append(init)
                continue
            first = entries[0]
            qtype = first["quant_type"].tensor_type
            axis = first.get("axis")
            if "scale" in first:  # the plan's own codes and scales
                qw = quantized.weights[layer_of[init.name]]
                values = _plan_codes(qw, tuple(init.dims), axis)
                zp_dtype = numpy_helper.helper.tensor_dtype_to_np_dtype(qtype)
                scale = np.array([e["scale"] for e in entries], np.float32)
                zero = np.array([e["zero_point"] for e in entries], zp_dtype)
                if axis is None:
                    scale, zero = scale[0], zero[0]
                q = _quantized_tensor(init.name + QUANTIZED_SUFFIX, values, qtype)
            else:  # onnxruntime's own parameters, from the float weight
                symmetric = first.get("symmetric", axis is not None or qtype in (onnx.TensorProto.INT8,
                                                                                onnx.TensorProto.INT16,
                                                                                onnx.TensorProto.INT4))
                if axis is None and qtype not in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
                    q, zero, scale = _per_tensor(init, base, qtype, symmetric, data)  # the large ones: in pieces
                else:
                    w = _float_array(init, base)
                    if axis is None:
                        zero, scale = compute_data_quant_params(w.ravel(), qtype, symmetric)
                    else:
                        pairs = [compute_data_quant_params(w.take(c, axis).ravel(), qtype, symmetric)
                                 for c in range(w.shape[axis])]
                        zero, scale = np.asarray([p[0] for p in pairs]), np.asarray([p[1] for p in pairs])
                    q = quantize_onnx_initializer(numpy_helper.from_array(w, init.name), qtype, zero, scale, axis)
                    del w
            if q.data_location != onnx.TensorProto.EXTERNAL:  # made whole in memory: its bytes go to the file
                q = data.put(q)
            params = [init.name + SCALE_SUFFIX, init.name + ZERO_SUFFIX]
            added += [q, numpy_helper.from_array(np.asarray(scale, np.float32), params[0]),
                      numpy_helper.from_array(np.asarray(zero), params[1])]
            attrs = {} if axis is None else {"axis": int(axis)}
            dq_nodes.append(helper.make_node("DequantizeLinear", [q.name, *params], [init.name],
                                             name=f"{init.name}_DequantizeLinear", **attrs))
            written.add(init.name)
            if role != "matmul":
                for n in readers[init.name]:
                    lookups[id(n)] = params if role == "gather" else None
    finally:
        data.close()
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept + added)
    nodes, excluded = list(dq_nodes), []
    renamed: dict[str, str] = {}
    for n in proto.graph.node:
        for k, i in enumerate(n.input):
            if i in renamed:
                n.input[k] = renamed[i]
        nodes.append(n)
        if id(n) in lookups:
            excluded.append(n.name)
        if lookups.get(id(n)):  # the lookup's output: quantized as onnxruntime does, with the table's parameters
            y = n.output[0]
            nodes += [helper.make_node("QuantizeLinear", [y, *lookups[id(n)]], [y + "_QuantizeLinear_Output"],
                                       name=y + "_QuantizeLinear"),
                      helper.make_node("DequantizeLinear", [y + "_QuantizeLinear_Output", *lookups[id(n)]],
                                       [y + "_DequantizeLinear_Output"], name=y + "_DequantizeLinear")]
            renamed[y] = y + "_DequantizeLinear_Output"
    for out in proto.graph.output:
        if out.name in renamed:
            raise ValueError(f"a graph output ('{out.name}') is a table lookup's result; it cannot be renamed")
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    onnx.save(proto, str(side_path))
    return side_path, written, excluded
