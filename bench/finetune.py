"""LoRA fine-tuning on the demo model: held-out perplexity before and after, time per step.

    python bench/finetune.py [--model demo] [--steps 200] [--rank 8] [--threads N]

Trains on the bundled calibration text (documents the base model never trained on) and scores the
whole bundled held-out text before and after, on the same windows of ``--seq-len`` tokens. The
merged model is written to a temporary directory and discarded.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args()
    import torch

    from workbench.compress.finetune import FinetuneConfig, finetune_lora
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = FinetuneConfig(steps=args.steps, rank=args.rank, lr=args.lr, batch_size=args.batch_size,
                         seq_len=args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        r = finetune_lora(args.model, None, Path(tmp) / "tuned", cfg, eval_tokens=10**9, progress=False)
        wall = time.perf_counter() - t0
    print(f"model {args.model}: LoRA r={args.rank} on {', '.join(r.config['target_modules'])}; "
          f"{r.trainable_parameters:,} trainable of {r.total_parameters:,} parameters")
    print(f"training: {args.steps} steps x {args.batch_size} windows of {args.seq_len} tokens from "
          f"{r.train_windows} windows ({r.train_tokens:,} tokens of the bundled calibration text); "
          f"loss {sum(r.losses[:10]) / 10:.3f} (first 10 steps) -> {sum(r.losses[-10:]) / 10:.3f} (last 10)")
    print("validation loss on " + f"{r.validation_windows} held-back windows: "
          + ", ".join(f"step {s} {v:.3f}" for s, v in r.validation) + f"; merged: step {r.best_step}")
    print(f"held-out perplexity ({r.eval_tokens:,} tokens, windows of {args.seq_len}): "
          f"{r.perplexity_before:.2f} -> {r.perplexity_after:.2f} "
          f"({r.perplexity_after / r.perplexity_before - 1:+.1%})")
    print(f"time: {wall:.0f} s in all, {r.seconds:.0f} s in fine-tuning "
          f"({args.steps * args.batch_size * args.seq_len / r.seconds:,.0f} training tokens/s incl. evaluation); "
          f"{torch.get_num_threads()} torch thread(s)")


if __name__ == "__main__":
    main()
