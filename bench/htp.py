"""Time and peak memory of an HTP evaluation (onnxruntime-qnn's emulator): the demo model and a 2-block
Qwen2.5-0.5B shape, INT8 QDQ graphs compiled for one Snapdragon, prefill and teacher-forced decode scored.

    python bench/htp.py                                  # demo model, 8 Gen 3
    python bench/htp.py --shape qwen2.5-0.5b --layers 2 --soc 8gen3 --windows 1 --prompt 120   # 7 decode steps
    python bench/htp.py --recipe --divergence                        # Qualcomm's w4a16 recipe (int8 KV cache)
    python bench/htp.py --shape qwen2.5-0.5b --layers 2 --recipe --windows 1 --prompt 120 --split-limit-mib 256

``--recipe`` converts with Qualcomm's w4a16 plan (``targets.qnn.recipe_plan``: int4 per channel, int8 lm_head,
16-bit embedding and activations, int8 KV cache) instead of INT8; ``--divergence`` runs each weighted layer
alone on the HTP against the CPU QDQ graph (``htp.layer_divergence``); ``--split-limit-mib`` splits both QDQ
graphs into parts whose weights fit that limit (``htp_parts``), compiles each part for the SoC and checks its
context binary against the limit, and runs the parts chained on the CPU against the whole graph.

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
    from workbench.convert import convert
    from workbench.evaluate import encode_text, read_text
    from workbench.assets import demo_text_path
    from workbench.models import load_model
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
    ap.add_argument("--split-limit-mib", type=float, help="split into parts whose weights fit this many MiB")
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
    """Parts of both QDQ graphs under ``limit``, each compiled for ``soc`` and checked; chained on the CPU."""
    from dataclasses import replace
    import numpy as np
    import onnxruntime as ort
    from workbench.runtime.onnx_runner import OnnxCausalLM
    from workbench.targets.htp import htp_soc, write_context_binaries
    from workbench.targets.htp_parts import plan_parts, run_parts, split_graph, weight_bytes_by_block
    lines, small = [], replace(htp_soc(soc), context_limit_bytes=limit)
    runner = OnnxCausalLM(twin / "prefill.qdq.onnx")
    feed = runner.prefill_feed(window)
    for g in ("prefill", "decode"):
        graph = twin / f"{g}.qdq.onnx"
        head, blocks, tail = weight_bytes_by_block(graph)
        parts = plan_parts(blocks, limit=limit, head_bytes=head, tail_bytes=tail)
        files = split_graph(graph, twin, parts)
        t0 = time.perf_counter()
        written = write_context_binaries({f.stem: f for f in files}, out, small)
        lines.append(f"  {g}: weights {(head + sum(blocks) + tail) / 2**20:.1f} MiB -> {len(parts)} parts {parts} "
                     f"under {limit / 2**20:.0f} MiB; context binaries "
                     + ", ".join(f"{w['bytes'] / 2**20:.1f}" for w in written) + f" MiB ({time.perf_counter() - t0:.1f} s)")
        if g == "prefill":
            whole = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(["logits"], feed)[0]
            same = np.array_equal(run_parts(files, feed)["logits"], whole)
            lines.append(f"  prefill parts chained on the CPU give the whole graph's logits: {same}")
    return lines


if __name__ == "__main__":
    main()
