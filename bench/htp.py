"""Time and peak memory of an HTP evaluation (onnxruntime-qnn's emulator): the demo model and a 2-block
Qwen2.5-0.5B shape, INT8 QDQ graphs compiled for one Snapdragon, prefill and teacher-forced decode scored.

    python bench/htp.py                                  # demo model, 8 Gen 3
    python bench/htp.py --shape qwen2.5-0.5b --layers 2 --soc 8gen3 --windows 1 --prompt 120   # 7 decode steps
    python bench/htp.py --recipe --divergence                        # Qualcomm's w4a16 recipe (int8 KV cache)
    python bench/htp.py --shape qwen2.5-0.5b --layers 2 --recipe --windows 1 --prompt 120 --split-limit-mib 256

``--recipe`` converts with Qualcomm's w4a16 plan (``targets.qnn.recipe_plan``: int4 per channel, int8 lm_head,
16-bit embedding and activations, int8 KV cache) instead of INT8; ``--divergence`` runs each weighted layer
alone on the HTP against the CPU QDQ graph (``htp.layer_divergence``); ``--split-limit-mib`` splits both QDQ
graphs into parts whose context binaries fit that limit (``htp.write_htp_binaries``, what ``workbench convert
--target qnn --soc ... --split-limit-mib`` runs), and runs the prefill parts chained on the CPU against the whole
graph.

Each evaluation runs in a child process (``measure_htp``), so the peak is the HTP evaluation's own
(compiling, the context binaries, the CPU QDQ and float graphs it is compared with).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prepare(model: str, work: Path, static: tuple[int, int], recipe: bool = False):
    """Float static graphs and their QDQ twin (``ort-qdq``'s; INT8, or Qualcomm's recipe), with held-out tokens."""
    from workbench.targets.convert import convert
    from workbench.evaluation.evaluate import encode_text, read_text
    from workbench.assets import demo_text_path
    from workbench.model.load import load_model
    from workbench.targets.qnn import recipe_plan
    plan = {"plan": recipe_plan()} if recipe else {"bits": 8}
    report = convert(model, "qnn", work, static=static, evaluate_outputs=False, **plan)
    lm = load_model(model)
    ids = encode_text(lm.tokenizer, read_text(demo_text_path("heldout"))).tolist()
    return report, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", help="a bench/shapes.py shape instead of the demo model (e.g. qwen2.5-0.5b)")
    ap.add_argument("--layers", type=int, default=2, help="blocks of --shape (default 2)")
    ap.add_argument("--soc", default="8gen3", help="Snapdragon device profile (default 8gen3)")
    ap.add_argument("--windows", type=int, default=4, help="128-token prefill windows scored (default 4)")
    ap.add_argument("--decode-windows", type=int, default=1, help="windows also decoded step by step (default 1)")
    ap.add_argument("--prompt", type=int, default=64, help="decode after this many tokens of a window (default 64)")
    ap.add_argument("--work", help="folder for the graphs (default: a temporary one)")
    ap.add_argument("--recipe", action="store_true", help="Qualcomm's w4a16 recipe (int8 KV cache) instead of INT8")
    ap.add_argument("--divergence", action="store_true", help="each layer alone on the HTP against the simulation")
    ap.add_argument("--split-limit-mib", type=float, help="split into parts whose context binaries fit this many MiB")
    args = ap.parse_args()
    from workbench.targets.htp import measure_htp
    with tempfile.TemporaryDirectory(prefix="bench-htp-") as tmp:
        work = Path(args.work or tmp)
        model = "demo"
        if args.shape:
            from shapes import build_shape
            model = str(build_shape(args.shape, work / f"{args.shape}-{args.layers}", layers=args.layers))
        t0 = time.perf_counter()
        report, ids = prepare(model, work / "qnn", (128, 511), recipe=args.recipe)
        prep_s = time.perf_counter() - t0
        q = work / "qnn"
        windows = [ids[k * 128:(k + 1) * 128] for k in range(args.windows)]
        m = measure_htp([q / "prefill.onnx", q / "decode.onnx"],
                        [q / "ort-qdq-twin" / "prefill.qdq.onnx", q / "ort-qdq-twin" / "decode.qdq.onnx"],
                        windows, device=args.soc, out_dir=work / "ctx", decode_windows=args.decode_windows,
                        prompt=args.prompt)
        twin = q / "ort-qdq-twin"
        extra = [f"  KV cache: {report.details['qdq'].get('kv_cache', {}).get('bytes_per_token', 'float32')} bytes a "
                 "token" if args.recipe else ""]
        if args.divergence:
            extra += divergence(twin / "prefill.qdq.onnx", windows[0], args.soc)
        if args.split_limit_mib:
            extra += split(twin, int(args.split_limit_mib * 2**20), args.soc, work / "parts", windows[0])
    name = f"{args.shape} ({args.layers} blocks)" if args.shape else "demo"
    print(f"{name} on {m.device} (soc {m.soc_model}, v{m.arch}); graphs prepared in {prep_s:.1f} s")
    for g in ("prefill", "decode"):
        r, s = getattr(m, g), m.simulation[g]
        print(f"  {g:<8} HTP vs float KL {r['kl_vs_float']:.2e} top-1 {r['top1_vs_float']:.4f} | HTP vs CPU QDQ KL "
              f"{r['kl_vs_simulation']:.2e} top-1 {r['top1_vs_simulation']:.4f} | CPU QDQ vs float KL "
              f"{s['kl_vs_float']:.2e} ({r['tokens']} positions)")
    print(f"  context binaries {m.context_bytes / 1e6:.1f} MB; compile {m.compile_seconds:.1f} s; evaluation "
          f"{m.eval_seconds:.1f} s; peak RSS {m.peak_rss_bytes / 2**30:.2f} GiB")
    print("\n".join(e for e in extra if e))


def divergence(graph: Path, window, soc: str) -> list[str]:
    from workbench.runtime.onnx_runner import OnnxCausalLM
    from workbench.targets.htp import layer_divergence
    d = layer_divergence(graph, OnnxCausalLM(graph).prefill_feed(window), soc, rows=len(window))
    worst = sorted(d["layers"].items(), key=lambda kv: -kv[1]["relative_error"])[:3]
    return [f"  layers alone on the HTP vs CPU QDQ ({len(d['layers'])} layers, {d['seconds']:.1f} s): departing "
            f"{d['departing'] or 'none'} (relative error > {d['threshold']:g}); largest "
            + ", ".join(f"{n} {v['relative_error']:.2e}" for n, v in worst)]


def split(twin: Path, limit: int, soc: str, out: Path, window) -> list[str]:
    """Both QDQ graphs compiled for ``soc`` with each context binary under ``limit`` (``htp.write_htp_binaries``:
    a graph over it split into parts), and the prefill parts chained on the CPU against the whole graph."""
    from workbench.runtime.onnx_runner import OnnxCausalLM
    from workbench.targets.htp import write_htp_binaries
    from workbench.targets.htp_parts import check_chained
    graphs = {g: twin / f"{g}.qdq.onnx" for g in ("prefill", "decode")}
    t0 = time.perf_counter()
    written = write_htp_binaries(graphs, out, soc, limit=limit)
    seconds = time.perf_counter() - t0
    if written["parts"] is None:
        return [f"  every graph fits one context binary under {limit / 2**20:.0f} MiB: "
                + ", ".join(f"{w['bytes'] / 2**20:.1f}" for w in written["context_binaries"]) + " MiB"]
    lines = []
    for g, d in written["parts"]["graphs"].items():
        lines.append(f"  {g}: weights {d['weight_bytes'] / 2**20:.1f} MiB -> {len(d['parts'])} parts "
                     f"{[tuple(p['blocks']) for p in d['parts']]} under {limit / 2**20:.0f} MiB; context binaries "
                     + ", ".join(f"{p['bytes'] / 2**20:.1f}" for p in d["parts"]) + " MiB")
    lines.append(f"  compiled in {seconds:.1f} s; manifest {out / 'parts.json'}")
    parts = [out / p["qdq"] for p in written["parts"]["graphs"]["prefill"]["parts"]]
    if len(parts) > 1:
        same = check_chained(graphs["prefill"], parts, OnnxCausalLM(graphs["prefill"]).prefill_feed(window))
        lines.append(f"  prefill parts chained on the CPU give the whole graph's outputs: {same['identical']}")
    return lines


if __name__ == "__main__":
    main()
