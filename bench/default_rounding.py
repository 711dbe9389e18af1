"""Which rounding a user gets by default: the grid, the scale search's importance, at every width, beside
llama.cpp's reference rounding, all in the workbench's evaluator (the one `workbench quantize` reports).

    python bench/default_rounding.py --model smollm2-135m [--widths 2,3,4,5,6,8] [--group-size 32] [--tokens 2048]
    python bench/default_rounding.py --model qwen2.5-coder-0.5b --widths 4 --configs default,15,ref

Each row quantizes every linear layer at the width (embeddings and tied output float16, as `workbench quantize
--bits N` does) and scores it against the float model on the same held-out tokens: KL with its standard error,
top-1 agreement, perplexity, and the time the rounding took. The configurations:

- ``default``: what `workbench quantize MODEL --bits N` does now (the plan's defaults, importance from the
  default calibration statistics: ``workbench.model.calibrate.importance_statistics``);
- ``15`` / ``15+imp``: the 15-level symmetric grid (max / (2^(b-1) - 1)) with the scale search, without / with
  the importance;
- ``16`` / ``16+imp``: the 16-level grid (llama.cpp's Q4_0 / Q5_0 layout) with the scale search and its
  stretched ranges, without / with the importance;
- ``asym+imp``: unsigned codes with a zero point per group (all 2^b levels, the zero point stored), with the
  importance;
- ``ref``: llama.cpp's reference rounding of the same layers (the gguf package's quantizer, what
  ``llama-quantize`` writes without an importance matrix): Q4_0, Q5_0, Q8_0 at 4, 5, 8 bits in 32-weight blocks.

Models: a local Hugging Face folder, ``demo``, or a name of bench/real_models.py (its folder under
``workspace/real-models``, fetched there by that bench). The importance statistics are read from the bundled
calibration text, never the held-out text; the workspace caches them.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "scripts")]

REFERENCE = {4: "Q4_0", 5: "Q5_0", 8: "Q8_0"}  # llama.cpp's 32-weight symmetric block types
CONFIGS = ("default", "15", "15+imp", "16", "16+imp", "asym+imp", "ref")


def peak_mib() -> int:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def model_path(name: str) -> str:
    real = HERE.parent / "workspace" / "real-models" / name
    return str(real) if (real / "config.json").is_file() else name


def row(label: str, bits: int, rep, seconds: float, bpw: float | None = None) -> dict:
    """One printed row; ``rep`` an evaluation report or a ``QuantCost`` (each names its KL's standard error)."""
    se = rep.kl_divergence_stderr if hasattr(rep, "kl_divergence_stderr") else rep.kl_stderr
    return {"config": label, "bits": bits, "kl": rep.kl_divergence, "kl_se": se, "top1": rep.top1_agreement,
            "perplexity": rep.perplexity, "bits_per_weight": bpw, "seconds": round(seconds, 1), "peak_mib": peak_mib()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--widths", default="2,3,4,5,6,8")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", help="write the rows to this file as well")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from workbench.model.calibrate import importance_statistics
    from workbench.model.load import load_model
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import heldout_ids, measure_cost, measure_reference, quantize_model
    from quality import evaluate_weights
    from real_models import reference_weights

    configs = args.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}; choose from {','.join(CONFIGS)}")
    t0 = time.perf_counter()
    lm = load_model(model_path(args.model))
    ids = heldout_ids(lm, max_tokens=args.tokens)
    baseline = measure_reference(lm.model, ids, progress=False)
    ref = baseline.report
    print(f"model {lm.path.name}: {lm.parameters:,} parameters; {ref.tokens:,} held-out tokens scored in "
          f"{ref.windows} windows, float perplexity {ref.perplexity:.3f} ({time.perf_counter() - t0:.1f} s, "
          f"peak {peak_mib()} MiB)", flush=True)
    t0 = time.perf_counter()
    calibration, how = importance_statistics(lm, progress=False)
    print(f"importance: {how} ({time.perf_counter() - t0:.1f} s, peak {peak_mib()} MiB)", flush=True)

    rows = []
    for bits in [int(b) for b in args.widths.split(",")]:
        base = QuantPlan.uniform(f"int{bits}", group_size=args.group_size)
        variants = {"default": (QuantPlan.default_for(f"int{bits}", group_size=args.group_size), True), "15": (replace(base, full_range=False), False),
                    "15+imp": (replace(base, full_range=False), True), "16": (replace(base, full_range=True), False),
                    "16+imp": (replace(base, full_range=True), True),
                    "asym+imp": (replace(base, full_range=False, symmetric=False), True)}
        for label in configs:
            t = time.perf_counter()
            if label == "ref":
                if bits not in REFERENCE or args.group_size != 32:
                    continue
                weights = reference_weights(lm, REFERENCE[bits], base)
                r = row(f"llama.cpp {REFERENCE[bits]} reference", bits, evaluate_weights(lm, weights, baseline),
                        time.perf_counter() - t)
            else:
                plan, weighted = variants[label]
                qm = quantize_model(lm, plan, calibration=calibration if weighted else None, progress=False)
                seconds = time.perf_counter() - t
                cost = measure_cost(qm, baseline, progress=False)
                r = row(label, bits, cost, seconds, cost.bits_per_weight)
                del qm
            rows.append(r)
            print(f"int{bits} g{args.group_size} {r['config']:<26} KL {r['kl']:.5f} ± {r['kl_se']:.5f}  top-1 "
                  f"{r['top1']:.4f}  ppl {r['perplexity']:.3f}  rounding {r['seconds']:.1f} s  peak {r['peak_mib']} MiB",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(lm.path), "tokens": ref.tokens, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
