"""Choose per-layer precisions under a size budget, then measure the choice for real.

The sensitivity sweep gives, per layer and precision, the KL divergence that layer alone adds.
Assuming damages add up, the best plan under a budget is a multiple-choice knapsack: every layer
(a tied embedding/lm_head pair counts as one unit, stored once when both share a precision)
picks one precision, total bytes <= budget, total predicted KL minimal. It is solved by dynamic
programming over bytes: exactly when the layer sizes' common divisor keeps the table under a
million cells, else with sizes rounded up to a millionth of the budget (the budget always holds).
The prediction is then checked: the plan is quantized with ``quantize_model`` and evaluated
against the unquantized model, and both figures are reported side by side.

    sens = run_sensitivity(lm, workspace=ws)
    auto = plan_for_budget(lm, sens, size_bytes=int(1.1 * plan_footprint(lm, QuantPlan.uniform("int4"))["size_bytes"]))
    point = measure_plan(lm, auto.plan, PlanEvaluator(lm, evaluation_tokens(lm)), label="auto", prediction=auto)
    point.kl_divergence, point.predicted_kl
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..errors import PlanError
from ..evaluation.evaluate import EvalReport, paired_difference
from ..model.load import LoadedModel
from ..quantize.plan import DEFAULT_GROUP_SIZE, QuantPlan, fitting_precisions, get_precision
from ..quantize.model import bits_per_weight
from .sensitivity import LayerVariants, PlanEvaluator, SensitivityReport, sweep_precisions
from ..model.sweep_backends import LocalBackend
from ..targets import get_target

__all__ = ["PlanPrediction", "PlanPoint", "Refinement", "refine_plan", "budget_bytes", "check_budget", "plan_footprint", "predict_damage", "plan_for_budget", "measure_plan",
           "pareto_points", "compare_points", "DEFAULT_CHOICES"]

DEFAULT_CHOICES = None  # fp16 and every precision the sweep measured (all registered integer ones by default)


def _choices(sensitivity: SensitivityReport | None, choices: Sequence[str] | None, symmetric: bool = True,
             targets: Sequence[str] = (), layers=None) -> list[str]:
    """The precisions a plan may give a layer: ``choices``, else fp16 plus the sweep's (or every registered) ones;
    with ``targets``, only those every one of these targets carries (their rules: ``Target.carries``)."""
    if choices is None:
        choices = ("fp16", *(sensitivity.precisions if sensitivity is not None else sweep_precisions(symmetric, layers)))
    out = [get_precision(c).name for c in choices]
    rules = [get_target(t) for t in targets]
    kept = [c for c in out if all(t.carries(get_precision(c)) for t in rules)]
    if not kept:
        raise PlanError(f"no precision among {', '.join(out)} is carried by every one of {', '.join(targets)}")
    return kept
_MAX_CELLS = 1_000_000  # knapsack table size: exact for small models, 1e-6 of the budget for large ones


def plan_footprint(lm: LoadedModel, plan: QuantPlan) -> dict:
    """Size in bytes (norms included) and bits per weight (``quantize.bits_per_weight``, the quantized model's
    own figure) of a plan, from the layer shapes alone (no model run)."""
    names = [info.name for info in lm.layers]
    return {"size_bytes": int(lm.size_bytes(plan)),
            "bits_per_weight": bits_per_weight(lm.layers, plan.resolve(names), plan.group_size, plan.symmetric)}


def predict_damage(sensitivity: SensitivityReport, assignments: Mapping[str, str | None]) -> dict:
    """Predicted KL and perplexity of a plan: per-layer damages summed (KL, and NLL for perplexity)."""
    kl = nll = 0.0
    for name, p in assignments.items():
        prec = get_precision(p)
        if prec is None or prec.is_float:
            continue
        kl += sensitivity.damage(name, prec.name, "kl")
        nll += sensitivity.damage(name, prec.name, "nll_delta")
    return {"kl_divergence": kl, "nll_delta": nll, "perplexity": sensitivity.reference_perplexity * math.exp(nll)}


@dataclass
class PlanPrediction:
    """An automatic plan and what the sensitivity sweep predicts for it."""

    plan: QuantPlan
    assignments: dict[str, str]
    size_bytes: int
    bits_per_weight: float
    budget_bytes: int
    predicted_kl: float
    predicted_perplexity: float  # on the sweep's tokens; measure_plan rescales it to the text it measures
    predicted_nll_delta: float = 0.0
    seconds: float = 0.0
    score: str = "kl"  # the sweep's: per-layer damages measured ("kl") or estimated ("proxy")

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "assignments": dict(self.assignments), "size_bytes": self.size_bytes,
                "bits_per_weight": self.bits_per_weight, "budget_bytes": self.budget_bytes,
                "predicted_kl_divergence": self.predicted_kl, "predicted_perplexity": self.predicted_perplexity,
                "predicted_nll_delta": self.predicted_nll_delta, "score": self.score}


def _units(lm: LoadedModel, names: Sequence[str]) -> list[list[str]]:
    """Layers grouped so that tied weights (embedding + lm_head) are decided together."""
    groups: dict[str, list[str]] = {}
    for info in lm.layers:
        if info.name in names:
            groups.setdefault(info.tied_to or info.name, []).append(info.name)
    return list(groups.values())


def _unit_choices(lm: LoadedModel, unit: Sequence[str], choices: Sequence[str]) -> list[str]:
    """The choices every layer of ``unit`` can take (a fixed block layout only where its blocks fit)."""
    widths = {lm.layer(n).shape[1] for n in unit}
    return [c for c in choices if all(fitting_precisions((c,), w) for w in widths)]


def _plan_from_assignments(assignments: Mapping[str, str], settings: Mapping, meta: Mapping) -> QuantPlan:
    """A readable plan: the most common precision as default, exact rules for the rest.

    ``settings`` are the sweep's ``quantizer_settings``: the plan rounds layers as the sweep measured them.
    """
    counts: dict[str, int] = {}
    for p in assignments.values():
        counts[p] = counts.get(p, 0) + 1
    default = max(counts, key=lambda p: (counts[p], p))
    rules = tuple({"pattern": n, "precision": p} for n, p in assignments.items() if p != default)
    return QuantPlan(default=default, rules=rules, **settings, method="rtn", meta=dict(meta))


def budget_bytes(lm: LoadedModel, *, size_bytes: int | None = None, bits_per_weight: float | None = None) -> int:
    """A budget given as bytes or as average bits per weight, in bytes."""
    if (size_bytes is None) == (bits_per_weight is None):
        raise PlanError("give exactly one budget: size_bytes or bits_per_weight")
    if bits_per_weight is not None:
        if not bits_per_weight > 0:
            raise PlanError(f"bits per weight must be positive, got {bits_per_weight}")
        size_bytes = int(bits_per_weight * lm.parameters / 8)
    if size_bytes <= 0:
        raise PlanError(f"size budget must be a positive number of bytes, got {size_bytes}")
    return int(size_bytes)


def check_budget(lm: LoadedModel, size: int, *, group_size=DEFAULT_GROUP_SIZE, symmetric: bool = True,
                 choices: Sequence[str] | None = DEFAULT_CHOICES, targets: Sequence[str] = ()) -> None:
    """Fail before any sweep when even the smallest precision everywhere exceeds ``size`` bytes."""
    choices = _choices(None, choices, symmetric, targets, lm.layers)
    smallest = min(lm.size_bytes(QuantPlan(default=c, group_size=group_size, symmetric=symmetric)) for c in choices)
    if smallest > size:
        raise PlanError(f"no plan fits {size:,} bytes ({8 * size / lm.parameters:.2f} bits/weight): the smallest "
                        f"with {'/'.join(choices)} is {smallest:,} bytes ({8 * smallest / lm.parameters:.2f} "
                        "bits/weight); raise the budget")


def plan_for_budget(lm: LoadedModel, sensitivity: SensitivityReport, *, size_bytes: int | None = None,
                    bits_per_weight: float | None = None, choices: Sequence[str] | None = DEFAULT_CHOICES,
                    metric: str = "kl", targets: Sequence[str] = (),
                    fixed: Mapping[str, str] | None = None) -> PlanPrediction:
    """The plan with the least predicted damage whose size fits the budget (bytes or bits/weight).

    ``targets`` (names such as ``"qnn"``, ``"llama.cpp"``) keeps the plan to precisions all of them carry.
    A fixed block layout (``int4-k``'s 256-weight blocks) is a choice only for the layers whose inputs it fits.
    ``fixed`` holds layers at given precisions outside the choice (a VLM's vision encoder as a runtime ships it);
    their bytes count against the budget and their measured damage (when measured) in the prediction.

    Layers the sweep did not measure keep fp16. Raises ``PlanError`` when even the smallest
    choice for every layer does not fit, naming the smallest size that does.
    """
    t0 = time.perf_counter()
    size_bytes = budget_bytes(lm, size_bytes=size_bytes, bits_per_weight=bits_per_weight)
    choices = _choices(sensitivity, choices, targets=targets)
    gs, sym = sensitivity.group_size, sensitivity.symmetric
    held = {name: get_precision(p).name for name, p in (fixed or {}).items()}
    unknown = sorted(set(held) - {info.name for info in lm.layers})
    if unknown:
        raise PlanError(f"fixed layer(s) {', '.join(unknown[:3])} are not quantizable layers of this model")
    measured = {layer.name for layer in sensitivity.layers} - set(held)
    fixed = {info.name: held.get(info.name, "fp16") for info in lm.layers if info.name not in measured}
    units = _units(lm, [n for n in (info.name for info in lm.layers) if n in measured])
    base = lm.other_bytes + lm.layer_bytes(fixed, gs, sym, names=fixed)  # norms + unmeasured layers: constant
    capacity_bytes = size_bytes - base
    options: list[list[tuple[dict[str, str], int, float]]] = []
    for unit in units:
        opts = []
        for combo in itertools.product(_unit_choices(lm, unit, choices), repeat=len(unit)):
            assign = dict(zip(unit, combo))
            nbytes = lm.layer_bytes(assign, gs, sym, names=assign)
            dmg = sum(sensitivity.damage(n, p, metric) for n, p in assign.items())
            opts.append((assign, nbytes, dmg))
        options.append(opts)
    smallest = base + sum(min(o[1] for o in opts) for opts in options)
    if smallest > size_bytes:
        raise PlanError(f"no plan fits {size_bytes:,} bytes ({8 * size_bytes / lm.parameters:.2f} bits/weight): the "
                        f"smallest with {'/'.join(choices)} is {smallest:,} bytes "
                        f"({8 * smallest / lm.parameters:.2f} bits/weight); raise the budget")
    # exact when the byte sizes share a large enough divisor, else sizes are rounded up to 1/_MAX_CELLS
    # of the budget (the plan still fits, and is optimal to within that rounding)
    unit = 0
    for opts in options:
        for _, nbytes, _ in opts:
            unit = math.gcd(unit, int(nbytes))
    unit = max(unit, 1)
    step = unit if capacity_bytes / unit <= _MAX_CELLS else math.ceil(capacity_bytes / _MAX_CELLS)
    cap = int(capacity_bytes // step)
    inf = float("inf")
    dp = np.full(cap + 1, inf)
    dp[0] = 0.0
    picks = []
    for opts in options:
        new = np.full(cap + 1, inf)
        pick = np.full(cap + 1, -1, dtype=np.int32)
        for k, (_, nbytes, dmg) in enumerate(opts):
            cost = int(math.ceil(nbytes / step))
            if cost > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[cost:] = dp[:cap + 1 - cost] + dmg
            better = cand < new
            new[better] = cand[better]
            pick[better] = k
        dp = new
        picks.append(pick)
    c = int(np.argmin(dp))
    if not math.isfinite(dp[c]):  # rounding bytes up can exclude the only plans that fit exactly
        raise PlanError(f"no plan fits {size_bytes:,} bytes once sizes are rounded; raise the budget slightly")
    assignments: dict[str, str] = dict(fixed)
    for opts, pick in zip(reversed(options), reversed(picks)):
        k = int(pick[c])
        assign, nbytes, _ = opts[k]
        assignments.update(assign)
        c -= int(math.ceil(nbytes / step))
    ordered = {info.name: assignments[info.name] for info in lm.layers}
    plan = _plan_from_assignments(ordered, sensitivity.quantizer_settings, {"budget_bytes": int(size_bytes), "chosen_by": "plan_for_budget",
                                                      "metric": metric, "score": sensitivity.score})
    foot = plan_footprint(lm, plan)
    swept = {layer.name for layer in sensitivity.layers}  # held layers the sweep measured count in the prediction
    pred = predict_damage(sensitivity, {n: p for n, p in ordered.items() if n in swept})
    return PlanPrediction(plan, ordered, foot["size_bytes"], foot["bits_per_weight"], int(size_bytes),
                          pred["kl_divergence"], pred["perplexity"], pred["nll_delta"], time.perf_counter() - t0,
                          sensitivity.score)


@dataclass
class Refinement:
    """The automatic plan after moves accepted by measurement, and the measured figures before and after."""

    prediction: PlanPrediction  # the refined plan, with the sweep's prediction for it
    start_kl: float  # the starting plan's KL, measured by the evaluator
    measured_kl: float  # the refined plan's KL, measured the same way
    moves: list[dict] = field(default_factory=list)  # accepted: {"set": {layer: precision}, "kl": measured}
    trials: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"start_kl": self.start_kl, "measured_kl": self.measured_kl, "moves": self.moves,
                "trials": self.trials, "seconds": self.seconds}


def _moves(lm: LoadedModel, sensitivity: SensitivityReport, assign: Mapping[str, str], units: list[list[str]],
           choices: Sequence[str], budget: int, gs, sym, metric: str) -> list[tuple[float, dict[str, str]]]:
    """Budget-respecting raises of one unit's precision, paid for (when needed) by lowering another unit's;
    each with its predicted gain (damage saved minus damage added), best first. Gains may be negative:
    the budget's optimum by prediction has no positive one, and measurement is the judge."""
    # a unit's bytes and damage depend only on its own precision: tabulate them once per call
    allowed = [_unit_choices(lm, u, choices) for u in units]
    nbytes = [{q: lm.layer_bytes({n: q for n in u}, gs, sym, names=u) for q in ok} for u, ok in zip(units, allowed)]
    damage = [{q: sum(sensitivity.damage(n, q, metric) for n in u) for q in ok} for u, ok in zip(units, allowed)]
    now = [assign[u[0]] for u in units]
    size = lm.layer_bytes(assign, gs, sym) + lm.other_bytes
    out = []
    for i, u in enumerate(units):
        cur = now[i]
        for q in allowed[i]:
            gain = damage[i][cur] - damage[i][q]
            if q == cur or gain <= 0:
                continue
            need = size + nbytes[i][q] - nbytes[i][cur] - budget
            if need <= 0:
                out.append((gain, {n: q for n in u}))
                continue
            best = None  # the cheapest way, by predicted damage, to free ``need`` bytes elsewhere
            for j, v in enumerate(units):
                for r in allowed[j]:
                    if j == i or r == now[j] or nbytes[j][now[j]] - nbytes[j][r] < need:
                        continue
                    cost = damage[j][r] - damage[j][now[j]]
                    if best is None or cost < best[0]:
                        best = (cost, {n: r for n in v})
            if best is not None:
                out.append((gain - best[0], {**{n: q for n in u}, **best[1]}))
    return sorted(out, key=lambda m: -m[0])


def _refine_trial(evaluator: PlanEvaluator, task: tuple) -> float:
    """One refinement move measured: the whole plan (``task``: its sorted layer -> precision pairs)."""
    return evaluator.evaluate_assignments(dict(task), desc="refine").kl_divergence


def _refine_worker_state(payload: tuple) -> PlanEvaluator:
    """A remote worker's evaluator for refinement moves, rounding as the caller's does and keeping codes."""
    lm, ids, ctx, batch_size, settings = payload
    return PlanEvaluator(lm, ids, ctx=ctx, batch_size=batch_size, variants=LayerVariants(lm, **settings))


def refine_plan(lm: LoadedModel, sensitivity: SensitivityReport, prediction: PlanPrediction,
                evaluator: PlanEvaluator, *, trials: int = 12, per_round: int = 3,
                choices: Sequence[str] | None = DEFAULT_CHOICES, metric: str = "kl",
                progress: bool = False, targets: Sequence[str] = (), backend=None,
                fixed: Mapping[str, str] | None = None) -> Refinement:
    """Greedy refinement by measured KL: the predicted damages assume layers do not interact; they do.

    Each round measures the ``per_round`` moves with the best predicted gain (a unit to another
    precision, paid for by lowering another unit when the budget is full) and keeps the one that
    lowers the measured KL most; it stops when no move measured helps or after ``trials`` measurements.
    A round's moves are independent: ``backend`` (``workbench.model.sweep_backends``) measures them side by side.
    Layers in ``fixed`` (as ``plan_for_budget`` held them) are never moved.
    """
    from tqdm.auto import tqdm

    backend = backend or LocalBackend()
    t0 = time.perf_counter()
    gs, sym = sensitivity.group_size, sensitivity.symmetric
    if not evaluator.variants.matches(QuantPlan(default=None, **sensitivity.quantizer_settings)):
        raise PlanError(f"the evaluator rounds layers with {evaluator.variants.describe()}, the sweep measured them "
                        "otherwise; refine with an evaluator made for the sweep's settings "
                        "(LayerVariants(lm, **sensitivity.quantizer_settings))")
    choices = _choices(sensitivity, choices, targets=targets)
    assign = dict(prediction.assignments)
    units = _units(lm, [layer.name for layer in sensitivity.layers if layer.name not in (fixed or {})])
    start = current = evaluator.evaluate_assignments(assign, desc="refine").kl_divergence
    moves, tried, seen = [], 0, set()
    # one object for every round: a backend holding workers (``with backend:``) reuses them for it
    payload = (lm, evaluator.ids, evaluator.ctx, evaluator.batch_size, dict(evaluator.variants.settings.quantizer_settings))
    with tqdm(total=trials, desc="refine plan (measured)", unit="trial", disable=not progress, leave=False) as bar:
        while tried < trials:
            candidates = [m for m in _moves(lm, sensitivity, assign, units, choices, prediction.budget_bytes, gs, sym,
                                            metric) if tuple(sorted(m[1].items())) not in seen][:per_round]
            best = None
            batch = [tuple(sorted({**assign, **change}.items())) for _gain, change in candidates[:trials - tried]]
            measured: dict[tuple, float] = {}

            def done(task: tuple, kl: float) -> None:
                measured[task] = kl
                bar.update(1)

            backend.run(batch, _refine_trial, done, state=evaluator, setup=_refine_worker_state, payload=payload)
            for (_gain, change), task in zip(candidates, batch):  # in predicted order: ties go as serially
                seen.add(tuple(sorted(change.items())))
                tried += 1
                kl = measured[task]
                if kl < current and (best is None or kl < best[0]):
                    best = (kl, change)
            if best is None:
                break
            current = best[0]
            assign.update(best[1])
            moves.append({"set": dict(best[1]), "kl": best[0]})
    ordered = {info.name: assign[info.name] for info in lm.layers}
    plan = _plan_from_assignments(ordered, sensitivity.quantizer_settings, {**prediction.plan.meta, "refined_by": "measured KL",
                                                     "refine_moves": len(moves)})
    foot = plan_footprint(lm, plan)
    swept = {layer.name for layer in sensitivity.layers}
    pred = predict_damage(sensitivity, {n: p for n, p in ordered.items() if n in swept})
    refined = PlanPrediction(plan, ordered, foot["size_bytes"], foot["bits_per_weight"], prediction.budget_bytes,
                             pred["kl_divergence"], pred["perplexity"], pred["nll_delta"],
                             prediction.seconds + time.perf_counter() - t0, sensitivity.score)
    return Refinement(refined, start, current, moves, tried, time.perf_counter() - t0)


@dataclass
class PlanPoint:
    """One measured plan: a point of the Pareto chart, with the prediction beside it when there is one."""

    label: str
    size_bytes: int
    bits_per_weight: float
    kl_divergence: float
    perplexity: float
    top1_agreement: float
    reference_perplexity: float
    tokens: int
    predicted_kl: float | None = None
    predicted_perplexity: float | None = None
    seconds: float = 0.0
    plan: QuantPlan | None = field(default=None, repr=False)
    report: EvalReport | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("plan", "report")}
        d["plan"] = self.plan.to_dict() if self.plan is not None else None
        return d


def measure_plan(lm: LoadedModel, plan: QuantPlan, evaluator: PlanEvaluator, *, label: str = "plan",
                 prediction: PlanPrediction | None = None, sensitivity: SensitivityReport | None = None,
                 calibration=None, progress: bool = False) -> PlanPoint:
    """Quantize ``plan`` with ``quantize_model`` and evaluate the quantized network it builds.

    This is the real measurement: the weights evaluated are the ones exporters read, computed from
    their integer codes (``QuantizedModel.build_model``: no second float copy of the model). The
    evaluator supplies the tokens and the reference outputs (captured once): a ``PlanEvaluator`` on text, a
    ``VisionPlanEvaluator`` on a VLM's pictures.
    """
    from ..quantize import quantize_model
    t0 = time.perf_counter()
    qm = quantize_model(lm, plan, calibration=calibration, progress=progress)
    model = qm.build_model()
    del qm
    report = evaluator.evaluate_model(model, progress=progress, desc=label)  # on text, or a VLM's on pictures
    del model
    foot = plan_footprint(lm, plan)
    pred_kl = pred_ppl = None
    if prediction is not None:
        pred_kl, delta = prediction.predicted_kl, prediction.predicted_nll_delta
    elif sensitivity is not None:
        pred = predict_damage(sensitivity, plan.resolve(info.name for info in lm.layers))
        pred_kl, delta = pred["kl_divergence"], pred["nll_delta"]
    if pred_kl is not None:  # the predicted change applied to the float model's perplexity on this text
        pred_ppl = report.reference_perplexity * math.exp(delta)
    return PlanPoint(label, foot["size_bytes"], foot["bits_per_weight"], report.kl_divergence, report.perplexity,
                     report.top1_agreement, report.reference_perplexity, report.tokens, pred_kl, pred_ppl,
                     time.perf_counter() - t0, plan, report)


def pareto_points(lm: LoadedModel, sensitivity: SensitivityReport, evaluator: PlanEvaluator, *,
                  budgets: Sequence[float] = (1.0, 1.1, 1.25, 1.5, 1.75), progress: bool = False) -> list[PlanPoint]:
    """Uniform INT8, uniform INT4 and automatic plans at budgets between them, all measured.

    ``budgets`` are multiples of the uniform-INT4 size; those above the uniform-INT8 size are
    dropped, and the INT8 size itself is always included.
    """
    kw = sensitivity.quantizer_settings
    int8, int4 = QuantPlan.uniform("int8", **kw), QuantPlan.uniform("int4", **kw)
    points = [measure_plan(lm, int8, evaluator, label="uniform int8", sensitivity=sensitivity, progress=progress),
              measure_plan(lm, int4, evaluator, label="uniform int4", sensitivity=sensitivity, progress=progress)]
    s8, s4 = points[0].size_bytes, points[1].size_bytes
    sizes = sorted({int(b * s4) for b in budgets if b * s4 <= s8} | {s8})
    for size in sizes:
        auto = plan_for_budget(lm, sensitivity, size_bytes=size)
        points.append(measure_plan(lm, auto.plan, evaluator, label=f"auto {8 * size / lm.parameters:.2f} b/w",
                                   prediction=auto, progress=progress))
    return points


def compare_points(candidate: PlanPoint, baseline: PlanPoint, metric: str = "kl") -> dict:
    """Per-token difference candidate - baseline with its standard error over the evaluation windows."""
    if candidate.report is None or baseline.report is None:
        raise PlanError("both points need their evaluation reports to be compared")
    return paired_difference(candidate.report, baseline.report, metric=metric)
