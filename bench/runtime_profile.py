"""What each export of the demo model costs to run here: prefill latency, decode speed, size, memory.

    python bench/runtime_profile.py [--model demo] [--candidates float,ort-int4,ort-qdq,mnn] [--threads 1]

Exports the float model and converts the uniform INT4 plan (g128) for each target into a temporary
directory, then prints `workbench profile` on it (median of 5 runs after a warm-up).
"""
from __future__ import annotations

import argparse
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--candidates", default="float,ort-int4,ort-qdq,mnn")
    ap.add_argument("--threads", type=int, default=1, help="runtime threads (default 1)")
    args = ap.parse_args()
    from workbench.cli import main as workbench
    from workbench.run.profile import build_candidates
    with tempfile.TemporaryDirectory() as tmp:
        out = build_candidates(args.model, tmp, bits=4, candidates=args.candidates.split(","))
        print(f"model {args.model}, uniform INT4 g128 for the converted candidates")
        workbench(["profile", str(out), "--threads", str(args.threads), "--prompt-lengths", "32,128"])


if __name__ == "__main__":
    main()
