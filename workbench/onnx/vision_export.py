"""A VLM's vision encoder as its own ONNX graph at one fixed image size: pixel patches in, image embeddings out.

    vx = export_vision_encoder(load_model("demo-vl"), "out/vision")      # the demo VLM's own 56x56
    vx = export_vision_encoder(lm, "out/vision", image_size=(336, 504))  # Qualcomm's Qwen2.5-VL size
    vx.path, vx.grid_thw, vx.input_shape, vx.output_shape, vx.max_abs_diff
    feed = encoder_feed(lm, image, vx)          # {"pixel_values": [patches, 3*2*14*14]}, the picture resized to fit
    emb = vision_embeddings(lm.model, feed["pixel_values"], vx.grid_thw)   # PyTorch's, for comparison

NPU compilers (QNN's, MNN's) want every shape fixed, so the graph is built for one image size (Qualcomm ships
Qwen2.5-VL's encoder at 336x504, Qwen3-VL's at 512x512): what depends only on the grid is computed here and
baked in as constants: the 2D rotary cos/sin tables, the window order of the patches and its inverse, and the
additive mask of windowed-attention blocks (0 inside a window, ``-MASK_BIAS`` outside: a finite value that
16-bit activations keep and that ``exp`` sends to 0). Built op by op with the text export's ``GraphBuilder``,
so each layer's weight is ``<layer>.weight.T`` (``[in, out]``, ``MatMul`` node ``/<layer>/MatMul``), as QDQ
overrides and QNN encodings address them. Supported: Qwen2.5-VL's vision tower (RMSNorm, SiLU-gated MLP, the
patch merger); other architectures are refused by name.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError, ModelLoadError
from ..files.workspace import atomic_write_json
from ..numerics.compute import float32_weight
from .build import DATA_FILE, INLINE_LIMIT, FloatWeights, GraphBuilder, TensorStore, apply_rotary, as_array

__all__ = ["VisionExport", "QUALCOMM_IMAGE_SIZES", "encoder_image_size", "export_vision_encoder", "encoder_feed",
           "vision_embeddings", "vision_block", "gelu", "VISION_FILE", "MASK_BIAS"]

VISION_FILE = "vision_encoder.onnx"
MASK_BIAS = 100.0  # outside a window: exp(-100) is 0 in every float format, and 16-bit codes keep the scores' step
# the fixed (height, width) Qualcomm's qai-hub-models compiles each family's encoder at
QUALCOMM_IMAGE_SIZES = {"qwen2_5_vl": (336, 504), "qwen3_vl": (512, 512)}
SUPPORTED = ("qwen2_5_vl",)
VISION_OPSET = 20  # the first with Gelu (the projector's activation)


@dataclass
class VisionExport:
    """What ``export_vision_encoder`` wrote, for which fixed picture, and how closely onnxruntime matched PyTorch."""

    path: Path
    image_size: tuple[int, int]  # (height, width) every picture is resized to
    grid_thw: tuple[int, int, int]  # patches (temporal, height, width) of that picture
    input_shape: tuple[int, int]  # pixel_values: [patches, channels * temporal * patch * patch]
    output_shape: tuple[int, int]  # image_embeds: [image tokens, language model hidden size]
    weight_names: dict[str, str]  # layer FQN -> ONNX initializer holding its weight
    weight_layouts: dict[str, str]
    windowed_blocks: list[int] = field(default_factory=list)  # blocks whose attention is masked to windows
    max_abs_diff: float | None = None  # onnxruntime vs PyTorch on one picture's embeddings; None when not checked
    seconds: float = 0.0
    data_path: Path | None = None

    @property
    def prefill_path(self) -> Path:
        """The graph under the name the QNN encoders read an export's graph by."""
        return self.path

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(path=str(self.path), data_path=str(self.data_path) if self.data_path else None)
        return d


def _size_of(preprocessor) -> tuple[int, int] | None:
    """A square size when the image processor allows exactly one pixel count (min_pixels == max_pixels)."""
    size = getattr(preprocessor, "size", None)
    lo = getattr(size, "shortest_edge", None) or getattr(preprocessor, "min_pixels", None)
    hi = getattr(size, "longest_edge", None) or getattr(preprocessor, "max_pixels", None)
    if lo and hi and lo == hi and math.isqrt(int(lo)) ** 2 == int(lo):
        side = math.isqrt(int(lo))
        return side, side
    return None


def encoder_image_size(lm, image_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """The fixed (height, width) of ``lm``'s encoder graph: ``image_size``, else the one size its preprocessor
    allows (the demo VLM's 56x56), else Qualcomm's size for its family; each side a multiple of patch x merge."""
    vc = lm.model.config.vision_config
    unit = int(vc.patch_size) * int(vc.spatial_merge_size)
    if image_size is None:
        proc = getattr(getattr(lm, "processor", None), "image_processor", None)
        image_size = _size_of(proc) if proc is not None else None
    if image_size is None:
        image_size = QUALCOMM_IMAGE_SIZES.get(lm.model.config.model_type)
    if image_size is None:
        raise DataError(f"'{lm.path}' has no fixed image size: give one (height, width), each a multiple of {unit}")
    h, w = (int(x) for x in image_size)
    if h <= 0 or w <= 0 or h % unit or w % unit:
        raise DataError(f"image size {h}x{w} does not fit the encoder's grid: each side must be a positive multiple "
                        f"of {unit} (patch {vc.patch_size} x merge {vc.spatial_merge_size})")
    return h, w


def _visual(lm):
    model_type = lm.model.config.model_type
    visual = getattr(getattr(lm.model, "model", None), "visual", None)
    if visual is None:
        raise ModelLoadError(f"'{lm.path}' has no vision encoder (model.visual): export its language model instead")
    if model_type not in SUPPORTED:
        raise ModelLoadError(f"the vision encoder of '{lm.path}' ({model_type}) cannot be exported as a fixed-size "
                             f"graph yet; supported: {', '.join(SUPPORTED)}")
    return visual


def _grid_constants(visual, grid_thw: tuple[int, int, int]) -> dict:
    """What the encoder computes from the grid alone, as transformers computes it for this one picture."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mq
    grid = torch.tensor([grid_thw])
    cfg = visual.config
    position_ids = mq.get_vision_position_ids(grid, visual.spatial_merge_size, kwargs={})
    window_index, cu_window = mq.get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                                         window_size=visual.window_size, patch_size=visual.patch_size,
                                                         kwargs={})
    n = int(np.prod(grid_thw))
    unit = visual.spatial_merge_unit
    dummy = torch.zeros(n, 1)
    cos, sin = visual.rotary_pos_emb(dummy, position_ids)
    order = (window_index[:, None] * unit + torch.arange(unit)[None]).reshape(-1)  # patch rows in window order
    cu = torch.unique_consecutive(torch.as_tensor(cu_window)).tolist()
    window_of = np.zeros(n, np.int64)
    for k, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        window_of[a:b] = k
    windowed = [i for i in range(cfg.depth) if i not in set(visual.fullatt_block_indexes)]
    return {"order": order.numpy(), "reverse": torch.argsort(window_index).numpy(),
            "cos": as_array(cos[order]), "sin": as_array(sin[order]),
            "mask": np.where(window_of[:, None] == window_of[None, :], 0.0, -MASK_BIAS).astype(np.float32),
            "windows": len(cu) - 1, "windowed": windowed if len(cu) > 2 else []}


def vision_block(g: GraphBuilder, linear, blk, i: int, h: str, cos: str, sin: str, mask: str | None, n: int,
                 heads: int, d: int) -> str:
    """One Qwen2.5-VL vision block on ``h`` ``[patches, dim]``: RMSNorm, attention with the 2D rotary (``cos`` /
    ``sin`` ``[1, patches, d]``) and the additive ``mask`` (None: full attention), RMSNorm, SiLU-gated MLP.
    ``linear(module, fqn, x)`` writes each linear layer (the weight policy's, or a target's that names the op);
    ``n``: the patches, or -1 where the graph takes any number (MNN's)."""
    fqn = f"model.visual.blocks.{i}"
    g.scope = f"{fqn}/attn"
    x = g.rms_norm(h, blk.norm1, f"{fqn}.norm1")
    qkv = g.reshape(linear(blk.attn.qkv, f"{fqn}.attn.qkv", x), [n, 3, heads, d])
    qkv = g.op("Transpose", [qkv], perm=[1, 2, 0, 3])  # [3, heads, patches, d]
    q, k, v = (g.op("Squeeze", [g.op("Slice", [qkv, g.const([j]), g.const([j + 1]), g.const([0])]), g.const([0])])
               for j in range(3))
    q, k = apply_rotary(g, q, cos, sin, d, axis=-1), apply_rotary(g, k, cos, sin, d, axis=-1)
    scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 2, 1])]),
                          g.const(float(blk.attn.scaling), np.float32)])
    if mask is not None:
        scores = g.op("Add", [scores, mask])
    out = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    out = g.reshape(g.op("Transpose", [out], perm=[1, 0, 2]), [n, heads * d])
    h = g.op("Add", [h, linear(blk.attn.proj, f"{fqn}.attn.proj", out)])
    g.scope = f"{fqn}/mlp"
    x = g.rms_norm(h, blk.norm2, f"{fqn}.norm2")
    gate = linear(blk.mlp.gate_proj, f"{fqn}.mlp.gate_proj", x)
    up = linear(blk.mlp.up_proj, f"{fqn}.mlp.up_proj", x)
    act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])  # SiLU
    return g.op("Add", [h, linear(blk.mlp.down_proj, f"{fqn}.mlp.down_proj", g.op("Mul", [act, up]))])


def gelu(g: GraphBuilder, x: str) -> str:
    """Exact GELU (the projector's). From opset 20 one ONNX Gelu node: QNN maps it to its own Gelu, where the
    ``Erf`` of the expanded form has no QNN mapping, and onnxruntime's QDQ quantizer gives it 16-bit codes (its
    ``com.microsoft`` Gelu it leaves in float, and everything after it). Before opset 20 (MNN's converter reads
    17) the erf form ``0.5 x (1 + erf(x / sqrt 2))``, transformers' ``gelu``."""
    if g.opset >= 20:
        return g.op("Gelu", [x])
    inner = g.op("Erf", [g.op("Mul", [x, g.const(1 / np.sqrt(2.0), np.float32)])])
    return g.op("Mul", [g.op("Mul", [x, g.const(0.5, np.float32)]), g.op("Add", [inner, g.const(1.0, np.float32)])])


def export_vision_encoder(lm, out_dir: str | Path, *, image_size: tuple[int, int] | None = None,
                          opset: int = VISION_OPSET,
                          check: bool = True, inline_limit: int | None = None) -> VisionExport:
    """``out_dir/vision_encoder.onnx``: ``lm``'s vision encoder and projector for pictures of ``image_size``
    (``encoder_image_size``), input ``pixel_values`` ``[patches, C*T*P*P]`` as the model's image processor makes
    them, output ``image_embeds`` ``[tokens, hidden]`` (what replaces the image tokens). ``check``: onnxruntime
    against PyTorch on one picture (``max_abs_diff``). A quantized model (the simulation) exports its dequantized
    weights."""
    from onnx import TensorProto, helper
    t0 = time.perf_counter()
    if opset < VISION_OPSET:
        raise ValueError(f"opset {opset} has no Gelu; the vision encoder needs {VISION_OPSET} or newer")
    visual = _visual(lm)
    vc = lm.model.config.vision_config
    if str(vc.hidden_act) not in ("silu", "swish"):
        raise ModelLoadError(f"the vision encoder of '{lm.path}' uses '{vc.hidden_act}', not SiLU: not exported")
    height, width = encoder_image_size(lm, image_size)
    p, t, c, merge = int(vc.patch_size), int(vc.temporal_patch_size), int(vc.in_channels), int(vc.spatial_merge_size)
    grid = (1, height // p, width // p)
    n, dim, heads = grid[1] * grid[2], int(vc.hidden_size), int(vc.num_heads)
    d, unit = dim // heads, merge * merge
    const = _grid_constants(visual, grid)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / VISION_FILE, out / DATA_FILE):
        stale.unlink(missing_ok=True)
    store = TensorStore(out, INLINE_LIMIT if inline_limit is None else inline_limit)
    policy = FloatWeights()
    g = GraphBuilder(store, opset, (1, n, 0))
    with torch.no_grad():
        g.scope = "model.visual.patch_embed"
        w = g.weight("model.visual.patch_embed.proj.weight.T",
                     lambda: as_array(float32_weight(visual.patch_embed.proj).reshape(dim, -1).T))
        h = g.op("MatMul", ["pixel_values", w], name="/model.visual.patch_embed.proj/MatMul")
        h = g.op("Gather", [h, g.const(const["order"])], axis=0)  # patches in window order
        cos, sin = g.const(const["cos"][None], np.float32), g.const(const["sin"][None], np.float32)
        mask = g.const(const["mask"], np.float32) if const["windowed"] else None
        for i, blk in enumerate(visual.blocks):
            h = vision_block(g, lambda *a: policy.linear(g, *a), blk, i, h, cos, sin,
                             mask if i in const["windowed"] else None, n, heads, d)
        g.scope = "model.visual.merger"
        m = visual.merger
        x = g.reshape(g.rms_norm(h, m.ln_q, "model.visual.merger.ln_q"), [n // unit, dim * unit])
        x = gelu(g, policy.linear(g, m.mlp[0], "model.visual.merger.mlp.0", x))
        x = policy.linear(g, m.mlp[2], "model.visual.merger.mlp.2", x)
        emb = g.op("Gather", [x, g.const(const["reverse"])], axis=0)  # back to the picture's order
    g.rename(emb, "image_embeds")
    store.close()
    hidden = int(m.mlp[2].out_features)
    graph = helper.make_graph(
        g.nodes, "vision_encoder",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [n, c * t * p * p])],
        [helper.make_tensor_value_info("image_embeds", TensorProto.FLOAT, [n // unit, hidden])],
        list(g.constants.values()) + [store.proto(w) for w in g.weights])
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if g.ms_domain else [])
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="workbench")
    proto.ir_version = min(proto.ir_version, 10)
    path = out / VISION_FILE
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(proto.SerializeToString())
    tmp.replace(path)
    names = {k: v for k, v in policy.weight_names.items() if k.startswith("model.visual.")}
    layouts = {k: policy.weight_layouts[k] for k in names}
    missing = [info.name for info in lm.layers if info.name.startswith("model.visual.") and info.name not in names]
    if missing:
        raise ModelLoadError(f"the vision graph holds no weight for {', '.join(missing[:3])}: the encoder has layers "
                             "the export does not know")
    result = VisionExport(path, (height, width), grid, (n, c * t * p * p), (n // unit, hidden), names, layouts,
                          const["windowed"], data_path=store.data_path if store.external else None)
    atomic_write_json(out / "vision_encoder.json", {"image_size": list(result.image_size),
                                                    "grid_thw": list(grid), "weight_names": names,
                                                    "weight_layouts": layouts})
    if check:
        import onnxruntime as ort
        pixels = torch.randn(n, c * t * p * p, generator=torch.Generator().manual_seed(0))
        ref = vision_embeddings(lm.model, pixels, grid)
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
            None, {"pixel_values": pixels.numpy()})[0]
        result.max_abs_diff = float(np.abs(got - ref).max())
    result.seconds = time.perf_counter() - t0
    return result


@torch.no_grad()
def vision_embeddings(model, pixel_values, grid_thw) -> np.ndarray:
    """PyTorch's image embeddings (after the projector) for one picture's ``pixel_values``, in float32."""
    visual = model.model.visual
    pixels = torch.as_tensor(np.asarray(pixel_values), dtype=torch.float32)
    out = visual(pixels.to(visual.dtype), grid_thw=torch.tensor([list(grid_thw)]))
    return out.pooler_output.float().cpu().numpy()


def encoder_feed(lm, image, export: VisionExport) -> dict[str, np.ndarray]:
    """The encoder graph's input for a PIL picture: resized to the graph's fixed size, then the model's own image
    processor; a picture whose patches still do not fit the grid is refused, naming both."""
    from PIL import Image
    height, width = export.image_size
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    pix = lm.processor.image_processor([image], return_tensors="pt")
    grid = tuple(int(v) for v in pix["image_grid_thw"][0])
    if grid != tuple(export.grid_thw):
        raise DataError(f"the picture resized to {width}x{height} gives a {grid[1]}x{grid[2]} patch grid, but the "
                        f"encoder graph was built for {export.grid_thw[1]}x{export.grid_thw[2]}: export it for the "
                        "size the image processor produces")
    return {"pixel_values": pix["pixel_values"].float().numpy()}
