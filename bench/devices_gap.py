"""The simulation-to-device gap for one plan: the workbench's PyTorch simulation beside CPU onnxruntime (ort-qdq's
QDQ graphs), MNN, the Hexagon HTP emulator (onnxruntime-qnn) and the RKNN simulator (rknn-toolkit2), each scored
against the float model (KL, top-1) for prefill and decode where it has them, with file size, time and peak memory.

    python bench/devices_gap.py                                    # demo model, INT8, 8 Gen 3
    python bench/devices_gap.py --bits 4 --max-tokens 4096 --html gap.html
    python bench/devices_gap.py --shape qwen2.5-0.5b --layers 2    # the 2-block Qwen2.5-0.5B shape
    python bench/devices_gap.py --model demo-vl --bits 4           # a VLM: the vision-language rows

Each target runs in a child process of its own, so its peak resident memory is its own (RKNN: the larger of
that process and the toolkit's subprocess). A graph whose KL to the float model exceeds the simulation's by
``GAP_KL_RATIO`` (+ ``GAP_KL_FLOOR``), or whose top-1 agreement with the simulation is below ``GAP_TOP1``
(the rules ``workbench.targets.convert`` flags conversions by), or that differs from CPU QDQ on the HTP by more than
``HTP_GAP_KL`` (``convert --target qnn --soc``'s rule), is flagged. A target whose toolchain is not installed
is a row saying what to install. The measuring is ``workbench.run.devices_gap`` (the app's Export tab and
``workbench report`` use it too); this is its command line. The rows are also written to
``WORK/devices_gap.json``.

A vision-language model (``--model demo-vl``, or a VL ``--shape``) gets the vision-language rows instead
(``workbench.run.vl_gap``): per target with a vision form, the image embeddings' cosine and relative error, the
answer-token KL and top-1, image-text matching, encoder ms and decode tok/s, with time and peak memory per target.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.run.devices_gap import HTP_WINDOWS, PROMPT, TARGETS, format_table, measure_devices_gap  # noqa: E402
from workbench.cli.common import add_backend_arguments, backend_from_args  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--shape", help="a bench/shapes.py shape instead of --model (e.g. qwen2.5-0.5b)")
    ap.add_argument("--layers", type=int, default=2, help="blocks of --shape (default 2)")
    ap.add_argument("--bits", type=int, default=8, choices=(4, 8), help="the uniform plan (default 8: INT8)")
    ap.add_argument("--plan", help="a plan file instead of --bits")
    ap.add_argument("--soc", default="8gen3", help="Snapdragon device profile for the HTP (default 8gen3)")
    ap.add_argument("--max-tokens", type=int, help="score the simulation, ort-qdq and MNN on the first N held-out "
                                                   "tokens (default: all)")
    ap.add_argument("--windows", type=int, default=HTP_WINDOWS, help=f"128-token windows the HTP scores (default "
                                                                    f"{HTP_WINDOWS}; the first also decoded)")
    ap.add_argument("--prompt", type=int, default=PROMPT, help=f"HTP decode after this many tokens (default {PROMPT})")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--pictures", type=int, help="a VLM: score only the first N held-out questions and captioned "
                    "pictures (default: all)")
    ap.add_argument("--html", help="also write the chart (plotly) here")
    ap.add_argument("--work", help="folder for what the targets write (default: a temporary one)")
    add_backend_arguments(ap, "the targets")
    args = ap.parse_args(argv)
    args.targets = args.targets.split(",")
    from workbench.run.vl_gap import VL_TARGETS
    unknown = [t for t in args.targets if t not in TARGETS and t not in VL_TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)} (a VLM: "
                 f"{', '.join(VL_TARGETS)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-devices-gap-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.shape:
        from shapes import build_shape
        model = str(build_shape(args.shape, work / f"{args.shape}-{args.layers}", layers=args.layers))
    from workbench.model.load import resolve_model_path
    from workbench.run.profile import is_vision_folder
    if is_vision_folder(resolve_model_path(model)):
        return _vision(args, model, work)
    try:
        gap = measure_devices_gap(model, plan=args.plan, bits=None if args.plan else args.bits, targets=args.targets,
                                  soc=args.soc, max_tokens=args.max_tokens, windows=args.windows, prompt=args.prompt,
                                  work=work, log=lambda m: print(m, flush=True), backend=backend_from_args(args))
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = f"{args.shape} ({args.layers} blocks)" if args.shape else model
    what = f"plan {gap.plan_hash}" if args.plan else f"INT{args.bits} plan"
    print(f"\n{name}, {what}; KL / top-1 against the float model\n")
    print(format_table(gap.rows))
    if args.html:
        from workbench.charts.graph import make_device_gap_figure
        make_device_gap_figure(gap.rows).write_html(args.html, include_plotlyjs=True)
        print(f"\nchart: {args.html}")
    print(f"files under {work} (the rows: {work / 'devices_gap.json'})")
    return 0


def _vision(args, model: str, work: Path) -> int:
    import time
    from workbench.quantize.plan import QuantPlan
    from workbench.run.devices_gap import DevicesGap
    from workbench.run.vl_gap import VL_TARGETS, format_vl_table, measure_vl_rows, vl_plan
    asked = args.targets != list(TARGETS)  # the default: every VL target
    targets = [t for t in args.targets if t in VL_TARGETS] if asked else list(VL_TARGETS)
    if not targets:
        print(f"error: none of {', '.join(args.targets)} has a vision-language row; choose from "
              f"{', '.join(VL_TARGETS)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        plan = vl_plan(model, QuantPlan.load(args.plan) if args.plan else None, None if args.plan else args.bits)
        rows = measure_vl_rows(model, plan=plan, targets=targets, work=work, pictures=args.pictures,
                               log=lambda m: print(m, flush=True))
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gap = DevicesGap(model, plan.to_dict(), plan.content_hash(), args.soc, args.max_tokens, args.windows,
                     work_dir=str(work.resolve()), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     seconds=time.perf_counter() - t0, complete=True, vl_rows=rows)
    gap.save()
    print(f"\n{model}, plan {gap.plan_hash} (vision encoder and projector int8 unless the plan says otherwise); "
          "against the float model on the held-out pictures\n")
    print(format_vl_table(rows))
    for r in rows:
        if r["seconds"] is not None:
            print(f"{r['target']}: {r['seconds']:.1f} s, peak {r['peak_bytes'] / 1e6:,.0f} MB")
    print(f"files under {work} (the rows: {work / 'devices_gap.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
