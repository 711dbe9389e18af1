"""LoRA fine-tuning on the user's text, merged into an ordinary model directory.

    workbench finetune demo --out out/tuned
    workbench finetune ./my-model --data domain.jsonl --out out/tuned --steps 300 --rank 16 --json
"""
from __future__ import annotations

from ..compress.finetune import FinetuneConfig, finetune_lora
from .common import count, number, add_json_flag, add_model_argument, print_json

HELP = "LoRA fine-tuning on your text before quantizing; writes a merged model directory"

_DEFAULTS = FinetuneConfig()


def add_arguments(p):
    add_model_argument(p)
    p.add_argument("--data", help="training text: plain text, JSONL ('text') or Alpaca .json (default: the demo "
                                  "model's bundled calibration text)")
    p.add_argument("--out", required=True, help="output model directory (written beside it, then renamed)")
    p.add_argument("--steps", type=count(1), default=_DEFAULTS.steps, help=f"optimizer steps (default {_DEFAULTS.steps})")
    p.add_argument("--rank", type=count(1), default=_DEFAULTS.rank, help=f"LoRA rank (default {_DEFAULTS.rank})")
    p.add_argument("--alpha", type=count(1), default=_DEFAULTS.alpha, help=f"LoRA alpha (default {_DEFAULTS.alpha})")
    p.add_argument("--lr", type=number(0, low_open=True), default=_DEFAULTS.lr, help=f"peak learning rate (default {_DEFAULTS.lr:g})")
    p.add_argument("--batch-size", type=count(1), default=_DEFAULTS.batch_size,
                   help=f"windows per step (default {_DEFAULTS.batch_size})")
    p.add_argument("--seq-len", type=count(2), default=_DEFAULTS.seq_len,
                   help=f"tokens per window (default {_DEFAULTS.seq_len})")
    p.add_argument("--seed", type=count(0), default=_DEFAULTS.seed)
    p.add_argument("--eval-text", help="held-out text for perplexity before and after (default: the bundled one)")
    p.add_argument("--overwrite", action="store_true", help="replace --out when it holds an earlier `workbench "
                   "finetune` output (any other non-empty directory is refused)")
    add_json_flag(p)


def run(args) -> int:
    cfg = FinetuneConfig(steps=args.steps, rank=args.rank, alpha=args.alpha, lr=args.lr, batch_size=args.batch_size,
                         seq_len=args.seq_len, seed=args.seed)
    report = finetune_lora(args.model, args.data, args.out, cfg, eval_text=args.eval_text, overwrite=args.overwrite,
                           progress=not args.json)
    if args.json:
        print_json(report.to_dict())
    else:
        print(report.summary())
    return 0
