"""Save a quantized model to a directory, and load it back to the same logits.

Layout (written atomically: built in a temporary sibling directory, then renamed into place)::

    config.json, tokenizer files   the source model's, with tie_word_embeddings cleared if untied
    model.safetensors              every float tensor: norms, biases, float layers (fp16 layers as
                                   float16; the rest float16 when that is exact, else float32)
    quantized.safetensors          per integer layer: <fqn>.qweight, <fqn>.scales (float16),
                                   <fqn>.zeros (asymmetric only); 4-bit codes packed two per byte
    plan.json                      the QuantPlan
    quantization.json              method, per-layer precision / group size / fallback / storage
    report.json                    measured cost (when given)
    manifest.json                  every file with its size and sha256

Codes as stored: int8 symmetric as int8; int8 asymmetric as uint8 with uint8 zero points; int4 as
uint8 nibbles (low nibble = even column), symmetric codes offset by +8, zero points packed likewise.

    qm.save("out/demo-int4"); lm, qm = load_quantized("out/demo-int4")
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ModelLoadError, WorkspaceError
from ..plan import QuantPlan, get_precision
from ..workspace import atomic_write_json, file_sha256, library_versions
from .qtensor import QuantizedWeight, pack_int4, unpack_int4

__all__ = ["save_quantized", "load_quantized", "layer_storage", "float_storage", "write_report", "FORMAT",
           "weight_file_bytes"]

FORMAT = "workbench-quantized"
FORMAT_VERSION = 1
FLOAT_FILE, QUANT_FILE = "model.safetensors", "quantized.safetensors"


def _lossless_float(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor as it is; a float32 one as float16 when that keeps every value exactly, else float32."""
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t
    t16 = t.to(torch.float16)
    return t16 if torch.equal(t16.to(t.dtype), t) else t.to(torch.float32)


def _quant_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    codes = qw.storage_codes()
    out = {f"{name}.scales": qw.scales.to(torch.float16)}
    if qw.bits == 4:
        out[f"{name}.qweight"] = pack_int4(codes)
    else:
        out[f"{name}.qweight"] = qw.qweight.clone()  # int8 (symmetric) or uint8 (asymmetric)
    if qw.zeros is not None:
        out[f"{name}.zeros"] = pack_int4(qw.zeros) if qw.bits == 4 else qw.zeros.clone()
    return {k: v.contiguous() for k, v in out.items()}


def _source_params(qm) -> dict[str, torch.Tensor]:
    if qm.source is None:
        raise WorkspaceError("this QuantizedModel has no source model to take its float tensors from; "
                             "create it with quantize_model or load_quantized")
    params = dict(qm.source.model.named_parameters(remove_duplicate=False))
    return {**params, **qm.float_overrides}


def layer_storage(qm) -> dict[str, torch.Tensor]:
    """Every layer weight exactly as stored (tied weights once): integer parts and float layers."""
    params = _source_params(qm)
    out: dict[str, torch.Tensor] = {}
    for r in qm.layers:
        if r.tied_to and not r.untied:
            continue  # stored once, under the embedding
        if r.name in qm.weights:
            out.update(_quant_tensors(r.name, qm.weights[r.name]))
            continue
        w = params[f"{r.name}.weight"].detach()
        prec = get_precision(r.precision) if r.precision else None
        if prec is not None and prec.bits == 16:
            out[f"{r.name}.weight"] = w.to(torch.float16)
        elif prec is not None and prec.bits == 32:
            out[f"{r.name}.weight"] = w.to(torch.float32)
        else:
            out[f"{r.name}.weight"] = _lossless_float(w)
    return out


def float_storage(qm) -> dict[str, torch.Tensor]:
    """Float tensors for ``model.safetensors``: float layer weights plus every non-layer parameter."""
    params = _source_params(qm)
    layer_weights = {f"{r.name}.weight" for r in qm.layers}
    stored = {k: v for k, v in layer_storage(qm).items() if k.endswith(".weight") and k in layer_weights}
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
                 tensors=sorted(_quant_tensors(r.name, qw)))
    return d


def _write_manifest(directory: Path, extra: dict) -> None:
    files = {f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)}
             for f in sorted(directory.iterdir()) if f.is_file() and f.name != "manifest.json"}
    atomic_write_json(directory / "manifest.json", {"format": FORMAT, "version": FORMAT_VERSION, **extra,
                                                    "versions": library_versions(), "files": files})


def save_quantized(qm, directory: str | Path, *, report: dict | None = None) -> Path:
    """Write ``qm`` to ``directory`` (replaced as a whole if it holds an earlier quantized model)."""
    out = Path(directory)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "quantization.json").is_file())):
        raise WorkspaceError(f"'{out}' exists and is not a quantized-model directory; choose an empty or new "
                             "--out directory (an earlier quantized model there would be replaced)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        lm = qm.source
        config = copy.deepcopy(lm.model.config)
        if qm.unties_embeddings:
            for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
                cfg.tie_word_embeddings = False
        config.save_pretrained(tmp)
        if lm.tokenizer is not None:
            lm.tokenizer.save_pretrained(tmp)
        save_file(float_storage(qm), tmp / FLOAT_FILE, metadata={"format": "pt"})
        quant = {}
        for r in qm.layers:
            if r.name in qm.weights and not (r.tied_to and not r.untied):
                quant.update(_quant_tensors(r.name, qm.weights[r.name]))
        save_file(quant, tmp / QUANT_FILE, metadata={"format": FORMAT})
        qm.plan.save(tmp / "plan.json")
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "method": qm.method, "source": str(lm.path),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": qm.seconds,
                "bits_per_weight": qm.bits_per_weight, "layers": [_layer_entry(qm, r) for r in qm.layers]}
        if qm.awq:
            meta["awq"] = {"tokens": qm.awq.get("tokens"), "grid": qm.awq.get("grid"),
                           "search_seconds": qm.awq.get("seconds"),
                           "groups": [{"prev": e["group"]["prev"], "layers": e["group"]["layers"], "alpha": e["alpha"],
                                       "loss": e["loss"], "identity_loss": e["identity_loss"]}
                                      for e in qm.awq["groups"]],
                           "clipped_layers": sorted(qm.awq.get("clips", {}))}
        atomic_write_json(tmp / "quantization.json", meta)
        if report is not None:
            atomic_write_json(tmp / "report.json", report)
        _write_manifest(tmp, {"method": qm.method, "source": str(lm.path)})
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_report(directory: str | Path, report: dict) -> Path:
    """Add (or replace) ``report.json`` in a saved quantized model and refresh its manifest."""
    d = Path(directory)
    if not (d / "manifest.json").is_file():
        raise WorkspaceError(f"'{d}' is not a saved quantized model (no manifest.json)")
    manifest = json.loads((d / "manifest.json").read_text())
    atomic_write_json(d / "report.json", report)
    _write_manifest(d, {k: manifest[k] for k in ("method", "source") if k in manifest})
    return d / "report.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"'{path}' is not valid JSON: {e}") from None


def load_quantized(directory: str | Path, *, verify: bool = True):
    """Load a saved quantized model: ``(LoadedModel with the quantized weights applied, QuantizedModel)``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..models import LoadedModel, check_safetensors_file, quantizable_layers
    from .model import LayerQuantReport, QuantizedModel
    hf_logging.set_verbosity_error()
    d = Path(directory)
    if not d.is_dir():
        raise ModelLoadError(f"quantized model directory '{d}' does not exist")
    for name in ("config.json", "quantization.json", "plan.json", FLOAT_FILE, QUANT_FILE, "manifest.json"):
        if not (d / name).is_file():
            raise ModelLoadError(f"'{d}' has no {name}: not a complete quantized model (save it again with "
                                 "QuantizedModel.save or `workbench quantize --out`)")
    meta = _read_json(d / "quantization.json")
    if meta.get("format") != FORMAT or meta.get("version", 0) > FORMAT_VERSION:
        raise ModelLoadError(f"'{d / 'quantization.json'}' is not a {FORMAT} v{FORMAT_VERSION} description")
    if verify:
        manifest = _read_json(d / "manifest.json")
        for name, info in manifest.get("files", {}).items():
            f = d / name
            if not f.is_file() or f.stat().st_size != info["size"] or \
                    (name.endswith(".safetensors") and file_sha256(f) != info["sha256"]):
                raise ModelLoadError(f"'{f}' is missing or differs from the manifest; the directory was changed "
                                     "or partly copied: save the quantized model again")
    for f in (d / FLOAT_FILE, d / QUANT_FILE):
        check_safetensors_file(f)
    config = AutoConfig.from_pretrained(d, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    floats = load_file(d / FLOAT_FILE)
    quant = load_file(d / QUANT_FILE)
    params = dict(model.named_parameters(remove_duplicate=False))
    reports, weights = [], {}
    for entry in meta["layers"]:
        r = LayerQuantReport(entry["name"], entry["kind"], tuple(entry["shape"]), entry["precision"],
                             entry.get("group_size"), entry.get("fallback"), entry.get("tied_to"),
                             entry.get("untied", False), entry.get("weight_error"))
        reports.append(r)
        if "bits" in entry:
            n = r.name
            out_f, in_f = r.shape
            bits, g = entry["bits"], entry["group_size"]
            zeros = quant.get(f"{n}.zeros")
            if f"{n}.qweight" not in quant:
                raise ModelLoadError(f"'{d / QUANT_FILE}' has no tensor '{n}.qweight' for layer '{n}'")
            if bits == 4:
                codes = unpack_int4(quant[f"{n}.qweight"], in_f)
                if zeros is not None:
                    zeros = unpack_int4(zeros, in_f // (g or in_f))
                weights[n] = QuantizedWeight.from_storage_codes(codes, quant[f"{n}.scales"], zeros, 4, g)
            else:
                weights[n] = QuantizedWeight(quant[f"{n}.qweight"], quant[f"{n}.scales"].float(), zeros, bits, g)
    for r in reports:
        if r.tied_to and not r.untied and r.tied_to in weights:
            weights[r.name] = weights[r.tied_to]
    covered = {id(params[k]) for k in floats if k in params}
    covered |= {id(params[f"{n}.weight"]) for n in weights}
    missing = [k for k, p in params.items() if id(p) not in covered]
    unknown = [k for k in floats if k not in params]
    if missing or unknown:
        raise ModelLoadError(f"'{d}' does not match its config: missing {missing[:3]} unexpected {unknown[:3]}")
    with torch.no_grad():
        for k, t in floats.items():
            params[k].data.copy_(t.to(torch.float32))
    tokenizer = None
    if any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        tokenizer.model_max_length = 1 << 30
    lm = LoadedModel(model=model, tokenizer=tokenizer, path=d, name=str(directory), layers=quantizable_layers(model))
    qm = QuantizedModel(QuantPlan.load(d / "plan.json"), meta["method"], weights, reports, {}, source=lm,
                        seconds=meta.get("seconds", 0.0))
    qm.apply_(model)
    return lm, qm
