"""What does each quantization method cost on the demo model, and how long and how much memory does it take?

    python bench/quantize.py [--model demo] [--group-size 128] [--samples 128] [--seq-len 512] [--threads N]
    python bench/quantize.py --formats [--model demo] [--samples 128] [--seq-len 512] [--eval-tokens N]
    python bench/quantize.py --scale-search [--model demo] [--samples 128] [--seq-len 512] [--eval-tokens N]

Calibration statistics are computed first (timed apart). Each method (INT8 RTN, INT4 RTN, INT4
AWQ, INT4 GPTQ, INT4 AWQ+GPTQ) then runs in its own subprocess, so its wall time (after a warm-up run) and peak resident
memory (VmHWM, reset just before the timed run) are its own; it saves its result to a
temporary directory. This process then reloads every saved model (what is evaluated is what was
saved) and evaluates it against the float model on the bundled held-out text, on the same
windows: perplexity, KL divergence, top-1 agreement, bits per weight, size of the weight files,
and the paired standard error of the per-window AWQ-vs-RTN and GPTQ-vs-RTN differences.

``--formats`` measures quality per stored bit instead (in this process, no timing): INT4 with
float16 group scales against two-level scales (int4-lpbq) at groups 32, 64 and 128, by RTN, RTN
with the scale search and GPTQ, then every other registered width (int2 ... int8, int8-lpbq) at
group 32 by RTN. Each row: KL, top-1 and perplexity on the held-out text, the model's bits per
weight (the one definition: embeddings included, fp16 here) and the bits per weight of the
integer layers alone, from their stored bytes.

``--scale-search`` measures what the plan's scale search (``QuantPlan.scale_search``) does, for
RTN, AWQ and GPTQ at INT4 g128, INT4 g32 asymmetric, INT8 g128 and int4-lpbq g128: KL without and
with it on the same windows, and the paired difference with its standard error (AWQ reuses one
search for both; its clipped layers keep their clips, so the search reaches only q_proj and k_proj).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

METHODS = [("INT8 RTN", 8, "rtn"), ("INT4 RTN", 4, "rtn"), ("INT4 AWQ", 4, "awq"), ("INT4 GPTQ", 4, "gptq"),
           ("INT4 AWQ+GPTQ", 4, "awq+gptq")]


def run_one(args) -> None:
    """Child: quantize once to warm up, once timed; save; print one JSON line."""
    from workbench.numerics.memory import reset_peak_rss, rss_mb, settled_rss_mb
    from workbench.model.load import load_model
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import CALIBRATED_METHODS, quantize_model
    from workbench.files.workspace import Workspace
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype="float32")
    plan = QuantPlan.uniform(f"int{args.bits}", group_size=args.group_size or None, method=args.method)
    calibration = None
    if args.method in CALIBRATED_METHODS:  # statistics were computed by the parent: read back from the workspace
        from workbench.model.calibrate import calibrate
        calibration = calibrate(lm, samples=args.samples, seq_len=args.seq_len, workspace=Workspace(args.workspace),
                                progress=False)
        # warm-up on a small slice, so one-time costs (allocator, kernels) are not in the timed run
        quantize_model(lm, plan, calibration=calibration, progress=False, awq_tokens=512, gptq_tokens=512)
    else:
        quantize_model(lm, plan, progress=False)
    # the runtime's own working set: one forward of the decoder (no lm_head) on a calibration-sized input
    rss_before = settled_rss_mb()
    reset = reset_peak_rss()
    with torch.no_grad():
        lm.model.base_model(input_ids=torch.zeros(1, args.seq_len, dtype=torch.long), use_cache=False)
    forward_peak = rss_mb("VmHWM") if reset else float("nan")
    rss_before = settled_rss_mb()
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    qm = quantize_model(lm, plan, calibration=calibration, progress=False)
    seconds = time.perf_counter() - t0
    # the timed run's own peak where the kernel allows resetting it; else the whole process's peak
    peak = rss_mb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    qm.save(args.out)
    fp32 = sum(p.numel() for p in {id(p): p for p in lm.model.parameters()}.values()) * 4 / 2**20
    print(json.dumps({"seconds": seconds, "rss_before_mb": rss_before, "peak_rss_mb": peak, "fp32_model_mb": fp32,
                      "forward_mb": forward_peak - rss_before,
                      "threads": torch.get_num_threads(),
                      "awq_tokens": (qm.awq or {}).get("tokens"),
                      "awq_alphas": [e["alpha"] for e in (qm.awq or {}).get("groups", [])]}))


FORMAT_ROWS = [(p, g, m) for m in ("rtn", "rtn+search", "gptq") for g in (32, 64, 128) for p in ("int4", "int4-lpbq")]
WIDTH_ROWS = ["int8", "int8-lpbq", "int6", "int5", "int3", "int2"]


def run_formats(args) -> None:
    """KL and stored bits per weight of every scale format and width on the held-out text (see the docstring)."""
    from workbench.evaluation.data import load_calibration_set
    from workbench.model.load import load_model
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import heldout_ids, measure_cost, measure_reference, quantize_model
    lm = load_model(args.model, dtype="float32")
    ids = heldout_ids(lm, max_tokens=args.eval_tokens or None, ctx=args.ctx)
    baseline = measure_reference(lm.model, ids, ctx=args.ctx, progress=False)
    calib = load_calibration_set(tokenizer=lm.tokenizer, samples=args.samples, seq_len=args.seq_len)
    print(f"model {args.model}; held-out text: {baseline.report.tokens:,} scored tokens in {baseline.report.windows} "
          f"windows of {baseline.report.ctx}; GPTQ on {args.samples} x {args.seq_len} calibration tokens; "
          f"embeddings and lm_head fp16\n")
    head = f"{'precision':<11}{'group':>6}{'method':>11}{'KL':>20}{'top-1':>8}{'ppl':>9}{'bits/w':>8}{'int bits/w':>11}"
    print(head)
    print("-" * len(head))
    rows = FORMAT_ROWS + [(p, 32, "rtn") for p in WIDTH_ROWS]
    for precision, group, method in rows:
        plan = QuantPlan.uniform(precision, group_size=group, method=method.split("+")[0],
                                 scale_search=method.endswith("+search"))
        qm = quantize_model(lm, plan, calibration=calib if method == "gptq" else None, progress=False)
        cost = measure_cost(qm, baseline, progress=False)
        integer = [qw for r in qm.layers if (qw := qm.weights.get(r.name)) is not None and not r.tied_to]
        int_bits = 8 * sum(qw.storage_bytes() for qw in integer) / sum(qw.qweight.numel() for qw in integer)
        print(f"{precision:<11}{group:>6}{method:>11}{cost.kl_divergence:>11.5f}±{cost.kl_divergence_stderr:.5f}"
              f"{cost.top1_agreement:>8.2%}{cost.perplexity:>9.3f}{cost.bits_per_weight:>8.3f}{int_bits:>11.3f}",
              flush=True)


SEARCH_CONFIGS = "int4:128:sym,int4:32:asym,int8:128:sym,int4-lpbq:128:sym"
SEARCH_METHODS = ("rtn", "awq", "gptq")


def _search_configs(text: str) -> list[tuple[str, int | None, bool]]:
    """``precision:group:sym|asym`` items, comma-separated (group 0: per-channel)."""
    out = []
    for item in text.split(","):
        precision, group, sym = item.split(":")
        if sym not in ("sym", "asym"):
            sys.exit(f"--configs item '{item}': the third part is sym or asym")
        out.append((precision, int(group) or None, sym == "sym"))
    return out


def run_scale_search(args) -> None:
    """KL without and with the scale search, per method and precision (see the docstring)."""
    from workbench.model.calibrate import calibrate
    from workbench.evaluation.evaluate import paired_difference
    from workbench.model.load import load_model
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import CALIBRATED_METHODS, heldout_ids, measure_cost, measure_reference, quantize_model
    from workbench.files.workspace import Workspace
    lm = load_model(args.model, dtype="float32")
    ids = heldout_ids(lm, max_tokens=args.eval_tokens or None, ctx=args.ctx)
    baseline = measure_reference(lm.model, ids, ctx=args.ctx, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        calibration = calibrate(lm, samples=args.samples, seq_len=args.seq_len, workspace=Workspace(tmp),
                                progress=False)
    print(f"model {args.model}; held-out text: {baseline.report.tokens:,} scored tokens in {baseline.report.windows} "
          f"windows of {baseline.report.ctx}; AWQ and GPTQ on {args.samples} x {args.seq_len} calibration tokens; "
          f"embeddings and lm_head fp16\n")
    head = (f"{'precision':<11}{'group':>6}{'sym':>5}{'method':>7}{'KL min/max':>20}{'KL searched':>20}"
            f"{'searched - min/max':>22}{'change':>8}{'s off':>7}{'s on':>7}  helps")
    print(head)
    print("-" * len(head))
    for precision, group, symmetric in _search_configs(args.configs):
        for method in args.methods.split(","):
            calib = calibration if method in CALIBRATED_METHODS else None
            costs, seconds, awq = [], [], None
            for search in (False, True):
                plan = QuantPlan.uniform(precision, group_size=group, symmetric=symmetric, method=method,
                                         scale_search=search)
                t0 = time.perf_counter()
                qm = quantize_model(lm, plan, calibration=calib, awq_search=awq, progress=False)
                seconds.append(time.perf_counter() - t0)
                awq = qm.awq  # the AWQ search does not depend on the scale search: run once, used twice
                costs.append(measure_cost(qm, baseline, progress=False))
            d = paired_difference(costs[1].report, costs[0].report, "kl")
            kl = [f"{c.kl_divergence:.3e}±{c.kl_divergence_stderr:.1e}" for c in costs]
            verdict = "yes" if d["mean"] + 2 * d["stderr"] < 0 else ("no" if d["mean"] > 2 * d["stderr"] else "~")
            change = d["mean"] / costs[0].kl_divergence if costs[0].kl_divergence else 0.0
            print(f"{precision:<11}{group or 'chan':>6}{'yes' if symmetric else 'no':>5}{method:>7}{kl[0]:>20}"
                  f"{kl[1]:>20}{d['mean']:>+14.2e}±{d['stderr']:.1e}{change:>+8.1%}{seconds[0]:>7.1f}{seconds[1]:>7.1f}"
                  f"  {verdict}", flush=True)
    print("\nhelps: yes = searched lower by more than 2 standard errors of the paired difference, no = higher by "
          "more than 2, ~ = within the noise; s off / s on: quantization seconds (AWQ's search counted in 'off')")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=128, help="AWQ calibration samples")
    ap.add_argument("--seq-len", type=int, default=512, help="AWQ calibration sample length")
    ap.add_argument("--ctx", type=int, default=512, help="evaluation window")
    ap.add_argument("--threads", type=int, help="torch threads for every run (default: torch's); on a busy shared "
                    "CPU one thread avoids stalls at every parallel region")
    ap.add_argument("--formats", action="store_true", help="quality per stored bit: float16 against two-level "
                    "scales at groups 32/64/128 (RTN, RTN + scale search, GPTQ), and every registered width")
    ap.add_argument("--scale-search", action="store_true", help="KL without and with the scale search, for RTN, AWQ "
                    "and GPTQ (--methods) at int4 g128, int4 g32 asymmetric, int8 g128 and int4-lpbq g128 (--configs)")
    ap.add_argument("--configs", default=SEARCH_CONFIGS, help="--scale-search: precision:group:sym|asym items, "
                    f"comma-separated (default {SEARCH_CONFIGS})")
    ap.add_argument("--methods", default=",".join(SEARCH_METHODS), help="--scale-search: methods, comma-separated")
    ap.add_argument("--eval-tokens", type=int, default=0, help="--formats, --scale-search: held-out tokens to measure "
                    "on (0: all)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bits", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--workspace", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return run_one(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.formats:
        return run_formats(args)
    if args.scale_search:
        return run_scale_search(args)

    from workbench.evaluation.evaluate import paired_difference
    from workbench.model.load import load_model
    from workbench.model.load import load_quantized
    from workbench.quantize import heldout_ids, measure_cost, measure_reference
    from workbench.quantize.storage import weight_file_bytes

    print(f"model {args.model}, group size {args.group_size}, AWQ calibration {args.samples} x {args.seq_len} "
          f"tokens (bundled calibration text); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    lm = load_model(args.model, dtype="float32")
    ids = heldout_ids(lm)
    baseline = measure_reference(lm.model, ids, ctx=args.ctx, progress=False)
    ref = baseline.report
    rows = [{"label": "FP (fp16 file)", "perplexity": ref.perplexity, "kl": 0.0, "top1": 1.0, "bits": 16.0,
             "size": weight_file_bytes(lm.path)}]
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        from workbench.model.calibrate import calibrate
        from workbench.files.workspace import Workspace
        t0 = time.perf_counter()
        calibrate(lm, samples=args.samples, seq_len=args.seq_len, workspace=Workspace(Path(tmp) / "ws"), progress=False)
        calib_seconds = time.perf_counter() - t0
        for label, bits, method in METHODS:
            out = Path(tmp) / label.replace(" ", "-")
            cmd = [sys.executable, __file__, "--one", "--model", args.model, "--bits", str(bits), "--method", method,
                   "--group-size", str(args.group_size), "--samples", str(args.samples), "--seq-len",
                   str(args.seq_len), "--out", str(out), "--workspace", str(Path(tmp) / "ws")]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{label} failed:\n{proc.stderr[-3000:]}")
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            qlm, qm = load_quantized(out)
            cost = measure_cost(qm, baseline, candidate=qlm.model, saved_dir=out, progress=False)
            reports[label] = cost.report
            rows.append({"label": label, "perplexity": cost.perplexity, "dppl": cost.perplexity_change,
                         "dppl_se": cost.perplexity_change_stderr, "rel": cost.perplexity_change_relative,
                         "kl": cost.kl_divergence, "kl_se": cost.kl_divergence_stderr, "top1": cost.top1_agreement,
                         "bits": cost.bits_per_weight, "size": cost.size_bytes, **run})
    print(f"held-out text: {ref.tokens:,} scored tokens in {ref.windows} windows of {ref.ctx}; "
          f"{rows[1]['threads']} torch thread(s)\n")
    head = (f"{'':<15}{'perplexity':>11}{'change':>18}{'KL':>20}{'top-1':>8}{'bits/w':>8}{'size MB':>9}"
            f"{'time s':>8}{'peak RSS MB':>13}{'(+delta)':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        change = "" if "dppl" not in r else f"{r['dppl']:+.3f}±{r['dppl_se']:.3f} ({r['rel']:+.2%})"
        kl = "" if "kl_se" not in r else f"{r['kl']:.5f}±{r['kl_se']:.5f}"
        timing = "" if "seconds" not in r else (f"{r['seconds']:8.2f}{r['peak_rss_mb']:13.0f}"
                                                f"{r['peak_rss_mb'] - r['rss_before_mb']:+10.0f}")
        print(f"{r['label']:<15}{r['perplexity']:>11.3f}{change:>18}{kl:>20}{r['top1']:>8.2%}{r['bits']:>8.2f}"
              f"{r['size'] / 1e6:>9.2f}{timing}")
    print()
    for label in ("INT4 AWQ", "INT4 GPTQ", "INT4 AWQ+GPTQ"):
        d_nll, d_kl = (paired_difference(reports[label], reports["INT4 RTN"], k) for k in ("nll", "kl"))
        print(f"{label} - INT4 RTN, per token over {d_nll['windows']} windows: log-perplexity "
              f"{d_nll['mean']:+.5f} ± {d_nll['stderr']:.5f} (s.e.), KL {d_kl['mean']:+.6f} ± {d_kl['stderr']:.6f} "
              "(s.e.)")
    a = rows[3]
    print(f"AWQ: {a['awq_tokens']:,} search tokens, calibration statistics {calib_seconds:.1f} s "
          f"(not in the AWQ time); alphas per group: {a['awq_alphas']}")
    fp32 = a["fp32_model_mb"]
    worst = max(rows[1:], key=lambda r: r["peak_rss_mb"] - r["rss_before_mb"] - r["forward_mb"])
    extra = worst["peak_rss_mb"] - worst["rss_before_mb"] - worst["forward_mb"]
    print(f"memory: peak RSS is the timed run's own; (+delta) is what it added to the process holding the loaded "
          f"model ({a['rss_before_mb']:.0f} MB, settled); the runtime's working set, one decoder forward on "
          f"{args.seq_len} tokens, adds {a['forward_mb']:.0f} MB. Worst method ({worst['label']}): FP32 model "
          f"{fp32:.1f} MB + {extra:.0f} MB beyond that working set = {fp32 + extra:.0f} MB; "
          f"target < 3 x FP32 = {3 * fp32:.0f} MB: {'yes' if fp32 + extra < 3 * fp32 else 'NO'}")
    i8 = rows[1]
    verdict = lambda ok: "yes" if ok else "NO"  # noqa: E731
    print(f"targets: INT8 RTN rise < 1% relative: {verdict(i8['rel'] < 0.01)}; INT4 AWQ <= INT4 RTN in KL: "
          f"{verdict(rows[3]['kl'] <= rows[2]['kl'])}, in perplexity: {verdict(rows[3]['perplexity'] <= rows[2]['perplexity'])}; "
          f"RTN < 5 s: {verdict(max(rows[1]['seconds'], rows[2]['seconds']) < 5)}; AWQ < 60 s: "
          f"{verdict(rows[3]['seconds'] < 60)}; GPTQ < AWQ in KL: {verdict(rows[4]['kl'] < rows[3]['kl'])}, "
          f"GPTQ < 120 s: {verdict(rows[4]['seconds'] < 120)}")


if __name__ == "__main__":
    main()
