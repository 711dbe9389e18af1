"""Structured pruning: remove attention heads and MLP channels by importance; write a smaller model directory.

    workbench prune demo --heads 0.25 --mlp 0.2 --out out/pruned        # middle layers only, by importance
    workbench prune demo --plan prune.json --out out/pruned --json

The output is a Hugging Face directory (fewer heads, a narrower MLP) that eval, quantize, export
and distill take; when its layers keep different counts, config.json lists them per layer
(``layer_shapes``), which the workbench's loader reads and plain transformers does not. prune.json
beside it says what each layer kept and what the pruning cost on held-out text.
"""
from __future__ import annotations

from ..errors import PlanError
from ..compress.prune import DEFAULT_IMPORTANCE_TOKENS, HEAD_UNITS, SCORES, SPREADS, PrunePlan, prune
from ..files.workspace import Workspace
from .common import count, number, plus_minus, add_json_flag, add_model_argument, print_json

HELP = "prune attention heads and MLP channels by importance; writes a smaller model directory"


def add_arguments(p):
    add_model_argument(p)
    p.add_argument("--plan", help="pruning plan JSON (fractions removed, per-layer ratios or kept lists)")
    p.add_argument("--heads", type=number(0, 1, high_open=True), help="fraction of the model's heads removed (without --plan)")
    p.add_argument("--mlp", type=number(0, 1, high_open=True), help="fraction of the model's MLP channels removed (without --plan)")
    p.add_argument("--spread", choices=SPREADS, default="global",
                   help="global: the least important units of the prunable layers, wherever they are, so layers "
                        "keep different counts (default); layer: every prunable layer loses the same fraction")
    p.add_argument("--prune-first-last", action="store_true",
                   help="prune the first and last layers too (by default they stay whole)")
    p.add_argument("--head-unit", choices=HEAD_UNITS, default="group",
                   help="group: a KV head with its query heads (default); query: query heads, the same number from "
                        "every KV group")
    p.add_argument("--score", choices=SCORES, default="taylor",
                   help="rank units by first-order Taylor (default), activation norm, or measured KL (heads)")
    p.add_argument("--mlp-multiple", type=count(1), default=32,
                   help="keep every layer's MLP width a multiple of this (default 32: group-32 quantization divides)")
    p.add_argument("--out", required=True, help="output model directory (written beside it, then swapped in)")
    p.add_argument("--importance-tokens", type=count(1), default=DEFAULT_IMPORTANCE_TOKENS,
                   help="calibration tokens the importance scores are computed on (default %(default)s)")
    p.add_argument("--eval-tokens", type=count(2, zero="no evaluation"), default=4096,
                   help="held-out tokens for perplexity and KL before/after (0 skips the measurement)")
    add_json_flag(p)


def run(args) -> int:
    if args.plan:
        if args.heads is not None or args.mlp is not None:
            raise PlanError("give --plan or --heads/--mlp, not both")
        plan = PrunePlan.load(args.plan)
    else:
        if args.heads is None and args.mlp is None:
            raise PlanError("say what to prune: --plan PRUNE.json, or --heads R and/or --mlp R (fractions removed)")
        plan = PrunePlan(heads=args.heads or 0.0, mlp=args.mlp or 0.0, head_unit=args.head_unit, score=args.score,
                         mlp_multiple=args.mlp_multiple, spread=args.spread,
                         keep_first_last=not args.prune_first_last)
    report = prune(args.model, plan, args.out, workspace=Workspace(), evaluate_tokens=args.eval_tokens or None,
                   progress=not args.json, importance_tokens=args.importance_tokens)
    if args.json:
        print_json(report)
        return 0
    print(report["summary"])
    ev = report.get("evaluation")
    if ev:
        err = ev["perplexity_after_stderr"]
        spread = f" (± {err:.2f})" if err is not None and err == err else ""  # none from a single window
        print(f"held-out perplexity {ev['perplexity_before']:.2f} -> {ev['perplexity_after']:.2f}{spread}, KL to the "
              f"original {plus_minus(ev['kl'], ev['kl_stderr'], '.4f')}, top-1 {ev['top1']:.3f} on {ev['tokens']:,} tokens")
    print(f"-> {report['out_dir']}")
    return 0
