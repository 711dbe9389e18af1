"""List the device profiles (assets/devices/*.json and $WORKBENCH_DEVICES) with every figure and its source.

    workbench devices
    workbench devices --json
"""
from __future__ import annotations

from ..devices.profiles import LIST_FIELDS, NUMBER_FIELDS, load_devices, replacement_note
from ..units import text_table
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
            ("RAM GB", "ram_gb"), ("NPU limit GB", "npu_memory_limit_gb")]
    rows = [("device", "name", "class", *(c for c, _ in cols), "weights")]
    rows += [(d.key, d.name, d.device_class, *(_fmt(getattr(d, f)) for _, f in cols), _fmt(d.weight_precisions))
             for d in devices.values()]
    lines = text_table(rows, right=range(3, 3 + len(cols)), rule="-").splitlines()
    print("\n".join(lines[:2]))
    for d, line in zip(devices.values(), lines[2:]):
        print(line)
        if args.sources:
            for f in (*NUMBER_FIELDS, *LIST_FIELDS):
                print(f"    {f}: {d.source(f)}")
    print("- : no source gives it (`--sources` says why). Add a device: one JSON file in $WORKBENCH_DEVICES.")
    for d in devices.values():
        if replacement_note(d):
            print(f"note: {replacement_note(d)}")
    return 0
