"""Why layers are hard on trained models: the sensitivity sweep at llama.cpp's Q4_0 layout beside each layer's
traits (input outlier channels, heavy-tailed weights, place), on the real models of bench/real_models.py.

    python bench/layer_difficulty.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--tokens 1024] [--score kl]

Per model (fetched as bench/real_models.py does): calibration statistics from the bundled calibration text,
every layer quantized alone at int4 in 32-weight groups on the 16-level grid with the scale search (the layout
the workbench writes as Q4_0) and its KL measured on the held-out text (``--score proxy``: the Fisher
estimate, one pass), then ``workbench.precision.layer_difficulty``: the hardest layers with what stands out about them,
each trait's rank correlation with the damage, and the damage's share by place and by layer type. The chart
(``make_difficulty_figure``) is written beside the models as NAME-difficulty.html. Wall time and peak memory
of each step are printed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
import real_models  # noqa: E402  (fetch, texts, step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(real_models.MODELS))
    ap.add_argument("--root", type=Path, default=Path("workspace/real-models"))
    ap.add_argument("--tokens", type=int, default=1024, help="held-out tokens each trial is scored on")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--samples", type=int, default=64, help="calibration samples for the input statistics")
    ap.add_argument("--score", choices=("kl", "proxy"), default="kl")
    ap.add_argument("--top", type=int, default=12, help="hardest layers listed")
    ap.add_argument("--json", type=Path, help="also write every row and summary here")
    args = ap.parse_args()
    from workbench.model.calibrate import calibrate
    from workbench.charts.precision import make_difficulty_figure
    from workbench.precision.layer_difficulty import difficulty_summary, layer_difficulty
    from workbench.model.load import load_model
    from workbench.precision.sensitivity import run_sensitivity
    from workbench.files.workspace import Workspace

    everything = {}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        path = real_models.fetch(name, args.root)
        lm = load_model(str(path), dtype="float32")
        _cut, calib_text, ids = real_models.texts(args.root, lm, args.tokens)
        times = [real_models.step(print, f"{name}: fetch, load, texts", t0)]
        t0 = time.perf_counter()
        _set, stats = calibrate(lm, calib_text, samples=args.samples, seq_len=256,
                                workspace=Workspace(args.root / "ws"), progress=False)
        times.append(real_models.step(print, "calibration statistics", t0))
        t0 = time.perf_counter()
        report = run_sensitivity(lm, ids=ids, tokens=args.tokens, precisions=("int4",), group_size=32,
                                 symmetric=True, scale_search=True, full_range=True, ctx=args.ctx, score=args.score,
                                 progress=False)
        times.append(real_models.step(print, f"sensitivity ({report.score_label}, {len(report.layers)} layers)", t0))
        rows = layer_difficulty(lm, report, stats)
        summary = difficulty_summary(rows)
        print(f"\n## {name}: {len(rows)} layers at int4 (Q4_0's layout), {report.score_label} on {report.tokens} "
              "held-out tokens\n")
        print("| layer | KL alone | share | input max/median | weight max/RMS | weight kurtosis | what stands out |")
        print("|---|---|---|---|---|---|---|")
        for r in rows[:args.top]:
            ratio = "" if r.input_max_to_median is None else f"{r.input_max_to_median:.0f}"
            print(f"| {r.name} | {r.damage:.5f} | {100 * r.share:.1f}% | {ratio} | {r.weight_max_to_rms:.1f} | "
                  f"{r.weight_kurtosis:.1f} | {'; '.join(r.why)} |")
        corr = ", ".join(f"{k} {v:+.2f}" if v is not None else f"{k} n/a" for k, v in summary["correlation"].items())
        print(f"\nrank correlation with the damage over the block layers: {corr}")
        print("share of the damage: " + ", ".join(f"{k} {100 * v['share']:.1f}% ({v['layers']} layers)"
                                                 for k, v in summary["places"].items()))
        print("by layer type: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in summary["roles"].items()))
        html = args.root / f"{name}-difficulty.html"
        make_difficulty_figure(rows, score_label=report.score_label).write_html(str(html), include_plotlyjs=True)
        print(f"chart: {html}")
        everything[name] = {"rows": [r.to_dict() for r in rows], "summary": summary, "times": times,
                            "tokens": report.tokens, "score": report.score}
        del lm, stats, report
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
