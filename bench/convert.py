"""Export and conversion on the demo model: times, file sizes, and agreement with the simulation.

    python bench/convert.py [--model demo] [--bits 4] [--max-tokens N] [--json results.json]

Prints:
- ONNX export time (dynamic and static 128,511 shapes; target < 30 s), checker/onnxruntime check
  time, max abs difference of logits and KV against PyTorch, greedy tokens identical out of 32;
- per conversion target: time, bytes written, KL divergence and top-1 agreement against the
  float model, the same for the workbench's simulation, and top-1 agreement with the simulation
  (target: INT4 ONNX and MNN >= 0.95), with MatMulNBits accuracy_level 0 vs 4 (agreement and
  decode tokens/s after a warm-up, 1 thread).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from workbench.targets.convert import GAP_TOP1, convert, prepare_models
from workbench.onnx.export import export_onnx
from workbench.model.load import load_model

TARGETS = ("ort-int4", "mnn", "ort-qdq", "qnn", "tensorrt", "rknn")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--max-tokens", type=int, help="evaluate on the first N held-out tokens (default: all)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-convert-"))
    results: dict = {"model": args.model, "bits": args.bits, "export": {}, "conversions": []}

    lm = load_model(args.model)
    export_onnx(lm, out / "warmup", check=False)  # first export pays for imports and tracing caches
    for label, static in (("dynamic", None), ("static 128,511", (128, 511))):
        r = export_onnx(lm, out / label.split()[0], static=static, greedy_steps=32)
        sizes = {p.name: p.stat().st_size for p in r.files}
        results["export"][label] = {"export_seconds": r.export_seconds, "check_seconds": r.check_seconds,
                                    "max_abs_diff": r.max_abs_diff, "greedy_match_steps": r.greedy_match_steps,
                                    "bytes": sizes}
        print(f"export ({label}): {r.export_seconds:.1f} s (target < 30 s), checks {r.check_seconds:.1f} s, "
              f"max abs diff {r.max_abs_diff:.2e}, greedy identical {r.greedy_match_steps}/32, "
              f"files {', '.join(f'{k} {v / 2**20:.1f} MB' for k, v in sizes.items())}")

    prepared = prepare_models(args.model, bits=args.bits)
    print(f"\n{'target':<10} {'seconds':>8} {'MB':>7} {'KL':>9} {'KL sim':>9} {'top1':>7} {'top1 sim':>8} "
          f"{'vs sim':>7}  note")
    ok, tokens = True, 0
    for target in args.targets.split(","):
        t = time.perf_counter()
        rep = convert(args.model, target, out / target, prepared=prepared, max_tokens=args.max_tokens)
        seconds = time.perf_counter() - t
        mb = sum(f["bytes"] for f in rep.files) / 2**20
        results["conversions"].append(rep.to_dict())
        if rep.kl_divergence is None:
            print(f"{target:<10} {seconds:>8.1f} {mb:>7.2f} {'(SDK bundle: not runnable here)':>44}")
            continue
        s = rep.simulation
        tokens = rep.eval_tokens
        note = rep.gap or ""
        if target in ("ort-int4", "mnn") and rep.top1_agreement_vs_simulation < GAP_TOP1:
            ok = False
            note = (note + " BELOW TARGET").strip()
        print(f"{target:<10} {seconds:>8.1f} {mb:>7.2f} {rep.kl_divergence:>9.5f} {s['kl_divergence']:>9.5f} "
              f"{rep.top1_agreement:>7.4f} {s['top1_agreement']:>8.4f} {rep.top1_agreement_vs_simulation:>7.4f}  {note}")
        if target == "ort-int4":
            for level, m in rep.details["accuracy_levels"].items():
                tps = rep.details["decode_tokens_per_second"][level]
                print(f"{'':<10} accuracy_level {level}: top-1 vs sim {m['top1_agreement_vs_simulation']:.4f}, "
                      f"KL {m['kl_divergence']:.5f}, decode {tps:.0f} tok/s (1 thread)")
    print(f"\nevaluated on {tokens:,} held-out tokens; files under {out}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
