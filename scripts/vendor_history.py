"""How AI Hub's own figure for one build moved between qai-hub-models releases: the same model, device, runtime,
precision and context, read from each release's wheel as the measurements file reads 0.65.0.

    pip download --no-deps qai-hub-models==0.60.0 ... qai-hub-models==0.65.0 -d wheels/   # no install
    python scripts/vendor_history.py wheels/*.whl --device "Snapdragon X Elite CRD" --runtime genie

Prints, per build measured in the newest wheel given, its decode tokens/s in each release that lists it ("=" where
the release repeats the one before), and per runtime on the device the median and largest change between a build's
figures: what a projection fitted to one release cannot be expected to beat.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vendor_measurements import qai_rows  # noqa: E402


def _version(wheel: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in wheel.name.split("-")[1].split(".") if x.isdigit())


def history(wheels: list[Path], device: str) -> dict[tuple, dict[str, float]]:
    """(model, runtime, precision, context) -> {release: decode tok/s} for the device, oldest release first."""
    out: dict[tuple, dict[str, float]] = {}
    for wheel in sorted(wheels, key=_version):
        release = ".".join(map(str, _version(wheel)))
        for r in qai_rows(wheel)[1]:
            if r["vendor_device"] == device:
                out.setdefault((r["model"], r["runtime"], r["precision"], r["context"]), {})[release] = r["decode_tps"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wheels", type=Path, nargs="+", help="qai-hub-models wheels, one per release")
    ap.add_argument("--device", required=True, help="AI Hub's device name, e.g. 'Snapdragon X Elite CRD'")
    ap.add_argument("--runtime", action="append", help="workbench runtime name(s) (default: genie and qairt)")
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args(argv)
    runtimes = args.runtime or ["genie", "qairt"]
    releases = [".".join(map(str, _version(w))) for w in sorted(args.wheels, key=_version)]
    hist = history(args.wheels, args.device)
    newest = releases[-1]
    print(f"{args.device}, decode tok/s at {args.context} tokens, per qai-hub-models release")
    print(f"{'model':<34} {'runtime':<8} " + " ".join(f"{r:>7}" for r in releases) + "   moved")
    for rt in runtimes:
        moves = []
        for (model, runtime, prec, ctx), fig in sorted(hist.items()):
            if runtime != rt or ctx != args.context or newest not in fig:
                continue
            cells, last = [], None
            for r in releases:
                v = fig.get(r)
                cells.append("-" if v is None else ("=" if v == last else f"{v:.1f}"))
                last = v if v is not None else last
            vals = list(fig.values())
            moved = max(vals) / min(vals) - 1
            moves.append(moved)
            print(f"{model + ' ' + prec:<34} {rt:<8} " + " ".join(f"{c:>7}" for c in cells) + f"   {moved:5.0%}")
        if moves:
            print(f"{'':<34} {rt:<8} a build's figures apart: median {statistics.median(moves):.0%}, "
                  f"largest {max(moves):.0%} ({len(moves)} builds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
