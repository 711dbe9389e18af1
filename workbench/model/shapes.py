"""A model's shapes without its weights, and what a plan of it holds and reads: the one byte accounting.

    lm = model_shape("qwen3-4b")          # a name in assets/model_shapes.json, a config.json, a model directory
    plan_bytes(lm, plan, context=4096, prompt=128, kv_bytes=1)   # resident, per token, KV, prefill FLOPs

Projections (``workbench.devices.projection``) and the fits to vendor measurements (``workbench.devices.vendor_fit``) both count
bytes here, so a projection and the measurement it is held against are counted alike.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..assets import ASSETS_DIR
from ..errors import ModelLoadError
from .load import (LoadedModel, check_model_config, layer_shapes, model_from_config, quantizable_layers,
                     resolve_model_path)
from ..quantize.plan import QuantPlan

__all__ = ["SHAPES_FILE", "KV_BYTES", "load_shape_config", "model_shape", "attention_dims", "PlanBytes",
           "plan_bytes"]

SHAPES_FILE = ASSETS_DIR / "model_shapes.json"
KV_BYTES = 2  # fp16 KV cache


# -- the model's shapes -------------------------------------------------------------------------------
def load_shape_config(name: str) -> dict:
    """A config dict from ``assets/model_shapes.json`` by name (``qwen2.5-1.5b``, ``qwen3-1.7b``, ...)."""
    shapes = json.loads(SHAPES_FILE.read_text(encoding="utf-8"))["shapes"]
    if name not in shapes:
        raise ModelLoadError(f"unknown model shape '{name}'; choose one of: {', '.join(shapes)}, or give a "
                             "config.json or model directory")
    return dict(shapes[name])


def _config_from_path(path: Path) -> dict:
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.is_file():
        raise ModelLoadError(f"'{path}' is neither a model directory with config.json, a config.json, nor a shape in "
                             f"{SHAPES_FILE.name}; pass one of those")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"'{cfg_path}' is not valid JSON ({e}); fix or re-copy it") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ModelLoadError(f"'{cfg_path}' has no 'model_type' string: not a Hugging Face model config")
    return cfg


def model_shape(source, name: str | None = None) -> LoadedModel:
    """A LoadedModel whose layers carry the real names and shapes; weights on the meta device (no memory).

    ``source``: a LoadedModel (returned as is), a config dict, a config.json or model directory path, or a
    shape name from ``assets/model_shapes.json``. Model code named by ``auto_map`` is never run: the
    config's ``model_type`` picks transformers' own class.
    """
    if isinstance(source, LoadedModel):
        return source
    if isinstance(source, Mapping):
        cfg, label = dict(source), name or str(source.get("_name_or_path") or source.get("model_type"))
    else:
        text = str(source)
        path = resolve_model_path(text)
        if path.exists():
            cfg, label = _config_from_path(path), name or text
        else:
            cfg, label = load_shape_config(text), name or text
    import torch
    from transformers import AutoConfig
    cfg = {k: v for k, v in cfg.items() if k not in ("auto_map", "quantization_config", "architectures")}
    check_model_config(cfg, label)  # sizes no model has are refused before transformers builds anything
    model_type = cfg.pop("model_type")
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers' typed configs refuse with it
    except ImportError:
        StrictDataclassError = ValueError
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:
        raise ModelLoadError(f"cannot build a '{model_type}' config for '{label}' ({e}); projection needs a model "
                             "type transformers knows") from None
    with torch.device("meta"):
        model = model_from_config(config)  # per-layer shapes of a pruned model included
    return LoadedModel(model=model, tokenizer=None, path=Path(label), name=label, layers=quantizable_layers(model))


def attention_dims(config) -> tuple[int, int, int, int]:
    """(layers, attention heads, KV heads, head_dim) from a transformers config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, kv, head_dim


@dataclass(frozen=True)
class PlanBytes:
    """What a plan of a model holds and reads: the one byte accounting projections and vendor fits share."""

    weight_bytes: int  # resident weights (tied once, norms at fp16)
    per_token: int  # weights one decode step reads (the embedding: one row)
    kv_per_token: int
    kv_bytes: int  # KV cache at the context
    buffers: int  # logits + the largest prefill activations at fp16
    flops: float  # prefill of the prompt: 2 per weight per token, plus attention


def plan_bytes(lm: LoadedModel, plan: QuantPlan, *, context: int, prompt: int, kv_bytes: int = KV_BYTES) -> PlanBytes:
    """Bytes and prefill FLOPs of ``plan`` on ``lm``'s shapes, with ``kv_bytes`` per cached element."""
    names = [info.name for info in lm.layers]
    assignments = plan.resolve(names)
    cfg = lm.config
    layers, heads, kv_heads, head_dim = attention_dims(cfg)
    embed = [i for i in lm.layers if i.kind == "embedding"]
    read_names = [i.name for i in lm.layers if i.kind != "embedding"]
    per_token = lm.layer_bytes(assignments, plan.group_size, plan.symmetric, names=read_names) + lm.other_bytes
    for info in embed:  # a lookup reads one row of the table (tied or not, lm_head reads it all above)
        table = info.bytes_at(assignments.get(info.name) or "fp16", plan.group_size, plan.symmetric)
        per_token += table // info.shape[0]
    shapes = layer_shapes(cfg)  # a pruned model's layers may hold different numbers of KV heads
    kv_total = sum(kv for _, kv, _ in shapes) if shapes else layers * kv_heads
    kv_per_token = 2 * kv_total * head_dim * kv_bytes
    inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    buffers = cfg.vocab_size * 4 + prompt * (2 * inter + 3 * cfg.hidden_size) * 2 + heads * prompt * prompt * 2
    linear_params = sum(i.parameters for i in lm.layers if i.kind == "linear" and i.name != "lm_head")
    lm_head = next((i.parameters for i in lm.layers if i.name == "lm_head"), 0)
    flops = 2.0 * linear_params * prompt + 2.0 * lm_head + 2.0 * layers * heads * head_dim * prompt * prompt
    return PlanBytes(int(lm.size_bytes(plan)), int(per_token), kv_per_token, kv_per_token * context, int(buffers),
                     flops)
