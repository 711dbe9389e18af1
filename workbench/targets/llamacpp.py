"""llama.cpp, ``llama.cpp``: the plan as ``llama-quantize --tensor-type`` rules, and the commands to build the GGUF.

    write_llamacpp_tensor_types("types.txt", lm, plan)  # llama-quantize --tensor-type-file types.txt in.gguf out.gguf Q8_0
    convert("demo", "llama.cpp", "out/gguf", bits=4)    # types.txt and commands.sh (llama.cpp is not installed here)

llama.cpp reads GGUF, not ONNX, so this target has no operator rule table: its converter writes
the tensor-type file and ``commands.sh`` (``convert_hf_to_gguf.py`` on the float model, then
``llama-quantize`` with those types, then ``llama-perplexity`` to compare). llama.cpp quantizes in
its own 32-weight blocks with its own scales, so it re-quantizes the plan instead of carrying
the workbench's integers: the notes say so.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from ..errors import PlanError
from ..models import LoadedModel
from ..plan import QuantPlan, get_precision
from ..workspace import atomic_write_text
from .common import OverrideFile, block_role, layer_precisions
from .registry import OverrideFormat, Target, check_precisions, register_target

__all__ = ["gguf_tensor_name", "llamacpp_tensor_types", "write_llamacpp_tensor_types", "read_llamacpp_tensor_types",
           "convert_llamacpp", "GGUF_ROLES", "TARGET"]

GGUF_ROLES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_tensor_name(fqn: str) -> str | None:
    """The GGUF tensor (without ``.weight``) of a Hugging Face layer name, as llama.cpp's converter names it."""
    if fqn.endswith("embed_tokens"):
        return "token_embd"
    if fqn == "lm_head":
        return "output"
    role = block_role(fqn)
    return None if role is None else f"blk.{role[0]}.{GGUF_ROLES[role[1]]}"


def _gguf_type(precision, symmetric: bool) -> str:
    """The ggml type of a precision (by kind and width: a registered alias of int8 is q8_0)."""
    if precision.is_float:
        return {16: "f16", 32: "f32"}[precision.bits]
    return {8: "q8_0", 4: "q4_0" if symmetric else "q4_1"}[precision.bits]


_GGUF_TO_PRECISION = {"f32": "fp32", "f16": "fp16", "bf16": "fp16", "q8_0": "int8", "q4_0": "int4", "q4_1": "int4"}


def llamacpp_tensor_types(lm: LoadedModel, plan: QuantPlan, *, notes: list[str] | None = None) -> list[tuple[str, str]]:
    """``(pattern, ggml type)`` pairs for ``llama-quantize --tensor-type``; patterns are anchored regexes."""
    notes = notes if notes is not None else []
    precisions = layer_precisions(lm.layers, plan)
    check_precisions(TARGET, precisions, "llama.cpp")
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
    base = _base_type(plan)
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


def convert_llamacpp(job) -> None:
    """The tensor-type file of the plan and ``commands.sh`` building and scoring the mixed GGUF with llama.cpp."""
    prep, out = job.prep, job.out
    written = write_llamacpp_tensor_types(out / "tensor-types.txt", prep.float_lm, prep.qm.plan)
    src = shlex.quote(str(Path(prep.float_lm.path).resolve()))
    lines = ["#!/usr/bin/env bash", "# Build the plan's mixed-precision GGUF with llama.cpp (set LLAMA_CPP to its "
             "checkout, with its binaries built). Run from this directory.", "set -euo pipefail", "",
             f"python \"$LLAMA_CPP/convert_hf_to_gguf.py\" {src} --outtype f16 --outfile model-f16.gguf",
             f"\"$LLAMA_CPP/build/bin/llama-quantize\" --tensor-type-file tensor-types.txt model-f16.gguf "
             f"model-mixed.gguf {_base_type(prep.qm.plan)}",
             "\"$LLAMA_CPP/build/bin/llama-perplexity\" -m model-mixed.gguf -f \"${TEXT:?set TEXT to a text file to score}\"", ""]
    script = out / "commands.sh"
    atomic_write_text(script, "\n".join(lines))
    script.chmod(0o755)
    job.report.notes += written.notes + ["the GGUF is built and run with llama.cpp, which is not installed here"]
    job.report.details["tensor_types"] = written.tensors


def _base_type(plan: QuantPlan) -> str:
    p = get_precision(plan.default)
    return _gguf_type(p, plan.symmetric).upper() if p else "Q8_0"


def _write(path, lm, plan, *, quantized=None, export=None, calibration=None) -> OverrideFile:
    return write_llamacpp_tensor_types(path, lm, plan)


def _read(path, lm, export=None) -> dict[str, str]:
    return read_llamacpp_tensor_types(path, lm)


TARGET = register_target(Target(
    "llama.cpp", "llama.cpp (GGUF)", rules=None, convert=convert_llamacpp, runnable=False,
    overrides=OverrideFormat("llamacpp", _write, _read), module=__name__,
    precision_note="llama.cpp's 2, 3, 5 and 6-bit types (Q2_K, Q3_K, Q5_0/Q5_K, Q6_K) and its k-quant super-block "
                   "scales have their own layouts, which the plan's codes and scales do not map to; int3, int5 and "
                   "int6 run in the workbench's simulation, int2 and two-level scales also through ort-int4"))
