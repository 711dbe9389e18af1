"""ONNX Runtime: QDQ models for its QNN execution provider, and INT4/INT8 ``MatMulNBits`` models for its CPU.

    qdq = quantize_qdq("onnx/prefill.onnx", "ort-qdq/prefill.qdq.onnx", feeds, activation_bits=16,
                       weight_bits_by_initializer={"lm_head.weight.T": 16})
    int4 = build_matmulnbits_onnx("onnx/prefill.onnx", "ort-int4/prefill.onnx", qm, export.weight_names,
                                  export.weight_layouts, accuracy_level=4)

``build_matmulnbits_onnx`` writes the integer codes, scales and zero points of the workbench's
``QuantizedModel`` into ``MatMulNBits`` nodes unchanged (no second quantization): the ONNX model
computes what the simulation computes, up to kernel arithmetic. ``accuracy_level`` 4 lets the
kernel quantize activations to int8 (faster decode on AVX2/NEON, small extra error); 0 keeps them
float. The causal-mask fix for QDQ: the mask is built from float32's minimum, which min/max
calibration turns into a scale of ~1e34 that wipes out attention; the mask tensors are pinned
to [-MASK_RANGE, MASK_RANGE] instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

__all__ = ["MASK_RANGE", "Int4Build", "causal_mask_tensors", "quantize_qdq", "build_matmulnbits_onnx",
           "matmulnbits_block_size", "ACCURACY_LEVELS"]

MASK_RANGE = 100.0  # exp(-100) is 0 in every float format: masked keys stay masked, real scores keep their resolution
ACCURACY_LEVELS = {0: "unset (float activations)", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8 activations"}


def causal_mask_tensors(proto, threshold: float = -1e30) -> list[str]:
    """Float tensors downstream of a huge negative constant, up to (not past) the Softmax that consumes them."""
    from onnx import numpy_helper
    seeds = set()
    for init in proto.graph.initializer:
        if init.data_type in (1, 10, 16) and int(np.prod(init.dims or [1])) <= 16:
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


class _FeedReader:
    """onnxruntime's CalibrationDataReader over a list of ready-made input dicts."""

    def __init__(self, feeds: Iterable[Mapping[str, np.ndarray]]):
        self._feeds = list(feeds)
        self._it = iter(self._feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):
        self._it = iter(self._feeds)


def quantize_qdq(float_onnx: str | Path, out_path: str | Path, feeds: Iterable[Mapping[str, np.ndarray]], *,
                 activation_bits: int = 16, weight_bits_by_initializer: Mapping[str, int] | None = None,
                 per_channel: bool = True, mask_range: float = MASK_RANGE) -> dict:
    """Static QDQ quantization with onnxruntime's QNN configuration; returns what was overridden.

    Activations get ``activation_bits`` (16 or 8, unsigned, as HTP wants); weights 8 bit unless
    ``weight_bits_by_initializer`` names another width (16 for layers the plan keeps in float).
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    if activation_bits not in (8, 16):
        raise ValueError(f"activation_bits must be 8 or 16, got {activation_bits}")
    types = {8: QuantType.QUInt8, 16: QuantType.QUInt16}
    proto = onnx.load(str(float_onnx))
    mask = causal_mask_tensors(proto)
    overrides: dict[str, list[dict]] = {t: [{"rmin": np.array(-mask_range, np.float32),
                                             "rmax": np.array(mask_range, np.float32)}] for t in mask}
    for name, bits in (weight_bits_by_initializer or {}).items():
        if bits not in (8, 16):
            raise ValueError(f"weight bits for '{name}' must be 8 or 16, got {bits}")
        if bits != 8:
            overrides[name] = [{"quant_type": types[bits]}]
    config = get_qnn_qdq_config(proto, _FeedReader(feeds), activation_type=types[activation_bits],
                                weight_type=QuantType.QUInt8, per_channel=per_channel,
                                init_overrides=overrides or None)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".partial")
    quantize(proto, tmp, config)
    tmp.replace(out_path)
    return {"mask_tensors": mask, "mask_range": mask_range, "activation_bits": activation_bits,
            "weight_overrides": {k: v for k, v in (weight_bits_by_initializer or {}).items() if v != 8},
            "per_channel": per_channel}


def matmulnbits_block_size(group_size: int) -> int | None:
    """The largest power of two (>= 16) dividing ``group_size``: MatMulNBits blocks must be powers of two."""
    b = group_size & -group_size
    return b if b >= 16 else None


@dataclass
class Int4Build:
    """What ``build_matmulnbits_onnx`` replaced and what it had to leave as dequantized float."""

    path: Path
    replaced: dict[str, str] = field(default_factory=dict)  # layer FQN -> MatMulNBits node name
    kept_float: dict[str, str] = field(default_factory=dict)  # layer FQN -> why (e.g. an embedding Gather)
    accuracy_level: int = 0


def _nbits_tensors(qw, block: int):
    """MatMulNBits B, scales and zero points from a QuantizedWeight, repeating scales when groups > blocks."""
    import torch

    from ..quantize import pack_int4
    n, k = qw.shape
    repeat = qw.effective_group_size // block
    scales = qw.scales.float().repeat_interleave(repeat, dim=1)  # [N, k_blocks]
    k_blocks = k // block
    codes = qw.storage_codes()  # uint8 [N, K], symmetric codes offset by 2^(bits-1) = MatMulNBits' default zero
    if qw.bits == 4:
        b = pack_int4(codes).reshape(n, k_blocks, block // 2)
    else:
        b = codes.reshape(n, k_blocks, block)
    zeros = None
    if qw.zeros is not None:
        z = qw.zeros.to(torch.uint8).repeat_interleave(repeat, dim=1)
        zeros = pack_int4(z) if qw.bits == 4 else z
    return b.numpy(), scales.numpy().astype(np.float32), None if zeros is None else zeros.numpy()


def build_matmulnbits_onnx(float_onnx: str | Path, out_path: str | Path, qm, weight_names: Mapping[str, str],
                           weight_layouts: Mapping[str, str], *, accuracy_level: int = 0) -> Int4Build:
    """Replace each quantized layer's MatMul with ``MatMulNBits`` carrying the workbench's own codes and scales.

    ``float_onnx`` must be exported from the simulation (``qm.apply_``), so layers that stay float
    (or that MatMulNBits cannot express) already hold exactly the simulated values.
    """
    import onnx
    from onnx import helper, numpy_helper

    if accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(f"accuracy_level must be one of {sorted(ACCURACY_LEVELS)}, got {accuracy_level}")
    proto = onnx.load(str(float_onnx))
    graph = proto.graph
    build = Int4Build(Path(out_path), accuracy_level=accuracy_level)
    consumers: dict[str, list] = {}
    for node in graph.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
    new_nodes: dict[int, object] = {}
    new_inits, drop_inits = [], set()
    done_weights: dict[str, tuple[str, str, str | None]] = {}
    for fqn, qw in qm.weights.items():
        init_name = weight_names.get(fqn)
        if init_name is None:
            build.kept_float[fqn] = "no initializer recorded for this layer"
            continue
        if weight_layouts.get(fqn) != "in_out":
            build.kept_float[fqn] = "weight is read by a Gather (embedding lookup), not a MatMul: kept as dequantized float"
            continue
        users = consumers.get(init_name, [])
        if not users or any(u.op_type != "MatMul" or u.input[1] != init_name for u in users):
            build.kept_float[fqn] = "weight feeds something other than MatMul's B input: kept as dequantized float"
            continue
        block = matmulnbits_block_size(qw.effective_group_size)
        if block is None:
            build.kept_float[fqn] = (f"group size {qw.effective_group_size} has no power-of-two block >= 16: kept as "
                                     "dequantized float")
            continue
        n, k = qw.shape
        if init_name not in done_weights:
            b, scales, zeros = _nbits_tensors(qw, block)
            base = init_name[:-2] if init_name.endswith(".T") else init_name
            names = (f"{base}.qweight", f"{base}.scales", f"{base}.zeros" if zeros is not None else None)
            new_inits += [numpy_helper.from_array(b, names[0]), numpy_helper.from_array(scales, names[1])]
            if zeros is not None:
                new_inits.append(numpy_helper.from_array(zeros, names[2]))
            done_weights[init_name] = names
            drop_inits.add(init_name)
        qname, sname, zname = done_weights[init_name]
        for u in users:
            inputs = [u.input[0], qname, sname] + ([zname] if zname else [])
            node = helper.make_node("MatMulNBits", inputs, list(u.output), name=f"{u.name or fqn}/MatMulNBits",
                                    domain="com.microsoft", K=k, N=n, bits=qw.bits, block_size=block,
                                    accuracy_level=accuracy_level)
            new_nodes[id(u)] = node
            build.replaced[fqn] = node.name
    rebuilt = [new_nodes.get(id(node), node) for node in graph.node]
    del graph.node[:]
    graph.node.extend(rebuilt)
    kept = [i for i in graph.initializer if i.name not in drop_inits]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    onnx.save(proto, str(tmp))
    tmp.replace(out)
    return build
