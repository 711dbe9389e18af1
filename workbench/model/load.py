"""Load a local Hugging Face causal LM safely, and describe its quantizable layers.

    lm = load_model("demo")                 # the bundled model; any local HF directory works
    for layer in lm.layers: print(layer.name, layer.shape, layer.bytes_at("int4"))

Never downloads, never runs remote code unless the caller opts in (``trust_remote_code``), prefers
safetensors and loads pickled weights only with ``weights_only=True``. A directory written by
``workbench quantize`` loads as the quantized model (``lm.quantized`` holds its QuantizedModel), and
weights that do not cover the model exactly are refused, never initialised at random.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import re
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import safe_open
from torch import nn

from ..assets import DEMO_MODEL_DIR, DEMO_VL_MODEL_DIR
from ..errors import ModelLoadError
from ..quantize.plan import DEFAULT_GROUP_SIZE, QuantPlan, get_precision
from ..quantize.model import LayerQuantReport, QuantizedModel
from ..quantize.qtensor import QuantizedWeight, SubScales, unpack_int4
from ..quantize.storage import (FORMAT, FORMAT_VERSION, HALF_DTYPES, V1_FLOAT_FILE, V1_QUANT_FILE, WEIGHTS_FILE,
                               stored_integer_layers, stored_shapes, weight_from_file)
from ..files.workspace import file_sha256
from .vision import VISION_MODEL_TYPES, is_vision_config, load_vision_model, model_parts, vision_inputs
from ..numerics.compute import enable_float32_compute
from ..numerics.memory import release_freed_memory
from ..quantize.layers import QuantEmbedding, QuantLinear

__all__ = ["LayerInfo", "LoadedModel", "resolve_model_path", "load_model",
           "quantizable_layers", "check_safetensors_file", "is_quantized_dir",
           "weights_mismatch_error", "load_quantized", "quantized_source", "LAYER_SHAPES", "layer_shapes", "model_from_config", "apply_layer_shapes",
           "check_model_config", "MAX_PARAMETERS", "MAX_LAYERS"]

MODEL_ALIASES = {"demo": DEMO_MODEL_DIR, "demo-vl": DEMO_VL_MODEL_DIR}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

log = logging.getLogger("workbench")  # notes for the user; the CLI prints them as "workbench <command>: note: ..."

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """``demo`` names the bundled model (``demo-vl`` the bundled vision-language one); anything else is a local
    directory."""
    if str(name_or_path) in MODEL_ALIASES:
        return MODEL_ALIASES[str(name_or_path)]
    return Path(name_or_path).expanduser()


@dataclass(frozen=True)
class LayerInfo:
    """A quantizable layer: a Linear (or the token embedding) named by its FQN."""

    name: str
    kind: str  # "linear" or "embedding"
    shape: tuple[int, int]  # (out_features, in_features) as stored in the weight
    tied_to: str | None = None  # set on lm_head when it shares the embedding's weight

    @property
    def parameters(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def block(self) -> str:
        """``layers.3`` for block layers, else the top-level part (``embed_tokens``, ``lm_head``); a vision-language
        model's vision side is named by its module (``visual.blocks.0``, ``visual.merger``,
        ``vision_model.encoder.layers.0``), so it never shares a name with a language-model block."""
        m = _VISION_MODULE.search(self.name)
        if m:
            rest = self.name[m.end():].split(".")
            for key in ("blocks", "layers"):
                if key in rest:
                    i = rest.index(key)
                    return ".".join([m.group(1), *rest[:i + 2]])
            return f"{m.group(1)}.{rest[0]}"
        parts = self.name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            return ".".join(parts[i:i + 2])
        return parts[-1]

    @property
    def role(self) -> str:
        """The short layer type: q_proj, k_proj, ..., down_proj, embed_tokens, lm_head."""
        return self.name.rsplit(".", 1)[-1]

    def bytes_at(self, precision: str, group_size: int | None = DEFAULT_GROUP_SIZE, symmetric: bool = True) -> int:
        p = get_precision(precision)
        return p.weight_bytes(self.shape[0], self.shape[1], group_size, symmetric)

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "shape": list(self.shape), "parameters": self.parameters,
                "tied_to": self.tied_to,
                "bytes": {p: self.bytes_at(p) for p in ("fp32", "fp16", "int8", "int4")}}


_VISION_MODULE = re.compile(r"(?:^|\.)(visual|vision_model|vision_tower|connector|multi_modal_projector)\.")


def quantizable_layers(model: nn.Module) -> list[LayerInfo]:
    """Every linear and embedding layer in module order, with tied weights marked.

    ``QuantLinear`` / ``QuantEmbedding`` (integer layers computing from their codes) count as the
    layers they replace, with the shape of their codes, so a loaded quantized model lists them too.
    """
    out: list[LayerInfo] = []
    seen: dict[int, str] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding, QuantLinear, QuantEmbedding)):
            w = mod.qweight if isinstance(mod, (QuantLinear, QuantEmbedding)) else mod.weight
            tied = seen.get(id(w))
            seen.setdefault(id(w), name)
            kind = "embedding" if isinstance(mod, (nn.Embedding, QuantEmbedding)) else "linear"
            out.append(LayerInfo(name, kind, (int(w.shape[0]), int(w.shape[1])), tied))
    return out


@dataclass
class LoadedModel:
    """A model, its tokenizer and where they came from.

    ``quantized`` is the QuantizedModel behind a model loaded from a ``workbench quantize`` directory
    (its integer layers compute from their codes); None for a float model. ``processor`` is set for a
    vision-language model (``workbench.model.vision.VisionInputs``: picture and question to model inputs).
    """

    model: nn.Module
    tokenizer: object
    path: Path
    name: str
    layers: list[LayerInfo] = field(default_factory=list)
    quantized: object = field(default=None, repr=False)
    processor: object = field(default=None, repr=False)

    @property
    def config(self):
        return self.model.config

    @property
    def text_config(self):
        """The language model's config: the config itself for a text model, its ``text_config`` for a VLM."""
        return self.model.config.get_text_config()

    @property
    def is_vision(self) -> bool:
        """Whether the model takes pictures (it has a vision encoder)."""
        return getattr(self.model.config, "vision_config", None) is not None

    def parts(self) -> list:
        """A VLM's vision encoder, projector and language model (``ModelPart``: prefixes, parameters, bytes);
        a text model is one part, its language model."""
        return model_parts(self.model, [info.name for info in self.layers])

    @property
    def parameters(self) -> int:
        """Weights of the network, an integer layer counted as its codes (tied weights once)."""
        tensors = {id(p): p for p in self.model.parameters()}
        tensors.update({id(m.qweight): m.qweight for m in self.model.modules()
                        if isinstance(m, (QuantLinear, QuantEmbedding))})
        return sum(t.numel() for t in tensors.values())

    def require_float(self, step: str) -> None:
        """Refuse, in one line, a step that re-quantizes (sensitivity, plan) on an already quantized model."""
        if self.quantized is not None:
            source = quantized_source(self.path)
            raise ModelLoadError(f"'{self.path}' is already quantized ({self.quantized.method}); run {step} on the "
                                 f"float model it was made from{f' ({source})' if source else ''}")

    def release(self) -> None:
        """Free the weights (they move to the meta device) for a caller done with the model; any later
        forward fails instead of computing with freed memory."""
        self.model.to("meta")
        self.quantized = None
        gc.collect()

    def layer(self, name: str) -> LayerInfo:
        for info in self.layers:
            if info.name == name:
                return info
        raise KeyError(name)

    def layer_bytes(self, assignments: Mapping[str, str | None], group_size: int | None = DEFAULT_GROUP_SIZE,
                    symmetric: bool = True, names: Iterable[str] | None = None) -> int:
        """Weight bytes of the named layers (all by default) at the assigned precisions (missing or None:
        fp16); a tied weight is counted once when both its uses have the same precision."""
        by_weight: dict[tuple[str, str], int] = {}
        for info in self.layers if names is None else [self.layer(n) for n in names]:
            p = assignments.get(info.name) or "fp16"
            key = (info.tied_to or info.name, p)
            if key not in by_weight:
                by_weight[key] = info.bytes_at(p, group_size, symmetric)
        return sum(by_weight.values())

    @property
    def other_bytes(self) -> int:
        """Bytes of the parameters outside the quantizable layers (norms), counted at fp16."""
        layer_params = {id(m.weight) for m in self.model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        return 2 * sum(p.numel() for p in self.model.parameters() if id(p) not in layer_params)

    def size_bytes(self, plan=None, precision: str | None = None) -> int:
        """Weight bytes under a plan (or one precision for everything), norms included at fp16."""
        names = [info.name for info in self.layers]
        assignments = {n: precision for n in names} if precision else plan.resolve(names) if plan else {}
        group_size, symmetric = (plan.group_size, plan.symmetric) if plan else (DEFAULT_GROUP_SIZE, True)
        return self.layer_bytes(assignments, group_size, symmetric) + self.other_bytes


def stored_bytes(model: nn.Module) -> int:
    """Bytes a module's parameters hold in memory, at their own dtype; a tied parameter counted once."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def quantized_source(path: Path) -> str | None:
    """The float model a ``workbench quantize`` output was made from (its ``quantization.json``), or None."""
    try:
        return json.loads((Path(path) / "quantization.json").read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def check_safetensors_file(path: Path) -> None:
    """Fail with a clear message when a safetensors file is truncated or its header is corrupt."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"weights file '{path}' is truncated ({size} bytes): re-copy or re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise ModelLoadError(f"weights file '{path}' is corrupt: header length {n} exceeds the file size "
                                     f"{size}; the file is truncated or not safetensors")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelLoadError(f"weights file '{path}' has a corrupt safetensors header; re-copy it") from None
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        raise ModelLoadError(f"weights file '{path}' has a corrupt safetensors header (not a table of tensors "
                             "with data offsets); re-copy it") from None
    if 8 + n + end > size:
        raise ModelLoadError(f"weights file '{path}' is truncated: its header describes {8 + n + end:,} bytes but "
                             f"the file has {size:,}; re-copy it")


def is_quantized_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by ``workbench quantize`` (``QuantizedModel.save``)."""
    meta = resolve_model_path(path) / "quantization.json"
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text(encoding="utf-8")).get("format") == "workbench-quantized"
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def weights_mismatch_error(where, missing=(), unexpected=(), mismatched=()) -> ModelLoadError:
    """One line naming the tensors that keep a directory's weights from covering its model exactly.

    ``mismatched`` holds ``(name, shape in the file, shape in the model)``.
    """
    def names(kind: str, items: list[str]) -> str:
        more = f" and {len(items) - 3} more" if len(items) > 3 else ""
        return f"{len(items)} {kind} ({', '.join(items[:3])}{more})"
    missing, unexpected, mismatched = sorted(missing), sorted(unexpected), sorted(mismatched)
    parts = []
    if missing:
        parts.append(names("missing", missing))
    if unexpected:
        parts.append(names("unexpected", unexpected))
    if mismatched:
        parts.append(names("with another shape", [f"{n} {list(a)} vs {list(b)}" for n, a, b in mismatched]))
    return ModelLoadError(f"the weights in '{where}' do not match the model its config.json describes: "
                          f"{'; '.join(parts)} tensors; fix config.json or the weights files (nothing is "
                          "initialised at random)")


def _check_directory(path: Path, name: str) -> dict:
    if not path.exists():
        hint = " (the bundled demo model is missing: run scripts/build_demo_model.py)" if name == "demo" else \
            " (the bundled demo vision-language model is missing: run scripts/build_demo_vl_model.py)" \
            if name == "demo-vl" else "; pass a local Hugging Face model directory, or 'demo' for the bundled model"
        raise ModelLoadError(f"model path '{path}' does not exist{hint}")
    if not path.is_dir():
        raise ModelLoadError(f"model path '{path}' is a file; pass the directory that holds config.json")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"'{path}' has no config.json: not a Hugging Face model directory "
                             "(save one with model.save_pretrained(dir))")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"'{cfg_path}' is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"'{cfg_path}' holds a JSON {type(cfg).__name__}, not an object of model settings")
    st = sorted(path.glob("*.safetensors"))
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not st and not bins:
        raise ModelLoadError(f"'{path}' has no weights: expected model.safetensors (or pytorch_model.bin)")
    for f in st:
        check_safetensors_file(f)
    check_tokenizer_json(path)
    return cfg


def check_tokenizer_json(path: Path) -> None:
    """Refuse a ``tokenizer.json`` that is empty, not UTF-8 or not JSON (a truncated copy), naming the file."""
    f = path / "tokenizer.json"
    if not f.is_file():
        return
    size = f.stat().st_size
    hint = "copy tokenizer.json of the base model into the directory again"
    if size == 0:
        raise ModelLoadError(f"'{f}' is empty (0 bytes); {hint}")
    try:
        doc = json.loads(f.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"'{f}' is not UTF-8 text ({e.reason} at byte {e.start}); {hint}") from None
    except json.JSONDecodeError as e:
        truncated = " (the file looks truncated)" if e.pos >= len(e.doc.rstrip()) else ""
        raise ModelLoadError(f"'{f}' is not valid JSON{truncated}: {e.msg} at line {e.lineno} column {e.colno} of "
                             f"{size:,} bytes; {hint}") from None
    if not isinstance(doc, dict) or "model" not in doc:
        raise ModelLoadError(f"'{f}' is JSON but not a tokenizer (no 'model' section); {hint}")


def _stored_dtype(raw_cfg: dict) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are stored in (float32 when it does not say)."""
    name = raw_cfg.get("dtype") or raw_cfg.get("torch_dtype") or "float32"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.float32


def resolve_dtype(dtype: str | torch.dtype, raw_cfg: dict) -> torch.dtype:
    """``auto`` is the dtype the checkpoint is stored in; else a torch dtype or its name."""
    if dtype == "auto":
        return _stored_dtype(raw_cfg)
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ModelLoadError(f"unknown dtype '{dtype}'; use auto, float32, float16 or bfloat16")
    return torch_dtype


LAYER_SHAPES = "layer_shapes"  # config.json field: per-layer head counts and MLP widths of a pruned model
_SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def layer_shapes(config) -> list[tuple[int, int, int]] | None:
    """Per-layer ``(query heads, KV heads, MLP width)`` from a config's ``layer_shapes`` field; None without one.

    A pruned model whose layers keep different counts carries them there (the standard fields hold
    the largest); transformers ignores the field, so only this workbench's loader builds such a model.
    """
    raw = config.get(LAYER_SHAPES) if isinstance(config, Mapping) else getattr(config, LAYER_SHAPES, None)
    if raw is None:
        return None
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    n = get("num_hidden_layers")
    if not isinstance(raw, Mapping) or set(raw) != set(_SHAPE_KEYS) or \
            not all(isinstance(raw[k], list) and len(raw[k]) == n and
                    all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in raw[k]) for k in _SHAPE_KEYS):
        raise ModelLoadError(f"config field '{LAYER_SHAPES}' must map {', '.join(_SHAPE_KEYS)} to lists of "
                             f"{n} positive integers (one per layer); fix config.json or prune again")
    shapes = list(zip(*(raw[k] for k in _SHAPE_KEYS)))
    bad = [i for i, (h, kv, _) in enumerate(shapes) if h % kv]
    if bad:
        raise ModelLoadError(f"config field '{LAYER_SHAPES}': layer(s) {bad} have query heads that are not a multiple "
                             "of their KV heads; fix config.json or prune again")
    return shapes


def apply_layer_shapes(model: nn.Module, shapes: list[tuple[int, int, int]]) -> None:
    """Resize every block's q/k/v/o and gate/up/down to its layer's counts (on the device and dtype they have).

    transformers' Llama/Qwen attention reshapes with ``-1`` heads of ``head_dim`` and repeats KV heads
    ``num_key_value_groups`` times, so narrower Linears and that one attribute make a layer smaller.
    """
    blocks = model.model.layers
    for block, (heads, kv, inter) in zip(blocks, shapes):
        a, m = block.self_attn, block.mlp
        d = a.head_dim
        for mod, name, out_f, in_f in ((a, "q_proj", heads * d, None), (a, "k_proj", kv * d, None),
                                       (a, "v_proj", kv * d, None), (a, "o_proj", None, heads * d),
                                       (m, "gate_proj", inter, None), (m, "up_proj", inter, None),
                                       (m, "down_proj", None, inter)):
            old = getattr(mod, name)
            out_f, in_f = out_f or old.out_features, in_f or old.in_features
            if (out_f, in_f) != (old.out_features, old.in_features):
                setattr(mod, name, nn.Linear(in_f, out_f, bias=old.bias is not None, device=old.weight.device,
                                             dtype=old.weight.dtype))
        a.num_key_value_groups = heads // kv
        if hasattr(m, "intermediate_size"):
            m.intermediate_size = inter


MAX_PARAMETERS = 100_000_000_000  # far beyond what a step here can hold or time on one machine
MAX_LAYERS = 1_000  # the deepest published LLMs have under 200; each costs ~1 ms and ~0.1 MB to build, even on meta
_SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "num_key_value_heads", "head_dim")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_model_config(config, where, weight_files: Iterable[Path] = ()) -> None:
    """Refuse, before anything is built, a config no model here can have or that its weights contradict.

    Building follows the config's numbers: a million layers is minutes and gigabytes even on the meta
    device, and a width of 2^40 an allocation that never returns. Sizes must be positive whole numbers,
    the model at most ``MAX_LAYERS`` layers and ``MAX_PARAMETERS`` parameters (estimated from the sizes),
    and with ``weight_files`` (safetensors; only their headers are read) the layer count, hidden size and
    vocabulary must be those the tensors have.
    """
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    fix = "fix config.json"
    sizes = {}
    for k in _SIZE_KEYS:
        v = get(k)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ModelLoadError(f"'{where}': {k} must be a positive whole number, got {v!r}; {fix}")
        sizes[k] = v
    heads, kv = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ModelLoadError(f"'{where}': num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; "
                             f"{fix}")
    layers = sizes.get("num_hidden_layers")
    if all(k in sizes for k in _SIZE_KEYS[:5]):
        hidden, kv = sizes["hidden_size"], kv or heads
        head_dim = sizes.get("head_dim") or max(1, hidden // heads)
        per_layer = hidden * head_dim * 2 * (heads + kv) + 3 * hidden * sizes["intermediate_size"]
        embeddings = sizes["vocab_size"] * hidden * (1 if get("tie_word_embeddings") else 2)
        params = layers * per_layer + embeddings
        if layers > MAX_LAYERS or params > MAX_PARAMETERS:
            raise ModelLoadError(f"'{where}' describes {layers:,} layers and about {params / 1e9:,.1f} B parameters "
                                 f"(from its sizes), beyond the {MAX_LAYERS:,} layers and {MAX_PARAMETERS / 1e9:.0f} B "
                                 f"parameters any workbench step can handle; {fix}")
    elif layers is not None and layers > MAX_LAYERS:
        raise ModelLoadError(f"'{where}' describes {layers:,} layers, beyond the {MAX_LAYERS:,} any workbench step "
                             f"can handle; {fix}")
    files = [Path(f) for f in weight_files]
    if not files:
        return
    shapes = _Tensors(files).shapes
    found = {int(m.group(1)) for k in shapes for m in [_LAYER_INDEX.search(k)] if m}
    held = f"the weights in '{files[0].parent}'"
    fix = "fix config.json, or use the one that came with the weights"
    if found and layers is not None and layers != max(found) + 1:
        raise ModelLoadError(f"'{where}' gives num_hidden_layers {layers:,} but {held} hold {max(found) + 1} "
                             f"(layers.0 to layers.{max(found)}); {fix}")
    expected = {"model.norm.weight": ("hidden_size",), "model.embed_tokens.weight": ("vocab_size", "hidden_size")}
    for name, keys in expected.items():
        shape = shapes.get(name)
        if shape is None or len(shape) != len(keys):
            continue
        for k, n in zip(keys, shape):
            if k in sizes and sizes[k] != n:
                raise ModelLoadError(f"'{where}' gives {k} {sizes[k]:,} but {held} have {name} of shape "
                                     f"{list(shape)}; {fix}")


def model_from_config(config, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> nn.Module:
    """``AutoModelForCausalLM.from_config``, then each layer resized to the config's ``layer_shapes`` if it has them.

    The config's sizes are checked first (``check_model_config``), so no caller builds an impossible model."""
    from transformers import AutoModelForCausalLM
    check_model_config(config, getattr(config, "name_or_path", None) or f"{getattr(config, 'model_type', '')} config")
    kw = {"dtype": dtype} if dtype is not None else {}
    vision_class = VISION_MODEL_TYPES.get(getattr(config, "model_type", None))
    if vision_class is not None:  # a vision-language model: its own transformers class, never remote code
        import transformers
        model = getattr(transformers, vision_class[0])._from_config(config, **kw)
    else:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **kw)
    base = getattr(model, "model", None)
    rotary = getattr(base, "rotary_emb", None)
    if dtype not in (None, torch.float32) and rotary is not None and hasattr(rotary, "inv_freq"):
        # built under a 16-bit default dtype, the rotary frequencies were rounded; from_pretrained's are float32
        device = rotary.inv_freq.device
        fresh = type(rotary)(config=config)
        base.rotary_emb = fresh if device.type == "meta" or fresh.inv_freq.is_meta else fresh.to(device)
    shapes = layer_shapes(config)
    if shapes is not None:
        apply_layer_shapes(model, shapes)
    return model


def _load_per_layer(p: Path, config, torch_dtype: torch.dtype) -> nn.Module:
    """A model whose layers have their own shapes (``layer_shapes``): built, resized, then filled from safetensors."""
    from safetensors.torch import load_file
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"'{p}' has per-layer shapes ('{LAYER_SHAPES}' in config.json) but no safetensors "
                             "weights; save the pruned model with save_pruned")
    model = model_from_config(config, dtype=torch_dtype)
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    own = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in own if k not in state and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in own]
    mismatched = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in state
                  if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or mismatched:
        raise weights_mismatch_error(p, missing, unexpected, mismatched)
    model.load_state_dict({k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in state.items()},
                          strict=False)
    if tied:
        model.tie_weights()
    return model


REMOTE_CODE_OPT_IN = ("`workbench info --trust-remote-code` runs it (only for a directory whose code you trust), "
                      "other commands never do")


def _custom_code(raw_cfg: dict) -> str | None:
    """What ``auto_map`` in config.json points at (the model's own Python code), or None."""
    auto_map = raw_cfg.get("auto_map")
    if not auto_map:
        return None
    if isinstance(auto_map, dict):
        target = auto_map.get("AutoModelForCausalLM") or next(iter(auto_map.values()), None)
        return f"auto_map: {target if isinstance(target, str) else json.dumps(target)}"
    return f"auto_map: {json.dumps(auto_map)[:60]}"


def _refused_pickle(e: BaseException) -> str | None:
    """What torch's weights_only unpickler refused in ``e`` or its causes ('GLOBAL posix.system'), or None."""
    import pickle
    import re
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in text:
            m = re.search(r"GLOBAL\s+([\w.]+)", text)
            return f"GLOBAL {m.group(1)}" if m else "objects other than tensors"
        e = e.__cause__ or e.__context__
    return None


def _plain_pickle_global(path: Path) -> str | None:
    """The first global a plain (non-zip) pickle would import beyond torch's own ('GLOBAL posix.system'), read
    opcode by opcode without running anything; None for a zip checkpoint or none found."""
    import pickletools
    import zipfile
    if zipfile.is_zipfile(path):
        return None
    safe = ("torch", "collections", "_codecs", "numpy")
    strings: list[str] = []
    try:
        with open(path, "rb") as f:
            for op, arg, _pos in pickletools.genops(f):
                if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                    strings = (strings + [arg])[-2:]
                elif op.name in ("GLOBAL", "INST") or (op.name == "STACK_GLOBAL" and len(strings) == 2):
                    module, name = arg.split(" ", 1) if op.name != "STACK_GLOBAL" else strings
                    if not module.split(".")[0] in safe:
                        return f"GLOBAL {module}.{name}"
                elif op.name == "STOP":
                    return None
    except Exception:  # noqa: BLE001 - a damaged pickle: say what torch said instead
        return None
    return None


def _one_line(e: BaseException) -> str:
    """An exception's message on one line: its non-empty lines joined (the first is often only a heading)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = " ".join(lines) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def load_model(path: str | os.PathLike = "demo", *, dtype: str | torch.dtype = "auto", device: str = "cpu",
               trust_remote_code: bool = False, load_tokenizer: bool = True,
               float32_compute: bool = True) -> LoadedModel:
    """Load a local causal-LM directory (or ``demo``) on ``device``.

    ``dtype="auto"`` keeps the weights in the dtype they are stored in (bfloat16 / float16 for most
    checkpoints: half the memory of float32); ``float32_compute`` then widens each block to float32
    only while it runs (``workbench.numerics.compute``), so figures are float32 figures.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # progress bars and notices go nowhere useful in a CLI or panel
    hf_logging.disable_progress_bar()

    name = str(path)
    p = resolve_model_path(path)
    if is_quantized_dir(p):
        lm, _ = load_quantized(p, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                               load_tokenizer=load_tokenizer, require_tokenizer=True, float32_compute=float32_compute)
        lm.name = name
        return lm
    raw_cfg = _check_directory(p, name)
    if is_vision_config(raw_cfg):
        return _load_vision(p, name, raw_cfg, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                            load_tokenizer=load_tokenizer, float32_compute=float32_compute)
    model_type = raw_cfg.get("model_type")
    archs = raw_cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs) or \
            not isinstance(model_type, (str, type(None))):
        raise ModelLoadError(f"'{p / 'config.json'}': 'model_type' must be a string and 'architectures' a list of "
                             f"class names, got {model_type!r} and {archs!r}")
    causal_arch = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    custom_code = _custom_code(raw_cfg)
    if (archs and not causal_arch) or (model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code):
        arch = ", ".join(archs) or "unknown architecture"
        if custom_code and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            why = (f"which transformers has no built-in class for: it needs the model's own code ({custom_code}), "
                   f"which is not run; {REMOTE_CODE_OPT_IN}")
        else:
            why = "not a causal language model this workbench can load"
        raise ModelLoadError(f"'{p}' is model_type '{model_type}' ({arch}), {why}; supported include qwen2, qwen3 "
                             "and llama")
    if custom_code and not trust_remote_code:
        log.warning(f"'{p / 'config.json'}' names its own model code ({custom_code}), which is not run: the model is "
                    f"loaded with transformers' built-in class for '{model_type}', which may differ from it; "
                    f"{REMOTE_CODE_OPT_IN}")
    check_model_config(raw_cfg, p / "config.json", sorted(p.glob("*.safetensors")))
    torch_dtype = resolve_dtype(dtype, raw_cfg)
    try:
        config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code, local_files_only=True)
        if layer_shapes(raw_cfg) is not None:  # transformers would build every layer at the largest counts
            model, info = _load_per_layer(p, config, torch_dtype), {}
        else:
            with warnings.catch_warnings():  # torch's notice on a plain pickle's protocol: the refusal below says more
                warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
                model, info = AutoModelForCausalLM.from_pretrained(
                    p, config=config, dtype=torch_dtype, trust_remote_code=trust_remote_code, local_files_only=True,
                    use_safetensors=any(p.glob("*.safetensors")), output_loading_info=True,
                    ignore_mismatched_sizes=True)  # refused below, by name
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises many types; give one clear line
        refused = _refused_pickle(e)
        if refused is not None:
            files = sorted(p.glob("pytorch_model*.bin"))
            bins = ", ".join(f.name for f in files)
            if not refused.startswith("GLOBAL"):  # a plain pickle: torch stops at an opcode before any global
                refused = next(filter(None, map(_plain_pickle_global, files)), refused)
            raise ModelLoadError(f"'{p}' keeps its weights in a pickle ({bins}) that holds {refused}, not only "
                                 "tensors: loading it could run code, so weights_only loading refused it; convert "
                                 "the checkpoint to safetensors (model.safetensors) where you trust its source, "
                                 "or get a safetensors copy of the model") from e
        raise ModelLoadError(f"could not load model weights from '{p}': {_one_line(e)}") from e
    _ready(model, info, p, device, float32_compute)
    tokenizer = load_tokenizer_from(p, trust_remote_code=trust_remote_code) if load_tokenizer else None
    return LoadedModel(model=model, tokenizer=tokenizer, path=p, name=name, layers=quantizable_layers(model))


def _ready(model: nn.Module, info: dict, p: Path, device: str, float32_compute: bool) -> None:
    """Refuse weights that do not cover the model (nothing initialised at random), then place it for use."""
    mismatched = [(k, tuple(a), tuple(b)) for k, a, b in info.get("mismatched_keys") or ()]
    if info.get("missing_keys") or info.get("unexpected_keys") or mismatched:
        raise weights_mismatch_error(p, info.get("missing_keys") or (), info.get("unexpected_keys") or (), mismatched)
    model.to(device).eval()
    if float32_compute:
        enable_float32_compute(model)


def _load_vision(p: Path, name: str, raw_cfg: dict, *, dtype, device: str, trust_remote_code: bool,
                 load_tokenizer: bool, float32_compute: bool) -> LoadedModel:
    """A vision-language model directory (``workbench.model.vision``), with its picture preprocessing."""
    text = raw_cfg.get("text_config")
    check_model_config(text if isinstance(text, dict) else raw_cfg, p / "config.json")
    model, info, config, family = load_vision_model(p, raw_cfg, resolve_dtype(dtype, raw_cfg),
                                                    trust_remote_code=trust_remote_code)
    _ready(model, info, p, device, float32_compute)
    tokenizer = load_tokenizer_from(p) if load_tokenizer else None
    return LoadedModel(model=model, tokenizer=tokenizer, path=p, name=name, layers=quantizable_layers(model),
                       processor=vision_inputs(family, p, config, tokenizer))


def load_tokenizer_from(p: Path, *, trust_remote_code: bool = False, required: bool = True):
    """The tokenizer saved in model directory ``p`` (None when there is none and it is not ``required``)."""
    from transformers import AutoTokenizer
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        if not required:
            return None
        raise ModelLoadError(f"'{p}' has no tokenizer (expected tokenizer.json or tokenizer.model); copy the "
                             "tokenizer files of the base model into it")
    check_tokenizer_json(p)
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:
        first = _one_line(e)
        files = ", ".join(f for f in TOKENIZER_FILES if (p / f).is_file())
        raise ModelLoadError(f"could not load the tokenizer in '{p}' (from {files}): {first}") from e
    tokenizer.model_max_length = 1 << 30  # evaluation windows whole texts itself; silence the length notice
    return tokenizer


# -- quantized directories (`workbench quantize` outputs) ----------------------------------------------------------------------------------------

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
    None, float minimums, tensor shapes)``."""
    reports, integer = [], {}
    for entry in meta["layers"]:
        r = LayerQuantReport(entry["name"], entry["kind"], tuple(entry["shape"]), entry["precision"],
                             entry.get("group_size"), entry.get("fallback"), entry.get("tied_to"),
                             entry.get("untied", False), entry.get("weight_error"))
        reports.append(r)
        if "bits" in entry:
            spec = (entry["bits"], entry["group_size"], entry.get("symmetric", f"{r.name}.zeros" not in tensors.shapes))
            scale_bits = None if entry.get("scale_bits") is None else \
                SubScales(entry["scale_bits"], entry.get("scale_max"), entry.get("super_block"),
                          entry.get("minimums", False))
            float_minimums = scale_bits is None and entry.get("minimums", False)
            shapes = _v1_shapes(r.name, r.shape, *spec) if version == 1 else stored_shapes(r.name, r.shape, *spec,
                                                                                      scale_bits, float_minimums)
            integer[r.name] = (*spec, scale_bits, float_minimums, shapes)
    return reports, integer


def _check_cover(d: Path, sk: _Skeleton, tensors: _Tensors, reports: list, integer: dict) -> set[str]:
    """Refuse, naming the tensors, unless the files hold exactly the model's tensors in its shapes.

    Returns the weight names the integer layers stand for (tied copies included).
    """
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

    hf_logging.set_verbosity_error()
    d = Path(directory)
    meta, files = _open_directory(d, verify)
    version = meta["version"]
    raw_cfg = _read_json(d / "config.json")
    check_model_config(raw_cfg, d / "config.json", [d / f for f in files])
    torch_dtype = resolve_dtype(dtype, raw_cfg)
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
    for n, (bits, g, _, scale_bits, float_minimums, shapes) in integer.items():
        t = tensors.group(shapes)
        weights[n] = _v1_layer(n, t, shape_of[n], bits, g) if version == 1 else \
            weight_from_file(n, t, bits, g, scale_bits, float_minimums)
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
            elif not (float32_compute and {t.dtype, torch_dtype} <= HALF_DTYPES):  # either 16-bit kind is widened
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
        for r in stored_integer_layers(qm):
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
        enable_float32_compute(model)
    tokenizer = load_tokenizer_from(d, trust_remote_code=trust_remote_code, required=require_tokenizer) \
        if load_tokenizer else None
    family = VISION_MODEL_TYPES.get(getattr(model.config, "model_type", None))
    lm = LoadedModel(model=model, tokenizer=tokenizer, path=d, name=str(directory), layers=quantizable_layers(model),
                     quantized=qm, processor=vision_inputs(family[1], d, model.config, tokenizer) if family else None)
    qm.source = lm
    release_freed_memory()  # the per-layer unpacking temporaries
    return lm, qm
