"""GGUF files holding the plan's own integers, so llama.cpp runs exactly the weights the workbench measured.

    ggml_type_of(qw)                       # GGMLQuantizationType.Q4_0 for symmetric int4 in 32-weight groups
    write_gguf(qm, "model.gguf")           # the quantized model as llama.cpp reads it, written once
    check_gguf(qm, "model.gguf")           # every weight read back (gguf's own dequantizer) == the simulation

The workbench's layouts that are llama.cpp's, bit for bit:

- symmetric int4 / int5 / int8 with a float16 scale per 32 weights: ``Q4_0`` / ``Q5_0`` / ``Q8_0``
  (code ``c`` stored as ``c + 2^(b-1)``; coarser groups repeat their scale in every 32-weight block,
  the same weights in a bigger file, which the report says);
- ``int3-k`` and ``int6-k`` (16-weight groups, integer group scales under a float16 scale per 256
  weights): ``Q3_K`` and ``Q6_K``;
- ``int4-k`` and ``int5-k`` (32-weight groups, 6-bit group scales and minimums under two float16 scales
  per 256 weights, unsigned codes): ``Q4_K`` and ``Q5_K``;
- ``int4-min`` and ``int5-min`` (32-weight groups, a float16 scale and a float16 minimum each, unsigned
  codes): ``Q4_1`` and ``Q5_1`` (llama.cpp adds its ``m``: the workbench's minimum negated, exactly);
- any of them on the embedding (``token_embd``) and an untied output layer (``output``) too;
- float16 / float32 layers: ``F16`` / ``F32``; norms and biases ``F32``.

A Qwen2.5-VL's language model is written as llama.cpp's ``qwen2vl`` (its M-RoPE sections); its vision encoder
and projector go to the separate mmproj GGUF (``gguf_mmproj``).

Everything else (asymmetric zero points, two-level scales per channel, int2/int3/int6 with float16
group scales) has no llama.cpp block that holds it exactly and is refused, naming the precisions
that do. Blocks are packed here from llama.cpp's block definitions (``ggml-common.h``) and checked
against the ``gguf`` package's independent dequantizer in the tests and in ``check_gguf``.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import PlanError
from ..model.vision import PART_PREFIXES
from ..quantize.plan import get_precision
from ..quantize.qtensor import QuantizedWeight
from ..quantize.storage import float_storage, stored_integer_layers

__all__ = ["ggml_type_of", "pack_blocks", "write_gguf", "gguf_writer", "write_tensors", "ggml_layer_type", "check_gguf",
           "gguf_parameter_name", "GGUF_ARCHES", "in_language_model", "text_config", "BLOCK_BYTES", "gguf_package",
           "parameter_names"]

GGUF_ARCHES = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama",  # Hugging Face model_type -> GGUF architecture
               "qwen2_5_vl": "qwen2vl"}  # a VLM: its language model (M-RoPE), the vision part in gguf_mmproj
_LANGUAGE_PREFIX = "model.language_model."  # a VLM's language model, named as the text model's "model."
_VISION_PREFIXES = tuple(f"{p}." for part in ("vision encoder", "projector") for p in PART_PREFIXES[part])
_LEGACY = {4: "Q4_0", 5: "Q5_0", 8: "Q8_0"}  # symmetric b-bit codes with a float16 scale per 32 weights
_LEGACY_MIN = {4: "Q4_1", 5: "Q5_1"}  # unsigned b-bit codes with a float16 scale and minimum per 32 weights
# (bits, sub-scale bits, largest sub-scale, minimums) in 256-weight blocks
_K = {(3, 6, 31, False): "Q3_K", (6, 8, 127, False): "Q6_K", (4, 6, 63, True): "Q4_K", (5, 6, 63, True): "Q5_K"}
_K_GROUP = {"Q3_K": 16, "Q6_K": 16, "Q4_K": 32, "Q5_K": 32}
_ROLES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_package():
    try:
        import gguf
    except ImportError:
        raise PlanError("writing GGUF needs the gguf package: pip install gguf==0.19.0 (the README's install "
                        "command includes it)") from None
    return gguf


def ggml_type_of(qw: QuantizedWeight) -> str:
    """The llama.cpp block type holding ``qw``'s codes and scales exactly; ``PlanError`` when none does."""
    if qw.two_level:
        key = (qw.bits, qw.scale_bits, qw.scale_max, qw.mins is not None)
        if qw.super_block == 256 and key in _K and qw.group_size == _K_GROUP[_K[key]]:
            return _K[key]
        raise PlanError(f"{qw.bits}-bit codes with {qw.scale_bits}-bit sub-scales per "
                        f"{'channel' if not qw.super_block else f'{qw.super_block} weights'} have no llama.cpp block "
                        "layout; use int3-k, int4-k, int5-k or int6-k (llama.cpp's Q3_K / Q4_K / Q5_K / Q6_K) or a "
                        "float16-scale precision")
    if qw.float_minimums:
        if qw.bits not in _LEGACY_MIN or qw.effective_group_size != 32:
            raise PlanError(f"llama.cpp's blocks with a float16 minimum (Q4_1, Q5_1) hold 4 or 5-bit codes in "
                            f"32-weight groups, not {qw.bits}-bit codes in groups of {qw.effective_group_size}; "
                            "use int4-min or int5-min")
        return _LEGACY_MIN[qw.bits]
    if not qw.symmetric:
        raise PlanError("asymmetric zero points have no exact llama.cpp block (Q4_1 / Q5_1 store scale x zero "
                        "as a rounded float16); plan with symmetric=true, or use int4-min / int5-min (Q4_1 / "
                        "Q5_1's own layout) for llama.cpp")
    if qw.bits not in _LEGACY:
        raise PlanError(f"int{qw.bits} with float16 group scales has no llama.cpp block; use "
                        + ("int3-k (Q3_K)" if qw.bits == 3 else "int6-k (Q6_K)" if qw.bits == 6 else
                           "int4 (Q4_0)") + " instead")
    g = qw.effective_group_size
    if g % 32 or qw.shape[1] % 32:
        raise PlanError(f"llama.cpp's {_LEGACY[qw.bits]} stores 32-weight blocks; a group of {g} over "
                        f"{qw.shape[1]} inputs does not fill them (plan with a group size that is a multiple of 32)")
    return _LEGACY[qw.bits]


def _fp16_bytes(x: torch.Tensor) -> np.ndarray:
    """float16 values (exact: scales are float16 by construction) as their two little-endian bytes."""
    h = x.to(torch.float16)
    if not torch.equal(h.to(torch.float32), x.to(torch.float32)):
        raise PlanError("a scale is not a float16 value; the quantized model is not in the stored form")
    return h.numpy().view(np.uint8).reshape(*x.shape, 2)


def _legacy(qw: QuantizedWeight, bits: int) -> np.ndarray:
    """Q4_0 / Q5_0 / Q8_0 (d, codes offset by 2^(b-1)) and Q4_1 / Q5_1 (d, m, unsigned codes)."""
    rows, cols = qw.shape
    nb = cols // 32
    u = qw.storage_codes().numpy().reshape(rows, nb, 32)
    d = _fp16_bytes(qw.scales.repeat_interleave(qw.effective_group_size // 32, dim=1))  # [rows, nb, 2]
    if qw.float_minimums:
        d = np.concatenate([d, _fp16_bytes(-qw.mins)], -1)  # llama.cpp's y = d q + m
    if bits == 8:
        return np.concatenate([d, qw.qweight.numpy().astype(np.int8).view(np.uint8).reshape(rows, nb, 32)], -1)
    qs = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)
    if bits == 4:
        return np.concatenate([d, qs], -1)
    high = ((u >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)  # element j's fifth bit at bit j
    qh = high.sum(-1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(rows, nb, 4)
    return np.concatenate([d, qh, qs], -1)


def _q6_k(qw: QuantizedWeight) -> np.ndarray:
    rows, cols = qw.shape
    ns = cols // 256
    u = (qw.qweight.to(torch.int16) + 32).numpy().astype(np.uint8).reshape(rows, ns, 2, 4, 32)  # half, quarter, l
    low, high = u & 15, u >> 4
    ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], -1)
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    scales = qw.sub_scales.numpy().astype(np.int8).view(np.uint8).reshape(rows, ns, 16)
    return np.concatenate([ql.reshape(rows, ns, 128), qh.reshape(rows, ns, 64), scales,
                           _fp16_bytes(qw.channel_scales)], -1)


def _q3_k(qw: QuantizedWeight) -> np.ndarray:
    rows, cols = qw.shape
    ns = cols // 256
    u = (qw.qweight.to(torch.int16) + 4).numpy().astype(np.uint8).reshape(rows, ns, 2, 4, 32)  # n, j, l
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]
    qs = ((u & 3) << shifts).sum(3, dtype=np.uint8)  # [rows, ns, 2, 32]: pair j in bits 2j, 2j+1
    hbits = ((u >> 2) & 1).reshape(rows, ns, 8, 32)  # n * 4 + j
    hmask = (hbits << np.arange(8, dtype=np.uint8)[None, None, :, None]).sum(2, dtype=np.uint8)
    s = (qw.sub_scales.to(torch.int16) + 32).numpy().astype(np.uint8).reshape(rows, ns, 16)  # 6-bit, offset 32
    packed = np.concatenate([(s[..., 0:4] & 15) | ((s[..., 8:12] & 15) << 4),
                             (s[..., 4:8] & 15) | ((s[..., 12:16] & 15) << 4),
                             (s[..., 0:4] >> 4) | ((s[..., 4:8] >> 4) << 2) | ((s[..., 8:12] >> 4) << 4)
                             | ((s[..., 12:16] >> 4) << 6)], -1)
    return np.concatenate([hmask, qs.reshape(rows, ns, 64), packed, _fp16_bytes(qw.channel_scales)], -1)


def _q45_k(qw: QuantizedWeight) -> np.ndarray:
    """Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of fifth bits), 128 of nibbles."""
    rows, cols = qw.shape
    ns = cols // 256
    u = qw.qweight.numpy().astype(np.uint8).reshape(rows, ns, 8, 32)  # sub-block s, element l
    sc = qw.sub_scales.numpy().astype(np.uint8).reshape(rows, ns, 8)
    m = qw.sub_mins.numpy().astype(np.uint8).reshape(rows, ns, 8)
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], -1)
    qs = ((u[:, :, 0::2] & 15) | ((u[:, :, 1::2] & 15) << 4)).reshape(rows, ns, 128)  # pairs of sub-blocks
    parts = [_fp16_bytes(qw.channel_scales), _fp16_bytes(qw.channel_mins), scales]
    if qw.bits == 5:  # element l's fifth bit of sub-block s at bit s of byte l
        parts.append((((u >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, None, :, None]).sum(2, dtype=np.uint8))
    return np.concatenate([*parts, qs], -1)


def pack_blocks(qw: QuantizedWeight) -> tuple[str, np.ndarray]:
    """``(ggml type name, uint8 [rows, bytes per row])``: ``qw`` as llama.cpp's blocks, row by row."""
    kind = ggml_type_of(qw)
    qw = qw.to("cpu")
    blocks = _q3_k(qw) if kind == "Q3_K" else _q6_k(qw) if kind == "Q6_K" else \
        _q45_k(qw) if kind in ("Q4_K", "Q5_K") else _legacy(qw, qw.bits)
    return kind, np.ascontiguousarray(blocks.reshape(qw.shape[0], -1))


def gguf_parameter_name(name: str) -> str | None:
    """The GGUF tensor name of a Hugging Face parameter (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``), as llama.cpp's converter names it; None when it has none. A VLM's language model
    (``model.language_model.*``) is named as the text model's."""
    if name.startswith(_LANGUAGE_PREFIX):
        name = "model." + name.removeprefix(_LANGUAGE_PREFIX)
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        role = _ROLES.get(".".join(parts[3:-1]))
        if role:
            return f"blk.{parts[2]}.{role}.{parts[-1]}"
    return None


def in_language_model(name: str) -> bool:
    """Whether a parameter or layer belongs in the language model's GGUF (a VLM's vision encoder and projector
    go to the mmproj GGUF instead: ``gguf_mmproj``)."""
    return not f"{name}.".startswith(_VISION_PREFIXES)


def text_config(config):
    """The language model's config: a VLM keeps it under ``text_config``; a text model is its own."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rotary_heads(config, name: str) -> int | None:
    """The head count a llama q/k weight's rows are permuted by for llama.cpp (None: written as it is)."""
    if GGUF_ARCHES[config.model_type] != "llama":
        return None
    heads = text_config(config).num_attention_heads
    return heads if ".q_proj." in name else (getattr(text_config(config), "num_key_value_heads", None) or heads) \
        if ".k_proj." in name else None


def _permute_rows(a, n_head: int):
    """llama's q/k rows in llama.cpp's rotary order (its converter's permutation; rows are whole blocks)."""
    return a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _pre_tokenizer(tok: dict) -> str:
    """llama.cpp's name for a byte-level BPE tokenizer's split rule (refused when it is none it knows)."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            return "gpt-2"
        if step.get("type") == "Split":
            rx = (step.get("pattern") or {}).get("Regex", "")
            if r"\p{N}{1,3}" in rx:
                return "llama-bpe"
            if r"|\p{N}|" in rx or rx.endswith(r"\p{N}"):
                return "qwen2"
    raise PlanError("this tokenizer's pre-tokenizer is not one llama.cpp's GGUF names here (GPT-2, Qwen2, "
                    "Llama-3 byte-level BPE); convert the vocabulary with llama.cpp's convert_hf_to_gguf.py")


def _add_vocabulary(writer, gguf, model_dir: Path, n_vocab: int) -> None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise PlanError(f"'{model_dir}' has no tokenizer.json; a GGUF carries its vocabulary (a byte-level BPE "
                        "tokenizer.json is needed)")
    tok = json.loads(path.read_text(encoding="utf-8"))
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise PlanError(f"'{path}' is a {model.get('type')} tokenizer; only byte-level BPE vocabularies are written "
                        "here (use llama.cpp's convert_hf_to_gguf.py for others)")
    T = gguf.TokenType
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [T.UNUSED] * n_vocab
    for text, i in model["vocab"].items():
        if i < n_vocab:
            tokens[i], types[i] = text, T.NORMAL
    for added in tok.get("added_tokens", []):
        if added["id"] < n_vocab:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = T.CONTROL if added.get("special") else T.USER_DEFINED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)


def _add_hyperparameters(writer, config, arch: str, name: str) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise PlanError("this model scales its rotary embedding, which this GGUF writer does not carry; convert "
                        "with llama.cpp's convert_hf_to_gguf.py")
    if arch == "qwen2vl":  # M-RoPE: the rotary pairs given to the time, height and width positions of image tokens
        sections = list(rope.get("mrope_section") or [])
        if not sections or len(sections) > 4 or sum(sections) * 2 != head_dim:
            raise PlanError(f"this VLM's mrope_section {sections or 'is missing'}: llama.cpp's qwen2vl needs up to 4 "
                            f"sections summing to half the head size ({head_dim // 2})")
        writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab_size)


def parameter_names(model, layers: set[str]) -> list[str]:
    """Every weight's name in model order; a quantized layer (its weight a buffer) counts as ``NAME.weight``."""
    names = []
    for mname, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        if mname in layers:
            names.append(f"{prefix}weight")
        names += [f"{prefix}{p}" for p, _ in module.named_parameters(recurse=False)
                  if not (mname in layers and p == "weight")]
    return list(dict.fromkeys(names))


BLOCK_BYTES = {"Q4_0": (32, 18), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q3_K": (256, 110), "Q6_K": (256, 210),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q4_1": (32, 20), "Q5_1": (32, 24)}


def ggml_layer_type(qw: QuantizedWeight, layer: str, precision) -> tuple[str, int]:
    """The ggml block type a layer's integers are written as and the bytes of one packed row; a plan that maps to
    none is refused naming the layer and its precision."""
    try:
        kind = ggml_type_of(qw)
    except PlanError as e:
        raise PlanError(f"layer '{layer}' ({precision}): {e}") from None
    per, size = BLOCK_BYTES[kind]
    return kind, qw.shape[1] // per * size


def _tensors(qm) -> list[tuple[str, str, tuple, np.dtype, int, object]]:
    """``(gguf name, ggml type, shape as written, dtype, bytes, make())`` of every tensor in model order;
    ``make()`` packs it when called, so a writer holds one tensor at a time."""
    lm = qm.source
    precisions = qm.precisions
    floats = float_storage(qm)
    params = dict(lm.model.named_parameters())
    integer = {f"{r.name}.weight": r.name for r in stored_integer_layers(qm)}
    tied = {r.name for r in qm.layers if r.tied_to and not r.untied}
    out = []
    for name in parameter_names(lm.model, {r.name for r in qm.layers}):
        layer = name.removesuffix(".weight")
        if not in_language_model(name):
            continue  # a VLM's vision encoder and projector: the mmproj GGUF (gguf_mmproj.write_mmproj)
        if layer in tied:
            continue  # llama.cpp reads token_embd for a tied output layer
        target = gguf_parameter_name(name)
        if target is None:
            raise PlanError(f"parameter '{name}' has no GGUF tensor name known here; this architecture is not "
                            "written by the workbench's GGUF writer")
        rotary = _rotary_heads(lm.model.config, name)
        if name in integer:
            qw = qm.weights[integer[name]]
            kind, row_bytes = ggml_layer_type(qw, layer, precisions.get(layer))
            shape = (qw.shape[0], row_bytes)

            def make(qw=qw, rotary=rotary):
                data = pack_blocks(qw)[1]
                return data if rotary is None else _permute_rows(data, rotary)
            out.append((target, kind, shape, np.dtype(np.uint8), shape[0] * shape[1], make))
            continue
        t = floats[name] if name in floats else params[name].detach()  # norms, biases: in float_storage too
        prec = get_precision(precisions.get(layer))
        half = t.dim() >= 2 and (prec.bits == 16 if prec is not None else t.dtype != torch.float32)
        kind, dtype = ("F16", np.float16) if half else ("F32", np.float32)

        def make(t=t, dtype=dtype, rotary=rotary):
            data = t.to(torch.float16 if dtype == np.float16 else torch.float32).cpu().numpy()
            return data if rotary is None else _permute_rows(data, rotary)
        out.append((target, kind, tuple(t.shape), np.dtype(dtype), t.numel() * np.dtype(dtype).itemsize, make))
    return out


def write_gguf(qm, path: str | Path, *, name: str | None = None) -> Path:
    """Write the quantized model ``qm`` as one GGUF llama.cpp runs (atomically: a killed run leaves no file)."""
    gguf = gguf_package()
    lm = qm.source
    arch = GGUF_ARCHES.get(lm.model.config.model_type)
    config = text_config(lm.model.config)
    if arch is None:
        raise PlanError(f"model type '{lm.model.config.model_type}' is not written as GGUF here; supported: "
                        f"{', '.join(GGUF_ARCHES)}")
    tensors = _tensors(qm)  # every layer's block type checked before a byte is written
    with gguf_writer(path, arch) as writer:
        _add_hyperparameters(writer, config, arch, name or Path(lm.path).name)
        _add_vocabulary(writer, gguf, Path(lm.path), config.vocab_size)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_tensors(writer, tensors)
    return Path(path)


@contextlib.contextmanager
def gguf_writer(path: str | Path, arch: str):
    """A ``GGUFWriter`` for ``arch`` whose file appears at ``path`` only when the block inside finished (a killed
    run leaves no file): written beside it under a hidden name, then moved."""
    gguf = gguf_package()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.writing")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        yield writer
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)


def write_tensors(writer, tensors) -> None:
    """``tensors`` (``(name, ggml type, shape, numpy dtype, bytes, make)``) after the key-values already added:
    every tensor's info, the header, then each tensor's data made one at a time (no whole copy of the model held)."""
    gguf = gguf_package()
    for target, kind, shape, dtype, nbytes, _make in tensors:
        raw = None if kind in ("F16", "F32") else getattr(gguf.GGMLQuantizationType, kind)
        writer.add_tensor_info(target, shape, dtype, nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for *_, make in tensors:
        writer.write_tensor_data(np.ascontiguousarray(make()))


def check_gguf(qm, path: str | Path) -> dict:
    """Read every integer tensor back with gguf's own dequantizer and compare with the simulation's weights.

    Returns ``{"tensors": n, "weights": n, "max_abs_diff": x, "types": {type: count}}``; ``max_abs_diff`` is
    0.0 when the file holds exactly the weights the workbench evaluated.
    """
    gguf = gguf_package()
    from gguf.quants import dequantize
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    worst, count, weights, types = 0.0, 0, 0, {}
    for r in stored_integer_layers(qm):
        if not in_language_model(r.name):
            continue  # in the mmproj GGUF, checked by gguf_mmproj.check_mmproj
        layer, qw = r.name, qm.weights[r.name]
        target = gguf_parameter_name(f"{layer}.weight")
        t = by_name.get(target)
        if t is None:
            raise PlanError(f"'{path}' has no tensor {target} for layer {layer}")
        got = dequantize(np.asarray(t.data), t.tensor_type).reshape(qw.shape)
        want = qw.dequantize().numpy()
        rotary = _rotary_heads(qm.source.model.config, f"{layer}.weight")
        if rotary is not None:
            want = _permute_rows(want, rotary)
        worst = max(worst, float(np.abs(got - want).max()) if want.size else 0.0)
        count, weights = count + 1, weights + want.size
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"tensors": count, "weights": weights, "max_abs_diff": worst, "types": types}
