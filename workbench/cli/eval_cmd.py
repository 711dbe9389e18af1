"""Perplexity (strided) of a model on a text; with --ref, KL divergence and top-1 agreement.

With ``--images`` (a vision-language model and its float reference, ``--ref``): the answer tokens' KL and top-1
given each picture, and image-text matching of both, on an image set (``default``: the bundled demo-vl set).

    workbench eval out/demo-vl-int4 --ref demo-vl --images default
"""
from __future__ import annotations

import sys

from ..assets import demo_text_path
from ..evaluation.evaluate import DEFAULT_CTX, SCHEMES, default_token_budget, evaluate
from ..errors import DataError
from ..model.load import load_model
from ..model.vision_quality import measure_vision_quality, vision_eval_set
from ..evaluation.textio import read_tokens
from .common import count, plus_minus, add_device_argument, add_budget_argument, add_json_flag, add_model_argument, print_json

HELP = "perplexity, and KL / top-1 agreement against a reference model"


def add_arguments(p):
    add_model_argument(p)
    p.add_argument("--ref", help="reference model to compare against (KL divergence, top-1 agreement)")
    p.add_argument("--text", help="UTF-8 text file to evaluate on (default: the bundled held-out text)")
    p.add_argument("--ctx", type=count(2), default=DEFAULT_CTX, help=f"window length in tokens (default {DEFAULT_CTX})")
    p.add_argument("--stride", type=count(1), help="window stride in tokens (default: ctx, non-overlapping)")
    p.add_argument("--scheme", choices=SCHEMES, default="strided",
                   help="strided windows (default), or llama.cpp: llama-perplexity's chunks, second half scored, "
                        "to set beside its output (use --ctx 256 or its -c)")
    p.add_argument("--batch-size", type=count(1), default=4, help="windows per forward pass")
    p.add_argument("--images", help="score a vision-language model against --ref on pictures instead of text: an image "
                                    "set (a folder with captions.jsonl, or a records file), or 'default' for the "
                                    "bundled demo-vl held-out set")
    add_budget_argument(p)
    add_device_argument(p)
    add_json_flag(p)


def run(args) -> int:
    lm = load_model(args.model, device=args.device)
    if args.images:
        return run_images(args, lm)
    text_path = args.text or demo_text_path("heldout")
    # read only as far as the token budget: a text far larger than it is never read whole
    budget = default_token_budget(lm.model, sys.maxsize, args.ctx) if args.max_tokens == "auto" else args.max_tokens
    ids, extent = read_tokens(lm.tokenizer, text_path, max_tokens=budget)
    read_note = extent.note(f"the evaluation's budget of {budget:,} tokens" if budget else "")
    ref = load_model(args.ref, device=args.device).model if args.ref else None
    report = evaluate(lm.model, ids, reference=ref, ctx=args.ctx, stride=args.stride,
                      batch_size=args.batch_size, progress=not args.json, scheme=args.scheme)
    out = {"model": str(lm.path), "reference": args.ref, "text": str(text_path), "text_read": extent.to_dict(),
           **report.to_dict()}
    if args.json:
        print_json(out)
        return 0
    if read_note:
        print(read_note)
    windows = f"stride {report.stride}" if report.scheme == "strided" else "llama.cpp chunks, second half scored"
    print(f"perplexity {plus_minus(report.perplexity, report.perplexity_stderr, '.3f')} over {report.tokens:,} tokens "
          f"({report.windows} windows, ctx {report.ctx}, {windows}; {report.tokens_per_second:,.0f} tok/s)")
    if ref is not None:
        print(f"reference perplexity {report.reference_perplexity:.3f}; KL divergence "
              f"{plus_minus(report.kl_divergence, report.kl_stderr, '.6f')}; "
              f"top-1 agreement {report.top1_agreement:.4f}")
    return 0


def run_images(args, lm) -> int:
    """The model against its float reference on pictures (``workbench.model.vision_quality``)."""
    if not lm.is_vision:
        raise DataError(f"'{args.model}' is a text model (no vision encoder): drop --images, or pass a "
                        "vision-language model")
    if not args.ref:
        raise DataError("--images compares against a reference: add --ref with the float model (e.g. --ref demo-vl)")
    images = vision_eval_set(None if args.images == "default" else args.images)
    ref = load_model(args.ref, device=args.device)
    if not ref.is_vision:
        raise DataError(f"--ref '{args.ref}' is a text model: give the float vision-language model {args.model} "
                        "was made from")
    quality = measure_vision_quality(ref, lm.model, images, progress=not args.json)
    if args.json:
        print_json({"model": str(lm.path), "reference": args.ref, **quality.to_dict()})
    else:
        print(quality.summary())
    return 0
