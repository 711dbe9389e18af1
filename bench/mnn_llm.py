"""What writing an ``mnn-llm`` directory costs at a real model's shape, and how fast MNN's engine runs it.

    python bench/mnn_llm.py                               # the Qwen2.5-0.5B shape (random weights), --bits 4
    python bench/mnn_llm.py --shape qwen2.5-0.5b --layers 2 --threads 1 --json

The random-weight model is built once (bench/shapes.py) under --models-dir. The plan and its simulation are
prepared first (not counted); then the write alone (ONNX graph, MNN's converter, the plan's codes, embedding,
tokenizer) is timed, with its peak resident memory read as the process's high-water mark reset just before it
(MNN's converter runs in this process, so its memory is counted). Then `workbench profile DIR` times the
engine's own prefill and decode in a child process. The load average is printed beside the speeds: on a shared
machine they move with it. `bench/scale.py --steps convert-mnn-llm,profile-mnn-llm` measures the whole
`workbench convert` step (scoring in the engine included) the same way as the other targets.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from shapes import build_shape  # noqa: E402
from scale import shape_label, workbench_cmd  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="a bench/shapes.py shape (default %(default)s)")
    ap.add_argument("--layers", type=int, help="keep only this many decoder blocks (smoke runs)")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--threads", type=int, default=2, help="engine threads for the profile (default %(default)s)")
    ap.add_argument("--models-dir", default=str(Path.home() / ".cache" / "workbench-bench" / "shapes"))
    ap.add_argument("--out", help="write the directory here and keep it (default: a temporary one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    from workbench.targets.convert import prepare_models
    from workbench.numerics.memory import release_freed_memory, reset_peak_rss, rss_mb
    from workbench.targets.mnn_llm import write_mnn_llm_folder

    model = build_shape(args.shape, Path(args.models_dir).expanduser() / shape_label(args.shape, args.layers),
                        layers=args.layers)
    t = time.perf_counter()
    prep = prepare_models(str(model), bits=args.bits)
    prepare_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="mnn-llm-bench-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "mnn-llm"
        release_freed_memory()
        before = rss_mb()
        reset_peak_rss()
        t = time.perf_counter()
        info = write_mnn_llm_folder(prep.sim_lm, prep.qm, out, Path(tmp) / "work")
        write_s = time.perf_counter() - t
        peak = rss_mb("VmHWM")
        files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
        del prep
        release_freed_memory()
        load = os.getloadavg()
        r = subprocess.run(workbench_cmd() + ["profile", str(out), "--threads", str(args.threads), "--json"],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"workbench profile failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        text = r.stdout
        prof = json.loads(text[text.find("{"):])["profiles"][0]
    report = {"model": str(model), "bits": args.bits, "prepare_seconds": prepare_s, "write_seconds": write_s,
              "rss_before_write_mb": before, "peak_rss_during_write_mb": peak, "files": files,
              "bytes": sum(files.values()), "plan_codes_written": info["plan_codes_written"],
              "load_average_before_profile": load, "profile": {k: prof.get(k) for k in (
                  "runtime", "threads", "prefill_ms", "decode_tokens_per_second", "peak_rss_added_mb", "size_bytes")}}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    mb = 2**20
    print(f"{args.shape}{f' ({args.layers} blocks)' if args.layers else ''}, --bits {args.bits}: write "
          f"{write_s:.1f} s, peak RSS {peak / 1024:.2f} GB (the prepared models before it: {before / 1024:.2f} GB), "
          f"{report['bytes'] / mb:,.0f} MiB written ({', '.join(f'{k} {v / mb:,.1f} MiB' for k, v in files.items())})")
    prefill = ", ".join(f"{n} tokens {ms:,.0f} ms" for n, ms in prof["prefill_ms"].items())
    print(f"workbench profile, {prof['threads']} thread(s), load average {load[0]:.1f}: prefill {prefill}; decode "
          f"{prof['decode_tokens_per_second']:.2f} tok/s; engine resident {prof['peak_rss_added_mb']:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
