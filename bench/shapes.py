"""Random-weight models shaped like real Qwen checkpoints: what a step costs depends on shapes, not values.

    python bench/shapes.py qwen2.5-0.5b --out /tmp/shapes/qwen2.5-0.5b      # 494 M parameters, bf16
    python bench/shapes.py qwen3-4b --out /tmp/shapes/qwen3-4b --layers 2  # the real widths, 2 blocks
    python bench/shapes.py qwen2.5-1.5b-f32-untied --out /tmp/shapes/f32    # float32 file, its own lm_head

Each directory is a plain Hugging Face model directory (config.json, model.safetensors in bfloat16)
with the demo model's tokenizer copied in, so every workbench step can load it offline. The
vocabulary stays at the real 151,936 rows (the demo tokenizer only ever emits ids below 4,096).

Every text shape also has a ``-f32-untied`` variant, the checkpoint as users often bring it after fine-tuning or
dequantization: float32 safetensors (in 2 GB shards), weights drawn in float32 (so bfloat16 does not hold them
exactly), and an output layer of its own (``tie_word_embeddings`` false).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEMO = ROOT / "assets" / "demo-model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

DEMO_VL = ROOT / "assets" / "demo-vl-model"
VL_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# The published configs' shapes, kept as data in assets/model_shapes.json (the projection reads the text ones too).
_ALL = json.loads((ROOT / "assets" / "model_shapes.json").read_text(encoding="utf-8"))
VISION_SHAPES: dict[str, dict] = _ALL["vision_shapes"]
F32_UNTIED = "-f32-untied"  # suffix of a shape's float32, untied variant
SHAPES: dict[str, dict] = {**_ALL["shapes"], **VISION_SHAPES,
                           **{n + F32_UNTIED: {**s, "tie_word_embeddings": False, "storage_dtype": "float32"}
                              for n, s in _ALL["shapes"].items()}}


def is_built(out: Path) -> bool:
    """Whether ``out`` already holds a model (one safetensors file, or shards with their index)."""
    return (out / "config.json").is_file() and any((out / f).is_file() for f in
                                                   ("model.safetensors", "model.safetensors.index.json"))


def build_shape(name: str, out: str | Path, *, layers: int | None = None, seed: int = 0) -> Path:
    """Write a random bf16 model of shape ``name`` (optionally only ``layers`` blocks) to ``out``; reuse it if there."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape '{name}'; choose one of: {', '.join(SHAPES)}")
    if name in VISION_SHAPES:
        return build_vision_model_dir(SHAPES[name], Path(out), layers=layers, seed=seed)
    spec = dict(SHAPES[name])
    if layers:
        spec["num_hidden_layers"] = layers
    return build_model_dir(spec, out, seed=seed)


def build_vision_model_dir(spec: dict, out: Path, *, layers: int | None = None, seed: int = 0) -> Path:
    """A random bf16 vision-language model of the config fields ``spec`` with the demo VLM's tokenizer (its vision
    tokens' ids are the image tokens) and a preprocessor config for the shape's patch and merge sizes."""
    import torch
    import transformers
    from transformers import AutoConfig

    from workbench.model.vision import VISION_MODEL_TYPES
    if (out / "model.safetensors.index.json").is_file() or (out / "model.safetensors").is_file():
        return out
    spec = json.loads(json.dumps(spec))
    model_type = spec.pop("model_type")
    if layers:
        spec["text_config"]["num_hidden_layers"] = layers
        spec["vision_config"]["depth"] = layers
        spec["vision_config"].pop("fullatt_block_indexes", None)
        spec["vision_config"]["deepstack_visual_indexes"] = [] if "deepstack_visual_indexes" in spec["vision_config"] \
            else None
        spec["vision_config"] = {k: v for k, v in spec["vision_config"].items() if v is not None}
    vocab = json.loads((DEMO_VL / "config.json").read_text())
    ids = {k: vocab[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    spec["text_config"].update(bos_token_id=0, eos_token_id=0, pad_token_id=0, rms_norm_eps=1e-6)
    cfg = AutoConfig.for_model(model_type, **spec, **ids)
    cfg.architectures = [VISION_MODEL_TYPES[model_type][0]]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = getattr(transformers, VISION_MODEL_TYPES[model_type][0])._from_config(cfg, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in VL_TOKENIZER_FILES:
        if (DEMO_VL / f).is_file():
            shutil.copy(DEMO_VL / f, tmp / f)
    vc = spec["vision_config"]
    pre = json.loads((DEMO_VL / "preprocessor_config.json").read_text())
    pre.update(patch_size=vc["patch_size"], merge_size=vc["spatial_merge_size"],
               temporal_patch_size=vc["temporal_patch_size"])
    (tmp / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def build_model_dir(spec: dict, out: str | Path, *, seed: int = 0) -> Path:
    """Write a random model of the config fields ``spec`` (``model_type`` included; ``storage_dtype`` float32 for a
    float32 file, default bf16) to ``out``; reuse it if there."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    if is_built(out):
        return out
    spec = dict(spec)
    model_type = spec.pop("model_type")
    dtype = getattr(torch, spec.pop("storage_dtype", "bfloat16"))
    cfg = AutoConfig.for_model(model_type, **spec, rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=0,
                               eos_token_id=0, pad_token_id=0)
    cfg.architectures = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # never hold an fp32 copy of a 4 B model unless a float32 file is asked for
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    # a float32 file in 2 GB shards: saving copies one shard at a time, not the whole model
    model.save_pretrained(tmp, **({"max_shard_size": "2GB"} if dtype == torch.float32 else {}))
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, help="directory to write (reused when it already holds the model)")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many decoder blocks")
    args = ap.parse_args()
    t0 = time.perf_counter()
    path = build_shape(args.shape, args.out, layers=args.layers)
    print(f"{args.shape}: {path} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
