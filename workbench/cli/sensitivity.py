"""Per-layer sensitivity: each quantizable layer alone at int8 and int4, KL divergence and perplexity change.

    workbench sensitivity demo
    workbench sensitivity demo --data heldout.txt --tokens 4096 --json
    workbench sensitivity ./qwen2.5-0.5b --score proxy

``--score kl`` measures every trial, ``--score proxy`` estimates them all in one forward and
backward pass (Fisher-weighted weight error), ``auto`` (default) measures small models and
estimates large ones; the output says which was used. ``--workers N`` runs the measured trials on N
processes of this machine (forked: the model is not copied), ``--ray auto`` runs the measured trials on a
Ray started on 127.0.0.1 for the run, ``--ray ADDRESS`` on a running cluster (docs/sweeps.md); the
results are the same as without it. Results are cached in the workspace
(``--workspace``, default ./workspace) and a measured sweep resumes where it stopped when interrupted.
"""
from __future__ import annotations

from ..model.load import load_model
from ..precision.sensitivity import DEFAULT_SWEEP_TOKENS, METRICS, run_sensitivity
from ..model.sweep_backends import default_workers
from ..files.workspace import Workspace
from .common import (add_backend_arguments, add_device_argument, add_json_flag, add_model_argument,
                     add_scale_search_argument, backend_from_args, count, print_json)

HELP = "per-layer sensitivity sweep (KL and perplexity change of each layer quantized alone)"


def add_sweep_arguments(p) -> None:
    """Arguments shared with `workbench plan`, which runs (or finds) the same sweep."""
    p.add_argument("--data", help="UTF-8 text to measure on (default: the bundled held-out text)")
    p.add_argument("--tokens", type=count(2), default=DEFAULT_SWEEP_TOKENS,
                   help=f"evaluation budget in tokens per trial (default {DEFAULT_SWEEP_TOKENS})")
    p.add_argument("--group-size", type=count(0), default=128, help="quantization group size (0 = per-channel)")
    p.add_argument("--asymmetric", action="store_true", help="asymmetric quantization (zero points)")
    add_scale_search_argument(p)
    p.add_argument("--score", choices=("auto", "kl", "proxy"), default="auto",
                   help="kl: measure each layer x precision; proxy: estimate all in one pass (Fisher-weighted "
                        "weight error); auto (default): kl for small models, proxy for large ones")
    p.add_argument("--workspace", help="workspace directory for the cached sweep (default ./workspace)")
    p.add_argument("--force", action="store_true", help="recompute the sweep even when it is cached")
    add_backend_arguments(p, "the measured trials", "one per CPU")
    add_device_argument(p)


def add_arguments(p):
    add_model_argument(p)
    add_sweep_arguments(p)
    p.add_argument("--precisions", help="comma-separated integer precisions (default: every registered one: int8, "
                   "int6, int5, int4, int3, int2, int8-lpbq, int4-lpbq)")
    add_json_flag(p)


def sweep(lm, args, progress: bool, backend=None):
    backend = backend or backend_from_args(args, default_workers())
    chosen = getattr(args, "precisions", None)
    precisions = tuple(chosen.split(",")) if chosen else None
    return run_sensitivity(lm, text_path=args.data, tokens=args.tokens, precisions=precisions,
                           group_size=args.group_size or None, symmetric=not args.asymmetric,
                           scale_search=args.scale_search, score=args.score,
                           workspace=Workspace(args.workspace) if args.workspace else Workspace(),
                           force=args.force, progress=progress, backend=backend)


def run(args) -> int:
    lm = load_model(args.model, device=args.device)
    report = sweep(lm, args, progress=not args.json)
    layers = [{"name": layer.name, "block": layer.block, "role": layer.role, "shape": list(layer.shape),
               "parameters": layer.parameters, "tied_to": layer.tied_to, **layer.damage} for layer in report.layers]
    out = {"model": str(lm.path), "precisions": list(report.precisions), "tokens": report.tokens, "ctx": report.ctx,
           "group_size": report.group_size, "symmetric": report.symmetric, "scale_search": report.scale_search,
           "reference_perplexity": report.reference_perplexity, "sweep_seconds": report.seconds,
           "trials_run": report.trials_run, "score": report.score, "score_reason": report.score_reason,
           "metric": METRICS[report.score] + "; ppl_delta: perplexity change", "layers": layers}
    if args.json:
        print_json(out)
        return 0
    cached = " (from the workspace)" if report.trials_run == 0 else ""
    print(f"sensitivity of {len(layers)} layers on {report.tokens:,} tokens, float perplexity "
          f"{report.reference_perplexity:.3f}; sweep {report.seconds:.1f} s{cached}")
    print(f"score: {report.score_label} ({report.score_reason})")
    heads = "".join(f"  {p + ' KL':>11}  {p + ' dppl':>10}" for p in report.precisions)
    width = max(len(layer.name) for layer in report.layers)
    print(f"{'layer':<{width}}  {'params':>9}{heads}")
    for layer in report.layers:
        cells = "".join(f"  {layer.damage[p]['kl']:>11.3e}  {layer.damage[p]['ppl_delta']:>+10.4f}"
                        if p in layer.damage else f"  {'-':>11}  {'-':>10}" for p in report.precisions)  # -: misfit
        print(f"{layer.name:<{width}}  {layer.parameters:>9,}{cells}")
    at = "int4" if "int4" in report.precisions else report.precisions[-1]  # the width most plans start from
    worst = report.ranking(at)[:3]
    print(f"most sensitive at {at}: " + ", ".join(n for n, _ in worst))
    return 0
