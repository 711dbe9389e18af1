"""What each part of a vision-language model costs at each precision, measured on pictures.

    python bench/vlm_parts.py                    # the bundled demo VLM on its held-out set
    python bench/vlm_parts.py --model DIR --images SET --json

Two tables, both scored against the float model on the same pictures (answer-token KL and top-1 given the
image; image-text matching accuracy of the quantized and the float model, with the paired difference):

1. **Parts**: the language model fixed at int4, the vision encoder fixed at int8, and the projector (Qwen's
   merger, SmolVLM's connector: where image features become language-model inputs) at fp16 / int8 / int4;
   then the vision encoder at fp16 / int8 / int4 with the projector at int8; and every part at int4.
2. **Layers**: each linear layer of the vision encoder and the projector alone at int4, everything else
   float: which layer breaks first, and whether it is the first linear after a normalisation (the layer a
   medical-imaging team's Hexagon account names), with each layer's fraction of near-zero inputs
   (|x| < max |x| / 254, half a step of per-tensor symmetric INT8: the calibration statistics' own rule,
   ``workbench.model.calibrate.NEAR_ZERO_DIVISOR``, over the held-out pictures).

Quantization: the workbench's default rounding (``QuantPlan.default_for``, round to nearest, no importance
statistics), group size 128 or the nearest divisor. Prints the tables and each run's seconds; exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.evaluation.images import read_image  # noqa: E402
from workbench.model.calibrate import NEAR_ZERO_DIVISOR  # noqa: E402
from workbench.model.load import load_model  # noqa: E402
from workbench.model.vision_quality import (measure_vision_baseline, measure_vision_quality, part_plan,  # noqa: E402
                                            part_prefixes, vision_eval_set)
from workbench.quantize import quantize_model  # noqa: E402
from workbench.quantize.plan import QuantPlan  # noqa: E402


def score(lm, plan: QuantPlan, baseline) -> dict:
    t0 = time.perf_counter()
    qm = quantize_model(lm, plan, progress=False)
    vq = measure_vision_quality(lm, qm.build_model(), baseline=baseline)
    return {**vq.to_dict(), "bits_per_weight": qm.bits_per_weight, "seconds": time.perf_counter() - t0}


def input_traits(lm, images, names: list[str]) -> dict[str, dict]:
    """Per layer, over 16 held-out pictures: the fraction of its inputs with |x| < its largest |x| / 254,
    and whether its input is a normalisation's output itself (the first linear after a LayerNorm / RMSNorm,
    found from the tensors that flow, not from names)."""
    modules = dict(lm.model.named_modules())
    norm_outputs: set[int] = set()
    seen: dict[str, list] = {n: [] for n in names}
    after_norm = {n: False for n in names}

    def on_norm(m, a, o):
        norm_outputs.add(o.data_ptr())

    def on_linear(m, a, o, n):
        after_norm[n] = after_norm[n] or a[0].data_ptr() in norm_outputs
        seen[n].append(a[0].detach().float().reshape(-1))

    hooks = [m.register_forward_hook(on_norm) for m in modules.values() if "norm" in type(m).__name__.lower()]
    hooks += [modules[n].register_forward_hook(lambda m, a, o, n=n: on_linear(m, a, o, n)) for n in names]
    try:
        with torch.inference_mode():
            for s in images.questions[:16]:
                norm_outputs.clear()
                lm.model(**lm.processor(read_image(s.image), s.prompt), use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for n, xs in seen.items():
        x = torch.cat(xs).abs()
        out[n] = {"near_zero": float((x < x.max() / NEAR_ZERO_DIVISOR).float().mean()), "after_norm": after_norm[n]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo-vl")
    ap.add_argument("--images", help="image set (default: the bundled demo-vl held-out set)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--parts-only", action="store_true", help="only the parts table (each layer alone takes longer)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    lm = load_model(args.model)
    images = vision_eval_set(args.images)
    baseline = measure_vision_baseline(lm, images)  # the float model, scored once
    base = QuantPlan.default_for("int4")
    rows = []
    for label, vision, projector in [("projector fp16", "int8", None), ("projector int8", "int8", "int8"),
                                     ("projector int4", "int8", "int4"), ("vision fp16", None, "int8"),
                                     ("vision int4", "int4", "int8"), ("all int4", "int4", "int4")]:
        r = score(lm, part_plan(lm, base, vision=vision, projector=projector), baseline)
        rows.append({"plan": f"LM int4, vision {vision or 'fp16'}, projector {projector or 'fp16'}", "label": label, **r})
        if not args.json:
            print(f"  {label}: answer KL {r['answer_kl']:.5f}, ITM {r['itm_accuracy']:.2%} ({r['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
    vision_layers = [] if args.parts_only else [layer.name for layer in lm.layers if layer.kind == "linear" and any(
        layer.name.startswith(p + ".") for part in ("vision encoder", "projector") for p in part_prefixes(lm, part))]
    traits = input_traits(lm, images, vision_layers)
    alone = dataclasses.replace(base, default=None, rules=())  # every layer float but the one named
    layers = []
    for name in vision_layers:
        r = score(lm, alone.with_override(name, "int4"), baseline)
        layers.append({"layer": name, **traits[name], **r})
    layers.sort(key=lambda r: -r["answer_kl"])
    if args.json:
        print(json.dumps({"model": str(lm.path), "images": images.source, "parts": rows, "layers": layers}, indent=1))
        return 0
    print(f"{lm.name}: {images.describe()}; answer KL / top-1 against the float model; image-text matching (ITM) "
          f"of the quantized and the float model")
    print(f"{'plan':<44} {'bits/w':>6} {'answer KL':>18} {'top-1':>7} {'ITM':>15} {'float ITM':>9} {'ITM diff':>16} {'s':>5}")
    for r in rows:
        print(f"{r['plan']:<44} {r['bits_per_weight']:6.2f} {r['answer_kl']:9.5f} ± {r['answer_kl_stderr']:.5f} "
              f"{r['answer_top1']:7.2%} {r['itm_accuracy']:7.2%} ± {r['itm_accuracy_stderr']:.1%} "
              f"{r['reference_itm_accuracy']:9.2%} {r['itm_difference']:+7.2%} ± {r['itm_difference_stderr']:.1%} "
              f"{r['seconds']:5.1f}")
    if not layers:
        return 0
    print()
    print("each vision / projector linear alone at int4 (everything else float), most damaging first:")
    print(f"{'layer':<40} {'after norm':>10} {'near-zero in':>12} {'answer KL':>18} {'top-1':>7} {'ITM diff':>16}")
    for r in layers:
        print(f"{r['layer']:<40} {'yes' if r['after_norm'] else 'no':>10} {r['near_zero']:12.1%} "
              f"{r['answer_kl']:9.6f} ± {r['answer_kl_stderr']:.6f} {r['answer_top1']:7.2%} "
              f"{r['itm_difference']:+7.2%} ± {r['itm_difference_stderr']:.1%}")
    top = layers[0]
    print(f"\nmost sensitive: {top['layer']} ({'the first linear after a normalisation' if top['after_norm'] else 'not the first linear after a normalisation'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
