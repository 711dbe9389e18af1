"""A vision-language model on a device: the image's tokens, the vision encoder's cost and the first token with it.

    vp = project_vision("qwen2.5-vl-3b", "8elite", image=(512, 512), runtime="genie")
    vp.image_tokens, vp.encoder_ms, vp.first_token_ms, vp.encoder_share, vp.text.vendor

The image's tokens follow the model's own resize (Qwen's ``smart_resize``: each side to a multiple of patch x merge,
the area kept within the processor's pixel bounds); the encoder's FLOPs and weights come from its shape (patch
embedding, ``depth`` blocks of attention + MLP, windowed where the config says, the merger(s)). No vendor publishes a
vision encoder's latency, so the encoder's FLOPs are timed at the rate the vendor-fitted first token reaches on that
device and runtime while prefilling the image's tokens (the fitted first token with them, minus without, over the
FLOPs they add), never faster than one read of its weights. The language part is projected by :func:`project` with
the image's tokens added to the prompt. AI Hub's VLM figures
(``vl_measurements``: the language part's first token and decode of Qwen2.5-VL-7B, Qwen3-VL-2B/4B) were never fitted,
so projecting them gives the error on models the fit had not seen.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from ..errors import WorkbenchError
from ..model.load import resolve_model_path
from ..model.shapes import SHAPES_FILE
from ..quantize.plan import QuantPlan
from .profiles import Device, get_device
from .projection import AUTO, DEFAULT_CONTEXT, DEFAULT_PROMPT, Projection, project
from .vendor_fit import VENDOR_FILE, relative_error
from .runtimes import get_runtime

__all__ = ["VisionShape", "VisionProjection", "VendorCheck", "vision_model", "image_tokens", "encoder_cost",
           "project_vision", "vendor_vl_check", "parse_image_size", "DEFAULT_IMAGE"]

# the language model's own model type inside each VL family (its decoder is that model's; M-RoPE moves positions only)
TEXT_TYPES = {"qwen2_5_vl": "qwen2", "qwen2_vl": "qwen2", "qwen3_vl": "qwen3"}
# the image size Qualcomm's exports fix (width, height): Qwen2.5-VL 336 high x 504 wide, Qwen3-VL 512 x 512
DEFAULT_IMAGE = {"qwen2_5_vl": (504, 336), "qwen2_vl": (504, 336), "qwen3_vl": (512, 512)}
# the image processors' default pixel bounds (min, max), where the model folder has no preprocessor_config.json
PIXEL_BOUNDS = {"qwen2_5_vl": (56 * 56, 28 * 28 * 1280), "qwen2_vl": (56 * 56, 28 * 28 * 1280),
                "qwen3_vl": (65536, 16777216)}
GATED_MLP = {"qwen2_5_vl"}  # gate/up/down in each vision block; the others: fc1/fc2


@dataclass(frozen=True)
class VisionShape:
    """The vision encoder's sizes, read from a VL config's ``vision_config``."""

    model_type: str
    patch: int
    merge: int
    temporal: int
    depth: int
    hidden: int
    intermediate: int
    out_hidden: int
    window: int | None  # patches per window side in the windowed blocks (Qwen2.5-VL), None: all full attention
    full_blocks: tuple[int, ...]
    mergers: int  # the final merger plus any deepstack ones (Qwen3-VL)
    min_pixels: int
    max_pixels: int


def _vision_config(source) -> tuple[dict, str] | None:
    if isinstance(source, Mapping):
        return dict(source), str(source.get("_name_or_path") or source.get("model_type"))
    text = str(source)
    path = resolve_model_path(text)
    if path.exists():
        cfg_path = path / "config.json" if path.is_dir() else path
        if not cfg_path.is_file():
            return None
        return json.loads(cfg_path.read_text(encoding="utf-8")), text
    shapes = json.loads(SHAPES_FILE.read_text(encoding="utf-8")).get("vision_shapes", {})
    return (dict(shapes[text]), text) if text in shapes else None


def vision_model(source) -> tuple[dict, VisionShape, str] | None:
    """(the language part's config with its own model type, the encoder's shape, a label) of a VL model directory,
    config.json, config dict or ``vision_shapes`` name; None when it is no vision-language model."""
    found = _vision_config(source)
    if found is None:
        return None
    cfg, label = found
    model_type, vc, tc = cfg.get("model_type"), cfg.get("vision_config"), cfg.get("text_config")
    if not isinstance(vc, dict) or not isinstance(tc, dict):
        return None
    if model_type not in TEXT_TYPES:
        raise WorkbenchError(f"'{label}' is a {model_type} vision-language model; image projection knows "
                             f"{', '.join(TEXT_TYPES)}")
    rope = dict(tc.get("rope_parameters") or {})
    text = {k: v for k, v in tc.items() if k not in ("rope_parameters", "model_type", "rope_scaling")}
    text.update(model_type=TEXT_TYPES[model_type], tie_word_embeddings=cfg.get("tie_word_embeddings",
                                                                                tc.get("tie_word_embeddings", False)),
                rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", tc.get("rope_theta",
                                                                                                    1e6))})
    bounds = PIXEL_BOUNDS[model_type]
    pre = Path(resolve_model_path(str(source))) / "preprocessor_config.json" if not isinstance(source, Mapping) else None
    if pre is not None and pre.is_file():
        size = json.loads(pre.read_text(encoding="utf-8")).get("size") or {}
        bounds = (size.get("shortest_edge", bounds[0]), size.get("longest_edge", bounds[1]))
    patch = int(vc["patch_size"])
    window = vc.get("window_size")
    shape = VisionShape(
        model_type=model_type, patch=patch, merge=int(vc.get("spatial_merge_size", 2)),
        temporal=int(vc.get("temporal_patch_size", 2)), depth=int(vc["depth"]), hidden=int(vc["hidden_size"]),
        intermediate=int(vc["intermediate_size"]), out_hidden=int(vc.get("out_hidden_size", tc["hidden_size"])),
        window=None if not window or model_type != "qwen2_5_vl" else max(1, int(window) // patch),
        full_blocks=tuple(vc.get("fullatt_block_indexes") or ()),
        mergers=1 + len(vc.get("deepstack_visual_indexes") or ()), min_pixels=int(bounds[0]), max_pixels=int(bounds[1]))
    return text, shape, label


def parse_image_size(text: str) -> tuple[int, int]:
    """'512x512' -> (width, height)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise WorkbenchError(f"image size '{text}' is not WIDTHxHEIGHT in pixels (e.g. 512x512)")
    return int(parts[0]), int(parts[1])


def image_tokens(vs: VisionShape, width: int, height: int) -> tuple[int, int, int, int]:
    """(resized width, resized height, patches, tokens the language model reads) for an image: Qwen's smart_resize
    rounds each side to patch x merge and keeps the area within the processor's bounds."""
    f = vs.patch * vs.merge
    if max(width, height) / min(width, height) > 200:
        raise WorkbenchError(f"image {width}x{height}: the aspect ratio is over 200, which the processor refuses")
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > vs.max_pixels:
        beta = math.sqrt(height * width / vs.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < vs.min_pixels:
        beta = math.sqrt(vs.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    patches = (h // vs.patch) * (w // vs.patch)
    return w, h, patches, patches // vs.merge ** 2


def encoder_cost(vs: VisionShape, width: int, height: int) -> tuple[float, int]:
    """(FLOPs, parameters) of encoding one image of this resized size: 2 per weight per patch (per merged token in
    the mergers) plus attention's two matrix products over each block's keys (a window's, or all patches)."""
    n = (height // vs.patch) * (width // vs.patch)
    tokens = n // vs.merge ** 2
    embed = 3 * vs.temporal * vs.patch ** 2 * vs.hidden
    block = 4 * vs.hidden ** 2 + (3 if vs.model_type in GATED_MLP else 2) * vs.hidden * vs.intermediate
    wide = vs.hidden * vs.merge ** 2
    merger = wide * wide + wide * vs.out_hidden
    flops = 2.0 * n * (embed + vs.depth * block) + 2.0 * tokens * vs.mergers * merger
    for i in range(vs.depth):
        keys = n if vs.window is None or i in vs.full_blocks else min(n, vs.window ** 2)
        flops += 4.0 * n * keys * vs.hidden
    return flops, embed + vs.depth * block + vs.mergers * merger


@dataclass
class VendorCheck:
    """The text fit projecting the vendor's VLM measurements of this device and runtime, which it never saw."""

    n: int  # measurements projected
    ttft_error: float | None  # median |projected / measured - 1| of the first token (text prompt)
    decode_error: float | None
    models: list[str] = field(default_factory=list)
    source: str = ""


@dataclass
class VisionProjection:
    """The image's share of the first token on a device, beside the language part's projection."""

    model: str
    device: str
    image: tuple[int, int]  # as asked
    resized: tuple[int, int]  # as the processor resizes it
    patches: int
    image_tokens: int
    encoder_flops: float
    encoder_parameters: int
    encoder_precision: str
    encoder_read_ms: float | None  # one read of the encoder's weights at the device's bandwidth: a lower bound
    prefill_tflops: float | None  # FLOPs per second the vendor-fitted first token reaches (the image tokens' share)
    encoder_ms: float | None
    image_prefill_ms: float | None  # the image tokens' share of the language part's first token
    text_first_token_ms: float | None  # the language part at prompt + image tokens
    first_token_ms: float | None
    encoder_share: float | None
    basis: str
    vendor_check: VendorCheck | None
    text: Projection
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["text"] = self.text.to_dict()
        return d


def _vl_rows(path: Path = VENDOR_FILE) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8")).get("vl_measurements", [])


def _text_shape(shape: str):
    vm = vision_model(shape)
    return shape if vm is None else {**vm[0], "_name_or_path": shape}


def vendor_vl_check(device: Device, runtime: str, *, path: Path = VENDOR_FILE) -> VendorCheck:
    """Project each vendor VLM measurement of ``device`` and ``runtime`` (its language part, at its precision,
    context and prompt) with the text fit, and report the median errors: those rows were never fitted."""
    rt = get_runtime(runtime)
    rows = [r for r in _vl_rows(path) if r["device"] == device.key and r["runtime"] == rt.name]
    ttft, decode, models = [], [], []
    for r in rows:
        try:
            plan = rt.plan(r["precision"])
        except (WorkbenchError, KeyError):
            continue
        p = project(_text_shape(r["shape"]), device, plan, context=r["context"], prompt=r["prompt"] or DEFAULT_PROMPT,
                    runtime=rt.name)
        v = p.vendor
        if v is None:
            continue
        if v.ttft_ms and r.get("ttft_ms"):
            ttft.append(relative_error("ttft_ms", v.ttft_ms, r["ttft_ms"]))
        if v.decode_tps and r.get("decode_tps"):
            decode.append(relative_error("decode_tps", v.decode_tps, r["decode_tps"]))
        models.append(r["model"])
    med = (lambda xs: statistics.median(abs(x) for x in xs) if xs else None)
    return VendorCheck(len(models), med(ttft), med(decode),
                       sorted(set(models)), "qai-hub-models perf.yaml (vl_measurements)")


def project_vision(model, device: str | Device, plan: QuantPlan | None = None, *, image: tuple[int, int] | None = None,
                   context: int = DEFAULT_CONTEXT, prompt: int = DEFAULT_PROMPT, runtime: str | None = AUTO,
                   encoder_precision: str = "int8", ram_gb: float | None = None) -> VisionProjection:
    """The VL ``model`` on ``device``: the language part projected with ``prompt`` + the image's tokens, the encoder's
    time for one ``image`` (width, height; default the size Qualcomm's export fixes) and its share of the first
    token. ``encoder_precision``: 'int8' (the w8a16 preset Qualcomm runs its vision encoders at) or 'fp16': the
    bytes its weights take."""
    vm = vision_model(model)
    if vm is None:
        raise WorkbenchError(f"'{model}' has no vision part (no vision_config): --image projects vision-language "
                             "models only")
    text_cfg, vs, label = vm
    if encoder_precision not in ("int8", "fp16"):
        raise WorkbenchError(f"encoder precision '{encoder_precision}': choose int8 or fp16")
    dev = device if isinstance(device, Device) else get_device(device)
    image = image or DEFAULT_IMAGE[vs.model_type]
    w, h, patches, tokens = image_tokens(vs, *image)
    notes = []
    if (w, h) != tuple(image):
        notes.append(f"the processor resizes {image[0]}x{image[1]} to {w}x{h} (multiples of {vs.patch * vs.merge})")
    name = {**text_cfg, "_name_or_path": label}
    text = project(name, dev, plan, context=max(context, prompt + tokens), prompt=prompt + tokens, runtime=runtime,
                   ram_gb=ram_gb)
    flops, params = encoder_cost(vs, w, h)
    read_ms = (None if dev.memory_bandwidth_gbps is None else
               params * (1 if encoder_precision == "int8" else 2) / (dev.memory_bandwidth_gbps * 1e9) * 1e3)
    fitted = text.vendor.ttft_ms if text.vendor is not None else None
    rate, image_ms, encoder_ms = None, None, None
    if fitted is not None:
        # the image tokens' prefill: the fitted first token with them minus without; what it computes per ms is the
        # rate the vendor's measurements show this NPU reach, which the encoder's FLOPs are timed at
        bare = project(name, dev, plan, context=max(context, prompt + tokens), prompt=prompt, runtime=runtime,
                       ram_gb=ram_gb)
        if bare.vendor is not None and bare.vendor.ttft_ms is not None and fitted > bare.vendor.ttft_ms:
            image_ms = fitted - bare.vendor.ttft_ms
            rate = (text.prefill_flops - bare.prefill_flops) / image_ms  # FLOPs per ms
    if rate is not None:
        compute_ms = flops / rate
        encoder_ms = max(compute_ms, read_ms or 0.0)
        basis = (f"encoder: {flops / 1e9:,.0f} GFLOP at the {rate / 1e9:.2f} TFLOP/s that {text.vendor.runtime_title}'s "
                 f"fitted first token reaches on {dev.name} while prefilling"
                 + ("" if compute_ms >= (read_ms or 0) else ", bounded below by one read of its weights")
                 + "; no vendor publishes a vision encoder's latency")
    else:
        basis = ("encoder: no time (no vendor first-token fit for this device and runtime that grows with the "
                 "prompt)" + (f"; one read of its weights takes {read_ms:.1f} ms" if read_ms is not None else ""))
    first = None if encoder_ms is None or fitted is None else encoder_ms + fitted
    check = vendor_vl_check(dev, text.runtime) if text.runtime else None
    return VisionProjection(
        model=label, device=dev.name, image=tuple(image), resized=(w, h), patches=patches, image_tokens=tokens,
        encoder_flops=flops, encoder_parameters=params, encoder_precision=encoder_precision, encoder_read_ms=read_ms,
        prefill_tflops=None if rate is None else rate / 1e9, encoder_ms=encoder_ms, image_prefill_ms=image_ms,
        text_first_token_ms=fitted, first_token_ms=first,
        encoder_share=None if first is None else encoder_ms / first, basis=basis, vendor_check=check, text=text,
        notes=notes)
