"""ONNX Runtime: QDQ models for its QNN execution provider, and INT4/INT8 ``MatMulNBits`` models for its CPU.

    qdq = quantize_qdq("onnx/prefill.onnx", "ort-qdq/prefill.qdq.onnx", feeds, activation_bits=16,
                       weight_bits_by_initializer={"lm_head.weight.T": 16})
    int4 = build_nbits_onnx(sim_model, "ort-int4", qm.precisions, accuracy_level=4)

``build_nbits_onnx`` builds the graphs straight from the workbench's simulation of a plan
(``QuantizedModel.build_model()``): integer layers become ``MatMulNBits`` and an integer embedding
``GatherBlockQuantized``, carrying the codes, scales and zero points unchanged (no second
quantization), so the ONNX model computes what the simulation computes, up to kernel arithmetic.
A tied ``lm_head`` reads the embedding's bytes (written once). Layers the plan keeps in float16 are
stored as float16 (onnxruntime's CPU widens them when it loads the model). ``accuracy_level`` 4
lets the kernel quantize activations to int8 (faster decode on AVX2/NEON, small extra error); 0
keeps them float.

The causal-mask fix for QDQ: the mask is built from float32's minimum, which min/max calibration
turns into a scale of ~1e34 that wipes out attention; the mask tensors are pinned to
[-MASK_RANGE, MASK_RANGE] instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from ..graph_build import BuiltGraphs, FloatWeights, GraphBuilder, as_array

__all__ = ["MASK_RANGE", "Int4Build", "NBitsWeights", "causal_mask_tensors", "quantize_qdq", "build_nbits_onnx",
           "matmulnbits_block_size", "ACCURACY_LEVELS"]

MASK_RANGE = 100.0  # exp(-100) is 0 in every float format: masked keys stay masked, real scores keep their resolution
ACCURACY_LEVELS = {0: "unset (float activations)", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8 activations"}


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
    A graph with external data gives a QDQ graph with external data (``<out_path>.data``).
    """
    import shutil

    import onnx
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    if activation_bits not in (8, 16):
        raise ValueError(f"activation_bits must be 8 or 16, got {activation_bits}")
    types = {8: QuantType.QUInt8, 16: QuantType.QUInt16}
    mask = causal_mask_tensors(onnx.load(str(float_onnx), load_external_data=False))
    overrides: dict[str, list[dict]] = {t: [{"rmin": np.array(-mask_range, np.float32),
                                             "rmax": np.array(mask_range, np.float32)}] for t in mask}
    for name, bits in (weight_bits_by_initializer or {}).items():
        if bits not in (8, 16):
            raise ValueError(f"weight bits for '{name}' must be 8 or 16, got {bits}")
        if bits != 8:
            overrides[name] = [{"quant_type": types[bits]}]
    config = get_qnn_qdq_config(str(float_onnx), _FeedReader(feeds), activation_type=types[activation_bits],
                                weight_type=QuantType.QUInt8, per_channel=per_channel,
                                init_overrides=overrides or None)
    out_path = Path(out_path)
    partial = out_path.parent / f".{out_path.name}.partial"  # graph and its data file named as they will stay
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        quantize(str(float_onnx), partial / out_path.name, config)
        for f in sorted(partial.iterdir(), key=lambda f: f.suffix == ".onnx"):  # the graph last
            f.replace(out_path.parent / f.name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return {"mask_tensors": mask, "mask_range": mask_range, "activation_bits": activation_bits,
            "weight_overrides": {k: v for k, v in (weight_bits_by_initializer or {}).items() if v != 8},
            "per_channel": per_channel}


def matmulnbits_block_size(group_size: int) -> int | None:
    """The largest power of two (>= 16) dividing ``group_size``: MatMulNBits blocks must be powers of two."""
    b = group_size & -group_size
    return b if b >= 16 else None


@dataclass
class Int4Build:
    """What ``build_nbits_onnx`` wrote, which layers became integer ops, and which could not."""

    path: Path  # the prefill graph
    graphs: BuiltGraphs | None = None  # both graphs and the shared data file
    replaced: dict[str, str] = field(default_factory=dict)  # layer FQN -> MatMulNBits / GatherBlockQuantized node
    kept_float: dict[str, str] = field(default_factory=dict)  # layer FQN -> why it stayed float (and at what width)
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


def _written() -> np.ndarray:
    raise AssertionError("tensor expected in the store already")


class NBitsWeights(FloatWeights):
    """The plan's integers as ``MatMulNBits`` / ``GatherBlockQuantized``; float16 layers stored as float16.

    Reads modules of the simulation: a module with a ``quantized`` QuantizedWeight is an integer
    layer. Codes are written once per tensor: a tied ``lm_head`` aliases the embedding's bytes.
    """

    def __init__(self, precisions: Mapping[str, str | None], accuracy_level: int = 0):
        super().__init__()
        if accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(f"accuracy_level must be one of {sorted(ACCURACY_LEVELS)}, got {accuracy_level}")
        self.precisions, self.accuracy_level = dict(precisions), accuracy_level
        self.replaced: dict[str, str] = {}
        self._codes: dict[int, tuple[str, str, str | None]] = {}  # id(codes tensor) -> (qweight, scales, zeros)

    def _half(self, fqn: str) -> bool:
        from ..plan import get_precision
        p = get_precision(self.precisions.get(fqn)) if self.precisions.get(fqn) else None
        return p is not None and p.is_float and p.bits == 16

    def _block(self, fqn: str, qw) -> int | None:
        block = matmulnbits_block_size(qw.effective_group_size)
        if block is None:
            self.notes[fqn] = (f"group size {qw.effective_group_size} has no power-of-two block >= 16, which "
                               "onnxruntime's integer ops need: kept as dequantized float32")
        return block

    def _tensors(self, g: GraphBuilder, qw, fqn: str, block: int, kind: str) -> tuple[str, str, str | None]:
        """Initializer names of codes, scales, zeros, shaped for ``kind`` ("matmul" or "gather"); written once."""
        n, k = qw.shape
        codes_shape = [n, k // block, block * qw.bits // 8] if kind == "matmul" else [n, k * qw.bits // 8]
        names = (f"{fqn}.weight.qweight", f"{fqn}.weight.scales",
                 f"{fqn}.weight.zeros" if qw.zeros is not None else None)
        first = self._codes.get(id(qw.qweight))
        if first is None:
            codes, scales, zeros = _nbits_tensors(qw, block)
            for name, array in zip(names, (codes.reshape(codes_shape), scales, zeros)):
                if name:
                    g.weight(name, lambda array=array: array)
            self._codes[id(qw.qweight)] = names
            return names
        for name in first:  # already written (by the other graph, or by the layer these codes are tied to)
            if name:
                g.weight(name, _written)
        if first[0] == names[0]:
            return first
        return (g.alias(names[0], first[0], codes_shape), first[1], first[2])  # same bytes, this op's shape

    def linear(self, g: GraphBuilder, module, fqn: str, x: str) -> str:
        from onnx import TensorProto
        qw = getattr(module, "quantized", None)
        if qw is not None and self._block(fqn, qw):
            block = matmulnbits_block_size(qw.effective_group_size)
            qweight, scales, zeros = self._tensors(g, qw, fqn, block, "matmul")
            n, k = qw.shape
            name = f"/{fqn}/MatMulNBits"
            y = g.op("MatMulNBits", [x, qweight, scales] + ([zeros] if zeros else []), domain="com.microsoft",
                     name=name, K=k, N=n, bits=qw.bits, block_size=block, accuracy_level=self.accuracy_level)
            self.record(fqn, qweight, "nbits")
            self.replaced[fqn] = name
            return self.bias(g, module, fqn, y)
        if qw is None and self._half(fqn):
            w = g.weight(f"{fqn}.weight.T", lambda: as_array(module.weight.T, np.float16))
            self.record(fqn, w, "in_out")
            y = g.op("MatMul", [x, g.op("Cast", [w], to=TensorProto.FLOAT)], name=f"/{fqn}/MatMul")
            return self.bias(g, module, fqn, y)
        return super().linear(g, module, fqn, x)

    def embedding(self, g: GraphBuilder, module, fqn: str, ids: str) -> str:
        from onnx import TensorProto
        qw = getattr(module, "quantized", None)
        if qw is not None and self._block(fqn, qw):
            block = matmulnbits_block_size(qw.effective_group_size)
            qweight, scales, zeros = self._tensors(g, qw, fqn, block, "gather")
            name = f"/{fqn}/GatherBlockQuantized"
            self.record(fqn, qweight, "nbits")
            self.replaced[fqn] = name
            return g.op("GatherBlockQuantized", [qweight, ids, scales] + ([zeros] if zeros else []),
                        domain="com.microsoft", name=name, gather_axis=0, quantize_axis=1, block_size=block,
                        bits=qw.bits)
        if qw is None and self._half(fqn):
            w = g.weight(f"{fqn}.weight", lambda: as_array(module.weight, np.float16))
            self.record(fqn, w, "out_in")
            return g.op("Cast", [g.op("Gather", [w, ids], axis=0, name=f"/{fqn}/Gather")], to=TensorProto.FLOAT)
        return super().embedding(g, module, fqn, ids)

    def lm_head(self, g: GraphBuilder, module, fqn: str, x: str, embedding) -> str:
        """A tied float16 head reads the embedding's float16 table (transposed and widened when loaded)."""
        from onnx import TensorProto
        tied = getattr(module, "weight", None) is not None and module.weight is getattr(embedding, "weight", None)
        if getattr(module, "quantized", None) is None and tied and self._half(fqn) and \
                self.weight_names.get("model.embed_tokens") == "model.embed_tokens.weight":
            table = self.weight_names["model.embed_tokens"]
            self.record(fqn, table, "out_in")
            w = g.op("Cast", [g.op("Transpose", [table], perm=[1, 0])], to=TensorProto.FLOAT)
            return self.bias(g, module, fqn, g.op("MatMul", [x, w], name=f"/{fqn}/MatMul"))
        return self.linear(g, module, fqn, x)


def build_nbits_onnx(sim_model, out_dir: str | Path, precisions: Mapping[str, str | None], *,
                     accuracy_level: int = 0, inline_limit: int | None = None, progress: bool = False) -> Int4Build:
    """Prefill and decode graphs of ``sim_model`` (a plan's simulation) with its integers in ONNX Runtime ops.

    ``precisions`` maps layer names to the plan's precision (``QuantizedModel.precisions``): float16
    layers are stored as float16. What could not be expressed is listed in ``kept_float``.
    """
    from ..graph_build import build_graphs
    policy = NBitsWeights(precisions, accuracy_level)
    built = build_graphs(sim_model, out_dir, policy=policy, progress=progress, inline_limit=inline_limit)
    kept = dict(policy.notes)
    for fqn, prec in precisions.items():
        if fqn not in policy.replaced and fqn not in kept and prec and prec.startswith("int"):
            kept[fqn] = f"{prec} in the plan, but the layer reached the graph as float"
    return Int4Build(built.prefill_path, built, dict(policy.replaced), kept, accuracy_level)
