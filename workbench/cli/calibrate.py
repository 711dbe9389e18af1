"""Activation statistics of every linear layer's input over a calibration set, cached in the workspace.

    workbench calibrate demo
    workbench calibrate ./my-model --data calib.jsonl --samples 256 --seq-len 512 --json
    workbench calibrate demo-vl                        # a VLM: the bundled image + text pairs, every part
    workbench calibrate ./my-vlm --images ./pictures    # a folder of images with captions.jsonl / .csv / .tsv

Near zero: |x| < abs-max / 254, half a step of per-tensor symmetric INT8 (what such a quantizer rounds to 0).
"""
from __future__ import annotations

from ..model.calibrate import NEAR_ZERO_DIVISOR, OUTLIER_FACTOR, calibrate
from ..model.vision_quality import layer_parts
from ..evaluation.data import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from ..model.load import load_model
from ..files.workspace import Workspace
from .common import count, number, add_device_argument, add_json_flag, add_model_argument, print_json

HELP = "activation statistics (per-channel magnitudes, outliers) over a calibration set"


def add_arguments(p):
    add_model_argument(p)
    p.add_argument("--data", help="calibration text: plain text, JSONL ('text', optional 'source'/'lang') or Alpaca "
                                  ".json (default: the demo model's bundled calibration text)")
    p.add_argument("--images", help="a vision-language model: the image set to calibrate on (a folder of images with "
                                    "captions.jsonl / .csv / .tsv, or a records file; default for a VLM: the bundled "
                                    "demo-vl calibration pairs). Every part's layers get statistics")
    p.add_argument("--samples", type=count(1), default=DEFAULT_SAMPLES, help=f"samples to draw (default {DEFAULT_SAMPLES})")
    p.add_argument("--seq-len", type=count(2),
                   help=f"tokens per sample; longer texts are split (default {DEFAULT_SEQ_LEN}, or the model's "
                        "context when that is shorter)")
    p.add_argument("--seed", type=count(0), default=0, help="sampling seed (default 0)")
    p.add_argument("--bilingual", action="store_true",
                   help="the set is for a Chinese-English model: warn when Chinese:English is below 1:1")
    p.add_argument("--outlier-factor", type=number(0, low_open=True), default=OUTLIER_FACTOR,
                   help=f"a channel is an outlier above this multiple of the median channel abs-max "
                        f"(default {OUTLIER_FACTOR:g})")
    p.add_argument("--workspace", help="workspace directory (default ./workspace or $WORKBENCH_WORKSPACE)")
    p.add_argument("--force", action="store_true", help="recompute even if the workspace has the result")
    add_device_argument(p)
    add_json_flag(p)


def run(args) -> int:
    lm = load_model(args.model, device=args.device)
    ws = Workspace(args.workspace) if args.workspace else Workspace()
    seq_len = args.seq_len
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, getattr(lm.config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN)
    cs, stats = calibrate(lm, args.data, samples=args.samples, seq_len=seq_len, workspace=ws, seed=args.seed,
                          bilingual=args.bilingual, outlier_factor=args.outlier_factor, progress=not args.json,
                          force=args.force, images=args.images)
    art = stats.artifact
    parts = layer_parts(lm)
    if args.json:
        print_json({"model": str(lm.path), "artifact": str(art.path) if art else None,
                    "key": art.key if art else None, "cached": stats.cached, "coverage": cs.report.to_dict(),
                    "meta": stats.meta, "near_zero_rule": f"|x| < abs_max / {NEAR_ZERO_DIVISOR:g}",
                    "layers": [{**s, "part": parts.get(s["name"])} for s in stats.summary()]})
        return 0
    for line in cs.report.summary_lines():
        print(line)
    if "images" in stats.meta:
        print(f"{stats.meta['images']} pictures, {stats.meta['image_tokens']:,} of the tokens hold them")
    vision = getattr(lm, "is_vision", False)
    width = max(44, *(len(n) for n in stats.layers)) if vision else 44
    part_col = f" {'part':<14}" if vision else ""
    print(f"\n{'layer':<{width}}{part_col} {'in':>5} {'rows':>6} {'abs-max':>9} {'p99.9':>8} {'kurtosis':>9} "
          f"{'max/med':>8} {'outliers':>8} {'near-0':>7}")
    for s in stats.layers.values():
        part = f" {parts.get(s.name, ''):<14}" if vision else ""
        print(f"{s.name:<{width}}{part} {s.in_features:>5} {s.tokens:>6} {s.abs_max_value:>9.3g} "
              f"{s.percentiles['p99.9']:>8.3g} {s.kurtosis:>9.2f} {s.max_to_median:>8.1f} "
              f"{len(s.outlier_channels):>8} {s.near_zero_fraction:>7.1%}")
    print(f"\nnear-0: share of a layer's inputs with |x| < abs-max / {NEAR_ZERO_DIVISOR:g} (rounded to 0 by "
          "per-tensor symmetric INT8); rows: tokens, or image patches in the vision encoder")
    if vision:
        for part in dict.fromkeys(parts.values()):
            got = [s for s in stats.layers.values() if parts.get(s.name) == part]
            if got:
                top = max(got, key=lambda s: s.near_zero_fraction)
                med = sorted(s.near_zero_fraction for s in got)[len(got) // 2]
                print(f"{part}: {len(got)} layers, median near-0 {med:.1%}, most {top.near_zero_fraction:.1%} "
                      f"({top.name})")
    cached = " (read back from the workspace)" if stats.cached else ""
    print(f"\n{len(stats.layers)} layers, {stats.meta['tokens']:,} tokens, {stats.meta['seconds']:.1f} s of "
          f"calibration{cached}; statistics in {art.path if art else '-'}")
    return 0
