"""Activation statistics of every linear layer's input over a calibration set, cached in the workspace.

    workbench calibrate demo
    workbench calibrate ./my-model --data calib.jsonl --samples 256 --seq-len 512 --json
"""
from __future__ import annotations

from ..model.calibrate import OUTLIER_FACTOR, calibrate
from ..evaluation.data import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from ..model.load import load_model
from ..files.workspace import Workspace
from .common import count, number, add_device_argument, add_json_flag, add_model_argument, print_json

HELP = "activation statistics (per-channel magnitudes, outliers) over a calibration set"


def add_arguments(p):
    add_model_argument(p)
    p.add_argument("--data", help="calibration text: plain text, JSONL ('text', optional 'source'/'lang') or Alpaca "
                                  ".json (default: the demo model's bundled calibration text)")
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
                          force=args.force)
    art = stats.artifact
    if args.json:
        print_json({"model": str(lm.path), "artifact": str(art.path) if art else None,
                    "key": art.key if art else None, "cached": stats.cached, "coverage": cs.report.to_dict(),
                    "meta": stats.meta,
                    "layers": stats.summary()})
        return 0
    for line in cs.report.summary_lines():
        print(line)
    print(f"\n{'layer':<44} {'in':>5} {'abs-max':>9} {'p99.9':>8} {'kurtosis':>9} {'max/med':>8} "
          f"{'outliers':>8} {'near-0':>7}")
    for s in stats.layers.values():
        print(f"{s.name:<44} {s.in_features:>5} {s.abs_max_value:>9.3g} {s.percentiles['p99.9']:>8.3g} "
              f"{s.kurtosis:>9.2f} {s.max_to_median:>8.1f} {len(s.outlier_channels):>8} "
              f"{s.near_zero_fraction:>7.1%}")
    cached = " (read back from the workspace)" if stats.cached else ""
    print(f"\n{len(stats.layers)} layers, {stats.meta['tokens']:,} tokens, {stats.meta['seconds']:.1f} s of "
          f"calibration{cached}; statistics in {art.path if art else '-'}")
    return 0
