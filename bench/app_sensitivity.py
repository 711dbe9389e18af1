"""How long the app's Precisions tab takes to answer "which layers hurt", on the demo model.

    python bench/app_sensitivity.py              # the default: Fisher estimate at INT8 / INT4, then the chart
    python bench/app_sensitivity.py --measured   # also the measured sweep at the same precisions (minutes)

Presses what the app's **Run sensitivity** button presses (``WorkbenchApp.run_sensitivity``) with the
tab's default choices: the one-pass Fisher estimate of every layer alone at INT8 and INT4 on the app's
256 tokens, then uniform INT8 / INT4 and two automatic plans measured for the size-against-damage
chart. Each timed run uses a fresh workspace (nothing read from a cache); one untimed run in another
fresh workspace comes first, so the figure is after warm-up. The goal: under 30 s on a 2-core CPU.
Prints one JSON object: seconds for the estimate, for the chart, in all, the measured sweep's when asked, and
the machine's 1-minute load average at the end (a figure taken under others' load is not this code's speed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.ui.app import WorkbenchApp  # noqa: E402
from workbench.files.workspace import Workspace  # noqa: E402

GOAL_SECONDS = 30.0


def press(model: str, root: Path, score: str, frontier: bool) -> dict:
    """One press of Run sensitivity in a fresh app on a fresh workspace under ``root``."""
    app = WorkbenchApp(model, workspace=Workspace(root / "workspace"), out_dir=root / "run")
    if app.load() is None:
        raise SystemExit(f"could not load {model}: {app.error}")
    app.sweep_how.value = score
    t0 = time.perf_counter()
    report = app.run_sensitivity(frontier=frontier)
    total = time.perf_counter() - t0
    if report is None:
        raise SystemExit(f"the sensitivity run failed: {app.error}")
    points = app.override_panel.points
    return {"score": report.score, "precisions": list(report.precisions), "tokens": report.tokens,
            "layers": len(report.layers), "estimate_seconds": round(report.seconds, 2),
            "chart_seconds": round(sum(p.seconds for p in points), 2), "total_seconds": round(total, 2),
            "chart_points": [{"label": p.label, "bits_per_weight": round(p.bits_per_weight, 3),
                              "kl": p.kl_divergence, "predicted_kl": p.predicted_kl} for p in points]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--measured", action="store_true", help="also time the measured sweep (no chart)")
    ap.add_argument("--no-warmup", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-app-sensitivity-") as tmp:
        tmp = Path(tmp)
        if not args.no_warmup:
            press(args.model, tmp / "warmup", "proxy", frontier=True)
        result = {"model": args.model, "default": press(args.model, tmp / "default", "proxy", frontier=True),
                  "goal_seconds": GOAL_SECONDS}
        result["within_goal"] = result["default"]["total_seconds"] < GOAL_SECONDS
        result["load_average_1min"] = round(os.getloadavg()[0], 2)  # others' work on a shared machine slows it
        if args.measured:
            result["measured"] = press(args.model, tmp / "measured", "kl", frontier=False)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
