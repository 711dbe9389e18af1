"""How well the one-pass proxy score stands in for measured KL: rank correlation, cost, and the plans each picks.

    python bench/sensitivity_proxy.py [--model demo] [--tokens 1024] [--eval-tokens 0] [--json]

Prints, on the same tokens:
- the measured sweep (every layer x each swept precision, one evaluation each) and the proxy (one forward and
  one backward pass): wall time of each;
- Spearman rank correlation between measured and estimated KL, per precision and pooled over all of them, and the
  ratio of their sums (the proxy estimates KL in the same unit, nats/token);
- the automatic plan at the size of uniform INT4 + 10%, chosen from each score, measured on the
  held-out text (``--eval-tokens 0`` = all of it): what picking by the proxy costs in KL.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from workbench.precision.autoplan import compare_points, measure_plan, plan_footprint, plan_for_budget
from workbench.model.load import load_model
from workbench.quantize.plan import QuantPlan
from workbench.precision.proxy import spearman
from workbench.precision.sensitivity import DEFAULT_SWEEP_TOKENS, PlanEvaluator, evaluation_tokens, run_sensitivity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=DEFAULT_SWEEP_TOKENS, help="sweep tokens (both scores)")
    ap.add_argument("--eval-tokens", type=int, default=0, help="tokens to measure the plans on (0 = the whole text)")
    ap.add_argument("--precisions", default="int8,int4", help="integer precisions swept (default int8,int4, as the "
                    "README's figures; 'all' for every registered one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    precisions = None if args.precisions == "all" else tuple(args.precisions.split(","))

    lm = load_model(args.model)
    ids = evaluation_tokens(lm, tokens=args.tokens)
    runs = {}
    for score in ("kl", "proxy"):
        t0 = time.perf_counter()
        runs[score] = run_sensitivity(lm, ids=ids, score=score, precisions=precisions, progress=False)
        runs[score].seconds = time.perf_counter() - t0
    kl, px = runs["kl"], runs["proxy"]
    out: dict = {"model": str(lm.path), "parameters": lm.parameters, "threads": torch.get_num_threads(),
                 "tokens": kl.tokens, "measured_seconds": kl.seconds, "proxy_seconds": px.seconds,
                 "trials": len(kl.layers) * len(kl.precisions), "spearman": {}, "sum_ratio": {}}
    pooled_m, pooled_e = [], []
    for p in kl.precisions:
        m = [kl.damage(layer.name, p) for layer in kl.layers]
        e = [px.damage(layer.name, p) for layer in kl.layers]
        pooled_m += m
        pooled_e += e
        out["spearman"][p] = spearman(m, e)
        out["sum_ratio"][p] = sum(e) / sum(m)
    out["spearman"]["pooled"] = spearman(pooled_m, pooled_e)
    out["top5_int4"] = {"measured": kl.ranking("int4")[:5], "proxy": px.ranking("int4")[:5]}

    evaluator = PlanEvaluator(lm, evaluation_tokens(lm, tokens=args.eval_tokens or None))
    size = int(1.1 * plan_footprint(lm, QuantPlan.uniform("int4", group_size=kl.group_size,
                                                          symmetric=kl.symmetric))["size_bytes"])
    points = {}
    for score, sens in runs.items():
        auto = plan_for_budget(lm, sens, size_bytes=size)
        points[score] = measure_plan(lm, auto.plan, evaluator, label=f"auto by {score}", prediction=auto)
    diff = compare_points(points["proxy"], points["kl"])
    out["plans_at_int4_plus_10"] = {s: {k: v for k, v in p.to_dict().items() if k != "plan"} for s, p in points.items()}
    out["proxy_minus_measured_plan_kl"] = diff

    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return
    print(f"model {out['model']}: {lm.parameters:,} parameters, {out['trials']} layer x precision trials on "
          f"{out['tokens']:,} tokens, {out['threads']} threads")
    print(f"measured KL sweep {kl.seconds:.1f} s; proxy {px.seconds:.1f} s ({kl.seconds / px.seconds:.1f}x faster)")
    print("Spearman rank correlation, proxy vs measured KL: " +
          ", ".join(f"{p} {v:.3f}" for p, v in out["spearman"].items()))
    print("sum of estimated / sum of measured KL: " + ", ".join(f"{p} {v:.2f}" for p, v in out["sum_ratio"].items()))
    for score in ("measured", "proxy"):
        print(f"  most sensitive at int4 ({score}): " +
              ", ".join(f"{n} {v:.2e}" for n, v in out["top5_int4"][score]))
    print(f"\nautomatic plan at uniform INT4 size + 10% ({size:,} bytes), measured on {points['kl'].tokens:,} tokens:")
    print(f"{'chosen from':<14}{'bits/w':>8}{'KL':>11}{'predicted':>11}{'ppl':>9}{'top-1':>8}")
    for score, p in points.items():
        print(f"{score:<14}{p.bits_per_weight:>8.2f}{p.kl_divergence:>11.3e}{p.predicted_kl:>11.3e}"
              f"{p.perplexity:>9.3f}{p.top1_agreement:>8.4f}")
    print(f"KL of the proxy's plan - the measured sweep's plan: {diff['mean']:+.2e} +- {diff['stderr']:.1e}")


if __name__ == "__main__":
    main()
