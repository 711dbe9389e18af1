"""Write a plan's per-layer precisions for a converter: QNN encodings, ONNX Runtime overrides, llama.cpp, MNN.

    workbench overrides plan.json --model demo --format qnn --out quant_overrides.json
    workbench overrides plan.json --model demo --format llamacpp --out tensor_types.txt

qnn and ort name tensors of the exported ONNX graph: the graph is exported to --onnx-dir (default
next to --out) unless that directory already holds an export. Whatever a format cannot express
is printed as a note.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from ..errors import PlanError
from ..model.load import load_model
from ..precision.overrides import OVERRIDE_FORMATS, write_overrides
from ..quantize.plan import QuantPlan
from .common import add_json_flag, print_json
from ..model.calibrate import calibrate

HELP = "write a plan as QNN encodings, ONNX Runtime overrides, llama.cpp --tensor-type or MNN quant config"


def add_arguments(p):
    p.add_argument("plan", help="plan JSON (from `workbench plan` or the override panel)")
    p.add_argument("--model", required=True, help="the model the plan is for: a local directory or 'demo'")
    p.add_argument("--format", required=True, choices=OVERRIDE_FORMATS, help="which converter to write for")
    p.add_argument("--out", required=True, help="file to write")
    p.add_argument("--onnx-dir", help="exported graph directory (qnn/ort; default: <out>-onnx next to --out)")
    p.add_argument("--activations", action="store_true",
                   help="qnn: add activation encodings from calibration statistics (runs or reuses `calibrate`)")
    add_json_flag(p)


def _graph(lm, onnx_dir: Path):
    """A previous export in ``onnx_dir`` (its weight_names.json), or a fresh one."""
    names = onnx_dir / "weight_names.json"
    prefill = onnx_dir / "prefill.onnx"
    if names.is_file() and prefill.is_file():
        doc = json.loads(names.read_text(encoding="utf-8"))
        if set(doc.get("weight_names", {})) == {info.name for info in lm.layers}:
            return SimpleNamespace(weight_names=doc["weight_names"], weight_layouts=doc.get("weight_layouts", {}),
                                   prefill_path=prefill)
    from ..onnx.export import export_onnx
    return export_onnx(lm, onnx_dir, check=False)


def run(args) -> int:
    plan = QuantPlan.load(args.plan)
    lm = load_model(args.model)
    out = Path(args.out)
    export = calibration = None
    if args.format in ("qnn", "ort"):
        onnx_dir = Path(args.onnx_dir) if args.onnx_dir else out.with_name(out.stem + "-onnx")
        export = _graph(lm, onnx_dir)
    if args.activations:
        if args.format != "qnn":
            raise PlanError("--activations applies to --format qnn only")
        _, calibration = calibrate(lm, progress=not args.json)
    result = write_overrides(args.format, out, lm, plan, export=export, calibration=calibration)
    if args.json:
        print_json({**result.to_dict(), "onnx": str(export.prefill_path) if export is not None else None})
        return 0
    print(f"wrote {result.path} ({args.format}, {result.tensors} tensors)")
    if export is not None:
        print(f"graph: {export.prefill_path}")
    print(f"use: {result.usage}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
