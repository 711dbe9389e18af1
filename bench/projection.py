"""The projection held against the vendors' own measurements, then the field's published claims.

    python bench/projection.py

First, per vendor device, runtime and precision (assets/vendor_measurements.json: Qualcomm AI Hub's and Rockchip's
measurements), the leave-one-model-out error of the fitted decode tokens/s, time to first token and peak memory
(median |projected / measured - 1| over every measurement, its model left out of the fit; goals 15%, 30%, 20%),
the effective bandwidth the decode fit implies, and the leave-one-device-out error a device without measurements
gets from its class. Then the issue's own cases projected by `workbench project` beside the vendors' figures.
Then the practitioners' claims:

Each case in assets/field_measurements.json (from shared/docs/FIELD.md) is projected from its model's shapes
(assets/model_shapes.json: "Qwen3-1.5B" does not exist, the Qwen3-1.7B shape stands in; "Qwen2.5-1.8B"
neither, Qwen2.5-1.5B stands in) at a 1,024-token context and a 128-token prompt. Decode is projected as the
bandwidth bound times the efficiency fitted to the device class's published cases; "error" is projected /
published - 1 in the fit, "held out" the same with the case left out of its own fit (no second case in the
class: none). A published figure above its bound is impossible and is not fitted.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.devices.profiles import get_device  # noqa: E402
from workbench.devices.projection import (DEFAULT_CONTEXT, check_claim, check_memory_claim, fit_efficiency,  # noqa: E402
                                  model_shape, plan_from_spec, project, published_measurements)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


GOALS = {"decode": 0.15, "ttft": 0.30, "memory": 0.20}  # the goals for a group measured on at least four models


def _twin_spread(f) -> float | None:
    """The largest gap between two measurements of one shape at one context (fine-tunes of one base, e.g. Qwen3-4B
    and Qwen3-4B-Instruct-2507): noise no model of shapes can follow."""
    by = {}
    for r in f.rows:
        by.setdefault((r["shape"], r["context"]), []).append(r["decode_tps"])
    gaps = [max(v) / min(v) - 1 for v in by.values() if len(v) > 1]
    return max(gaps) if gaps else None


def _fit_line(f, profiles: dict) -> str:
    """One (vendor device, runtime, precision): held-out errors (a '*' past its goal), the bandwidth the fit implies."""
    d = f.decode
    coef = dict(zip(f.decode_any.features, f.decode_any.coef))  # the one-rate fit: one effective bandwidth
    byte = coef.get("weights_gb", coef.get("weights_gb+kv_gb", 0.0))
    terms = " + ".join(f"{c:.2f}" + ("" if t == "1" else f"*{t}") for t, c in zip(d.features, d.coef))
    worst = max(abs(e) for e in d.held_out) if d.held_out else None
    errs = {w: getattr(f, w).median_error if getattr(f, w) else None for w in GOALS}
    marks = {w: _pct(e) + ("*" if e is not None and len(f.models) >= 4 and e > GOALS[w] else " ")
             for w, e in errs.items()}
    other = f"{_pct(f.decode_any.family_error)}/{_pct(f.ttft.family_error if f.ttft else None)}"
    ref = f.rows[0].get("reference_chipset")
    profile = f.device or (f"= {ref.removeprefix('qualcomm-')}" if ref else "-")
    return (f"{f.vendor_device:<24} {f.runtime:<14} {f.precision:<10} {len(f.models):>6} {len(f.rows):>4}  "
            f"{marks['decode']:>8} {_pct(worst):>5} {_pct(_twin_spread(f)):>6}  {marks['ttft']:>7}  {marks['memory']:>7}  "
            f"{other:>9}  "
            f"{(1e3 / byte if byte else float('nan')):>9.1f}  {profile:<30} {terms}")


def _tally(fits: list, label: str) -> str:
    """How many groups meet each goal, a device AI Hub lists by its reference chipset counted once (it repeats it)."""
    own = [f for f in fits if not f.rows[0].get("reference_chipset")]
    parts = []
    for what, goal in GOALS.items():
        errs = [getattr(f, what).median_error for f in own
                if getattr(f, what) and getattr(f, what).median_error is not None]
        parts.append(f"{what} {sum(e <= goal for e in errs)} of {len(errs)}")
    return f"{label} (reference-chipset copies left out): " + ", ".join(parts)


def vendor_table() -> None:
    from workbench.devices.profiles import load_devices
    from workbench.devices.vendor_fit import class_transfer_errors, vendor_fits
    profiles = load_devices()
    head = (f"{'device':<24} {'runtime':<14} {'prec.':<10} {'models':>6} {'rows':>4}  {'decode':>8} {'max':>5} {'twins':>6}  "
            f"{'TTFT':>7}  {'memory':>7}  {'new fam.':>9}  {'GB/s eff.':>9}  {'profile':<30} decode fit (ms per token)")
    fits = vendor_fits()
    print("held out by model, at least four models (goals: decode <= 15%, TTFT <= 30%, memory <= 20%; * misses)")
    print(head)
    four = [f for f in fits.values() if len(f.models) >= 4]
    for f in four:
        print(_fit_line(f, profiles))
    print(_tally(four, "within goal"))
    print("\nthree models (the fewest fitted): what each fit does with what it has, no goal applies")
    print(head)
    three = [f for f in fits.values() if len(f.models) == 3]
    for f in three:
        print(_fit_line(f, profiles))
    print(_tally(three, "within the four-model goals"))
    print("\ntwins: the largest decode gap between two measurements of one shape at one context (fine-tunes of one "
          "base): two rows a model of shapes must project alike;\nprofile '= chipset': AI Hub lists the device with that "
          "reference chipset (not a measurement of its own);\nnew fam.: decode / TTFT error held out by family, what a "
          "plan of a family the group has not measured gets (Qwen2.5 on Genie: only Qwen3 and Llama are measured);\n"
          "decode fit: Genie's at one byte rate per family (@llama, @qwen3) where two families of two models each are "
          "measured; GB/s eff. from the one-rate fit")
    print()
    for cls, rt, prec in (("hexagon-htp", "genie", "w4a16"), ("hexagon-htp", "qairt", "w4a16"),
                          ("hexagon-htp", "llama.cpp-npu", "q4_0"), ("hexagon-htp", "llama.cpp-gpu", "q4_0"),
                          ("hexagon-htp", "llama.cpp-cpu", "q4_0")):
        e = class_transfer_errors(cls, rt, prec)
        med = {k: (statistics.median(abs(x) for x in v) if v else None) for k, v in e.items()}
        print(f"class {cls} {rt} {prec}: a device without measurements, held out by chipset: decode "
              f"{_pct(med['decode'])} ({len(e['decode'])}), TTFT {_pct(med['ttft'])} ({len(e['ttft'])})")
    print()


CASES = (  # `workbench project` invocations beside the vendor figure of the same model, device and runtime
    ("qwen3-4b", "snapdragon-8-elite", "genie", None, 4096, 128, "Qwen3-4B", 26.1, None),
    ("qwen3-1.7b", "snapdragon-8-elite", "genie", None, 4096, 128, "Qwen3-1.7B", 56.7, None),
    ("qwen2.5-1.5b", "rk3588", "rkllm", "w8a8", 192, 128, "Qwen2.5-1.5B", 16.69, 1689.21),
    ("qwen2-0.5b", "rk3588", "rkllm", "w8a8", 192, 128, "Qwen2-0.5B", 41.58, 669.56),
    # the profiles added for AI Hub's other measured chipsets: the measured figure is the nearest measurement's
    ("qwen3-4b", "snapdragon-8-elite-gen-5", "genie", None, 4096, 128, "Qwen3-4B", None, None),
    ("qwen3-4b", "snapdragon-x2-elite", "genie", None, 4096, 128, "Qwen3-4B", None, None),
    ("qwen3-4b", "dragonwing-iq-9075", "genie", None, 4096, 128, "Qwen3-4B", None, None),
)


def vendor_cases() -> None:
    from workbench.devices.runtimes import get_runtime
    print(f"{'case':<56} {'projected':>9} {'measured':>8} {'ratio':>6}  {'memory MB':>9} {'measured':>8}  held-out error")
    for shape, device, rt, prec, ctx, prompt, label, measured, mem in CASES:
        plan = get_runtime(rt).plan(prec)
        p = project(shape, device, plan, context=ctx, prompt=prompt, runtime=rt)
        v = p.vendor
        if measured is None:  # the same model measured on the device, as `workbench project` prints it
            assert v.nearest["model"] == label, v.nearest
            measured = round(v.nearest["decode_tps"], 2)
        peak = f"{v.peak_bytes / 1e6:,.0f}" if v.peak_bytes else "-"
        print(f"{label + ' ' + v.precision + ', ' + device + ', ' + rt:<56} {v.decode_tps:>9.1f} {measured:>8g} "
              f"{v.decode_tps / measured:>6.2f}  {peak:>9} {mem or '-':>8}  decode {_pct(v.decode_error)} "
              f"({v.decode_n}), TTFT {_pct(v.ttft_error)}, memory {_pct(v.memory_error)}")
    print()


def residuals() -> None:
    """Which feature, if any, the residuals follow: each group's held-out median error of decode and of the first token
    with other term sets and a fit on absolute error, each family's in-sample decode error, how much of each miss one
    build's rows carry, and Genie against QAIRT on the same chip (`python bench/projection.py --residuals`)."""
    from workbench.devices.vendor_fit import (family_residuals, residual_study, runtime_ratios, vendor_fits,
                                      without_each_model)
    fits = [f for f in vendor_fits().values() if len(f.models) >= 4 and not f.rows[0].get("reference_chipset")]
    for what, target, tail in (("decode", "decode_ms", "  in sample, per family"), ("ttft", "ttft_ms", "")):
        print(f"{what}: held out by model, median |error|, per term set (goal {GOALS[what]:.0%})")
        names = None
        for f in fits:
            study = residual_study(f, target)
            if names is None:
                names = list(study)
                print(f"{'device':<24} {'runtime':<7} " + " ".join(f"{n:>13}" for n in names) + tail)
            fams = ", ".join(f"{k} {v:+.0%}" for k, v in family_residuals(f).items()) if what == "decode" else ""
            print(f"{f.vendor_device:<24} {f.runtime:<7} " + " ".join(f"{_pct(study[n]):>13}" for n in names)
                  + (f"  {fams}" if fams else ""))
        print()
    print("the misses with one build's rows taken out of the data (the headline keeps every row)")
    for f in fits:
        for what, target in (("decode", "decode_ms"), ("ttft", "ttft_ms")):
            lf = getattr(f, what)
            if lf is None or lf.median_error is None or lf.median_error <= GOALS[what]:
                continue
            print(f"{f.vendor_device} {f.runtime} {what} {_pct(lf.median_error)}")
            for by in ("model", "shape"):
                without = ", ".join(f"{m.removesuffix('-Instruct')} {_pct(e)}"
                                    for m, e in without_each_model(f, target, by).items())
                print(f"  without one {'build' if by == 'model' else 'shape (all its builds)'}: {without}")
    print()
    print("Genie / QAIRT on the same chip, the same model, 4,096 tokens (the same context binaries): decode tokens/s, "
          "first-token time")
    for device, ratios in runtime_ratios().items():
        cells = ", ".join(f"{m.removesuffix('-Instruct')} {d:.2f}/{'-' if t is None else f'{t:.2f}'}"
                          for m, d, t in ratios)
        print(f"{device:<24} {cells}")
    print()


def main() -> None:
    if "--residuals" in sys.argv[1:]:
        residuals()
        return
    vendor_table()
    vendor_cases()
    fit = fit_efficiency()
    points = {pt["label"]: pt for c in fit.classes.values() for pt in c.points}
    print(f"{'case':<36} {'device':<20} {'bound':>7} {'proj.':>7} {'publ.':>6} {'error':>7} {'held out':>9}  "
          f"{'TTFT bound':>10} {'publ.':>6}  {'memory':>8} {'publ.':>6}")
    verdicts = []
    for m in published_measurements():
        p = project(m["shape"], m["device"], plan_from_spec(m["plan"]), context=m.get("context", DEFAULT_CONTEXT),
                    fit=fit, runtime=None)
        pt = points.get(m["label"])
        err = f"{pt['error']:+.0%}" if pt else "-"
        loo = f"{pt['loo_error']:+.0%}" if pt and pt["loo_error"] is not None else "-"
        proj = f"{p.projected_decode_tps:.1f}" if p.projected_decode_tps else "-"
        peak = f"{m['peak_gb']:g}" if m.get("peak_gb") else "-"
        print(f"{m['label']:<36} {p.device:<20} {p.decode_bound_tps:>7.1f} {proj:>7} {m['decode_tps']:>6g} {err:>7} "
              f"{loo:>9}  {p.prefill_bound_ms:>8.0f}ms {m['ttft_ms']:>6g}  {p.total_bytes / 1e9:>6.2f}GB {peak:>6}")
        for c in check_claim(p, decode_tps=m["decode_tps"], peak_gb=m.get("peak_gb")):
            if c.possible is False:
                verdicts.append(f"IMPOSSIBLE  {m['label']} on {p.device}, {c.what}: {c.arithmetic}")
        if p.unsupported_layers:
            kinds = ", ".join(sorted({q for _, q in p.unsupported_layers}))
            verdicts.append(f"NOT ON NPU  {m['label']} on {p.device}: {len(p.unsupported_layers)} layers at {kinds}, "
                            f"which it does not compute with ({p.device} runs "
                            f"{', '.join(get_device(m['device']).weight_precisions)})")
    print()
    for c, cf in fit.classes.items():
        if cf.factor is None:
            print(f"efficiency {c:<12} no possible published case to fit ({len(cf.impossible)} above the bound); "
                  f"uses all classes pooled: {fit.pooled.factor:.2f} (error up to {fit.pooled.max_error:.0%})")
        else:
            loo = f", held out up to {cf.max_loo_error:.0%}" if cf.max_loo_error is not None else ""
            print(f"efficiency {c:<12} {cf.factor:.2f} of the bound from {len(cf.points)} case(s); "
                  f"error up to {cf.max_error:.0%}{loo}")
    print()
    for v in verdicts:
        print(v)
    from workbench.quantize.plan import PRECISIONS
    seven_b = model_shape("qwen2.5-7b")
    fewest = min(p.bits for p in PRECISIONS.values())
    claim = check_memory_claim(seven_b.parameters, 0.0093, bits=fewest)
    print(f"IMPOSSIBLE  'a 7B model in 9.3 MB of peak memory' (the {seven_b.name} shape, "
          f"{seven_b.parameters / 1e9:.2f} B parameters, at {fewest} bits, the fewest any registered precision "
          f"stores): {claim.arithmetic}")


if __name__ == "__main__":
    main()
