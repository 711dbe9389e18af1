"""List the device profiles (assets/devices/*.json and $WORKBENCH_DEVICES) with every figure and its source.

    workbench devices
    workbench devices --json
"""
from __future__ import annotations

from ..devices import LIST_FIELDS, NUMBER_FIELDS, load_devices
from .common import add_json_flag, print_json

HELP = "list device profiles and where each figure comes from"


def add_arguments(p):
    p.add_argument("--sources", action="store_true", help="print the source (or reason) of every figure")
    add_json_flag(p)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return ",".join(v) if isinstance(v, tuple) else f"{v:g}"


def run(args) -> int:
    devices = load_devices()
    if args.json:
        print_json([d.to_dict() for d in devices.values()])
        return 0
    cols = [("GB/s", "memory_bandwidth_gbps"), ("INT8 TOPS", "npu_int8_tops"), ("FP16 TOPS", "npu_fp16_tops"),
            ("RAM GB", "ram_gb"), ("NPU limit GB", "npu_memory_limit_gb"), ("weights", "weight_precisions")]
    header = f"{'device':<20} {'name':<22} {'class':<13}" + "".join(f"{c:>13}" for c, _ in cols[:-1]) + "  weights"
    print(header)
    print("-" * len(header))
    for d in devices.values():
        print(f"{d.key:<20} {d.name:<22} {d.device_class:<13}"
              + "".join(f"{_fmt(getattr(d, f)):>13}" for _, f in cols[:-1]) + f"  {_fmt(d.weight_precisions)}")
        if args.sources:
            for f in (*NUMBER_FIELDS, *LIST_FIELDS):
                print(f"    {f}: {d.source(f)}")
    print("- : no source gives it (`--sources` says why). Add a device: one JSON file in $WORKBENCH_DEVICES.")
    return 0
