"""Per-layer sensitivity: each quantizable layer alone at int8 and int4, KL divergence and perplexity change.

    workbench sensitivity demo
    workbench sensitivity demo --data heldout.txt --tokens 4096 --json
    workbench sensitivity ./qwen2.5-0.5b --score proxy
    workbench sensitivity demo-vl --precisions int8,int4            # a VLM: on pictures, every part's layers
    workbench sensitivity ./my-vlm --images ./pictures --questions 64

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
from ..precision.sensitivity import DEFAULT_SWEEP_QUESTIONS, DEFAULT_SWEEP_TOKENS, METRICS, run_sensitivity
from ..model.vision_quality import layer_parts
from ..errors import PlanError
from ..model.sweep_backends import default_workers
from ..files.workspace import Workspace
from .common import (add_backend_arguments, add_device_argument, add_json_flag, add_model_argument,
                     add_scale_search_argument, backend_from_args, count, print_json)

HELP = "per-layer sensitivity sweep (KL and perplexity change of each layer quantized alone)"


def add_sweep_arguments(p) -> None:
    """Arguments shared with `workbench plan`, which runs (or finds) the same sweep."""
    p.add_argument("--data", help="UTF-8 text to measure on (default: the bundled held-out text; a vision-language "
                                  "model is measured on text only when this is given)")
    p.add_argument("--images", help="a vision-language model: the image set each trial answers questions about (a "
                                    "folder with captions.jsonl, or a records file; default: the bundled demo-vl "
                                    "held-out set); the answer tokens' KL given the image is the damage")
    p.add_argument("--questions", type=count(1), default=DEFAULT_SWEEP_QUESTIONS,
                   help=f"a vision-language model: questions per trial (default {DEFAULT_SWEEP_QUESTIONS})")
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
    pictures = getattr(lm, "is_vision", False) and not args.data
    if pictures and (getattr(args, "workers", None) or getattr(args, "ray", None)):
        raise PlanError("a sweep on pictures runs in this process: drop --workers / --ray (or sweep on text with "
                        "--data)")
    backend = None if pictures else backend or backend_from_args(args, default_workers())
    chosen = getattr(args, "precisions", None)
    precisions = tuple(chosen.split(",")) if chosen else None
    return run_sensitivity(lm, text_path=args.data, tokens=args.tokens, precisions=precisions,
                           group_size=args.group_size or None, symmetric=not args.asymmetric,
                           scale_search=args.scale_search, score=args.score,
                           workspace=Workspace(args.workspace) if args.workspace else Workspace(),
                           force=args.force, progress=progress, backend=backend,
                           images=args.images, questions=args.questions)


def run(args) -> int:
    lm = load_model(args.model, device=args.device)
    report = sweep(lm, args, progress=not args.json)
    parts = layer_parts(lm)
    layers = [{"name": layer.name, "part": parts.get(layer.name), "block": layer.block, "role": layer.role,
               "shape": list(layer.shape), "parameters": layer.parameters, "tied_to": layer.tied_to, **layer.damage}
              for layer in report.layers]
    out = {"model": str(lm.path), "precisions": list(report.precisions), "tokens": report.tokens, "ctx": report.ctx,
           "group_size": report.group_size, "symmetric": report.symmetric, "scale_search": report.scale_search,
           "reference_perplexity": report.reference_perplexity, "sweep_seconds": report.seconds,
           "trials_run": report.trials_run, "score": report.score, "score_reason": report.score_reason,
           "metric": METRICS[report.score] + "; ppl_delta: perplexity change", "layers": layers,
           "measured_on": report.measured_on or "text"}
    if args.json:
        print_json(out)
        return 0
    cached = " (from the workspace)" if report.trials_run == 0 else ""
    if report.measured_on:
        print(f"sensitivity of {len(layers)} layers on {report.tokens:,} answer tokens of {report.measured_on} (KL "
              f"given the image), float answer perplexity {report.reference_perplexity:.3f}; sweep "
              f"{report.seconds:.1f} s{cached}")
    else:
        print(f"sensitivity of {len(layers)} layers on {report.tokens:,} tokens, float perplexity "
              f"{report.reference_perplexity:.3f}; sweep {report.seconds:.1f} s{cached}")
    print(f"score: {report.score_label} ({report.score_reason})")
    heads = "".join(f"  {p + ' KL':>11}  {p + ' dppl':>10}" for p in report.precisions)
    width = max(len(layer.name) for layer in report.layers)
    vision = getattr(lm, "is_vision", False)
    part_head = f"  {'part':<14}" if vision else ""
    print(f"{'layer':<{width}}{part_head}  {'params':>9}{heads}")
    for layer in report.layers:
        cells = "".join(f"  {layer.damage[p]['kl']:>11.3e}  {layer.damage[p]['ppl_delta']:>+10.4f}"
                        if p in layer.damage else f"  {'-':>11}  {'-':>10}" for p in report.precisions)  # -: misfit
        part = f"  {parts.get(layer.name, ''):<14}" if vision else ""
        print(f"{layer.name:<{width}}{part}  {layer.parameters:>9,}{cells}")
    at = "int4" if "int4" in report.precisions else report.precisions[-1]  # the width most plans start from
    worst = report.ranking(at)[:3]
    print(f"most sensitive at {at}: " + ", ".join(n for n, _ in worst))
    if vision:
        ranked = report.ranking(at)
        for part in dict.fromkeys(parts.values()):
            top = next((n for n, _ in ranked if parts.get(n) == part), None)
            if top is not None:
                print(f"  {part}: {top} ({report.damage(top, at):.3e})")
    return 0
