"""Operator inventory and compatibility report of an ONNX graph for a deployment target.

    workbench inspect out/onnx/decode.onnx --target qnn
    workbench inspect out/onnx/prefill.onnx --target rknn --json

Exits 1 when the target would reject the graph (a finding of severity "error").
"""
from __future__ import annotations

from ..targets import TARGETS, inspect_graph
from ..units import format_bytes
from .common import add_json_flag, print_json
from ..targets.htp import soc_findings

HELP = "operator inventory and per-target compatibility of an ONNX graph"


def add_arguments(p):
    p.add_argument("onnx", metavar="MODEL.onnx", help="an ONNX file (e.g. written by `workbench export`)")
    p.add_argument("--target", required=True, choices=TARGETS, help="deployment target whose rules to apply")
    p.add_argument("--soc", metavar="DEVICE", help="qnn: also check what this Snapdragon's HTP generation runs "
                   "(a `workbench devices` name or alias: 8gen1, 8gen3, ...)")
    add_json_flag(p)


def run(args) -> int:
    report = inspect_graph(args.onnx, args.target)
    if args.soc:
        report.findings += soc_findings(args.onnx, args.soc)
    if args.json:
        print_json(report.to_dict())
        return 0 if report.ok else 1
    print(report.summary())
    print(f"initializers: {format_bytes(report.initializer_bytes)}; shapes {'static' if report.static else 'dynamic'}"
          + ("; constant-folded before checking" if report.folded else ""))
    print()
    print(f"{'op type':<28} {'domain':<16} {'opset':>5} {'count':>6}")
    for row in report.inventory:
        print(f"{row.op_type:<28} {row.domain:<16} {row.opset or '':>5} {row.count:>6}")
    if report.findings:
        print()
    for f in report.findings:
        nodes = f" [{', '.join(f.nodes[:3])}{', ...' if len(f.nodes) > 3 else ''}]" if f.nodes else ""
        print(f"{f.severity.upper():<8} {f.rule}: {f.message}{nodes}")
        print(f"         fix: {f.fix}")
    print()
    print("rules from: " + "; ".join(s["where"] for s in report.sources))
    return 0 if report.ok else 1
