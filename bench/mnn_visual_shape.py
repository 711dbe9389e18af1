"""What writing ``visual.mnn`` costs at Qwen2.5-VL-3B's vision shape, and how long MNN runs one picture through it.

    python bench/mnn_visual_shape.py                   # 32 blocks of 1280, random weights, int4 g128, a 448 x 448 picture
    python bench/mnn_visual_shape.py --depth 4 --side 224

The encoder (669 M parameters at the full depth) is built from the demo VLM's config with the 3B vision sizes and
a one-layer text part, in bfloat16 and random (nothing is downloaded); the ONNX graph is written op by op
(``targets.mnn_vision.export_visual_onnx``), MNN's converter quantizes it (int4, block 128: MNN's own rounding of
random weights, the size a plan's codes would take), and MNN's module loader runs one picture's patches as the
engine would (``run_visual_mnn``: load and run, twice). Peak memory is the process's high-water mark (MNN's
converter and runtime run in it). The load average is printed: on a shared machine the times move with it.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from workbench.targets.mnn import convert_to_mnn  # noqa: E402
from workbench.targets.mnn_vision import export_visual_onnx, run_visual_mnn  # noqa: E402


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=32, help="vision blocks (Qwen2.5-VL-3B: 32)")
    ap.add_argument("--side", type=int, default=448, help="the square picture's side in pixels (a multiple of 28)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.side % 28 or args.side < 28 or args.depth < 1:
        ap.error("--side must be a positive multiple of 28 and --depth at least 1")
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration
    torch.set_num_threads(args.threads)
    cfg = AutoConfig.from_pretrained(ROOT / "assets" / "demo-vl-model")
    v, t = cfg.vision_config, cfg.text_config
    v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.out_hidden_size = args.depth, 1280, 3420, 16, 2048
    v.fullatt_block_indexes = [i for i in (7, 15, 23, 31) if i < args.depth]
    t.hidden_size, t.num_hidden_layers, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads = \
        2048, 1, 256, 16, 2
    t0 = time.time()
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.model.visual.parameters())
    print(f"encoder: {params / 1e6:.0f} M parameters, built in {time.time() - t0:.1f} s; peak {peak_gb():.2f} GB")
    with tempfile.TemporaryDirectory(prefix="mnn-visual-shape-") as tmp:
        out = Path(tmp)
        t0 = time.time()
        onnx_path = export_visual_onnx(model, out / "visual.onnx")
        print(f"ONNX graph: {time.time() - t0:.1f} s; peak {peak_gb():.2f} GB")
        del model
        t0 = time.time()
        convert_to_mnn(onnx_path, out / "visual.mnn", weight_bits=4, block_size=128, asymmetric=True,
                       extra=["--saveExternalData"])
        size = sum(f.stat().st_size for f in out.glob("visual.mnn*"))
        print(f"visual.mnn int4 g128: {time.time() - t0:.1f} s, {size / 1e6:.0f} MB; peak {peak_gb():.2f} GB")
        grid = np.array([[1, args.side // 14, args.side // 14]])
        patches = np.random.default_rng(0).standard_normal((int(grid.prod()), 1176)).astype(np.float32)
        for label in ("first", "again"):
            t0 = time.time()
            emb = run_visual_mnn(out / "visual.mnn", patches, grid)
            print(f"{args.side}x{args.side} picture, {label}: {time.time() - t0:.1f} s load and run "
                  f"({emb.shape[0]} image tokens, {args.threads} thread(s)); peak {peak_gb():.2f} GB")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
