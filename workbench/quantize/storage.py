"""How a quantized model is stored: the compressed-tensors packing, the tensors as stored, and writing the directory.

``workbench.model.load.load_quantized`` loads the directory back (``load_model`` does for any quantized
directory). This module depends on nothing else of the package's quantization (a ``QuantizedModel``
is passed in), so the model can save itself and count its stored bytes without an import cycle.

Layout (written atomically: built in a temporary sibling directory, then renamed into place)::

    config.json, tokenizer files   the source model's, with tie_word_embeddings cleared if untied, and a
                                   compressed-tensors ``quantization_config`` when transformers can load it
    model.safetensors              every tensor, in the compressed-tensors "pack-quantized" layout that
                                   transformers (with the compressed-tensors package) and vLLM read:
                                   float tensors (norms, biases, float layers: fp16 layers as float16, the
                                   rest float16 when that is exact, else float32) and per integer layer
                                   <fqn>.weight_packed, <fqn>.weight_scale (float16 [out, groups]),
                                   <fqn>.weight_shape, <fqn>.weight_zero_point (asymmetric only)
    workbench.safetensors          instead of model.safetensors when an embedding is integer: transformers
                                   cannot build one (see ``TRANSFORMERS_CANNOT``), so it finds no weights
                                   file there and says so instead of loading a random network
    plan.json                      the QuantPlan
    quantization.json              method, weights file, per-layer precision / group size / fallback
    report.json                    measured cost (when given)
    manifest.json                  every file with its size and sha256

Layers with 2, 3, 5 or 6-bit codes or two-level scales are stored as dense bitstreams instead
(``storage.stored_shapes``: ``weight_packed``, ``weight_sub_scale`` + ``weight_channel_scale`` or
``weight_scale``, ``weight_zero_point``), in workbench.safetensors: compressed-tensors has no layout
for them.

Codes as stored: symmetric codes offset by ``2^(b-1)``, asymmetric codes as they are (both equal to
compressed-tensors' signed code plus its offset), packed ``32 / b`` to an int32 along the input axis,
the first code in the lowest bits; zero points likewise, packed along the output axis. Version 1
directories (``quantized.safetensors`` beside a float-only ``model.safetensors``) still load.

    d = qm.save(Path("out") / "demo-int4"); lm, qm = load_quantized(d)   # lm.model computes from the codes
    AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True)  # the same logits
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from ..errors import WorkspaceError
from .plan import get_precision
from ..files.workspace import (atomic_write_json, check_output_dir, file_sha256, library_versions, make_parents,
                               output_lock, remove_empty, storage_error, swap_into_place)
from .qtensor import QuantizedWeight, SubScales, pack_bits, pack_int4, unpack_bits, unpack_int4

SOURCE_SETTINGS = ("preprocessor_config.json",)  # copied from the source model where it has them
__all__ = ["save_quantized", "layer_storage", "float_storage", "write_report", "FORMAT", "FORMAT_VERSION",
           "weight_file_bytes", "pack_int32", "unpack_int32", "compressed_tensors_config", "WEIGHTS_FILE",
           "WORKBENCH_WEIGHTS_FILE", "TRANSFORMERS_CANNOT", "CT_FORMAT", "HALF_DTYPES", "stored_shapes",
           "stored_integer_layers", "weight_from_file", "weight_tensors", "write_manifest"]

FORMAT = "workbench-quantized"
FORMAT_VERSION = 3  # 3: 2/3/5/6-bit codes and two-level scales as dense bitstreams (versions 1 and 2 still load)
PLAIN_VERSION = 2  # what a model without those layers is written as, so earlier readers still load it
WEIGHTS_FILE = "model.safetensors"  # the file transformers looks for
WORKBENCH_WEIGHTS_FILE = "workbench.safetensors"  # integer embeddings: a name transformers does not look for
V1_FLOAT_FILE, V1_QUANT_FILE = "model.safetensors", "quantized.safetensors"
CT_FORMAT = "pack-quantized"
HALF_DTYPES = {torch.float16, torch.bfloat16}
# Measured with transformers 5.17 and compressed-tensors 0.20.1: a pack-quantized nn.Embedding fails in
# transformers' weight initialisation, so such a directory is kept out of its reach.
TRANSFORMERS_CANNOT = ("an integer embedding: transformers 5.17 with compressed-tensors 0.20 fails to build one "
                       "(AttributeError: 'Embedding' object has no attribute 'weight'); load it with "
                       "workbench.load_model")
# compressed-tensors' pack-quantized layout has one float16 scale per group and 32 / bits codes an int32 word:
# 3, 5 and 6-bit codes would waste bits, and two-level scales are not in it, so such layers are stored as
# dense bitstreams (the bytes the plan counts) in the file transformers does not look for.
TRANSFORMERS_CANNOT_BITS = ("layers with 2, 3, 5 or 6-bit codes or two-level scales, which compressed-tensors' "
                            "pack-quantized layout does not hold as stored here; load it with workbench.load_model")
CT_BITS = (4, 8)


def ct_layout(bits: int, scale_bits: "int | SubScales | None", minimums: bool = False) -> bool:
    """Whether a layer of ``bits``-bit codes (two-level with ``scale_bits``; with float16 minimums) is stored in
    compressed-tensors' layout."""
    return bits in CT_BITS and scale_bits is None and not minimums


def _in_ct_layout(qw: QuantizedWeight) -> bool:
    return ct_layout(qw.bits, qw.scale_bits, qw.float_minimums)


def _lossless_float(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor as it is; a float32 one as float16 when that keeps every value exactly, else float32."""
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t
    t16 = t.to(torch.float16)
    return t16 if torch.equal(t16.to(t.dtype), t) else t.to(torch.float32)


# -- compressed-tensors pack-quantized tensors ------------------------------------------------------

def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[rows, cols]`` (4 or 8 bits) -> int32 ``[rows, ceil(cols * bits / 32)]``.

    ``32 / bits`` codes a word, the first in the lowest bits: compressed-tensors' ``pack_to_int32``
    of the signed codes. Built byte-wise (nibble pairs for int4), so no wider temporary than the codes.
    """
    if sys.byteorder != "little":  # the int32 words are read as their little-endian bytes
        raise NotImplementedError("packing quantized weights needs a little-endian machine")
    per_word = 32 // bits
    codes = codes.to(torch.uint8)
    pad = -codes.shape[-1] % per_word
    if pad:
        codes = F.pad(codes, (0, pad))
    packed = pack_int4(codes) if bits == 4 else codes
    return packed.contiguous().flatten().view(torch.int32).view(*packed.shape[:-1], -1)


def unpack_int32(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: uint8 codes, the last axis cut to ``length``."""
    if sys.byteorder != "little":
        raise NotImplementedError("unpacking quantized weights needs a little-endian machine")
    raw = packed.contiguous().flatten().view(torch.uint8).view(*packed.shape[:-1], -1)
    return unpack_int4(raw, length) if bits == 4 else raw[..., :length]


def _packed_shape(rows: int, cols: int, bits: int) -> tuple[int, int]:
    return rows, -(-cols * bits // 32)


def stored_shapes(name: str, shape: tuple[int, int], bits: int, group_size: int | None, symmetric: bool,
                  scale_bits: "int | SubScales | None" = None, minimums: bool = False) -> dict:
    """The tensors (name -> shape) one integer layer is stored as.

    Outside compressed-tensors' layout (``ct_layout``): ``weight_packed`` the codes as one dense
    bitstream (uint8), ``weight_zero_point`` likewise; two-level scales as ``weight_sub_scale``
    (sub-scale - 1, a ``scale_bits``-bit bitstream) and ``weight_channel_scale`` (float16 ``[out]``)
    instead of ``weight_scale``.
    """
    out_f, in_f = shape
    groups = in_f // (group_size or in_f)
    if ct_layout(bits, scale_bits, minimums):
        d = {f"{name}.weight_packed": _packed_shape(out_f, in_f, bits), f"{name}.weight_scale": (out_f, groups),
             f"{name}.weight_shape": (2,)}
        if not symmetric:
            d[f"{name}.weight_zero_point"] = _packed_shape(groups, out_f, bits)[::-1]  # packed along the output axis
        return d
    d = {f"{name}.weight_packed": (-(-out_f * in_f * bits // 8),), f"{name}.weight_shape": (2,)}
    layout = SubScales.of(scale_bits)
    if layout is not None:
        d[f"{name}.weight_sub_scale"] = (-(-out_f * groups * layout.bits // 8),)
        d[f"{name}.weight_channel_scale"] = (out_f,) if not layout.super_block else \
            (out_f, layout.scales_per_row(in_f))
        if layout.mins:  # llama.cpp's Q4_K / Q5_K: the minimums' integers and float16 scales likewise
            d[f"{name}.weight_sub_min"] = d[f"{name}.weight_sub_scale"]
            d[f"{name}.weight_channel_min"] = d[f"{name}.weight_channel_scale"]
    else:
        d[f"{name}.weight_scale"] = (out_f, groups)
        if minimums:  # llama.cpp's Q4_1 / Q5_1: a float16 minimum beside each scale
            d[f"{name}.weight_min"] = (out_f, groups)
    if not symmetric and not minimums and not (layout is not None and layout.mins):
        d[f"{name}.weight_zero_point"] = (-(-out_f * groups * bits // 8),)
    return d


def _quant_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One integer layer's packed codes, scales as stored and packed zero points (without its shape record)."""
    if _in_ct_layout(qw):
        out = {f"{name}.weight_packed": pack_int32(qw.storage_codes(), qw.bits),
               f"{name}.weight_scale": qw.scales.to(torch.float16)}
        if qw.zeros is not None:
            out[f"{name}.weight_zero_point"] = pack_int32(qw.zeros.t(), qw.bits).t()
        return {k: v.contiguous() for k, v in out.items()}
    out = {f"{name}.weight_packed": pack_bits(qw.storage_codes(), qw.bits)}
    if qw.two_level:
        out[f"{name}.weight_sub_scale"] = pack_bits(qw.sub_scales.to(torch.int16) - 1, qw.scale_bits)
        out[f"{name}.weight_channel_scale"] = qw.channel_scales.to(torch.float16)
        if qw.mins is not None:
            out[f"{name}.weight_sub_min"] = pack_bits(qw.sub_mins, qw.scale_bits)
            out[f"{name}.weight_channel_min"] = qw.channel_mins.to(torch.float16)
    else:
        out[f"{name}.weight_scale"] = qw.scales.to(torch.float16)
        if qw.float_minimums:
            out[f"{name}.weight_min"] = qw.mins.to(torch.float16)
    if qw.zeros is not None:
        out[f"{name}.weight_zero_point"] = pack_bits(qw.zeros, qw.bits)
    return {k: v.contiguous() for k, v in out.items()}


def weight_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One integer layer's tensors as the weights file holds them, shape record included (``stored_shapes``
    names them; ``weight_from_file`` reads them back)."""
    return {**_quant_tensors(name, qw), f"{name}.weight_shape": torch.tensor(qw.shape, dtype=torch.int64)}


def weight_from_file(name: str, t: dict, bits: int, group_size: int | None,
                     scale_bits: "int | SubScales | None" = None, minimums: bool = False) -> QuantizedWeight:
    """The ``QuantizedWeight`` of layer ``name`` from its stored tensors ``t`` (the inverse of ``weight_tensors``)."""
    out_f, in_f = (int(x) for x in t[f"{name}.weight_shape"])
    if not ct_layout(bits, scale_bits, minimums):
        groups = in_f // (group_size or in_f)
        codes = unpack_bits(t[f"{name}.weight_packed"], bits, out_f * in_f).view(out_f, in_f)
        zp = t.get(f"{name}.weight_zero_point")
        zeros = None if zp is None else unpack_bits(zp, bits, out_f * groups).view(out_f, groups)
        if scale_bits is None:
            return QuantizedWeight.from_storage_codes(codes, t[f"{name}.weight_scale"], zeros, bits, group_size,
                                                      mins=t[f"{name}.weight_min"] if minimums else None)
        layout = SubScales.of(scale_bits)
        sub = unpack_bits(t[f"{name}.weight_sub_scale"], layout.bits, out_f * groups).view(out_f, groups) + 1
        mins = {} if not layout.mins else {
            "sub_mins": unpack_bits(t[f"{name}.weight_sub_min"], layout.bits, out_f * groups).view(out_f, groups),
            "channel_mins": t[f"{name}.weight_channel_min"].to(torch.float32)}
        return QuantizedWeight.from_storage_codes(codes, None, None, bits, group_size, sub_scales=sub,
                                                  channel_scales=t[f"{name}.weight_channel_scale"],
                                                  scale_bits=layout, **mins)
    codes = unpack_int32(t[f"{name}.weight_packed"], bits, in_f)
    zp = t.get(f"{name}.weight_zero_point")
    zeros = None if zp is None else unpack_int32(zp.t(), bits, out_f).t()
    return QuantizedWeight.from_storage_codes(codes, t[f"{name}.weight_scale"], zeros, bits, group_size)


def stored_integer_layers(qm) -> list:
    """Integer layers with their own tensors (a tied copy is stored once, under the embedding)."""
    return [r for r in qm.layers if r.name in qm.weights and not (r.tied_to and not r.untied)]


def compressed_tensors_config(qm) -> dict:
    """The ``quantization_config`` transformers reads: one config group per (bits, group size, symmetry)."""
    groups: dict[tuple, list[str]] = {}
    for r in stored_integer_layers(qm):
        qw = qm.weights[r.name]
        groups.setdefault((qw.bits, qw.group_size, qw.symmetric), []).append(r.name)
    config_groups = {}
    for i, ((bits, g, sym), names) in enumerate(groups.items()):
        config_groups[f"group_{i}"] = {
            "targets": names, "input_activations": None, "output_activations": None,
            "weights": {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group" if g else "channel",
                        "group_size": g, "dynamic": False}}
    return {"quant_method": "compressed-tensors", "format": CT_FORMAT, "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": []}


# -- saving -----------------------------------------------------------------------------------------

def _source_params(qm) -> dict[str, torch.Tensor]:
    if qm.source is None:
        raise WorkspaceError("this QuantizedModel has no source model to take its float tensors from; "
                             "create it with quantize_model or load_quantized")
    params = dict(qm.source.model.named_parameters(remove_duplicate=False))
    return {**params, **qm.float_overrides}


def _float_layer_weight(r, params) -> torch.Tensor:
    """A float layer's weight as stored: at its precision's width, else losslessly."""
    w = params[f"{r.name}.weight"].detach()
    prec = get_precision(r.precision) if r.precision else None
    if prec is not None and prec.bits == 16:
        return w.to(torch.float16)
    if prec is not None and prec.bits == 32:
        return w.to(torch.float32)
    return _lossless_float(w)


def layer_storage(qm) -> dict[str, torch.Tensor]:
    """Every layer weight as stored (tied weights once): packed codes, scales, zero points, float layers."""
    params = _source_params(qm)
    out: dict[str, torch.Tensor] = {}
    for r in qm.layers:
        if r.tied_to and not r.untied:
            continue  # stored once, under the embedding
        if r.name in qm.weights:
            out.update(_quant_tensors(r.name, qm.weights[r.name]))
        else:
            out[f"{r.name}.weight"] = _float_layer_weight(r, params)
    return out


def float_storage(qm) -> dict[str, torch.Tensor]:
    """Float tensors: float layer weights plus every non-layer parameter (integer layers are not packed here)."""
    params = _source_params(qm)
    layer_weights = {f"{r.name}.weight" for r in qm.layers}
    stored = {f"{r.name}.weight": _float_layer_weight(r, params) for r in qm.layers
              if not (r.tied_to and not r.untied) and r.name not in qm.weights}
    seen = {id(p) for k, p in qm.source.model.named_parameters(remove_duplicate=False) if k in layer_weights}
    for name, p in params.items():
        if name in layer_weights or (name not in qm.float_overrides and id(p) in seen):
            continue
        stored[name] = _lossless_float(p)
    return {k: v.contiguous() for k, v in stored.items()}


def weight_file_bytes(directory: str | Path) -> int:
    """Bytes of the weight files (``*.safetensors``) in a model directory, from the files themselves."""
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))


def _layer_entry(qm, r) -> dict:
    d = r.to_dict()
    qw = qm.weights.get(r.name)
    if qw is not None and not (r.tied_to and not r.untied):
        d.update(bits=qw.bits, symmetric=qw.symmetric, storage_bytes=qw.storage_bytes(),
                 tensors=sorted(stored_shapes(r.name, qw.shape, qw.bits, qw.group_size, qw.symmetric,
                                              qw.sub_layout, qw.float_minimums)))
        if qw.float_minimums:
            d["minimums"] = True
        if qw.two_level:
            d["scale_bits"] = qw.scale_bits
            if qw.scale_max is not None:
                d["scale_max"] = qw.scale_max
            if qw.super_block is not None:
                d["super_block"] = qw.super_block
            if qw.mins is not None:
                d["minimums"] = True
    return d


def write_manifest(directory: Path, extra: dict) -> None:
    """``manifest.json``: every file of the directory with its size and sha256 (what loading verifies), and ``extra``."""
    files = {f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)}
             for f in sorted(directory.iterdir()) if f.is_file() and f.name != "manifest.json"}
    version = json.loads((directory / "quantization.json").read_text(encoding="utf-8"))["version"] \
        if (directory / "quantization.json").is_file() else FORMAT_VERSION
    atomic_write_json(directory / "manifest.json", {"format": FORMAT, "version": version, **extra,
                                                    "versions": library_versions(), "files": files})


def _write_config(qm, directory: Path, transformers_loads: bool) -> None:
    config = copy.deepcopy(qm.source.model.config)
    if qm.unties_embeddings:
        for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
            cfg.tie_word_embeddings = False
    config.save_pretrained(directory)
    path = directory / "config.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    raw.pop("quantization_config", None)
    if transformers_loads:
        raw["quantization_config"] = compressed_tensors_config(qm)
    atomic_write_json(path, raw)


def save_quantized(qm, directory: str | Path, *, report: dict | None = None) -> Path:
    """Write ``qm`` to ``directory`` (replaced as a whole if it holds an earlier quantized model)."""
    with output_lock(directory):
        return _save_quantized(qm, directory, report)


def _save_quantized(qm, directory: str | Path, report: dict | None) -> Path:
    out = check_output_dir(directory, FORMAT)
    created = make_parents(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        lm = qm.source
        stored = stored_integer_layers(qm)
        why_not = TRANSFORMERS_CANNOT if any(r.kind == "embedding" for r in stored) else \
            TRANSFORMERS_CANNOT_BITS if not all(_in_ct_layout(qm.weights[r.name]) for r in stored) else None
        transformers_loads = why_not is None
        version = FORMAT_VERSION if not all(_in_ct_layout(qm.weights[r.name]) for r in stored) else PLAIN_VERSION
        weights_file = WEIGHTS_FILE if transformers_loads else WORKBENCH_WEIGHTS_FILE
        _write_config(qm, tmp, transformers_loads)
        if lm.tokenizer is not None:
            lm.tokenizer.save_pretrained(tmp)
        for name in SOURCE_SETTINGS:  # a vision-language model's picture preprocessing goes with it
            if (Path(lm.path) / name).is_file():
                shutil.copyfile(Path(lm.path) / name, tmp / name)
        tensors = float_storage(qm)
        for r in stored:
            tensors.update(weight_tensors(r.name, qm.weights[r.name]))
        save_file(tensors, tmp / weights_file, metadata={"format": "pt"})
        del tensors
        qm.plan.save(tmp / "plan.json")
        meta = {"format": FORMAT, "version": version, "method": qm.method, "source": str(lm.path),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": qm.seconds,
                "bits_per_weight": qm.bits_per_weight, "weights_file": weights_file,
                "transformers": {"loads": transformers_loads,
                                 "format": f"compressed-tensors {CT_FORMAT}" if transformers_loads else None,
                                 "why_not": why_not},
                "layers": [_layer_entry(qm, r) for r in qm.layers]}
        if qm.awq:
            meta["awq"] = {"workspace_key": qm.awq.get("workspace_key"), "tokens": qm.awq.get("tokens"),
                           "grid": qm.awq.get("grid"),
                           "search_seconds": qm.awq.get("seconds"),
                           "groups": [{"prev": e["group"]["prev"], "layers": e["group"]["layers"], "alpha": e["alpha"],
                                       "loss": e["loss"], "identity_loss": e["identity_loss"]}
                                      for e in qm.awq["groups"]],
                           "clipped_layers": sorted(qm.awq.get("clips", {}))}
        if qm.gptq:
            meta["gptq"] = dict(qm.gptq)
        atomic_write_json(tmp / "quantization.json", meta)
        if report is not None:
            atomic_write_json(tmp / "report.json", report)
        write_manifest(tmp, {"method": qm.method, "source": str(lm.path)})
        swap_into_place(tmp, out)
    except BaseException as e:
        full = storage_error(e, tmp, out, "give --out on another disk") if isinstance(e, Exception) else None
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(created)
        if full is not None:  # a full disk or a file-size limit, the file named
            raise full from None
        raise
    return out


def write_report(directory: str | Path, report: dict) -> Path:
    """Add (or replace) ``report.json`` in a saved quantized model and refresh its manifest."""
    d = Path(directory)
    if not (d / "manifest.json").is_file():
        raise WorkspaceError(f"'{d}' is not a saved quantized model (no manifest.json)")
    manifest = json.loads((d / "manifest.json").read_text())
    atomic_write_json(d / "report.json", report)
    write_manifest(d, {k: manifest[k] for k in ("method", "source") if k in manifest})
    return d / "report.json"
