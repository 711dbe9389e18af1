"""NVIDIA TensorRT, ``tensorrt``: ``trtexec`` command lines for the exported graphs (TensorRT is not installable here).

Dynamic axes become an optimization profile (``--minShapes/--optShapes/--maxShapes``); the
RMSNorm squares and epsilons that the inspection flags for float16 are pinned to float32 with
``--layerPrecisions`` so an FP16 engine does not overflow in them.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Mapping, Sequence

from ..onnx.export import export_onnx
from .base import inspect_graph
from .registry import Target, register_target

__all__ = ["trtexec_command", "write_tensorrt_bundle", "convert_tensorrt", "TARGET"]


def _shape_spec(proto, sizes: Mapping[str, int]) -> str:
    init = {i.name for i in proto.graph.initializer}
    parts = []
    for vi in proto.graph.input:
        if vi.name in init:
            continue
        dims = []
        for d in vi.type.tensor_type.shape.dim:
            dims.append(str(d.dim_value) if d.HasField("dim_value") else str(sizes.get(d.dim_param, 1)))
        parts.append(f"{vi.name}:{'x'.join(dims)}")
    return ",".join(parts)


def trtexec_command(onnx_path: str | Path, engine: str, proto, *, fp32_layers: Sequence[str] = (),
                    max_sequence: int = 512) -> list[str]:
    """One ``trtexec`` invocation building an FP16 engine with a profile covering 1..``max_sequence`` tokens."""
    cmd = ["trtexec", f"--onnx={Path(onnx_path).name}", f"--saveEngine={engine}", "--fp16"]
    dynamic = any(not d.HasField("dim_value") for vi in proto.graph.input for d in vi.type.tensor_type.shape.dim)
    if dynamic:
        lo = {"batch": 1, "sequence": 1, "past_sequence": 1, "total_sequence": 2}
        opt = {"batch": 1, "sequence": 128, "past_sequence": max_sequence // 2, "total_sequence": max_sequence // 2 + 1}
        hi = {"batch": 1, "sequence": max_sequence, "past_sequence": max_sequence - 1, "total_sequence": max_sequence}
        cmd += [f"--minShapes={_shape_spec(proto, lo)}", f"--optShapes={_shape_spec(proto, opt)}",
                f"--maxShapes={_shape_spec(proto, hi)}"]
    if fp32_layers:
        cmd += ["--precisionConstraints=obey", "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in fp32_layers)]
    return cmd


def write_tensorrt_bundle(out_dir: str | Path, graphs: Mapping[str, Path], *, fp32_layers: Sequence[str] = (),
                          max_sequence: int = 512) -> dict:
    """Write ``commands.sh`` next to ``graphs`` ({"prefill": path, "decode": path})."""
    import onnx
    out = Path(out_dir)
    lines = ["#!/usr/bin/env bash", "# Build TensorRT FP16 engines (run on the target: Jetson or an NVIDIA GPU).",
             "set -euo pipefail", ""]
    for name, path in graphs.items():
        proto = onnx.load(str(path), load_external_data=False)
        lines.append(" ".join(shlex.quote(c) for c in trtexec_command(path, f"{name}_fp16.plan", proto,
                                                                        fp32_layers=fp32_layers,
                                                                        max_sequence=max_sequence)))
    script = out / "commands.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return {"commands": str(script),
            "notes": ["FP16 engines; INT8 needs a calibration cache or explicit QDQ with symmetric int8 "
                      "(zero point 0), which the QNN-style QDQ model (unsigned, asymmetric) is not"]}


def convert_tensorrt(job) -> None:
    """The simulation's graphs (dequantized weights) and the trtexec commands, RMSNorm squares pinned to fp32."""
    ex = export_onnx(job.prep.sim_lm, job.out, check=False)
    insp = inspect_graph(ex.prefill_path, "tensorrt")
    fp32 = [n for f in insp.findings if f.rule == "fp16-overflow" for n in f.nodes]
    info = write_tensorrt_bundle(job.out, {"prefill": ex.prefill_path, "decode": ex.decode_path}, fp32_layers=fp32)
    job.report.notes += info["notes"] + ["the graphs carry the simulated (dequantized) weights of the plan"]
    job.report.details["inspection"] = insp.summary()


TARGET = register_target(Target("tensorrt", "NVIDIA TensorRT", rules="tensorrt", convert=convert_tensorrt,
                                module=__name__))
