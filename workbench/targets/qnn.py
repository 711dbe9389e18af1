"""Qualcomm QNN (HTP): the files and exact commands to build context binaries with the QNN SDK.

The SDK (``qnn-onnx-converter``, ``qnn-model-lib-generator``, ``qnn-context-binary-generator``)
cannot be installed here, so ``write_qnn_bundle`` writes everything it needs next to the static
prefill/decode graphs:

- ``quant_overrides.json`` (AIMET-style encodings, ``--quantization_overrides``): per-layer weight
  bit widths from the plan (keyed by the ONNX initializer names ``export_onnx`` recorded), float16
  for layers the plan keeps in float (weights AND their MatMul's activations, so HTP never sees a
  float x fixed-point MatMul), exact per-channel scales when the plan is per-channel, and the
  causal-mask range fix;
- ``input_list_prefill.txt`` / ``input_list_decode.txt`` with raw calibration tensors;
- ``commands.sh`` with the converter, model-library and context-binary commands.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..plan import get_precision
from .ort import MASK_RANGE, causal_mask_tensors

__all__ = ["write_qnn_bundle", "qnn_encodings", "write_calibration_raw"]


def _float_encoding() -> list[dict]:
    return [{"bitwidth": 16, "dtype": "float"}]


def _range_encoding(lo: float, hi: float, bits: int = 16) -> list[dict]:
    scale = (hi - lo) / ((1 << bits) - 1)
    return [{"bitwidth": bits, "dtype": "int", "is_symmetric": "False", "min": lo, "max": hi, "scale": scale,
             "offset": int(round(lo / scale))}]


def qnn_encodings(proto, qm, weight_names: Mapping[str, str], *, activation_bits: int = 16) -> tuple[dict, list[str]]:
    """Encodings overrides for ``qnn-onnx-converter`` from the quantized model's plan; plus notes."""
    producers_of = {}
    consumers: dict[str, list] = {}
    for node in proto.graph.node:
        for o in node.output:
            producers_of[o] = node
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    act, params, notes = {}, {}, []
    per_layer = {r.name: r for r in qm.layers}
    for fqn, init in weight_names.items():
        r = per_layer.get(fqn)
        if r is None:
            continue
        prec = get_precision(r.precision) if r.precision else None
        if prec is None or prec.is_float:
            params[init] = _float_encoding()
            for node in consumers.get(init, []):  # the whole MatMul in float: no mixed float x fixed-point
                if node.op_type in ("MatMul", "Gemm"):
                    act[node.input[0]] = _float_encoding()
                    act[node.output[0]] = _float_encoding()
            continue
        qw = qm.weights.get(fqn)
        if qw is not None and qw.group_size is None and qw.symmetric:
            lo = -(1 << (qw.bits - 1))
            params[init] = [{"bitwidth": qw.bits, "dtype": "int", "is_symmetric": "True", "scale": float(s),
                             "offset": lo, "min": float(s) * lo, "max": float(s) * (-lo - 1)}
                            for s in qw.scales[:, 0].tolist()]
        else:
            params[init] = [{"bitwidth": prec.bits, "dtype": "int", "is_symmetric": "True"}]
    grouped = sorted({qw.group_size for qw in qm.weights.values() if qw.group_size})
    if grouped:
        notes.append(f"the plan uses groups of {grouped} columns; these encodings give the bit width only and the "
                     "converter computes per-channel scales (--use_per_channel_quantization). Group-wise scales need "
                     "QNN's block quantization (LPBQ, --use_per_row_quantization and an encodings v2 file)")
    mask = causal_mask_tensors(proto)
    for t in mask:
        act[t] = _range_encoding(-MASK_RANGE, MASK_RANGE, activation_bits)
    if mask:
        notes.append(f"{len(mask)} causal-mask tensor(s) pinned to [-{MASK_RANGE:g}, {MASK_RANGE:g}] (min/max "
                     "calibration would give them a scale of ~1e34 and wipe out attention)")
    return {"version": "0.6.1", "activation_encodings": act, "param_encodings": params}, notes


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


def write_qnn_bundle(out_dir: str | Path, graphs: Mapping[str, Path], qm, weight_names: Mapping[str, str],
                     feeds: Mapping[str, Sequence[Mapping[str, np.ndarray]]], *, activation_bits: int = 16,
                     weight_bits: int = 8, soc_model: str | None = None) -> dict:
    """Write overrides, calibration inputs and ``commands.sh`` for static ``graphs`` ({"prefill": path, ...})."""
    import onnx
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    cmds = ["#!/usr/bin/env bash",
            "# Build QNN HTP context binaries from the workbench's static graphs. Needs the Qualcomm AI Engine Direct",
            "# SDK: source $QNN_SDK_ROOT/bin/envsetup.sh first. Run from this directory.",
            "set -euo pipefail", ""]
    for name, path in graphs.items():
        proto = onnx.load(str(path), load_external_data=False)
        enc, enc_notes = qnn_encodings(proto, qm, weight_names, activation_bits=activation_bits)
        (out / f"quant_overrides_{name}.json").write_text(json.dumps(enc, indent=1))
        notes += [n for n in enc_notes if n not in notes]
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
