"""Export a model to ONNX prefill and decode graphs with a KV cache, and check them against PyTorch.

    workbench export demo --out out/onnx
    workbench export demo --out out/onnx-static --static 128,511 --json
    workbench export out/demo-int4 --out out/onnx-int4     # a `workbench quantize` output: its simulated weights
"""
from __future__ import annotations

from pathlib import Path

from ..errors import WorkbenchError
from ..onnx.export import DEFAULT_OPSET, export_onnx
from ..model.load import load_model
from ..units import format_bytes
from ..files.workspace import check_output_dir, rebase_paths, staged_output
from .common import count, add_device_argument, add_json_flag, add_model_argument, print_json

HELP = "ONNX prefill/decode graphs with KV cache, checked against PyTorch"
EXPORT_FORMAT = "workbench-onnx-export"  # the kind named in the manifest of an export's --out


def parse_static(value: str | None) -> tuple[int, int] | None:
    """``"128,512"`` -> (128, 512); refused in the option's own terms (SEQ is also the window a conversion scores,
    where one token is predicted from another, so at least 2; PAST at least 1)."""
    if not value:
        return None
    try:
        seq, past = (int(v) for v in value.split(","))
    except ValueError:
        raise WorkbenchError(f"--static must be SEQ,PAST (two integers, e.g. 128,512), got '{value}'") from None
    if seq < 2 or past < 1:
        raise WorkbenchError(f"--static {value}: SEQ (prompt tokens a prefill graph takes, also the window its "
                             "scores are measured on) must be at least 2 and PAST (cached tokens a decode graph "
                             "takes) at least 1, e.g. 128,512")
    return seq, past


def add_arguments(p):
    add_model_argument(p, "a local Hugging Face model directory, 'demo', or a `workbench quantize` output directory")
    p.add_argument("--out", required=True, help="directory for prefill.onnx, decode.onnx and weight_names.json: new, "
                   "empty, or an earlier `workbench export` output (replaced once the new one is checked)")
    p.add_argument("--static", metavar="SEQ,PAST", help="fixed shapes for NPU compilers, e.g. 128,511")
    p.add_argument("--opset", type=count(1), default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--steps", type=count(1), default=32, help="greedy decoding steps compared with PyTorch (default 32)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime checks")
    add_device_argument(p)
    add_json_flag(p)


def run(args) -> int:
    static = parse_static(args.static)
    check_output_dir(args.out, EXPORT_FORMAT)
    lm = load_model(args.model, device=args.device)  # a quantize output loads as its integer layers
    # built and checked beside --out, swapped in only when whole: a failure leaves no half-written graph there
    with staged_output(args.out, EXPORT_FORMAT) as staged:
        result = export_onnx(lm, staged, static=static, opset=args.opset, check=not args.no_check,
                             greedy_steps=args.steps, progress=None if args.json else print, release_model=True)
    result = rebase_paths(result, staged, Path(args.out))
    d = result.to_dict()
    out = {"model": str(lm.path), "files": d["files"], "max_abs_diff": result.max_abs_diff,
           "greedy_match_steps": result.greedy_match_steps, "greedy_steps": result.greedy_steps,
           "diffs": result.diffs, "static": d["static"], "opset": result.opset,
           "export_seconds": result.export_seconds, "check_seconds": result.check_seconds, "seconds": result.seconds,
           "weight_names": result.weight_names}
    if args.json:
        print_json(out)
        return 0
    for f in d["files"]:
        print(f"wrote {f['path']} ({format_bytes(f['bytes'])})")
    print(f"export {result.export_seconds:.1f} s, checks {result.check_seconds:.1f} s")
    if result.max_abs_diff is not None:
        print(f"onnxruntime vs PyTorch: max abs diff {result.max_abs_diff:.2e} "
              f"({', '.join(f'{k} {v:.1e}' for k, v in result.diffs.items())}); greedy tokens identical for "
              f"{result.greedy_match_steps}/{result.greedy_steps} steps")
    return 0 if result.greedy_match_steps in (None, result.greedy_steps) else 1
