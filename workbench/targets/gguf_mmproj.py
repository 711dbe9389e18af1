"""A VLM's vision encoder and projector as llama.cpp's ``mmproj`` GGUF (its ``clip`` format), holding the plan's
own integers, so llama.cpp's multimodal code (``tools/mtmd``) encodes pictures with the weights the workbench
measured.

    write_mmproj(qm, "mmproj.gguf")    # Qwen2.5-VL's vision tower + merger, as llama.cpp's clip loader reads it
    check_mmproj(qm, "mmproj.gguf")    # every tensor read back (gguf's own dequantizer) == the plan

The layout is the one llama.cpp's ``clip.cpp`` loads for projector type ``qwen2.5vl_merger``: the fused ``qkv``
of each block as ``v.blk.N.attn_q / attn_k / attn_v`` (its rows split in three, so an integer layer's blocks are
split, not re-quantized), the temporal Conv3d patch embedding as two Conv2d kernels (``v.patch_embd.weight`` and
``.weight.1``), the merger's RMSNorm as ``v.post_ln`` and its MLP as ``mm.0`` / ``mm.2``; the ``clip.vision.*``
keys from the checkpoint's vision config and image processor. Layers the plan keeps float are F16 (llama.cpp's
default mmproj); integer layers are the llama.cpp block that holds their codes and scales exactly (``int8`` in
32-weight groups: Q8_0, llama.cpp's own mmproj quantization; ``gguf_file.ggml_type_of`` names the others and
refuses what no block holds). Norms, biases and position embeddings stay F32; the patch embedding is F16 in an
all-float file and F32 beside integer layers, as llama.cpp's converter writes them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import PlanError
from ..quantize.plan import get_precision
from ..quantize.storage import float_storage
from .gguf_file import (ggml_layer_type, gguf_package, gguf_writer, pack_blocks, parameter_names, text_config,
                        write_tensors)

__all__ = ["MMPROJ_TYPES", "mmproj_tensor_names", "write_mmproj", "check_mmproj"]

MMPROJ_TYPES = {"qwen2_5_vl": "qwen2.5vl_merger"}  # Hugging Face model_type -> llama.cpp's clip projector type
_VISUAL = "model.visual."
_BLOCK_ROLES = {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "mlp.gate_proj": "ffn_gate",
                "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"merger.ln_q": "v.post_ln", "merger.mlp.0": "mm.0", "merger.mlp.2": "mm.2"}
_FILE_TYPES = {"F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q3_K": 11, "Q4_K": 15, "Q5_K": 17,
               "Q6_K": 18}  # llama.cpp's general.file_type of a file whose weights are mostly this type


def mmproj_tensor_names(name: str) -> list[str] | None:
    """The mmproj tensor name(s) of a Qwen2.5-VL vision parameter (three for a fused ``qkv``, two for the patch
    embedding's temporal kernel); None for a parameter outside the vision tower."""
    if not name.startswith(_VISUAL):
        return None
    rest = name.removeprefix(_VISUAL)
    stem, suffix = rest.rsplit(".", 1)
    if stem == "patch_embed.proj" and suffix == "weight":
        return ["v.patch_embd.weight", "v.patch_embd.weight.1"]
    if stem in _TOP:
        return [f"{_TOP[stem]}.{suffix}"]
    parts = stem.split(".")
    if len(parts) >= 3 and parts[0] == "blocks" and parts[1].isdigit():
        role = ".".join(parts[2:])
        if role == "attn.qkv":
            return [f"v.blk.{parts[1]}.attn_{x}.{suffix}" for x in "qkv"]
        if role in _BLOCK_ROLES:
            return [f"v.blk.{parts[1]}.{_BLOCK_ROLES[role]}.{suffix}"]
    return None


def _check_model(lm) -> None:
    cfg = lm.model.config
    if cfg.model_type not in MMPROJ_TYPES:
        raise PlanError(f"'{lm.path}' is a {cfg.model_type} model; the mmproj GGUF is written here for "
                        f"{', '.join(MMPROJ_TYPES)} (Qwen2.5-VL); convert others with llama.cpp's "
                        "convert_hf_to_gguf.py --mmproj")
    vc = cfg.vision_config
    full = list(getattr(vc, "fullatt_block_indexes", None) or [])
    step = full[0] + 1 if full else 0
    if not full or any(b - a != step for a, b in zip(full, full[1:])):
        raise PlanError(f"vision blocks with full attention at {full}: llama.cpp's clip reads one every N blocks "
                        "(n_wa_pattern); this vision tower has no such pattern")
    if int(getattr(vc, "temporal_patch_size", 2)) != 2:
        raise PlanError("llama.cpp's Qwen2.5-VL patch embedding takes a temporal patch of 2 frames, this model's is "
                        f"{vc.temporal_patch_size}")


def _window_pattern(vc) -> int:
    """clip's ``n_wa_pattern``: every N-th block attends to the whole picture, the others within windows; 0 when
    every block does (no windows at all: the same computation, and llama.cpp's clip aborts on a window mask that no
    block reads, "Failed to get tensor window_mask", when told 1)."""
    full = list(vc.fullatt_block_indexes)
    return 0 if full == list(range(int(vc.depth))) else full[0] + 1


def _eps(model) -> float:
    """The vision RMSNorms' epsilon (one value for all of them, as clip.cpp reads one)."""
    found = {float(getattr(m, "variance_epsilon", getattr(m, "eps", 0.0)))
             for n, m in model.named_modules() if n.startswith(_VISUAL) and n.rsplit(".", 1)[-1] in ("norm1", "norm2",
                                                                                                     "ln_q")}
    if len(found) != 1:
        raise PlanError(f"the vision norms use epsilons {sorted(found)}; llama.cpp's clip reads one")
    return found.pop()


def _tensors(qm) -> list[tuple[str, str, tuple, np.dtype, object]]:
    """``(mmproj name, ggml type, shape as written, dtype, make())`` of every vision tensor in model order."""
    lm = qm.source
    floats = float_storage(qm)
    precisions = qm.precisions
    integer = {f"{r.name}.weight": r.name for r in qm.layers if r.name in qm.weights}
    any_integer = any(n.startswith(_VISUAL) for n in integer)
    out = []
    for name in parameter_names(lm.model, {r.name for r in qm.layers}):
        if not name.startswith(_VISUAL):
            continue
        targets = mmproj_tensor_names(name)
        if targets is None:
            raise PlanError(f"vision parameter '{name}' has no tensor in llama.cpp's Qwen2.5-VL mmproj; this vision "
                            "tower is not the one its clip loader reads")
        layer = name.removesuffix(".weight")
        if name in integer:
            qw = qm.weights[integer[name]]
            kind, row_bytes = ggml_layer_type(qw, layer, precisions.get(layer))
            rows = qw.shape[0] // len(targets)
            for i, target in enumerate(targets):
                def make(qw=qw, i=i, rows=rows):
                    return pack_blocks(qw)[1][i * rows:(i + 1) * rows]
                out.append((target, kind, (rows, row_bytes), np.dtype(np.uint8), make))
            continue
        t = floats[name]
        if len(targets) == 2:  # the Conv3d patch embedding [out, in, 2, p, p] as two Conv2d kernels
            half = not any_integer
            for i, target in enumerate(targets):
                out.append((target, "F16" if half else "F32", tuple(t[:, :, i].shape),
                            np.dtype(np.float16 if half else np.float32), lambda t=t, i=i, half=half:
                            t[:, :, i].to(torch.float16 if half else torch.float32).contiguous().numpy()))
            continue
        prec = get_precision(precisions.get(layer))
        half = t.dim() >= 2 and (prec.bits == 16 if prec is not None else t.dtype != torch.float32)
        dtype = np.dtype(np.float16 if half else np.float32)
        rows = t.shape[0] // len(targets)
        for i, target in enumerate(targets):
            out.append((target, "F16" if half else "F32", (rows, *t.shape[1:]), dtype,
                        lambda t=t, i=i, rows=rows, half=half:
                        t[i * rows:(i + 1) * rows].to(torch.float16 if half else torch.float32).contiguous().numpy()))
    return out


def _image_stats(lm) -> tuple[list[float], list[float]]:
    proc = getattr(getattr(lm, "processor", None), "image_processor", None)
    mean, std = getattr(proc, "image_mean", None), getattr(proc, "image_std", None)
    if mean is None or std is None:
        raise PlanError(f"'{lm.path}' has no image processor with image_mean / image_std (preprocessor_config.json); "
                        "the mmproj GGUF carries them")
    return [float(x) for x in mean], [float(x) for x in std]


def write_mmproj(qm, path: str | Path, *, name: str | None = None) -> Path:
    """Write the vision encoder and projector of the quantized VLM ``qm`` as llama.cpp's mmproj GGUF (atomically)."""
    gguf = gguf_package()
    lm = qm.source
    _check_model(lm)
    cfg = lm.model.config
    vc = cfg.vision_config
    tensors = _tensors(qm)  # every layer's block type checked before a byte is written
    mean, std = _image_stats(lm)
    eps = _eps(lm.model)
    kinds = [k for _, k, *_ in tensors if k not in ("F16", "F32")]
    main = max(set(kinds), key=kinds.count) if kinds else "F16"
    with gguf_writer(path, "clip") as writer:
        writer.add_type(gguf.GGUFType.MMPROJ)
        writer.add_name(name or f"{Path(lm.path).name} mmproj")
        writer.add_file_type(_FILE_TYPES[main])
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type(MMPROJ_TYPES[cfg.model_type])
        writer.add_vision_projection_dim(int(text_config(cfg).hidden_size))
        writer.add_vision_image_size(int(getattr(vc, "image_size", 560)))  # clip reads it; Qwen sizes are dynamic
        writer.add_vision_patch_size(int(vc.patch_size))
        writer.add_vision_embedding_length(int(vc.hidden_size))
        writer.add_vision_feed_forward_length(int(vc.intermediate_size))
        writer.add_vision_block_count(int(vc.depth))
        writer.add_vision_head_count(int(vc.num_heads))
        writer.add_vision_image_mean(mean)
        writer.add_vision_image_std(std)
        writer.add_vision_use_silu(True)
        writer.add_vision_n_wa_pattern(_window_pattern(vc))
        writer.add_vision_window_size(int(vc.window_size))
        writer.add_vision_spatial_merge_size(int(vc.spatial_merge_size))
        writer.add_vision_attention_layernorm_eps(eps)
        write_tensors(writer, [(target, kind, shape, dtype, int(np.prod(shape)) * dtype.itemsize, make)
                               for target, kind, shape, dtype, make in tensors])
    return Path(path)


def check_mmproj(qm, path: str | Path) -> dict:
    """Read every tensor of an mmproj GGUF back with gguf's own dequantizer and compare with the plan: integer layers
    with the simulation's weights, float tensors with the model's at the file's float type.

    Returns ``{"tensors": n, "weights": n, "max_abs_diff": x, "types": {type: count}, "integer_layers": n}``;
    ``max_abs_diff`` is 0.0 when the file holds exactly the vision weights the workbench evaluated.
    """
    gguf = gguf_package()
    from gguf.quants import dequantize
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    floats = float_storage(qm)
    want: dict[str, np.ndarray] = {}
    layers = 0
    for r in qm.layers:
        if r.name in qm.weights and r.name.startswith(_VISUAL):
            layers += 1
            w = qm.weights[r.name].dequantize().numpy()
            targets = mmproj_tensor_names(f"{r.name}.weight")
            for i, t in enumerate(targets):
                want[t] = w[i * (w.shape[0] // len(targets)):(i + 1) * (w.shape[0] // len(targets))]
    for name, t in floats.items():
        targets = mmproj_tensor_names(name) if name.startswith(_VISUAL) else None
        if not targets:
            continue
        if len(targets) == 2:
            for i, tn in enumerate(targets):
                want[tn] = t[:, :, i].float().numpy()
        else:
            rows = t.shape[0] // len(targets)
            for i, tn in enumerate(targets):
                want[tn] = t[i * rows:(i + 1) * rows].float().numpy()
    missing = sorted(set(want) - set(by_name))
    if missing:
        raise PlanError(f"'{path}' lacks {len(missing)} vision tensor(s), e.g. {missing[0]}")
    extra = sorted(set(by_name) - set(want))
    if extra:
        raise PlanError(f"'{path}' holds tensor(s) the model does not have, e.g. {extra[0]}")
    worst, weights, types = 0.0, 0, {}
    for tn, w in want.items():
        t = by_name[tn]
        got = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(w.shape)
        if t.tensor_type.name in ("F16", "F32"):  # float tensors: the model's values at the file's precision
            w = w.astype(np.float16 if t.tensor_type.name == "F16" else np.float32).astype(np.float32)
        worst = max(worst, float(np.abs(got - w).max()) if w.size else 0.0)
        weights += w.size
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"tensors": len(want), "weights": weights, "max_abs_diff": worst, "types": types, "integer_layers": layers}
