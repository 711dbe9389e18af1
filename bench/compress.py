"""Compression beyond quantization on the demo model: prune, quantize, distil, and what each step cost.

    python bench/compress.py [--heads 0.25] [--mlp 0.2] [--steps 100] [--out /tmp/compress-bench]

The plan removes ``--heads`` of the model's heads and ``--mlp`` of its MLP channels from the middle
layers (the first and last stay whole unless ``--prune-first-last``), the least important units
wherever they are (``--spread global``), so layers keep different counts; MLP widths stay multiples
of 32. Rows: float, uniform INT4 (RTN, group 32 by default: every pruned width divides), pruned,
pruned + INT4, pruned + distilled, pruned + INT4 + distilled (quantization-aware distillation, then
the same INT4 quantization). Every row is scored
on the whole bundled held-out text (windows of 512) against the float model: perplexity and KL with
their standard errors, and paired differences (per-window) between the rows compared. The pruned
directory is also loaded back, its parameters compared with the plan's prediction, and exported to
ONNX with the parity check. Distillation trains on the bundled calibration text only.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--heads", type=float, default=0.25, help="fraction of the model's heads removed")
    ap.add_argument("--mlp", type=float, default=0.2, help="fraction of the model's MLP channels removed")
    ap.add_argument("--head-unit", default="group")
    ap.add_argument("--spread", default="global", help="global (default) or layer: see PrunePlan")
    ap.add_argument("--prune-first-last", action="store_true", help="prune the first and last layers too")
    ap.add_argument("--group-size", type=int, default=32, help="INT4 group size")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="/tmp/compress-bench")
    args = ap.parse_args()

    from workbench.compress.distill import DistillConfig, distill
    from workbench.evaluation.evaluate import capture_reference, paired_difference
    from workbench.onnx.export import export_onnx
    from workbench.model.load import load_model
    from workbench.quantize.plan import QuantPlan
    from workbench.compress.prune import PrunePlan, head_and_channel_importance, measure_point, prune
    from workbench.quantize import quantize_model
    from workbench.precision.sensitivity import evaluation_tokens
    from workbench.files.workspace import Workspace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    lm = load_model(args.model)
    ids = evaluation_tokens(lm)
    ref = capture_reference(lm.model, ids, ctx=512, progress=False)
    int4 = QuantPlan.uniform("int4", group_size=args.group_size)
    rows, timings = [], {}

    def quantized(src):
        qm = quantize_model(src, int4, method="rtn", progress=False)
        return qm.build_model(), src.size_bytes(int4), qm.bits_per_weight, src.parameters

    rows.append(measure_point("float", lm.model, ids, ref, size_bytes=lm.size_bytes(precision="fp16"),
                              bits_per_weight=16.0))
    m, size, bpw, n = quantized(lm)
    rows.append(measure_point("INT4", m, ids, ref, size_bytes=size, bits_per_weight=bpw, parameters=n))

    t0 = time.perf_counter()
    plan = PrunePlan(heads=args.heads, mlp=args.mlp, head_unit=args.head_unit, spread=args.spread,
                     keep_first_last=not args.prune_first_last)
    importance = head_and_channel_importance(lm, workspace=Workspace(out / "workspace"), progress=False)
    pr = prune(lm, plan, out / "pruned", importance=importance, evaluate_tokens=None, progress=False)
    timings["prune (importance with KL per masked head + slicing + save)"] = time.perf_counter() - t0
    pruned = load_model(out / "pruned")
    counted = sum(p.numel() for p in {id(p): p for p in pruned.model.parameters()}.values())
    rows.append(measure_point("pruned", pruned.model, ids, ref, size_bytes=pruned.size_bytes(precision="fp16"),
                              bits_per_weight=16.0))
    m, size, bpw, n = quantized(pruned)
    rows.append(measure_point("pruned + INT4", m, ids, ref, size_bytes=size, bits_per_weight=bpw, parameters=n))

    cfg = DistillConfig(steps=args.steps, lr=args.lr)
    t0 = time.perf_counter()
    d = distill(out / "pruned", lm, out / "distilled", cfg, progress=False, overwrite=True)
    timings["distill (float student)"] = time.perf_counter() - t0
    dist = load_model(out / "distilled")
    rows.append(measure_point("pruned + distilled", dist.model, ids, ref,
                              size_bytes=dist.size_bytes(precision="fp16"), bits_per_weight=16.0))
    t0 = time.perf_counter()
    dq = distill(out / "pruned", lm, out / "distilled-int4", cfg, plan=int4, progress=False, overwrite=True)
    timings["distill (quantization-aware, INT4)"] = time.perf_counter() - t0
    qat = load_model(out / "distilled-int4")
    m, size, bpw, n = quantized(qat)
    rows.append(measure_point("pruned + INT4 + distilled", m, ids, ref, size_bytes=size, bits_per_weight=bpw,
                              parameters=n))

    t0 = time.perf_counter()
    ex = export_onnx(pruned, out / "onnx", greedy_steps=16)
    timings["export pruned to ONNX + parity"] = time.perf_counter() - t0

    by = {r["label"]: r for r in rows}
    print(f"model {args.model}: {pr['summary']}")
    print(f"asked to remove {args.heads:.0%} of heads and {args.mlp:.0%} of MLP channels; removed "
          f"{pr['heads_removed']:.1%} of query heads ({pr['kv_heads_removed']:.1%} of KV heads) and "
          f"{pr['mlp_removed']:.1%} of MLP channels (whole units; widths multiples of {plan.mlp_multiple})")
    print(f"parameters: plan predicts {pr['parameters_predicted']:,}, the saved directory holds {counted:,} "
          f"({'match' if counted == pr['parameters_predicted'] else 'MISMATCH'})")
    disk = lambda p: sum(f.stat().st_size for f in Path(p).glob("*.safetensors"))  # noqa: E731
    print(f"model.safetensors: {disk(lm.path):,} B -> {disk(out / 'pruned'):,} B")
    print(f"KL with each KV group masked alone ({importance.kl_tokens:,} held-out tokens), per layer: "
          + "; ".join(f"layer {i}: " + ", ".join(f"{v:.3f}" for v in row) for i, row in enumerate(importance.kl_groups))
          + f"; kept groups {pr['kept']['heads']} (by {plan.score})")
    print(f"ONNX export of the pruned model: max |diff| vs PyTorch {ex.max_abs_diff:.2e}, greedy decoding "
          f"{ex.greedy_match_steps}/{ex.greedy_steps} tokens equal")
    print(f"\nheld-out text: {rows[0]['tokens']:,} tokens scored in windows of 512\n")
    print("| model | bytes | bits/w | parameters | perplexity | KL vs float | top-1 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['size_bytes']:,} | {r['bits_per_weight']:.2f} | {r['parameters']:,} | "
              f"{r['perplexity']:.2f} ± {r['perplexity_stderr']:.2f} | "
              f"{r['kl_divergence']:.4f} ± {r['kl_stderr']:.4f} | {r['top1_agreement']:.3f} |")
    cost = paired_difference(by["pruned"]["report"], by["float"]["report"])
    won = paired_difference(by["pruned"]["report"], by["pruned + distilled"]["report"])
    share = won["mean"] / cost["mean"]
    share_se = share * ((won["stderr"] / won["mean"]) ** 2 + (cost["stderr"] / cost["mean"]) ** 2) ** 0.5
    print(f"\npruning raised log-perplexity by {cost['mean']:.4f} ± {cost['stderr']:.4f} nats/token; distillation "
          f"won back {won['mean']:.4f} ± {won['stderr']:.4f}: {share:.0%} ± {share_se:.0%} of it "
          f"(perplexity {by['pruned']['perplexity']:.2f} -> {by['pruned + distilled']['perplexity']:.2f}, float "
          f"{by['float']['perplexity']:.2f})")
    kl = paired_difference(by["pruned + INT4 + distilled"]["report"], by["pruned + INT4"]["report"], "kl")
    print(f"pruned + INT4 + distilled minus pruned + INT4, KL: {kl['mean']:+.4f} ± {kl['stderr']:.4f} nats/token "
          f"({kl['windows']} windows)")
    print(f"distillation: {args.steps} steps x {cfg.batch_size} windows of {cfg.seq_len} tokens, lr {cfg.lr:g}, "
          f"T {cfg.temperature:g} decaying {cfg.temperature_decay:.0%}/epoch; kept step {d.best_step} (float), "
          f"{dq.best_step} (INT4-aware) by KL on {d.validation_windows} held-back windows")
    for k, v in timings.items():
        print(f"time {k}: {v:.0f} s")
    print(f"time in all: {time.perf_counter() - t_all:.0f} s")
    (out / "compress.json").write_text(json.dumps({
        "rows": [{k: v for k, v in r.items() if k != "report"} for r in rows], "pruning": pr,
        "recovered": {"cost": cost, "won": won, "share": share, "share_stderr": share_se}, "kl_qat_vs_ptq": kl,
        "timings": timings}, indent=2, default=str))


if __name__ == "__main__":
    main()
