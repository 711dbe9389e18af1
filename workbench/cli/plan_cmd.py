"""Choose per-layer precisions under a size budget from the sensitivity sweep, then measure the plan.

    workbench plan demo --bits-per-weight 8 --out plan.json
    workbench plan demo --size 4000000 --out plan.json --json
    workbench plan demo --bits-per-weight 8 --target qnn --soc 8gen1 --out plan.json   # what that HTP runs
    workbench plan demo --preset qualcomm-w4a16 --out plan.json                        # Qualcomm's LLM recipe
    workbench plan demo --preset qualcomm-w4a16 --htp-divergence out/qnn --out plan.json   # + departing layers int8

The sweep is read from (or written to) the workspace (``--score`` as for `workbench sensitivity`);
the plan is quantized with quantize_model and evaluated against the unquantized model, and the
predicted figures are shown beside the measured ones, with the score they were predicted from.
``--soc`` (a Snapdragon's device profile) keeps the plan to the weights that SoC's HTP generation runs
(``assets/targets/qnn.json`` ``htp_generations``: no 16-bit weights, so no float layers, before v73): the
adaptation ``convert --target qnn --soc`` and ``inspect --soc`` apply, made in the plan, naming each layer
it changes from the plan the budget would otherwise get. ``--preset qualcomm-w4a16`` writes Qualcomm's w4a16
LLM recipe (``targets.qnn.recipe_plan``) instead of a budget's plan, with no sweep; ``--htp-divergence`` holds at
int8 the layers a ``convert --target qnn --soc`` output found departing from the simulation on the HTP.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..precision.autoplan import budget_bytes, check_budget, measure_plan, plan_for_budget, refine_plan
from ..evaluation.evaluate import default_token_budget
from ..evaluation.vision import VisionKLReport
from ..model.load import load_model
from ..quantize.plan import QuantPlan, get_precision
from ..precision.sensitivity import LayerVariants, PlanEvaluator, VisionPlanEvaluator, evaluation_tokens
from ..model.vision_quality import layer_parts, recipe_part_plan, vision_eval_set
from ..quantize.plan import MMPROJ_TYPES, vision_recipe_for
from ..model.sweep_backends import default_workers
from ..units import format_bytes
from .common import backend_from_args, count, number, add_device_argument, add_json_flag, add_model_argument, print_json
from .sensitivity import add_sweep_arguments, sweep
from ..targets.qnn import RECIPE, recipe_plan
from ..errors import DataError, PlanError
from ..targets import get_target
from ..targets.htp import departing_layers, htp_soc, soc_plan_changes, soc_runs

PRESETS = {RECIPE: recipe_plan}
PRESET_TARGETS = {RECIPE: ("qnn",)}  # whose VLM recipe (quantize.plan.vision_recipe) a preset's vision parts follow

HELP = "automatic mixed-precision plan under a size or bits/weight budget, predicted and measured"


def add_arguments(p):
    add_model_argument(p)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--bits-per-weight", type=number(0, 32, low_open=True), help="average bits per weight (all parameters)")
    budget.add_argument("--size", type=count(1), help="total weight bytes")
    budget.add_argument("--preset", choices=PRESETS, help="a vendor's recipe instead of a budget: qualcomm-w4a16 (int4 "
                                                          "per-channel weights, int8 lm_head, 16-bit embedding and "
                                                          "activations, int8 KV cache)")
    p.add_argument("--out", required=True, help="where to write the plan JSON (a new file, or an earlier plan)")
    p.add_argument("--eval-tokens", type=count(2), default=None,
                   help="tokens to measure the chosen plan on (default: the whole text for small models, about a "
                        "minute of a 2-core CPU for large ones: 2,048 tokens at 0.5 B parameters)")
    p.add_argument("--refine", type=count(0), default=0, metavar="TRIALS",
                   help="then move layers between precisions by measured KL, at most TRIALS measurements (default 0: "
                        "the plan that is optimal by the sweep's prediction)")
    p.add_argument("--target", action="append", default=[], metavar="NAME",
                   help="keep the plan to precisions this target carries (repeatable: all of them), e.g. --target qnn "
                        "--target llama.cpp; default: every registered precision")
    p.add_argument("--soc", metavar="DEVICE", help="qnn: the Snapdragon the plan is for (8gen3, 8gen2, 8elite, 8gen1, "
                                                   "xelite): only weights its HTP generation runs (implies --target qnn)")
    p.add_argument("--htp-divergence", metavar="CONVERSION",
                   help="hold at int8 the layers this `workbench convert --target qnn --soc DEVICE` output (folder or "
                        "its conversion.json) found departing from the simulation on the HTP")
    p.add_argument("--mmproj", choices=MMPROJ_TYPES, default="f16",
                   help="a vision-language model for --target llama.cpp: the mmproj GGUF's type (default f16; q8_0 "
                        "holds the vision encoder and projector at int8)")
    add_sweep_arguments(p)
    add_json_flag(p)


def _vision_recipe(args, lm, targets):
    """A VLM's vision encoder and projector as the first of ``targets`` with a recipe ships them (None: chosen
    by the budget with the rest; a text model: None, and --mmproj other than f16 refused)."""
    if not getattr(lm, "is_vision", False):
        if args.mmproj != "f16":
            raise PlanError("--mmproj is the vision part of a vision-language model; this is a text model: drop it")
        return None
    return vision_recipe_for(targets, getattr(lm.config, "model_type", None), mmproj=args.mmproj)


def run(args) -> int:
    QuantPlan.check_output_file(args.out)  # before the sweep, not after it
    raised = []
    if args.htp_divergence:
        raised = departing_layers(args.htp_divergence)
    lm = load_model(args.model, device=args.device)
    lm.require_float("plan")  # a plan is made for the float model; a quantized one already has its plan
    if args.preset:
        return _run_preset(args, lm, raised)
    budget = budget_bytes(lm, size_bytes=args.size, bits_per_weight=args.bits_per_weight)
    with backend_from_args(args, default_workers()) as backend:  # one Ray (or none) for the sweep and the refinement's rounds
        return _run_budget(args, lm, budget, raised, backend)


def _evaluator(args, lm, variants):
    """What a plan is measured on: a VLM's held-out questions about pictures (all of --images' set, unless text is
    given with --data), else the held-out text cut to --eval-tokens."""
    if args.images and not getattr(lm, "is_vision", False):
        raise DataError(f"'{args.model}' is a text model (no vision encoder): drop --images")
    if getattr(lm, "is_vision", False) and not args.data:
        images = vision_eval_set(args.images)
        return VisionPlanEvaluator(lm, variants, images, questions=len(images.questions), progress=not args.json)
    ids = evaluation_tokens(lm, args.data)
    ids = ids[:args.eval_tokens or default_token_budget(lm.model, len(ids))]
    return PlanEvaluator(lm, ids, progress=not args.json, variants=variants)


def _run_budget(args, lm, budget: int, raised: list[str], backend) -> int:
    """The plan the sweep's damages choose within ``budget`` bytes, refined and measured."""
    targets = tuple(args.target)
    soc = None
    if args.soc:
        soc = htp_soc(args.soc)  # an unknown device, or one without an HTP, before the sweep
        targets = targets if "qnn" in targets else (*targets, "qnn")
    check_budget(lm, budget, group_size=args.group_size or None, symmetric=not args.asymmetric, targets=targets)
    recipe = _vision_recipe(args, lm, targets)
    # the vision encoder and projector as the target's runtime ships them; the budget chooses the rest
    fixed = {n: (recipe.vision if part == "vision encoder" else recipe.projector)
             for n, part in layer_parts(lm).items() if part != "language model"} if recipe else None
    sens = sweep(lm, args, progress=not args.json, backend=backend)
    choices, soc_info = None, None
    if soc is not None:
        carried = [c for c in ("fp16", *sens.precisions) if all(get_target(t).carries(get_precision(c)) for t in targets)]
        choices = [c for c in carried if soc_runs(c, soc)]  # what the targets carry and this HTP generation runs
        free = plan_for_budget(lm, sens, size_bytes=budget, targets=targets, fixed=fixed)
    auto = plan_for_budget(lm, sens, size_bytes=budget, targets=targets, choices=choices, fixed=fixed)
    if recipe is not None:
        auto = replace(auto, plan=replace(auto.plan, meta={**auto.plan.meta, "vision_recipe": recipe.to_dict()}))
    if soc is not None:
        left = [n for n, prec in auto.plan.resolve(i.name for i in lm.layers).items() if not soc_runs(prec, soc)]
        if left:  # layers the sweep did not measure stay float in a plan: the int8 convert --soc would write
            plan = auto.plan
            for name in left:
                plan = plan.with_override(name, "int8")
            auto = replace(auto, plan=plan, assignments={**auto.assignments, **{n: "int8" for n in left}})
        changed = soc_plan_changes(free.plan.resolve(i.name for i in lm.layers),
                                   auto.plan.resolve(i.name for i in lm.layers), soc)
        soc_info = {"device": soc.device, "label": soc.label, "arch": soc.arch, "choices": choices,
                    "changed": {n: {"from": a, "to": b} for n, (a, b) in changed.items()}}
    # refinement measures layers rounded as the sweep measured them (and as the plan will ship them)
    evaluator = _evaluator(args, lm, LayerVariants(lm, **sens.quantizer_settings))
    refinement = None
    if args.refine > 0:  # a VLM's plans are measured on pictures in this process
        refinement = refine_plan(lm, sens, auto, evaluator, trials=args.refine, progress=not args.json,
                                 targets=targets, choices=choices, fixed=fixed,
                                 backend=None if isinstance(evaluator, VisionPlanEvaluator) else backend)
        auto = refinement.prediction
    if raised:
        plan = auto.plan
        for name in raised:
            plan = plan.with_override(name, "int8")
        auto = replace(auto, plan=plan, assignments={**auto.assignments, **{n: "int8" for n in raised}})
    point = measure_plan(lm, auto.plan, evaluator, label="auto", prediction=auto, progress=not args.json)
    saved = auto.plan.save(Path(args.out))
    out = {"model": str(lm.path), "plan_path": str(saved), "budget_bytes": auto.budget_bytes,
           "bits_per_weight": point.bits_per_weight, "size_bytes": point.size_bytes,
           "kl_divergence": point.kl_divergence, "perplexity": point.perplexity,
           "top1_agreement": point.top1_agreement, "reference_perplexity": point.reference_perplexity,
           "predicted_kl_divergence": auto.predicted_kl, "predicted_perplexity": point.predicted_perplexity,
           "eval_tokens": point.tokens, "sweep_tokens": sens.tokens, "score": sens.score,
           "score_reason": sens.score_reason, "assignments": auto.assignments,
           "plan": auto.plan.to_dict(), "refinement": refinement.to_dict() if refinement else None,
           "soc": soc_info, "htp_int8_layers": raised, "measured_on": sens.measured_on or "text",
           "parts": _part_counts(lm, auto.assignments), "vision_recipe": recipe.to_dict() if recipe else None}
    if args.json:
        print_json(out)
        return 0
    counts: dict[str, int] = {}
    for prec in auto.assignments.values():
        counts[prec] = counts.get(prec, 0) + 1
    print(f"plan for {format_bytes(auto.budget_bytes)}: {format_bytes(point.size_bytes)}, "
          f"{point.bits_per_weight:.2f} bits/weight ({', '.join(f'{n} {p}' for p, n in sorted(counts.items()))})")
    print(f"predicted from the sweep's {sens.score_label} on {sens.tokens:,} tokens ({sens.score_reason})")
    print(f"{'':<14}{'predicted':>12}{'measured':>12}")
    print(f"{'KL':<14}{auto.predicted_kl:>12.3e}{point.kl_divergence:>12.3e}")
    what = "answer tokens" if sens.measured_on else "tokens"
    print(f"{'perplexity':<14}{point.predicted_perplexity:>12.3f}{point.perplexity:>12.3f}   "
          f"(float {point.reference_perplexity:.3f}, {point.tokens:,} {what})")
    if out["parts"] is not None:
        for part, by in out["parts"].items():
            print(f"  {part}: " + ", ".join(f"{n} {p}" for p, n in sorted(by.items())))
    if recipe is not None:
        print(f"vision encoder and projector held as {recipe.runtime} ships them: {recipe.source}")
    if refinement is not None:
        print(f"refined by measurement: {len(refinement.moves)} move(s) kept of {refinement.trials} measured; KL "
              f"{refinement.start_kl:.3e} (the predicted optimum) -> {refinement.measured_kl:.3e}")
    if soc_info is not None:
        ch = soc_info["changed"]
        print(f"for {soc.label}: weights of {', '.join(choices)} only; " + (
            f"{len(ch)} layer(s) changed from the plan without --soc: " + ", ".join(
                f"{n} {c['from']} -> {c['to']}" for n, c in ch.items()) if ch else "no layer needed a change"))
    print(f"top-1 agreement {point.top1_agreement:.4f}; plan written to {saved}")
    return 0


def _part_counts(lm, assignments) -> dict | None:
    """A VLM plan's layers per precision in each part (None for a text model)."""
    if not getattr(lm, "is_vision", False):
        return None
    out: dict[str, dict[str, int]] = {}
    for name, part in layer_parts(lm).items():
        prec = str(assignments.get(name))
        out.setdefault(part, {})[prec] = out.setdefault(part, {}).get(prec, 0) + 1
    return out


def _run_preset(args, lm, raised: list[str]) -> int:
    """A vendor's recipe as the plan (no sweep, no budget), measured against the float model."""
    unknown = sorted(set(raised) - {i.name for i in lm.layers})
    if unknown:
        raise PlanError(f"--htp-divergence names layers this model does not have ({', '.join(unknown)}): pass the "
                        "conversion of this model")
    plan = PRESETS[args.preset](int8_layers=raised)
    recipe = _vision_recipe(args, lm, PRESET_TARGETS[args.preset])
    if recipe is not None:  # a VLM: the vision encoder and projector as the same vendor ships them
        plan = recipe_part_plan(lm, plan, recipe)
    point = measure_plan(lm, plan, _evaluator(args, lm, LayerVariants.for_plan(lm, plan)), label=args.preset,
                         progress=not args.json)
    saved = plan.save(Path(args.out))
    out = {"model": str(lm.path), "plan_path": str(saved), "preset": args.preset, "size_bytes": point.size_bytes,
           "bits_per_weight": point.bits_per_weight, "kl_divergence": point.kl_divergence,
           "perplexity": point.perplexity, "top1_agreement": point.top1_agreement,
           "reference_perplexity": point.reference_perplexity, "eval_tokens": point.tokens,
           "plan": plan.to_dict(), "htp_int8_layers": raised, "vision_recipe": recipe.to_dict() if recipe else None,
           "parts": _part_counts(lm, plan.resolve(i.name for i in lm.layers))}
    if args.json:
        print_json(out)
        return 0
    print(f"{args.preset}: {format_bytes(point.size_bytes)}, {point.bits_per_weight:.2f} bits/weight; KL "
          f"{point.kl_divergence:.3e}, perplexity {point.perplexity:.3f} (float {point.reference_perplexity:.3f}, "
          f"{point.tokens:,} {'answer tokens' if isinstance(point.report, VisionKLReport) else 'tokens'}), top-1 "
          f"agreement {point.top1_agreement:.4f}")
    for part, by in (out["parts"] or {}).items():
        print(f"  {part}: " + ", ".join(f"{n} {p}" for p, n in sorted(by.items())))
    if raised:
        print(f"held at int8 (they depart from the simulation on the HTP): {', '.join(raised)}")
    if recipe is not None:
        print(f"vision encoder and projector as {recipe.runtime} ships them: {recipe.source}")
    print(f"plan written to {saved}; convert it with `workbench convert MODEL --plan {saved} --target qnn --soc DEVICE`")
    return 0
