"""The workbench's AWQ against autoawq 0.2.9 (its CPU aliasing fixed) and RTN, on the demo model.

    python bench/awq_crosscheck.py [--model demo] [--samples 32] [--seq-len 512] [--group-size 128]

Both searches get the same calibration texts (whole lines of the bundled calibration text, cut to
``--seq-len`` tokens); autoawq's scaled and clipped weights are rounded by the workbench's own
quantizer (INT4, asymmetric, groups of ``--group-size``), so only the searches differ. Prints the
KL divergence of each to the float model on the bundled held-out text. Needs
``pip install --no-deps autoawq==0.2.9`` (``make install`` does it).
"""
from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args()
    import torch

    from workbench.evaluation.evaluate import read_text
    from workbench.assets import demo_text_path
    from workbench.model.load import load_model
    from workbench.quantize.crosscheck import AutoAwqUnavailable, calibration_texts, compare_with_autoawq, patched_autoawq
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype="float32")
    texts = calibration_texts(read_text(demo_text_path("calibration")), args.samples, min_chars=4 * args.seq_len)
    t0 = time.perf_counter()
    try:
        with patched_autoawq() as auto_awq:
            kl = compare_with_autoawq(lm, texts, auto_awq, group_size=args.group_size, seq_len=args.seq_len)
    except AutoAwqUnavailable as e:
        sys.exit(str(e))
    print(f"model {args.model}: INT4 asymmetric g{args.group_size}, {len(texts)} calibration samples of up to "
          f"{args.seq_len} tokens, KL to the float model on the bundled held-out text ({time.perf_counter() - t0:.0f} s)")
    for name, label in (("rtn", "RTN"), ("autoawq", "autoawq 0.2.9 (patched)"), ("ours", "workbench AWQ")):
        print(f"  {label:<26}{kl[name]:.5f}  ({kl[name] / kl['rtn'] - 1:+.1%} vs RTN)")


if __name__ == "__main__":
    main()
