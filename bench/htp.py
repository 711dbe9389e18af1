"""Time and peak memory of an HTP evaluation (onnxruntime-qnn's emulator): the demo model and a 2-block
Qwen2.5-0.5B shape, INT8 QDQ graphs compiled for one Snapdragon, prefill and teacher-forced decode scored.

    python bench/htp.py                                  # demo model, 8 Gen 3
    python bench/htp.py --shape qwen2.5-0.5b --layers 2 --soc 8gen3 --windows 1 --prompt 120   # 7 decode steps

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


def prepare(model: str, work: Path, static: tuple[int, int]):
    """Float static graphs and their INT8 QDQ twin (``ort-qdq``'s), with held-out token windows."""
    from workbench.convert import convert
    from workbench.evaluate import encode_text, read_text
    from workbench.assets import demo_text_path
    from workbench.models import load_model
    report = convert(model, "qnn", work, bits=8, static=static, evaluate_outputs=False)
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
    args = ap.parse_args()
    from workbench.targets.htp import measure_htp
    with tempfile.TemporaryDirectory(prefix="bench-htp-") as tmp:
        work = Path(args.work or tmp)
        model = "demo"
        if args.shape:
            from shapes import build_shape
            model = str(build_shape(args.shape, work / f"{args.shape}-{args.layers}", layers=args.layers))
        t0 = time.perf_counter()
        _, ids = prepare(model, work / "qnn", (128, 511))
        prep_s = time.perf_counter() - t0
        q = work / "qnn"
        windows = [ids[k * 128:(k + 1) * 128] for k in range(args.windows)]
        m = measure_htp([q / "prefill.onnx", q / "decode.onnx"],
                        [q / "ort-qdq-twin" / "prefill.qdq.onnx", q / "ort-qdq-twin" / "decode.qdq.onnx"],
                        windows, device=args.soc, out_dir=work / "ctx", decode_windows=args.decode_windows,
                        prompt=args.prompt)
    name = f"{args.shape} ({args.layers} blocks)" if args.shape else "demo"
    print(f"{name} on {m.device} (soc {m.soc_model}, v{m.arch}); graphs prepared in {prep_s:.1f} s")
    for g in ("prefill", "decode"):
        r, s = getattr(m, g), m.simulation[g]
        print(f"  {g:<8} HTP vs float KL {r['kl_vs_float']:.2e} top-1 {r['top1_vs_float']:.4f} | HTP vs CPU QDQ KL "
              f"{r['kl_vs_simulation']:.2e} top-1 {r['top1_vs_simulation']:.4f} | CPU QDQ vs float KL "
              f"{s['kl_vs_float']:.2e} ({r['tokens']} positions)")
    print(f"  context binaries {m.context_bytes / 1e6:.1f} MB; compile {m.compile_seconds:.1f} s; evaluation "
          f"{m.eval_seconds:.1f} s; peak RSS {m.peak_rss_bytes / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
