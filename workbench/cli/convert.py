"""Convert a model for a deployment target, run the result, and compare it with the float model and the simulation.

    workbench convert demo --bits 4 --target ort-int4 --out out/int4
    workbench convert demo --bits 4 --target ort-genai --out out/genai    # one fused graph, onnxruntime-genai runs it
    workbench convert out/demo-int4 --target mnn --out out/mnn --json     # a `workbench quantize` output
    workbench convert demo --plan plan.json --target qnn --out out/qnn    # bundle + measured QDQ twin
    workbench convert demo --bits 8 --target qnn --soc 8gen3 --split-limit-mib 4 --out out/qnn   # in parts

JSON: files, kl_divergence and top1_agreement (against the float model),
top1_agreement_vs_simulation (against the workbench's own quantized model), and the simulation's numbers.
Models over ~0.5 M parameter-tokens of text are evaluated on a token budget (1,024 tokens for a 0.5 B
model) unless --max-tokens says otherwise; the output says when.
"""
from __future__ import annotations

from pathlib import Path

from ..targets.convert import CONVERT_TARGETS, convert, write_conversion_json
from ..units import format_bytes
from ..files.workspace import check_output_dir, rebase_paths, staged_output
from .common import count, number, add_device_argument, add_json_flag, add_model_argument, print_json
from .export import parse_static

CONVERT_FORMAT = "workbench-convert"  # the kind named in the manifest of a conversion's --out
HELP = ("convert for a target (ort-genai, ort-int4, ort-qdq, mnn, qnn, tensorrt, rknn) and compare with the "
        "simulation")


def add_arguments(p):
    add_model_argument(p, "a float model directory or 'demo' (with --plan or --bits), or a `workbench quantize` "
                          "output directory")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--plan", help="quantization plan JSON for a float model")
    group.add_argument("--bits", type=int, choices=(2, 3, 4, 5, 6, 8), help="uniform INTn plan for a float model "
                       "(each target's rule says which widths it carries)")
    p.add_argument("--target", required=True, choices=CONVERT_TARGETS)
    p.add_argument("--out", required=True, help="output directory: new, empty, or an earlier `workbench convert` "
                   "output (replaced once the new one is written and measured)")
    p.add_argument("--text", help="evaluation text (default: the demo model's held-out text)")
    p.add_argument("--max-tokens", type=count(2),
                   help="evaluate on the first N tokens (default: the whole text for small models, a budget of at "
                        "least 1,024 tokens for big ones)")
    p.add_argument("--ctx", type=count(2), help="evaluation window (default 512 or the model's maximum)")
    p.add_argument("--activation-bits", type=int, choices=(8, 16), default=16, help="QDQ/QNN activations (default 16)")
    p.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=4,
                   help="MatMulNBits accuracy_level: 4 = int8 activation compute (fast), 0 = float (default 4)")
    p.add_argument("--static", metavar="SEQ,PAST", help="static shapes for qnn, ort-qdq and rknn (default 128,512)")
    p.add_argument("--soc", metavar="DEVICE", help="qnn: the Snapdragon to compile for and run on with "
                   "onnxruntime-qnn's HTP emulator, a `workbench devices` name or alias (8gen3, 8gen2, 8elite, 8gen1, "
                   "x-elite): context binaries for it, prefill and decode scored on it")
    p.add_argument("--split-limit-mib", type=number(0, low_open=True), metavar="MIB",
                   help="qnn with --soc: each context binary under this many MiB instead of the SoC's own limit "
                        "(2 GiB before HTP v73, 4 GiB from v73); a graph over it is split into numbered parts "
                        "listed in parts.json")
    add_device_argument(p)  # the PyTorch models; graphs and onnxruntime run on the CPU
    add_json_flag(p)


def run(args) -> int:
    static = parse_static(args.static)
    check_output_dir(args.out, CONVERT_FORMAT)
    # converted and measured beside --out, swapped in only when the whole conversion has succeeded
    with staged_output(args.out, CONVERT_FORMAT) as staged:
        report = convert(args.model, args.target, staged, plan=args.plan, bits=args.bits, text=args.text,
                         max_tokens=args.max_tokens, ctx=args.ctx, activation_bits=args.activation_bits,
                         accuracy_level=args.accuracy_level, static=static,
                         progress=not args.json, log=None if args.json else print, device=args.device,
                         soc=args.soc,
                         split_limit_bytes=int(args.split_limit_mib * 2**20) if args.split_limit_mib else None)
        report = rebase_paths(report, staged, Path(args.out))
        # the report names where the files will be once swapped in, not the staging directory
        write_conversion_json(report, staged)
    if args.json:
        print_json(report.to_dict())
        return 0
    for f in report.files:
        print(f"wrote {f['path']} ({format_bytes(f['bytes'])})")
    for n in report.notes:
        print(f"note: {n}")
    if report.runnable:
        s = report.simulation
        print(f"{'':<24} {'KL':>10} {'top-1 vs float':>15} {'perplexity':>11}")
        print(f"{'simulation':<24} {s['kl_divergence']:>10.5f} {s['top1_agreement']:>15.4f} {s['perplexity']:>11.3f}")
        print(f"{args.target:<24} {report.kl_divergence:>10.5f} {report.top1_agreement:>15.4f} "
              f"{report.perplexity:>11.3f}")
        d = report.decode
        if d:
            print(f"{args.target + ' decode':<24} {d['kl_divergence']:>10.5f} {d['top1_agreement']:>15.4f} "
                  f"{d['perplexity']:>11.3f}")
        print(f"top-1 agreement with the simulation: {report.top1_agreement_vs_simulation:.4f} "
              f"({report.eval_tokens:,} tokens, ctx {report.ctx}; measured on {report.measured_on})")
        if d:
            print(f"decode, teacher-forced after a {d['prompt']}-token prompt, every step ({d['tokens']:,} steps in "
                  f"{d['windows']} windows): top-1 with the simulation {d['top1_agreement_vs_simulation']:.4f}; "
                  f"the prefill graph on the same positions: KL {d['prefill_kl_divergence']:.5f}, top-1 "
                  f"{d['prefill_top1_agreement']:.4f} (measured on {d['measured_on']})")
        htp = report.details.get("htp", {}).get("measurement")
        if htp:
            print(f"on the HTP emulator ({report.details['htp']['soc']}):")
            for g in ("prefill", "decode"):
                m = htp[g]
                print(f"  {g:<8} vs float: KL {m['kl_vs_float']:.5f} top-1 {m['top1_vs_float']:.4f}; vs CPU QDQ: KL "
                      f"{m['kl_vs_simulation']:.2e} top-1 {m['top1_vs_simulation']:.4f} ({m['tokens']:,} positions)")
            parts = report.details["htp"].get("parts")
            split = (" in parts (" + ", ".join(f"{g} {len(d['parts'])}" for g, d in parts["graphs"].items()) + ")"
                     if parts else "")
            print(f"  context binaries {format_bytes(htp['context_bytes'])}{split}; compile "
                  f"{htp['compile_seconds']:.1f} s, run {htp['eval_seconds']:.1f} s, peak "
                  f"{format_bytes(htp['peak_rss_bytes'])}")
        if report.gap:
            print(f"GAP: {report.gap}")
    stages = ", ".join(f"{name.replace('_', ' ')} {sec:.1f}" for name, sec in report.details.get("seconds", {}).items())
    print(f"{report.seconds:.1f} s" + (f" ({stages})" if stages else ""))
    return 0
