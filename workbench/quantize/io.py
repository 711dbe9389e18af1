"""Save a quantized model to a directory, and load it back to the same logits.

Writing and the stored layout live in ``storage`` (which ``QuantizedModel.save`` uses); this module
loads, and re-exports the writing side so both directions are importable from here.

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
(``storage._ct_shapes``: ``weight_packed``, ``weight_sub_scale`` + ``weight_channel_scale`` or
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

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..errors import ModelLoadError
from ..plan import QuantPlan
from ..workspace import file_sha256
from .model import LayerQuantReport, QuantizedModel
from .qtensor import QuantizedWeight, SubScales, unpack_int4
from .storage import (_HALF, FORMAT, FORMAT_VERSION, TRANSFORMERS_CANNOT, V1_FLOAT_FILE, V1_QUANT_FILE, WEIGHTS_FILE,
                      WORKBENCH_WEIGHTS_FILE, _ct_shapes, _stored_integer_layers, _weight_from_file,
                      _write_manifest, compressed_tensors_config, float_storage, layer_storage, pack_int32,
                      save_quantized, unpack_int32, weight_file_bytes, write_report)

__all__ = ["save_quantized", "load_quantized", "layer_storage", "float_storage", "write_report", "FORMAT",
           "weight_file_bytes", "pack_int32", "unpack_int32", "compressed_tensors_config", "WEIGHTS_FILE",
           "WORKBENCH_WEIGHTS_FILE", "TRANSFORMERS_CANNOT"]


# -- loading ----------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"'{path}' is not valid JSON: {e}") from None


class _Tensors:
    """The tensors of a directory's weight files: names and shapes from the headers, data on demand."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            st = safe_open(f, "pt")
            for k in st.keys():
                self.where[k] = st
                self.shapes[k] = tuple(st.get_slice(k).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def group(self, names) -> dict[str, torch.Tensor]:
        return {n: self.get(n) for n in names if n in self.where}


def _v1_layer(name: str, t: dict, shape: tuple[int, int], bits: int, g: int | None) -> QuantizedWeight:
    """A layer as format version 1 stored it (qweight / scales / zeros in quantized.safetensors)."""
    in_f = shape[1]
    zeros = t.get(f"{name}.zeros")
    if bits == 4:
        codes = unpack_int4(t[f"{name}.qweight"], in_f)
        zeros = None if zeros is None else unpack_int4(zeros, in_f // (g or in_f))
        return QuantizedWeight.from_storage_codes(codes, t[f"{name}.scales"], zeros, 4, g)
    return QuantizedWeight(t[f"{name}.qweight"], t[f"{name}.scales"].float(), zeros, bits, g)


def _v1_shapes(name: str, shape: tuple[int, int], bits: int, g: int | None, symmetric: bool) -> dict:
    out_f, in_f = shape
    groups = in_f // (g or in_f)
    d = {f"{name}.qweight": (out_f, -(-in_f // 2) if bits == 4 else in_f), f"{name}.scales": (out_f, groups)}
    if not symmetric:
        d[f"{name}.zeros"] = (out_f, -(-groups // 2) if bits == 4 else groups)
    return d


def _skeleton(config, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The model the config describes with every tensor on the meta device: no memory, nothing random."""
    from ..models import model_from_config
    with torch.device("meta"):
        return model_from_config(config, dtype=dtype, trust_remote_code=trust_remote_code).eval()


class _Skeleton:
    """A meta-device model filled in tensor by tensor; a tied weight is one Parameter under all its names."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = dict(model.named_buffers())
        self.aliases: dict[int, list[str]] = {}
        for k, p in self.params.items():
            self.aliases.setdefault(id(p), []).append(k)

    def set(self, name: str, value: torch.Tensor) -> None:
        param = nn.Parameter(value, requires_grad=False)
        for alias in self.aliases[id(self.params[name])]:
            owner, _, leaf = alias.rpartition(".")
            self.model.get_submodule(owner)._parameters[leaf] = param

    def materialize_buffers(self, loaded: dict[str, torch.Tensor]) -> None:
        """Buffers left on the meta device (rotary frequencies) are computed by the model's own initialisation."""
        owners = set()
        for name, b in list(self.model.named_buffers()):
            if not b.is_meta:
                continue
            owner, _, leaf = name.rpartition(".")
            mod = self.model.get_submodule(owner)
            mod._buffers[leaf] = loaded[name] if name in loaded else torch.empty_like(b, device="cpu")
            if name not in loaded:
                owners.add(owner)
        init = getattr(self.model, "_init_weights", None)
        for owner in owners:
            mod = self.model.get_submodule(owner)
            for p in mod.parameters(recurse=False):
                p._is_hf_initialized = True  # loaded: transformers' init functions leave these alone
            if init is not None:
                init(mod)


def _layer_reports(meta: dict, version: int, tensors: _Tensors) -> tuple[list, dict]:
    """quantization.json's layers, and per stored integer layer ``(bits, group size, symmetric, sub-scale bits or
    None, tensor shapes)``."""
    reports, integer = [], {}
    for entry in meta["layers"]:
        r = LayerQuantReport(entry["name"], entry["kind"], tuple(entry["shape"]), entry["precision"],
                             entry.get("group_size"), entry.get("fallback"), entry.get("tied_to"),
                             entry.get("untied", False), entry.get("weight_error"))
        reports.append(r)
        if "bits" in entry:
            spec = (entry["bits"], entry["group_size"], entry.get("symmetric", f"{r.name}.zeros" not in tensors.shapes))
            scale_bits = None if entry.get("scale_bits") is None else \
                SubScales(entry["scale_bits"], entry.get("scale_max"), entry.get("super_block"))
            shapes = _v1_shapes(r.name, r.shape, *spec) if version == 1 else _ct_shapes(r.name, r.shape, *spec,
                                                                                      scale_bits)
            integer[r.name] = (*spec, scale_bits, shapes)
    return reports, integer


def _check_cover(d: Path, sk: _Skeleton, tensors: _Tensors, reports: list, integer: dict) -> set[str]:
    """Refuse, naming the tensors, unless the files hold exactly the model's tensors in its shapes.

    Returns the weight names the integer layers stand for (tied copies included).
    """
    from ..models import weights_mismatch_error
    params, buffers = sk.params, sk.buffers
    integer_weights = {f"{r.name}.weight" for r in reports
                       if r.name in integer or (r.tied_to in integer and not r.untied)}
    unknown = sorted(n for n in integer_weights if n not in params)
    bad = [(f"{r.name}.weight", r.shape, tuple(params[f"{r.name}.weight"].shape)) for r in reports
           if f"{r.name}.weight" in params and tuple(params[f"{r.name}.weight"].shape) != tuple(r.shape)]
    if unknown or bad:  # quantization.json describes layers the config's model does not have
        raise weights_mismatch_error(d, (), unknown, bad)
    expected_quant = {k: v for *_, shapes in integer.values() for k, v in shapes.items()}
    missing, unexpected, mismatched = [], [], []
    covered = {id(params[k]) for k in integer_weights}
    for k, shape in tensors.shapes.items():
        want = expected_quant.get(k) or (params[k].shape if k in params else buffers[k].shape if k in buffers else None)
        if want is None:
            unexpected.append(k)
            continue
        if k in params:
            covered.add(id(params[k]))
        if shape != tuple(want):
            mismatched.append((k, shape, tuple(want)))
    missing += [k for k in expected_quant if k not in tensors.shapes]
    missing += [names[0] for i, names in sk.aliases.items() if i not in covered]
    if missing or unexpected or mismatched:
        raise weights_mismatch_error(d, missing, unexpected, mismatched)
    return integer_weights


def _exact_cast(t: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 24) -> torch.Tensor:
    """``t`` in ``dtype`` when that holds every value exactly, else ``t`` itself (checked a chunk at a time)."""
    cast = t.to(dtype)
    flat, flat_cast = t.reshape(-1), cast.reshape(-1)
    for i in range(0, flat.numel(), chunk):
        if not torch.equal(flat_cast[i:i + chunk].to(t.dtype), flat[i:i + chunk]):
            return t
    return cast


def _open_directory(d: Path, verify: bool) -> tuple[dict, list[str]]:
    """quantization.json and the weight files, after checking the directory is complete and unchanged."""
    from ..models import check_safetensors_file
    if not d.is_dir():
        raise ModelLoadError(f"quantized model directory '{d}' does not exist")
    incomplete = "not a complete quantized model (save it again with QuantizedModel.save or `workbench quantize --out`)"
    for name in ("config.json", "quantization.json", "plan.json", "manifest.json"):
        if not (d / name).is_file():
            raise ModelLoadError(f"'{d}' has no {name}: {incomplete}")
    meta = _read_json(d / "quantization.json")
    version = meta.get("version", 0)
    if meta.get("format") != FORMAT or not 1 <= version <= FORMAT_VERSION:
        raise ModelLoadError(f"'{d / 'quantization.json'}' is not a {FORMAT} v1-v{FORMAT_VERSION} description; "
                             "upgrade workbench or quantize the model again")
    files = [V1_FLOAT_FILE, V1_QUANT_FILE] if version == 1 else [meta.get("weights_file", WEIGHTS_FILE)]
    for name in files:
        if not (d / name).is_file():
            raise ModelLoadError(f"'{d}' has no {name}: {incomplete}")
    if verify:
        manifest = _read_json(d / "manifest.json")
        for name, info in manifest.get("files", {}).items():
            f = d / name
            if not f.is_file() or f.stat().st_size != info["size"] or \
                    (name.endswith(".safetensors") and file_sha256(f) != info["sha256"]):
                raise ModelLoadError(f"'{f}' is missing or differs from the manifest; the directory was changed "
                                     "or partly copied: save the quantized model again")
    for name in files:
        check_safetensors_file(d / name)
    return meta, files


def load_quantized(directory: str | Path, *, verify: bool = True, dtype: str | torch.dtype = "auto",
                   device: str = "cpu", trust_remote_code: bool = False, load_tokenizer: bool = True,
                   require_tokenizer: bool = False, float32_compute: bool = True, float_model: bool = False):
    """Load a saved quantized model: ``(LoadedModel, QuantizedModel)``, the first with ``quantized`` set.

    The model is built from the config on the meta device, takes the float tensors as stored
    (``dtype="auto"``: 16-bit ones as they are in the file, float32 ones in the config's dtype when that
    holds them exactly; any other ``dtype`` casts them) and
    ``QuantLinear`` / ``QuantEmbedding`` for integer layers, computing from the codes
    (``QuantizedModel.build_model``): no float copy of an integer layer, nothing initialised at
    random. Weights that do not cover the model exactly are refused, naming the tensors.
    ``float_model=True`` gives the dequantized weights as ordinary float32 parameters instead.
    """
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from ..models import LoadedModel, load_tokenizer_from, quantizable_layers, resolve_dtype
    hf_logging.set_verbosity_error()
    d = Path(directory)
    meta, files = _open_directory(d, verify)
    version = meta["version"]
    torch_dtype = resolve_dtype(dtype, _read_json(d / "config.json"))
    try:
        config = AutoConfig.from_pretrained(d, local_files_only=True, trust_remote_code=trust_remote_code)
        if hasattr(config, "quantization_config"):  # for transformers' own loader; the integer layers are built here
            del config.quantization_config
        sk = _Skeleton(_skeleton(config, torch_dtype, trust_remote_code))
    except Exception as e:
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise ModelLoadError(f"could not build the model '{d / 'config.json'}' describes: {why}") from e
    tensors = _Tensors([d / f for f in files])
    reports, integer = _layer_reports(meta, version, tensors)
    integer_weights = _check_cover(d, sk, tensors, reports, integer)

    shape_of = {r.name: r.shape for r in reports}
    weights = {}
    for n, (bits, g, _, scale_bits, shapes) in integer.items():
        t = tensors.group(shapes)
        weights[n] = _v1_layer(n, t, shape_of[n], bits, g) if version == 1 else \
            _weight_from_file(n, t, bits, g, scale_bits)
    for r in reports:
        if r.tied_to and not r.untied and r.tied_to in weights:
            weights[r.name] = weights[r.tied_to]

    integer_tensors = {k for *_, shapes in integer.values() for k in shapes}
    loaded_buffers = {}
    for k in tensors.shapes:
        if k in integer_tensors:
            continue
        t = tensors.get(k)  # backed by the file's pages until it is cast
        if t.is_floating_point() and t.dtype != torch_dtype:
            if dtype != "auto":
                t = t.to(torch_dtype)
            elif not (float32_compute and {t.dtype, torch_dtype} <= _HALF):  # either 16-bit kind is widened
                t = _exact_cast(t, torch_dtype)
        if k in sk.buffers:
            loaded_buffers[k] = t
        else:
            sk.set(k, t)
    sk.materialize_buffers(loaded_buffers)
    for k in integer_weights:  # a one-element stand-in on the CPU until the layer is replaced: never read
        p = sk.params[k]
        sk.set(k, torch.zeros((), dtype=p.dtype).expand(p.shape))

    qm = QuantizedModel(QuantPlan.load(d / "plan.json"), meta["method"], weights, reports, {},
                        seconds=meta.get("seconds", 0.0))
    if float_model:
        for r in _stored_integer_layers(qm):
            sk.set(f"{r.name}.weight", qm.weights[r.name].dequantize())
        model = sk.model.to(torch.float32)
    else:
        model = qm.build_model(sk.model)
    del sk
    left = [k for k, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"'{d}': {len(left)} tensors of the model were not loaded ({', '.join(left[:3])}); "
                             "this architecture is not supported for quantized loading")
    model.to(device).eval()
    if float32_compute:
        from ..compute import enable_float32_compute
        enable_float32_compute(model)
    tokenizer = load_tokenizer_from(d, trust_remote_code=trust_remote_code, required=require_tokenizer) \
        if load_tokenizer else None
    lm = LoadedModel(model=model, tokenizer=tokenizer, path=d, name=str(directory), layers=quantizable_layers(model),
                     quantized=qm)
    qm.source = lm
    from ..memory import release_freed_memory
    release_freed_memory()  # the per-layer unpacking temporaries
    return lm, qm
