"""Per-layer precision on the demo model: sweep time, Evaluate time, and automatic plans against uniform ones.

    python bench/plan.py [--model demo] [--sweep-tokens 1024] [--eval-tokens 0] [--json]

Prints:
- the sensitivity sweep's wall time (every layer x int8/int4, a fresh workspace; target < 2 min on
  2 cores; its CPU time too, since wall time depends on what else runs) and the five most sensitive
  layers;
- the override panel's time to change one layer and press Evaluate (median of 7 after a warm-up
  press; target < 2 s) at the sweep's token budget;
- a table measured on the held-out text (``--eval-tokens 0`` = all of it): uniform INT8, uniform
  INT4, the automatic plan at the size of uniform INT4 + 10% (target: lower KL than uniform INT4)
  and at the size of uniform INT8 (target: within noise of INT8), each with size, bits/weight,
  KL and its paired difference to the uniform plan (mean +- standard error over windows),
  perplexity, top-1 agreement, and the KL the sweep predicted.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from workbench.precision.autoplan import compare_points, measure_plan, plan_footprint, plan_for_budget
from workbench.model.load import load_model, resolve_model_path
from workbench.quantize.plan import QuantPlan
from workbench.precision.sensitivity import DEFAULT_SWEEP_TOKENS, PlanEvaluator, evaluation_tokens, run_sensitivity
from workbench.ui.overrides import OverridePanel
from workbench.files.workspace import Workspace


def time_panel_evaluate(lm, sens, tokens: int, repeats: int = 7) -> dict:
    """One layer's dropdown changed, then Evaluate: what a user waits for in the panel."""
    panel = OverridePanel(lm, sensitivity=sens, tokens=tokens)
    names = [info.name for info in lm.layers if info.kind == "linear" and not info.tied_to]
    times, cpu = [], []
    with contextlib.redirect_stdout(io.StringIO()):  # the panel's log widget prints when no kernel runs
        t0 = time.perf_counter()
        panel.evaluate()  # first press: reference log-probs and the plan's weights are computed once
        first = time.perf_counter() - t0
        for i in range(repeats):
            name = names[(3 * i + 1) % len(names)]
            panel.set_precision(name, "int4" if panel.plan.precision_name_for(name) != "int4" else "fp16")
            t0, c0 = time.perf_counter(), time.process_time()
            panel.evaluate()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"first_seconds": first, "median_seconds": statistics.median(times), "max_seconds": max(times),
            "median_cpu_seconds": statistics.median(cpu),
            "tokens": panel.points[-1].tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--sweep-tokens", type=int, default=DEFAULT_SWEEP_TOKENS)
    ap.add_argument("--eval-tokens", type=int, default=0, help="tokens for the table (0 = the whole held-out text)")
    ap.add_argument("--precisions", default="int8,int4", help="integer precisions swept and chosen from (default "
                    "int8,int4, as the README's table; 'all' for every registered one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    precisions = None if args.precisions == "all" else tuple(args.precisions.split(","))

    build = resolve_model_path(args.model) / "BUILD.json"
    steps = json.loads(build.read_text()).get("args", {}).get("steps") if build.is_file() else None
    lm = load_model(args.model)
    out: dict = {"model": str(lm.path), "build_steps": steps, "threads": torch.get_num_threads(),
                 "parameters": lm.parameters}

    with tempfile.TemporaryDirectory() as tmp:  # a fresh workspace: the sweep really runs
        t0, c0 = time.perf_counter(), time.process_time()
        sens = run_sensitivity(lm, tokens=args.sweep_tokens, precisions=precisions, workspace=Workspace(Path(tmp)),
                               progress=False)
        sweep_seconds, sweep_cpu = time.perf_counter() - t0, time.process_time() - c0
    out["sweep"] = {"seconds": sweep_seconds, "cpu_seconds": sweep_cpu, "trials": sens.trials_run, "tokens": sens.tokens,
                    "most_sensitive_int4": sens.ranking("int4")[:5], "most_sensitive_int8": sens.ranking("int8")[:3]}
    out["panel_evaluate"] = time_panel_evaluate(lm, sens, args.sweep_tokens)

    evaluator = PlanEvaluator(lm, evaluation_tokens(lm, tokens=args.eval_tokens or None))
    kw = {"group_size": sens.group_size, "symmetric": sens.symmetric}
    int8, int4 = QuantPlan.uniform("int8", **kw), QuantPlan.uniform("int4", **kw)
    p8 = measure_plan(lm, int8, evaluator, label="uniform int8", sensitivity=sens)
    p4 = measure_plan(lm, int4, evaluator, label="uniform int4", sensitivity=sens)
    s4, s8 = plan_footprint(lm, int4)["size_bytes"], plan_footprint(lm, int8)["size_bytes"]
    a4 = plan_for_budget(lm, sens, size_bytes=int(1.1 * s4))
    a8 = plan_for_budget(lm, sens, size_bytes=s8)
    pa4 = measure_plan(lm, a4.plan, evaluator, label="auto @ int4 size +10%", prediction=a4)
    pa8 = measure_plan(lm, a8.plan, evaluator, label="auto @ int8 size", prediction=a8)
    rows = [(p8, None), (p4, None), (pa4, compare_points(pa4, p4)), (pa8, compare_points(pa8, p8))]
    out["table"] = [{**p.to_dict(), "kl_vs_uniform": d} for p, d in rows]
    out["auto_int4_plus_10_beats_int4"] = pa4.kl_divergence < p4.kl_divergence
    d8 = rows[3][1]
    out["auto_int8_within_noise_of_int8"] = d8["mean"] <= 2 * d8["stderr"]
    out["plans"] = {"auto_int4_plus_10": a4.assignments, "auto_int8": a8.assignments}

    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return
    print(f"model {out['model']} (build steps {steps}), {lm.parameters:,} parameters, {out['threads']} threads, "
          f"load average {os.getloadavg()[0]:.1f} at the end (other processes share these cores)")
    sw = out["sweep"]
    print(f"sensitivity sweep: {sw['trials']} trials on {sw['tokens']:,} tokens in {sw['seconds']:.1f} s wall, "
          f"{sw['cpu_seconds']:.1f} s CPU over {out['threads']} threads (target < 120 s wall on 2 cores)")
    print("  most sensitive at int4: " + ", ".join(f"{n} {v:.2e}" for n, v in sw["most_sensitive_int4"]))
    pe = out["panel_evaluate"]
    print(f"panel: one-layer change + Evaluate on {pe['tokens']:,} tokens: median {pe['median_seconds']:.2f} s "
          f"wall ({pe['median_cpu_seconds']:.2f} s CPU), max {pe['max_seconds']:.2f} s (target < 2 s; first "
          f"press {pe['first_seconds']:.2f} s)")
    print(f"\nmeasured on {p8.tokens:,} held-out tokens (float perplexity {p8.reference_perplexity:.3f}):")
    head = (f"{'plan':<24}{'bytes':>10}{'bits/w':>8}{'KL':>11}{'KL - uniform (+-se)':>24}{'ppl':>9}{'top-1':>8}"
            f"{'pred. KL':>11}")
    print(head)
    for p, d in rows:
        diff = f"{d['mean']:+.2e} +- {d['stderr']:.1e}" if d else ""
        pred = f"{p.predicted_kl:.2e}" if p.predicted_kl is not None else ""
        print(f"{p.label:<24}{p.size_bytes:>10,}{p.bits_per_weight:>8.2f}{p.kl_divergence:>11.3e}{diff:>24}"
              f"{p.perplexity:>9.3f}{p.top1_agreement:>8.4f}{pred:>11}")
    for label, assignments in (("auto @ int4 size +10%", a4.assignments), ("auto @ int8 size", a8.assignments)):
        counts = collections.Counter(assignments.values())
        print(f"{label} layers: " + ", ".join(f"{p} x {n}" for p, n in counts.most_common()))
    print(f"\nauto @ int4 size +10% has lower KL than uniform int4: {out['auto_int4_plus_10_beats_int4']}")
    print(f"auto @ int8 size within noise of uniform int8 (KL diff <= 2 se): {out['auto_int8_within_noise_of_int8']}")


if __name__ == "__main__":
    main()
