"""Projections for the field's published cases beside their published figures, and the 7B-in-9.3-MB claim.

    python bench/projection.py

Each case in assets/field_measurements.json (from shared/docs/FIELD.md) is projected from its model's shapes
(assets/model_shapes.json: "Qwen3-1.5B" does not exist, the Qwen3-1.7B shape stands in; "Qwen2.5-1.8B"
neither, Qwen2.5-1.5B stands in) at a 1,024-token context and a 128-token prompt. Decode is projected as the
bandwidth bound times the efficiency fitted to the device class's published cases; "error" is projected /
published - 1 in the fit, "held out" the same with the case left out of its own fit (no second case in the
class: none). A published figure above its bound is impossible and is not fitted.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.devices import get_device  # noqa: E402
from workbench.projection import (DEFAULT_CONTEXT, check_claim, check_memory_claim, fit_efficiency,  # noqa: E402
                                  model_shape, plan_from_spec, project, published_measurements)


def main() -> None:
    fit = fit_efficiency()
    points = {pt["label"]: pt for c in fit.classes.values() for pt in c.points}
    print(f"{'case':<36} {'device':<20} {'bound':>7} {'proj.':>7} {'publ.':>6} {'error':>7} {'held out':>9}  "
          f"{'TTFT bound':>10} {'publ.':>6}  {'memory':>8} {'publ.':>6}")
    verdicts = []
    for m in published_measurements():
        p = project(m["shape"], m["device"], plan_from_spec(m["plan"]), context=m.get("context", DEFAULT_CONTEXT),
                    fit=fit)
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
    from workbench.plan import PRECISIONS
    seven_b = model_shape("qwen2.5-7b")
    fewest = min(p.bits for p in PRECISIONS.values())
    claim = check_memory_claim(seven_b.parameters, 0.0093, bits=fewest)
    print(f"IMPOSSIBLE  'a 7B model in 9.3 MB of peak memory' (the {seven_b.name} shape, "
          f"{seven_b.parameters / 1e9:.2f} B parameters, at {fewest} bits, the fewest any registered precision "
          f"stores): {claim.arithmetic}")


if __name__ == "__main__":
    main()
