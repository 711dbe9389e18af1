"""Continue a prompt with a model and stream the text to stdout, a token at a time, with its speed.

    workbench generate out/genai --prompt "A class definition"          # an ort-genai folder: onnxruntime-genai
    workbench generate demo --prompt "Once" --max-new-tokens 32 --json  # the float model in PyTorch
    workbench generate out/int4 --prompt "Once" --temperature 0.8 --top-k 40 --seed 1
    workbench generate demo-vl --image pic.png --prompt "What colour is the shape?"   # a vision-language model

MODEL is any of what the Generate panel takes: a `workbench convert` output (ort-genai runs in
onnxruntime-genai, ort-int4 / ort-qdq in onnxruntime, mnn in MNN), a `workbench export` output, a
`workbench quantize` output or a float model directory ('demo' names the bundled one). The text goes
to stdout as it is made; the speed (tokens/s after the first token, prefill time) to stderr, so the
text can be piped. --json prints one object at the end instead: text, token ids and the figures.
"""
from __future__ import annotations

import sys

from ..run.generate import DEFAULT_MAX_NEW_TOKENS, open_model
from ..runtime.stream import Sampling
from .common import count, number, thread_count, add_json_flag, add_model_argument, print_json

HELP = "stream a model's continuation of a prompt (converted, quantized or float) with its tokens/s"


def add_arguments(p):
    add_model_argument(p, "a `workbench convert` or `workbench export` output, a `workbench quantize` output, a "
                          "model directory, 'demo', or 'demo-vl' (with --image)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="stop after this many new tokens (default %(default)s)")
    p.add_argument("--temperature", type=number(0), default=0.0, help="0: greedy (default); above 0: sample")
    p.add_argument("--top-k", type=count(1), default=None, help="sample among the k most likely tokens (default: all)")
    p.add_argument("--seed", type=count(0), default=0, help="seed of the sampling (default 0)")
    p.add_argument("--threads", type=thread_count(), default=1,
                   help="runtime threads, at most the CPU cores (default 1)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--image", help="a picture to ask a vision-language model about (the prompt is the question)")
    p.add_argument("--source", help="the float model a `workbench export` folder came from (its tokenizer)")
    add_json_flag(p)


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    sampling = Sampling(args.temperature, args.top_k, args.seed)
    model = open_model(args.model, threads=args.threads, source=args.source)
    gen = model.stream(args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, chat=args.chat,
                       image=args.image)
    if args.json:
        gen.run()
        image = {"image": args.image} if args.image else {}
        print_json({"model": model.name, "runtime": model.runtime, "path": str(model.path), "prompt": args.prompt,
                    **image, "prompt_ids": gen.prompt_ids, "text": gen.text, "tokens": gen.tokens, **gen.stats.to_dict()})
        return 0
    print(f"{model.name}", file=sys.stderr)
    for piece in gen:
        sys.stdout.write(piece.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(gen.stats.summary(), file=sys.stderr)
    return 0
