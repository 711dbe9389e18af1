"""Distillation: train a pruned (and/or to-be-quantized) student on the original model's soft labels.

    workbench distill out/pruned --teacher demo --out out/distilled
    workbench distill out/pruned --teacher demo --plan int4.json --out out/qat --steps 400 --json

With --plan the student is trained quantization-aware (the plan's layers rounded in the forward
pass, gradients passed straight through); quantize the output with the same plan afterwards.
"""
from __future__ import annotations

from ..compress.distill import MODES, DistillConfig, distill
from ..quantize.plan import QuantPlan
from .common import count, number, add_json_flag, add_model_argument, print_json

HELP = "distil a pruned or quantized student from its original model; writes the trained student"

_D = DistillConfig()


def add_arguments(p):
    add_model_argument(p, "the student: a model directory (e.g. a `workbench prune` output)")
    p.add_argument("--teacher", required=True, help="the unpruned / unquantized model ('demo' or a directory)")
    p.add_argument("--out", required=True, help="output model directory (written beside it, then renamed)")
    p.add_argument("--plan", help="precision plan JSON: train quantization-aware for it")
    p.add_argument("--data", help="training text (default: the demo model's calibration text)")
    p.add_argument("--steps", type=count(1), default=_D.steps, help=f"optimizer steps (default {_D.steps})")
    p.add_argument("--temperature", type=number(0, low_open=True), default=_D.temperature,
                   help=f"soft-label temperature at the start (default {_D.temperature:g})")
    p.add_argument("--temperature-decay", type=number(0, 1, high_open=True), default=_D.temperature_decay,
                   help=f"fraction the temperature shrinks each epoch (default {_D.temperature_decay:g})")
    p.add_argument("--lr", type=number(0, low_open=True), default=_D.lr, help=f"peak learning rate (default {_D.lr:g})")
    p.add_argument("--batch-size", type=count(1), default=_D.batch_size)
    p.add_argument("--seq-len", type=count(2), default=_D.seq_len)
    p.add_argument("--validation-fraction", type=number(0, 1, high_open=True), default=_D.validation_fraction,
                   help="share of the training windows held back to choose the step kept "
                        f"(default {_D.validation_fraction:g})")
    p.add_argument("--hard", type=number(0), default=_D.hard_weight, help="weight of the hard-label cross-entropy")
    p.add_argument("--hidden", type=number(0), default=_D.hidden_weight, help="weight of the hidden-state cosine term")
    p.add_argument("--attention", type=number(0), default=_D.attention_weight, help="weight of the attention-map MSE")
    p.add_argument("--mode", choices=MODES, default=_D.mode, help="train the whole student or LoRA adapters")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="keep only each block's input for backward and recompute the rest (less memory, one more "
                        "forward pass of the student per step)")
    p.add_argument("--seed", type=count(0), default=_D.seed)
    p.add_argument("--eval-text", help="held-out text for before/after (default: the bundled one)")
    p.add_argument("--eval-tokens", type=count(2), default=4096,
                   help="held-out tokens for perplexity and KL before/after (default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace --out when it holds an earlier distill output")
    add_json_flag(p)


def run(args) -> int:
    cfg = DistillConfig(steps=args.steps, temperature=args.temperature, temperature_decay=args.temperature_decay,
                        lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len,
                        validation_fraction=args.validation_fraction, hard_weight=args.hard,
                        hidden_weight=args.hidden, attention_weight=args.attention, mode=args.mode, seed=args.seed,
                        gradient_checkpointing=args.gradient_checkpointing)
    plan = QuantPlan.load(args.plan) if args.plan else None
    report = distill(args.model, args.teacher, args.out, cfg, plan=plan, data=args.data, eval_text=args.eval_text,
                     eval_tokens=args.eval_tokens, overwrite=args.overwrite, progress=not args.json)
    if args.json:
        print_json(report.to_dict())
    else:
        print(report.summary())
    return 0
