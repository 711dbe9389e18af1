"""Quantize a model by a plan (RTN or AWQ), save it, and measure what it cost on held-out text.

    workbench quantize demo --out out/demo-int4 --bits 4
    workbench quantize demo --out out/demo-awq --bits 4 --method awq --json
    workbench quantize demo --out out/mixed --plan plan.json --strict
    workbench quantize demo --out out/demo-lpbq --bits 4 --two-level --group-size 32   # int4-lpbq
    workbench quantize demo --out out/demo-qnn --bits 4 --target qnn   # the grid qnn holds (15 levels)

The output names the conversion targets the written model reaches. ``--target`` (or a plan's own ``"targets"`` in its
``meta``) picks the grid they hold: the 16-level grid (llama.cpp's Q4_0, the default) signs its group scales, which
only llama.cpp, ort-int4 and ort-genai hold; a device target (qnn, mnn, rknn, ort-qdq, ...) gets the 15-level grid.

Perplexity, KL divergence and top-1 agreement are measured against the unquantized model on the
held-out text (default: the bundled one), with standard errors of the per-window differences.

A vision-language model is scored on pictures instead (``--images``, default the bundled demo-vl held-out set):
the answer tokens' KL and top-1 given the image, and image-text matching accuracy of the float and the quantized
model; on text too when ``--text`` is given. ``--bits`` sets the language model; the vision encoder and the
projector keep ``--vision-bits`` / ``--projector-bits`` (default 8: Qualcomm's w8a16 encoder, llama.cpp's q8_0
mmproj, ExecuTorch's 8-bit weights; docs/quantize.md, 'Vision-language models').

    workbench quantize demo-vl --bits 4 --out out/demo-vl-int4 --json
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from ..evaluation.evaluate import DEFAULT_CTX
from ..numerics.memory import release_freed_memory
from ..model.load import load_model
from ..model.vision_quality import measure_vision_quality, part_plan, recipe_part_plan, vision_eval_set
from ..errors import PlanError
from ..quantize.plan import QuantPlan, vision_recipe_for
from ..quantize.cost import DEFAULT_PPL_THRESHOLD, check_ctx
from ..quantize.model import CALIBRATED_METHODS, METHODS
from ..units import format_bytes
from ..files.workspace import check_output_dir, staged_output, Workspace
from .common import (count, thread_count, plus_minus, add_device_argument, add_budget_argument, add_json_flag, number,
                     add_model_argument, add_scale_search_argument, print_json)
from ..quantize.storage import FORMAT, weight_file_bytes

FULL_STATS_MAX_PARAMETERS = 100_000_000  # above this the statistics pass costs minutes: opt in, or calibrate first
HELP = "quantize by plan (RTN / AWQ / GPTQ, INT2..INT8, two-level scales), save, and measure the cost"
BITS = (2, 3, 4, 5, 6, 8)
PART_BITS = ("4", "8", "16")
DEFAULT_VISION_BITS = "8"


def part_precision(bits: str | None, fallback: str) -> str | None:
    """``--vision-bits`` / ``--projector-bits`` as a precision name: 16 leaves the part unquantized (None)."""
    bits = bits or fallback
    return None if bits == "16" else f"int{bits}"


def add_arguments(p):
    add_model_argument(p)
    p.add_argument("--out", required=True, help="directory to write the quantized model to: new, empty, or an "
                   "earlier `workbench quantize` output (replaced once the new one is saved and measured)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--plan", help="a plan JSON file (per-layer precisions)")
    src.add_argument("--bits", type=int, choices=BITS, help="quantize every linear layer to this many bits "
                     "(embeddings and lm_head stay fp16); default 4 when no --plan")
    p.add_argument("--two-level", action="store_true", help="with --bits 4 or 8: two-level scales (int4-lpbq / "
                   "int8-lpbq: 4-bit integer group scales under a float16 scale per output channel, Qualcomm's LPBQ)")
    p.add_argument("--group-size", type=count(0), help="columns per scale (default: the plan's, 128); 0 = per-channel")
    p.add_argument("--asymmetric", action="store_true", help="unsigned codes with zero points")
    p.add_argument("--target", action="append", default=[], metavar="NAME",
                   help="a conversion target the model is for (repeatable): the plan is rounded on the grid every one "
                        "of them holds (the 15-level grid for device targets such as qnn, mnn, rknn, ort-qdq) and its "
                        "precisions are checked against them before quantizing (default: the plan's meta \"targets\")")
    p.add_argument("--full-range", action=argparse.BooleanOptionalAction, default=None,
                   help="symmetric codes over all 2^b levels with stretched ranges searched (llama.cpp's Q4_0 / Q5_0 "
                        "grid): lowest KL at every width on trained models, about 4.6x the search time of the 15-level "
                        "grid (default: the plan's; on for --bits; docs/quantize.md, 'The default rounding')")
    add_scale_search_argument(p, default=None, says="the plan's; on for --bits")
    p.add_argument("--method", choices=METHODS, help="round-to-nearest, AWQ, GPTQ, or AWQ's scales then GPTQ "
                   "(default: the plan's, rtn)")
    p.add_argument("--act-order", action="store_true", help="GPTQ: visit columns by decreasing input energy "
                   "(group scales then fixed from the original weights)")
    p.add_argument("--importance", action=argparse.BooleanOptionalAction, default=True,
                   help="RTN's scale search weighs each weight's error by its input column's mean squared activation "
                        "(llama.cpp's importance matrix): the workspace's `workbench calibrate` statistics, else a "
                        "short pass over --data, cached (default: on; docs/quantize.md, 'The default rounding')")
    p.add_argument("--data", help="calibration text for AWQ, GPTQ and RTN's importance (default: the bundled "
                                  "calibration text)")
    p.add_argument("--samples", type=count(1), default=128, help="calibration samples (AWQ, GPTQ)")
    p.add_argument("--seq-len", type=count(2), default=512, help="calibration sample length in tokens (AWQ, GPTQ)")
    p.add_argument("--full-stats", action="store_true", help="AWQ: run the calibration statistics pass over every "
                   "sample even on models over 100 M parameters (by default those use statistics already in the "
                   "workspace from `workbench calibrate`, else mean |x| over the search's own tokens, as AutoAWQ does)")
    p.add_argument("--awq-tokens", type=count(1), help="AWQ: calibration tokens the search runs on (default: 8,192, "
                   "fewer on big models: 2,048 at 0.5 B parameters)")
    p.add_argument("--text", help="held-out text to measure on (default: the bundled held-out text; a vision-language "
                                  "model is measured on text only when this is given)")
    p.add_argument("--images", help="a vision-language model: the image set it is scored on (a folder with "
                                    "captions.jsonl, or a records file; default: the bundled demo-vl held-out set)")
    p.add_argument("--vision-bits", choices=PART_BITS, default=None, help="a vision-language model: the vision "
                   "encoder's precision (default 8; 16 leaves it unquantized)")
    p.add_argument("--projector-bits", choices=PART_BITS, default=None, help="a vision-language model: the "
                   "projector's / merger's precision (default: --vision-bits)")
    p.add_argument("--ctx", type=count(2), help=f"evaluation window (default {DEFAULT_CTX}, or the model's maximum when "
                   "that is shorter)")
    add_budget_argument(p)
    p.add_argument("--threshold", type=number(0), default=DEFAULT_PPL_THRESHOLD,
                   help="warn, naming likely causes, when perplexity rises by more than this fraction of the float "
                        "model's (default 0.05: 5%%, the usual 0.5 at perplexity 10)")
    p.add_argument("--strict", action="store_true", help="fail instead of falling back when the group size "
                   "does not divide a layer")
    p.add_argument("--threads", type=thread_count(), help="torch CPU threads, at most the CPU cores (default: torch's; "
                   "on a busy shared CPU, 1 is often several times faster for the AWQ search)")
    add_device_argument(p)
    add_json_flag(p)


def _precision_from_args(args) -> str:
    """The precision ``--bits`` (and ``--two-level``) name."""
    from ..quantize.plan import PRECISIONS
    name = f"int{args.bits or 4}"
    if not getattr(args, "two_level", False):
        return name
    if args.plan:
        raise PlanError("--two-level goes with --bits; a plan names its two-level precisions (int4-lpbq) itself")
    lpbq = [p for p in PRECISIONS.values() if p.two_level and not p.super_block]  # per-channel (int3-k: by name)
    two = [p.name for p in lpbq if p.bits == (args.bits or 4)]
    if not two:
        have = ", ".join(p.name for p in lpbq)
        raise PlanError(f"no two-level precision with {args.bits}-bit codes is registered ({have}); use --bits 4 or 8")
    return two[0]


def _plan_from_args(args) -> QuantPlan:
    plan = QuantPlan.load(args.plan) if args.plan else QuantPlan.default_for(_precision_from_args(args),
                                                                              symmetric=not args.asymmetric)
    changes = {}
    if args.group_size is not None:
        if args.group_size < 0:
            raise PlanError(f"--group-size must be positive, or 0 for per-channel; got {args.group_size}")
        changes["group_size"] = args.group_size or None
    if args.asymmetric:
        changes["symmetric"] = False
    if args.scale_search is not None:
        changes["scale_search"] = args.scale_search
    if args.full_range is not None:
        changes["full_range"] = args.full_range
    if args.method:
        changes["method"] = args.method
    plan = replace(plan, **changes) if changes else plan
    return _plan_for_targets(plan, args)


def _plan_for_targets(plan: QuantPlan, args) -> QuantPlan:
    """The plan rounded on the grid its targets hold (``--target``, else the plan's meta "targets"), which it records."""
    from ..targets import get_target, grid_reach
    targets = list(dict.fromkeys(args.target)) or plan.meta.get("targets") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise PlanError(f"the plan's meta \"targets\" must be a list of target names, got {targets!r}")
    for name in targets:
        if get_target(name).convert is None:
            raise PlanError(f"'{name}' is not a conversion target; choose from: {', '.join(_convert_targets())}")
    narrow = grid_reach(targets)
    if narrow and plan.full_range:
        if args.full_range:
            raise PlanError(f"--full-range rounds on the 16-level grid, which {' / '.join(narrow)} cannot hold: drop "
                            "--full-range (--target picks the grid every target holds)")
        plan = replace(plan, full_range=False)
    return replace(plan, meta={**plan.meta, "targets": targets}) if targets else plan


def _convert_targets() -> list[str]:
    from ..targets import target_names
    return list(target_names("convert"))


def reach_text(reaches: list[str], unreachable: dict[str, str], plan: QuantPlan) -> str:
    """Where the written model can go (`workbench convert --target`), and what makes the rest reachable."""
    text = f"reaches: {', '.join(reaches) or 'no conversion target'}"
    if not unreachable:
        return text
    grid = [n for n, why in unreachable.items() if "16-level grid" in why]
    other = [n for n in unreachable if n not in grid]
    if grid:
        example = "qnn" if "qnn" in grid else grid[0]
        text += (f"; not {', '.join(grid)} (the 16-level grid signs its group scales, which they cannot hold: "
                 f"quantize with --target T, e.g. --target {example}, for a model T holds)")
    if other:
        text += f"; not {', '.join(other)} ({unreachable[other[0]]})"
    return text


def run(args) -> int:
    from ..quantize import heldout_ids, measure_cost, measure_reference, quantize_model, write_report
    plan = _plan_from_args(args)
    check_output_dir(args.out, FORMAT)  # refuse before any heavy work; checked again when swapped in
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device)
    vision = getattr(lm, "is_vision", False)
    images = None
    # a VLM for deployment targets (--target, or the plan's) without --vision-bits / --projector-bits: its runtime's recipe
    recipe = vision_recipe_for(plan.meta.get("targets"), lm.config.model_type) if vision and \
        args.vision_bits is None and args.projector_bits is None else None
    if recipe is not None:
        plan = recipe_part_plan(lm, plan, recipe)
        images = vision_eval_set(args.images)
    elif vision:
        vision_bits = args.vision_bits or DEFAULT_VISION_BITS
        plan = part_plan(lm, plan, vision=part_precision(vision_bits, DEFAULT_VISION_BITS),
                         projector=part_precision(args.projector_bits, vision_bits))
        images = vision_eval_set(args.images)  # a bad image set fails here, not after quantizing
    elif args.images or args.vision_bits or args.projector_bits:
        raise PlanError(f"'{args.model}' is a text model (no vision encoder): drop --images / --vision-bits / "
                        "--projector-bits, or pass a vision-language model such as demo-vl")
    targets = list(plan.meta.get("targets") or [])
    if targets:  # a precision a target cannot carry is refused before quantizing, naming the layers
        from ..targets import check_precisions, get_target
        precisions = plan.resolve(info.name for info in lm.layers)
        for name in targets:
            check_precisions(get_target(name), precisions)
    ctx = check_ctx(lm, args.ctx)  # a bad --ctx or --text fails here, not after quantizing
    ids = heldout_ids(lm, args.text, args.max_tokens, ctx) if not vision or args.text else None
    progress = not args.json
    calibration = workspace = None
    if plan.method in CALIBRATED_METHODS:
        from ..model.calibrate import calibrate
        workspace = Workspace()  # calibration statistics and the AWQ search are cached there
        full = args.full_stats or lm.parameters <= FULL_STATS_MAX_PARAMETERS
        calibration = calibrate(lm, data=args.data, samples=args.samples, seq_len=args.seq_len, workspace=workspace,
                                progress=progress, compute=full)
        if calibration[1] is None and progress:
            print("AWQ: mean |x| from the search's own calibration tokens (no stored statistics for this model and "
                  "set; `workbench calibrate` first, or --full-stats, to use every sample)")
    from ..model.calibrate import importance_statistics, reads_importance
    importance = None
    if args.importance and reads_importance(plan):
        calibration, importance = importance_statistics(lm, data=args.data, workspace=Workspace(), progress=progress)
        if progress:
            print(importance)
    # the float model's outputs are captured first (final hidden states: megabytes), so quantizing can let each
    # integer layer's float weight go as its codes are made: one float copy at most, never float weights + codes
    baseline = None
    t1 = time.perf_counter()
    if ids is not None:
        baseline = measure_reference(lm.model, ids, ctx=min(ctx, len(ids)), progress=progress)
    reference_seconds = time.perf_counter() - t1
    t0 = time.perf_counter()
    qm = quantize_model(lm, plan, calibration=calibration, strict=args.strict, progress=progress,
                        workspace=workspace, awq_tokens=args.awq_tokens, act_order=args.act_order,
                        release_float=not vision)  # a VLM's picture scoring runs the float model afterwards
    quantize_seconds = time.perf_counter() - t0
    out = Path(args.out)
    # the saved model, its evaluation and report.json are staged beside --out and swapped in together
    with staged_output(out, FORMAT) as staged:
        qm.save(staged)
        release_freed_memory()  # the per-layer float32 temporaries of quantizing and saving
        t1 = time.perf_counter() - reference_seconds
        cost = quality = None
        if baseline is not None:
            cost = measure_cost(qm, baseline, saved_dir=staged, threshold=args.threshold, progress=progress)
        if vision:
            quality = measure_vision_quality(lm, qm.build_model(), images, progress=progress)
        measured = cost.to_dict() if cost else {"size_bytes": weight_file_bytes(staged),
                                                "bits_per_weight": qm.bits_per_weight, "weight_bytes": qm.storage_bytes()}
        from ..targets import quantized_reach
        reach = quantized_reach(qm)
        result = {"model": str(lm.path), "out": str(out), "method": qm.method, "plan": plan.to_dict(), "importance": importance,
                  "reaches": [n for n, why in reach.items() if why is None],
                  "unreachable": {n: why for n, why in reach.items() if why is not None},
                  **measured, **({"vision": quality.to_dict()} if quality else {}),
                  "parts": [p.to_dict() for p in lm.parts()] if vision else None,
                  "reference_size_bytes": weight_file_bytes(lm.path),
                  "quantize_seconds": quantize_seconds, "evaluate_seconds": time.perf_counter() - t1,
                  "layers": [{"name": r.name, "precision": r.precision,
                              "group_size": r.group_size if r.name in qm.weights else None,
                              "fallback": r.fallback, "weight_error": r.weight_error} for r in qm.layers]}
        write_report(staged, result)
    if args.json:
        print_json(result)
        return 0
    print(qm.table())
    print()
    print(f"saved {out}: {format_bytes(result['size_bytes'])} of weight files "
          f"(source {format_bytes(result['reference_size_bytes'])}), {result['bits_per_weight']:.2f} bits per weight; "
          f"{qm.method} took {quantize_seconds:.1f} s")
    print(reach_text(result["reaches"], result["unreachable"], plan))
    if quality:
        print(quality.summary())
    if cost is None:
        return 0
    print(f"perplexity {cost.perplexity:.3f} vs {cost.reference_perplexity:.3f} "
          f"({plus_minus(cost.perplexity_change, cost.perplexity_change_stderr, '+.3f')}, "
          f"{cost.perplexity_change_relative:+.2%}); "
          f"KL {plus_minus(cost.kl_divergence, cost.kl_divergence_stderr, '.5f')}; top-1 agreement {cost.top1_agreement:.2%} "
          f"({cost.tokens:,} tokens, {cost.windows} windows)")
    for w in cost.warnings:
        print(f"warning: {w}")
    return 0
